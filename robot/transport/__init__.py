"""Transports: `make_transport("auto" | "rclpy" | "dds" | "inproc")`. See `robot.transport.base`."""

from __future__ import annotations

import os

from robot.transport.base import QOS_DEFAULT, QOS_LATCHED, QOS_SENSOR, Publisher, QoS, Subscription, Transport

BACKENDS = ("auto", "rclpy", "dds", "inproc")


def rclpy_available() -> bool:
    try:
        import rclpy  # noqa: F401
    except ImportError:
        return False
    return True


def make_transport(
    backend: str = "auto", *, node_name: str = "kinema", domain_id: int | None = None, local: bool = False, **kwargs
) -> Transport:
    """Connect a node to the graph. `auto` is rclpy where ROS 2 is installed, DDS otherwise.

    `domain_id` defaults to `ROS_DOMAIN_ID` (0 when unset), as in ROS 2. `local=True` keeps all traffic on this
    machine whatever the backend: this process's environment is pinned to loopback first
    (`robot.transport.loopback`: CycloneDDS XML, ROS_LOCALHOST_ONLY, ROS_AUTOMATIC_DISCOVERY_RANGE; read by rclpy's
    rmw when its context is created), and `dds` runs on the loopback XML even where CYCLONEDDS_URI names another.
    Other keywords go to the backend, e.g. `config=` for `dds` (None: CYCLONEDDS_URI if set, else the loopback
    config; "loopback"; or a CycloneDDS XML path).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown transport backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if domain_id is None:
        raw = os.environ.get("ROS_DOMAIN_ID", "") or "0"
        if not raw.strip().isdigit():
            raise ValueError(f"ROS_DOMAIN_ID={raw!r} is not a domain id; expected an integer 0..232 (0..101 on Linux)")
        domain_id = int(raw)
    if backend == "auto":
        backend = "rclpy" if rclpy_available() else "dds"
    if local and backend != "inproc":
        from robot.transport.loopback import pin_to_loopback

        pin_to_loopback()
        if backend == "dds":
            if kwargs.get("config") not in (None, "loopback"):
                raise ValueError(f"local=True runs DDS on the loopback config; got config={kwargs['config']!r} as well")
            kwargs["config"] = "loopback"
    if backend == "inproc":
        from robot.transport.inproc import InprocTransport

        return InprocTransport(domain_id=domain_id, **kwargs)
    if backend == "dds":
        from robot.transport.dds import DDSTransport

        return DDSTransport(domain_id=domain_id, node_name=node_name, **kwargs)
    from robot.transport.rclpy_backend import RclpyTransport

    return RclpyTransport(domain_id=domain_id, node_name=node_name, **kwargs)


__all__ = [
    "BACKENDS", "QOS_DEFAULT", "QOS_LATCHED", "QOS_SENSOR", "Publisher", "QoS", "Subscription", "Transport",
    "make_transport", "rclpy_available",
]
