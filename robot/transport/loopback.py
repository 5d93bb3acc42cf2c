"""The network rule in one place: the environment that keeps every DDS participant on this machine.

`loopback_environment()` pins every way a ROS 2 process may reach the network:
- CycloneDDS (our `dds` backend, and rclpy with rmw_cyclonedds_cpp): CYCLONEDDS_URI = the shipped loopback file
  (interface 127.0.0.1, no multicast, peer 127.0.0.1);
- any rmw on ROS 2 Humble: ROS_LOCALHOST_ONLY=1;
- any rmw on ROS 2 Jazzy and later: ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST, with no static peers. For
  rmw_fastrtps_cpp (ROS 2's default) that means: no multicast, discovery by unicast to 127.0.0.1's participant ports
  only, between processes found that way (all of them on this machine);
- Fast DDS 3 (ROS 2 Kilted and later): its default profile is the shipped loopback file
  (FASTDDS_DEFAULT_PROFILES_FILE = `FASTDDS_LOOPBACK_PROFILE`: UDP on 127.0.0.1 only, with 1 MiB socket buffers for
  camera frames). Fast DDS 2 (Humble, Jazzy) reads FASTRTPS_DEFAULT_PROFILES_FILE instead, which is removed: there
  the discovery range alone keeps it local, on default buffers (not tested: no such rmw here). Fast DDS's other ways
  around the range, a discovery server (ROS_DISCOVERY_SERVER, ROS2_EASY_MODE) and other XML profiles that may name
  peers on other hosts (FASTRTPS_DEFAULT_PROFILES_FILE, FASTDDS_ENVIRONMENT_FILE, DEFAULT_FASTDDS_PROFILES.xml in
  the working directory), are emptied, removed (`UNPINNED_VARIABLES`) or skipped (SKIP_DEFAULT_XML_FILE=1).
With `rmw=True` it also selects rmw_cyclonedds_cpp where it is installed (tests), so that the loopback XML is what
rclpy runs on; elsewhere rclpy runs on its default rmw, pinned by the discovery range and the profile above.

Used by `kinema deploy/sim-robot --local` (before rclpy.init), tests/conftest.py, the launch files' additional_env
and the benchmark's child processes. Imports nothing but the standard library and robot.paths (launch files and
conftest import it with no DDS library loaded).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from robot.paths import assets_dir

LOOPBACK_CONFIG: Path = assets_dir() / "dds" / "cyclonedds_loopback.xml"
FASTDDS_LOOPBACK_PROFILE: Path = assets_dir() / "dds" / "fastdds_loopback.xml"
RMW_CYCLONEDDS = "rmw_cyclonedds_cpp"


# Fast DDS also reads these files for profiles and environment values, which may name peers or servers on other
# hosts; only their presence matters, so pinning removes them (launch files, which can only set variables, cannot).
UNPINNED_VARIABLES = ("FASTRTPS_DEFAULT_PROFILES_FILE", "FASTDDS_ENVIRONMENT_FILE")


def rmw_installed(name: str) -> bool:
    """Whether the rmw implementation `name` is in an ament index: a ROS 2 install (AMENT_PREFIX_PATH) or ROS 2
    packages installed from PyPI into this environment (sys.prefix). Reads files only; imports nothing."""
    prefixes = [p for p in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep) if p] + [sys.prefix]
    return any(Path(p, "share", "ament_index", "resource_index", "rmw_typesupport", name).is_file() for p in prefixes)


def loopback_variables(*, rmw: bool = False) -> dict[str, str]:
    """Just the pinned variables."""
    env = {
        "CYCLONEDDS_URI": LOOPBACK_CONFIG.resolve().as_uri(),
        "ROS_LOCALHOST_ONLY": "1",
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
        "ROS_STATIC_PEERS": "",  # a user's static peers could name another host
        # Fast DDS: our loopback profile, no discovery server (empty means none), no profiles file from the working
        # directory.
        "FASTDDS_DEFAULT_PROFILES_FILE": str(FASTDDS_LOOPBACK_PROFILE.resolve()),
        "ROS_DISCOVERY_SERVER": "",
        "ROS2_EASY_MODE": "",
        "SKIP_DEFAULT_XML_FILE": "1",
    }
    if rmw and rmw_installed(RMW_CYCLONEDDS):
        env["RMW_IMPLEMENTATION"] = RMW_CYCLONEDDS
    return env


def loopback_environment(base: Mapping[str, str] | None = None, *, rmw: bool = False) -> dict[str, str]:
    """A copy of `base` (default: this process's environment) with every DDS path pinned to loopback.

    For child processes: `subprocess.run(cmd, env=loopback_environment())`; for this process, before any
    participant or rclpy context exists: `pin_to_loopback()`.
    """
    env = dict(os.environ if base is None else base)
    env.update(loopback_variables(rmw=rmw))
    for name in UNPINNED_VARIABLES:
        env.pop(name, None)
    return env


def pin_to_loopback(*, rmw: bool = False) -> None:
    """Pin this process (and the children it starts later) to loopback; call before rclpy.init / the first
    participant: rmw implementations read these variables when a context is created."""
    os.environ.update(loopback_variables(rmw=rmw))
    for name in UNPINNED_VARIABLES:
        os.environ.pop(name, None)


__all__ = [
    "FASTDDS_LOOPBACK_PROFILE", "LOOPBACK_CONFIG", "RMW_CYCLONEDDS", "UNPINNED_VARIABLES", "loopback_environment",
    "loopback_variables", "pin_to_loopback", "rmw_installed",
]
