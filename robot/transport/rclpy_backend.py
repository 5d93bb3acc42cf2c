"""ROS 2 through rclpy, where ROS 2 is installed: real message classes, a real node, one executor thread.

rclpy is imported when a transport is made, not when this module is: without ROS 2, `RclpyTransport(...)` raises an
ImportError that names the `dds` backend, which speaks the same wire format with no ROS install.

Network rule: this class pins nothing itself; rclpy's rmw reads the environment when the context is created, so
`make_transport("rclpy", local=True)` (what `--local` does) pins it first (robot/transport/loopback.py).

Conversion between `robot.messages` dataclasses and rclpy's generated classes is generic: it walks the dataclass
fields (same names and order as the upstream .msg) and converts by the kind of field, as the DDS backend does.
"""

from __future__ import annotations

import array
import dataclasses
import importlib
import logging
import threading
import typing
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

import robot.messages as messages
from robot.transport.base import QOS_DEFAULT, Publisher, QoS, Subscription, Transport, check_topic

log = logging.getLogger(__name__)

# rclpy and the messages kinema speaks, from PyPI with no ROS install (ROS 2 Kilted, Fast DDS; Linux wheels).
RCLPY_PIP = ("pip install ros-rclpy ros-kilted-rmw-fastrtps-cpp ros-kilted-sensor-msgs ros-kilted-std-msgs "
             "ros-kilted-trajectory-msgs")
NO_RCLPY = (
    "the 'rclpy' transport needs ROS 2's rclpy: source /opt/ros/<distro>/setup.bash first, or install it from PyPI "
    f"with `pip install 'kinema[rclpy]'` ({RCLPY_PIP}); without it use the 'dds' backend (make_transport('dds'), "
    "or --backend dds), which speaks ROS 2's wire format over CycloneDDS"
)

# array.array type codes for the numeric sequences rclpy stores (float64[] -> 'd', ...).
_TYPECODES = {np.dtype(np.float64): "d", np.dtype(np.float32): "f", np.dtype(np.int32): "i", np.dtype(np.uint32): "I",
              np.dtype(np.int64): "q", np.dtype(np.uint8): "B"}


def get_message(ros_type: str) -> type:
    """rclpy's generated class for `pkg/msg/Name` (what rosidl_runtime_py's get_message does; that package is not
    on PyPI, so the PyPI install of rclpy lacks it)."""
    pkg, kind, name = ros_type.split("/")
    try:
        return getattr(importlib.import_module(f"{pkg}.{kind}"), name)
    except (ImportError, AttributeError) as e:
        raise ImportError(f"no ROS 2 message class for {ros_type!r} ({e}); {NO_RCLPY}") from e


def _import_rclpy():
    try:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
    except ImportError as e:
        raise ImportError(NO_RCLPY) from e
    return rclpy, SingleThreadedExecutor, (QoSProfile, ReliabilityPolicy, HistoryPolicy, DurabilityPolicy), get_message


# ----------------------------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _fields(msg_type: type) -> tuple[tuple[str, str, Any], ...]:
    """(name, kind, detail) per field; kind is one of plain, bytes, array, struct, struct_list."""
    if messages.MESSAGE_TYPES.get(getattr(msg_type, "ros_type", None)) is not msg_type:
        known = ", ".join(sorted(cls.__name__ for cls in messages.MESSAGE_TYPES.values()))
        raise TypeError(f"{msg_type!r} is not a robot.messages type; expected one of: {known}")
    hints = typing.get_type_hints(msg_type)
    out = []
    for f in dataclasses.fields(msg_type):
        ann = hints[f.name]
        args = typing.get_args(ann)
        if ann is bytes:
            out.append((f.name, "bytes", None))
        elif ann is np.ndarray:
            out.append((f.name, "array", np.asarray(f.default_factory()).dtype))
        elif dataclasses.is_dataclass(ann):
            out.append((f.name, "struct", ann))
        elif typing.get_origin(ann) is list and args and dataclasses.is_dataclass(args[0]):
            out.append((f.name, "struct_list", args[0]))
        else:  # int, bool, str, list[str]: rclpy takes them as they are
            out.append((f.name, "plain", None))
    return tuple(out)


def to_ros(msg: Any, get_message: Callable[[str], type]) -> Any:
    """A `robot.messages` dataclass as an instance of rclpy's generated class for the same type."""
    ros = get_message(msg.ros_type)()
    for name, kind, detail in _fields(type(msg)):
        value = getattr(msg, name)
        if kind == "struct":
            value = to_ros(value, get_message)
        elif kind == "struct_list":
            value = [to_ros(v, get_message) for v in value]
        elif kind == "array":
            # rclpy keeps numeric sequences as array.array; filling one from bytes avoids a per-element check.
            value = array.array(_TYPECODES[detail], np.ascontiguousarray(value, dtype=detail).tobytes())
        elif kind == "bytes":
            value = array.array("B", value)
        elif isinstance(value, list):
            value = list(value)
        setattr(ros, name, value)
    return ros


def from_ros(ros: Any, msg_type: type) -> Any:
    """An rclpy message as the `robot.messages` dataclass `msg_type`."""
    kwargs = {}
    for name, kind, detail in _fields(msg_type):
        value = getattr(ros, name)
        if kind == "struct":
            value = from_ros(value, detail)
        elif kind == "struct_list":
            value = [from_ros(v, detail) for v in value]
        elif kind == "array":
            value = np.array(value, dtype=detail)
        elif kind == "bytes":
            value = bytes(value)
        elif isinstance(value, (list, tuple)):
            value = list(value)
        kwargs[name] = value
    return msg_type(**kwargs)


# ----------------------------------------------------------------------------------------------------------------
# The transport
# ----------------------------------------------------------------------------------------------------------------


class RclpyPublisher(Publisher):
    def __init__(self, transport: RclpyTransport, topic: str, msg_type: type, qos: QoS, handle):
        self.topic, self.msg_type, self.qos = topic, msg_type, qos
        self._transport, self._handle = transport, handle

    def publish(self, msg: Any) -> None:
        if not isinstance(msg, self.msg_type):
            raise TypeError(f"publisher on {self.topic!r} takes {self.msg_type.__name__}, got {type(msg).__name__}")
        if self._handle is None:
            raise RuntimeError(f"publisher on {self.topic!r} is closed")
        self._handle.publish(to_ros(msg, self._transport._get_message))

    def subscription_count(self) -> int:
        return 0 if self._handle is None else self._handle.get_subscription_count()

    def close(self) -> None:
        if self._handle is not None and not self._transport._closed:
            self._transport._node.destroy_publisher(self._handle)
        self._handle = None


class RclpySubscription(Subscription):
    def __init__(self, transport: RclpyTransport, topic: str, msg_type: type, callback, qos: QoS):
        self.topic, self.msg_type, self.qos = topic, msg_type, qos
        self._transport, self._callback = transport, callback
        self._handle = None
        self.received = 0
        self.dropped = 0

    def _on_message(self, ros_msg: Any) -> None:
        # rclpy lets a callback's exception escape spin_once; catch it here so that the executor thread lives on.
        self._deliver(lambda m: from_ros(m, self.msg_type), ros_msg, self._callback)

    def publisher_count(self) -> int:
        """Matched publishers (rclpy 7+, Jazzy), else the graph's count of publishers on the topic."""
        if self._handle is None:
            return 0
        matched = getattr(self._handle, "get_publisher_count", None)
        return matched() if matched is not None else self._transport._node.count_publishers(self.topic)

    def close(self) -> None:
        if self._handle is not None and not self._transport._closed:
            self._transport._node.destroy_subscription(self._handle)
        self._handle = None


class RclpyTransport(Transport):
    """A ROS 2 node (its own rclpy context, on `domain_id`) spun by a SingleThreadedExecutor in a thread."""

    backend = "rclpy"

    def __init__(self, domain_id: int = 0, node_name: str = "kinema"):
        rclpy, executor_cls, qos_classes, get_message = _import_rclpy()
        self._qos_classes = qos_classes
        self._get_message = lru_cache(maxsize=None)(get_message)
        self.domain_id, self.node_name = domain_id, node_name
        self._lock = threading.Lock()
        self._topics: dict[str, type] = {}
        self._endpoints: list = []
        self._closed = False
        self._context = rclpy.context.Context()
        rclpy.init(context=self._context, domain_id=domain_id)
        self._node = rclpy.create_node(node_name, context=self._context)
        self._executor = executor_cls(context=self._context)
        self._executor.add_node(self._node)
        self._thread = threading.Thread(target=self._spin, name=f"kinema-rclpy-{node_name}", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        while not self._closed and self._context.ok():
            try:
                self._executor.spin_once(timeout_sec=0.1)
            except Exception as e:  # shutdown races end the loop; anything else is logged and survived
                if self._closed or not self._context.ok():
                    return
                log.exception("rclpy executor of node %s: %s", self.node_name, e)

    def _qos(self, qos: QoS):
        profile, reliability, history, durability = self._qos_classes
        if not isinstance(qos.depth, int) or qos.depth < 1:
            raise ValueError(f"QoS.depth must be an int >= 1 (keep-last history), got {qos.depth!r}")
        return profile(
            history=history.KEEP_LAST,
            depth=qos.depth,
            reliability=reliability.RELIABLE if qos.reliable else reliability.BEST_EFFORT,
            durability=durability.TRANSIENT_LOCAL if qos.transient_local else durability.VOLATILE,
        )

    def _register(self, topic: str, msg_type: type) -> type:
        check_topic(topic)
        _fields(msg_type)  # rejects types that are not robot.messages
        if self._closed:
            raise RuntimeError(f"rclpy transport of node {self.node_name!r} is closed")
        known = self._topics.setdefault(topic, msg_type)
        if known is not msg_type:
            raise TypeError(f"topic {topic!r} already carries {known.ros_type}, not {msg_type.ros_type}")
        return self._get_message(msg_type.ros_type)

    def publisher(self, topic: str, msg_type: type, qos: QoS = QOS_DEFAULT) -> Publisher:
        with self._lock:
            ros_cls = self._register(topic, msg_type)
            handle = self._node.create_publisher(ros_cls, topic, self._qos(qos))
            pub = RclpyPublisher(self, topic, msg_type, qos, handle)
            self._endpoints.append(pub)
            return pub

    def subscribe(
        self, topic: str, msg_type: type, callback: Callable[[Any], None], qos: QoS = QOS_DEFAULT
    ) -> Subscription:
        if not callable(callback):
            raise TypeError(f"subscribe({topic!r}): callback must be callable, got {type(callback).__name__}")
        with self._lock:
            ros_cls = self._register(topic, msg_type)
            sub = RclpySubscription(self, topic, msg_type, callback, qos)
            sub._handle = self._node.create_subscription(ros_cls, topic, sub._on_message, self._qos(qos))
            self._endpoints.append(sub)
            return sub

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for endpoint in self._endpoints:
                endpoint.close()
            self._endpoints.clear()
            self._closed = True
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._executor.shutdown()
        self._node.destroy_node()
        self._context.try_shutdown()


__all__ = [
    "NO_RCLPY", "RCLPY_PIP", "RclpyPublisher", "RclpySubscription", "RclpyTransport", "from_ros", "get_message",
    "to_ros",
]
