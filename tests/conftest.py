"""Session-wide test setup: every DDS participant a test (or a child process) creates stays on this machine.

The environment is pinned to loopback by the one function that does it everywhere
(`robot.transport.loopback.pin_to_loopback`: CycloneDDS loopback XML, ROS_LOCALHOST_ONLY=1,
ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST, Fast DDS on the shipped loopback profile with its discovery servers and
other profile files turned off, and
rmw_cyclonedds_cpp for rclpy where it is installed, else rclpy's Fast DDS under the discovery range), and
ROS_DOMAIN_ID is random per session (one per xdist worker) so that concurrent test runs on one machine do not see
each other. Both are set in os.environ at import time, before any test module creates a participant, so child
processes inherit them.
"""

import os
import random

from robot.transport.loopback import pin_to_loopback

pin_to_loopback(rmw=True)
# 1..101: DDS ports are 7400 + 250 * domain + ..., and domains above 101 reach Linux's ephemeral port range
# (32768+), where a port already taken by some client makes participant creation fail at random.
# Under pytest-xdist each worker imports this file: the workers of one run share a random base (their run id) and
# take consecutive domains from it, so that two workers never share a domain and a DDS test never sees another's.
run_id, worker = os.environ.get("PYTEST_XDIST_TESTRUNUID"), os.environ.get("PYTEST_XDIST_WORKER", "")
if run_id and worker.startswith("gw"):
    os.environ["ROS_DOMAIN_ID"] = str(1 + (random.Random(run_id).randrange(101) + int(worker[2:])) % 101)
    # one worker per core: torch's and llvmpipe's own threads would oversubscribe them (set before torch loads)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("LP_NUM_THREADS", "1")
else:
    os.environ["ROS_DOMAIN_ID"] = str(random.SystemRandom().randint(1, 101))


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one worker per CPU this process may run on. xdist's own count is psutil's
    physical cores, which is 1 on a VM whose 2 vCPUs are one core's two threads, and the whole host in a container."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
