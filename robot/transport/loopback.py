"""The network rule in one place: the environment that keeps every DDS participant on this machine.

`loopback_environment()` pins all three ways a ROS 2 process may reach the network:
- CycloneDDS (our `dds` backend, and rclpy with rmw_cyclonedds_cpp): CYCLONEDDS_URI = the shipped loopback file
  (interface 127.0.0.1, no multicast, peer 127.0.0.1);
- any rmw on ROS 2 Humble: ROS_LOCALHOST_ONLY=1;
- any rmw on ROS 2 Jazzy and later: ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST, with no static peers.
With `rmw=True` it also selects rmw_cyclonedds_cpp (tests), so that the loopback XML is what rclpy runs on.

Used by `kinema deploy/sim-robot --local` (before rclpy.init), tests/conftest.py, the launch files' additional_env
and the benchmark's child processes. Imports nothing but the standard library and robot.paths (launch files and
conftest import it with no DDS library loaded).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from robot.paths import assets_dir

LOOPBACK_CONFIG: Path = assets_dir() / "dds" / "cyclonedds_loopback.xml"
RMW_CYCLONEDDS = "rmw_cyclonedds_cpp"


def loopback_variables(*, rmw: bool = False) -> dict[str, str]:
    """Just the pinned variables."""
    env = {
        "CYCLONEDDS_URI": LOOPBACK_CONFIG.resolve().as_uri(),
        "ROS_LOCALHOST_ONLY": "1",
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "ROS_STATIC_PEERS": "",  # a user's static peers could name another host
    }
    if rmw:
        env["RMW_IMPLEMENTATION"] = RMW_CYCLONEDDS
    return env


def loopback_environment(base: Mapping[str, str] | None = None, *, rmw: bool = False) -> dict[str, str]:
    """A copy of `base` (default: this process's environment) with every DDS path pinned to loopback.

    For child processes: `subprocess.run(cmd, env=loopback_environment())`; for this process, before any
    participant or rclpy context exists: `os.environ.update(loopback_environment({}))`.
    """
    env = dict(os.environ if base is None else base)
    env.update(loopback_variables(rmw=rmw))
    return env


def pin_to_loopback(*, rmw: bool = False) -> None:
    """Pin this process (and the children it starts later) to loopback; call before rclpy.init / the first
    participant: rmw implementations read these variables when a context is created."""
    os.environ.update(loopback_variables(rmw=rmw))


__all__ = ["LOOPBACK_CONFIG", "RMW_CYCLONEDDS", "loopback_environment", "loopback_variables", "pin_to_loopback"]
