"""The one transport interface: publish, subscribe with QoS, close.

Backends: `inproc` (this process, for unit tests), `dds` (PyPI cyclonedds speaking ROS 2's wire format, no ROS
install needed) and `rclpy` (a ROS 2 install). Everything above this layer sees `robot.messages` dataclasses.

Callbacks run on a transport-owned thread (on the publisher's thread for `inproc`): keep them short, and guard
shared state with a lock.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_log = logging.getLogger("robot.transport")


@dataclass(frozen=True)
class QoS:
    """The subset of ROS 2 QoS kinema uses. The default is ROS 2's: reliable, volatile, keep-last 10."""

    reliable: bool = True
    depth: int = 10
    transient_local: bool = False


QOS_DEFAULT = QoS()
# rclpy's qos_profile_sensor_data: best-effort, keep-last 5; used for cameras.
QOS_SENSOR = QoS(reliable=False, depth=5)
# For latched state such as e-stop: late joiners get the last value.
QOS_LATCHED = QoS(reliable=True, depth=1, transient_local=True)


class Publisher(abc.ABC):
    topic: str
    msg_type: type

    @abc.abstractmethod
    def publish(self, msg: Any) -> None: ...

    @abc.abstractmethod
    def subscription_count(self) -> int:
        """Subscriptions matched with this publisher, local and remote (rclpy's `get_subscription_count`)."""

    def close(self) -> None:  # noqa: B027 - optional for backends with nothing to release
        pass


class Subscription(abc.ABC):
    topic: str
    msg_type: type
    received: int = 0
    dropped: int = 0

    def _deliver(self, convert: Callable[[Any], Any], sample: Any, callback: Callable[[Any], None]) -> None:
        """Convert a backend sample and hand it to the callback. A sample that does not convert, or a callback that
        raises, is counted and logged: the backend's delivery thread must carry on."""
        try:
            msg = convert(sample)
        except Exception as e:
            self.dropped += 1
            _log.warning("dropped an invalid %s sample on %s: %r", self.msg_type.ros_type, self.topic, e)
            return
        try:
            callback(msg)
            self.received += 1
        except Exception:
            self.dropped += 1
            _log.exception("subscription callback on %s raised; the delivery thread carries on", self.topic)

    def close(self) -> None:  # noqa: B027
        pass


class Transport(abc.ABC):
    """A node's connection to the ROS 2 graph."""

    backend: str = "?"

    @abc.abstractmethod
    def publisher(self, topic: str, msg_type: type, qos: QoS = QOS_DEFAULT) -> Publisher: ...

    @abc.abstractmethod
    def subscribe(
        self, topic: str, msg_type: type, callback: Callable[[Any], None], qos: QoS = QOS_DEFAULT
    ) -> Subscription: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_topic(topic: str) -> str:
    """ROS 2 topic names are absolute here: `/joint_states`, `/arm/commands`."""
    if not isinstance(topic, str) or not topic.startswith("/") or topic.endswith("/") or "//" in topic:
        raise ValueError(f"topic {topic!r} is not a valid absolute ROS 2 topic name (expected e.g. '/joint_states')")
    return topic
