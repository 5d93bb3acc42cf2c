"""Session-wide test setup: every DDS participant a test (or a child process) creates stays on this machine.

CYCLONEDDS_URI points at the shipped loopback configuration, and ROS_DOMAIN_ID is random per session so that
concurrent test runs on one machine do not see each other. Both are set in os.environ at import time, before any
test module creates a participant, so child processes inherit them.
"""

import os
import random

from kinema.paths import assets_dir

os.environ["CYCLONEDDS_URI"] = (assets_dir() / "dds" / "cyclonedds_loopback.xml").resolve().as_uri()
# 1..101: DDS ports are 7400 + 250 * domain + ..., and domains above 101 reach Linux's ephemeral port range
# (32768+), where a port already taken by some client makes participant creation fail at random.
os.environ["ROS_DOMAIN_ID"] = str(random.SystemRandom().randint(1, 101))
