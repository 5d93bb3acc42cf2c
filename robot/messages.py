"""The ROS 2 messages kinema speaks, as plain dataclasses over numpy.

Policy-side code builds and reads these; a transport converts them to and from its own message classes
(rclpy's, or the DDS wire types in `robot.transport.dds`). Fields follow the upstream `.msg` definitions, in the
same order, so that the conversion is mechanical. Array fields are numpy arrays of the upstream element type;
image payloads are `bytes`, never lists of ints (a list costs ~20 ms per 640x480 frame).
"""

import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import ClassVar

import numpy as np

# Note: no `from __future__ import annotations` here: the DDS backend derives its wire types from these
# annotations, and IdlStruct declarations break under postponed evaluation.


def _f64(values) -> np.ndarray:
    return np.ascontiguousarray(values, dtype=np.float64).reshape(-1)


@dataclass
class Time:
    """builtin_interfaces/Time."""

    ros_type: ClassVar[str] = "builtin_interfaces/msg/Time"
    sec: int = 0
    nanosec: int = 0

    @classmethod
    def from_sec(cls, seconds: float) -> "Time":
        ns = int(round(seconds * 1e9))
        return cls(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)

    def to_sec(self) -> float:
        return self.sec + self.nanosec * 1e-9


@dataclass
class Duration:
    """builtin_interfaces/Duration."""

    ros_type: ClassVar[str] = "builtin_interfaces/msg/Duration"
    sec: int = 0
    nanosec: int = 0

    @classmethod
    def from_sec(cls, seconds: float) -> "Duration":
        ns = int(round(seconds * 1e9))
        return cls(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)

    def to_sec(self) -> float:
        return self.sec + self.nanosec * 1e-9


@dataclass
class Header:
    """std_msgs/Header."""

    ros_type: ClassVar[str] = "std_msgs/msg/Header"
    stamp: Time = field(default_factory=Time)
    frame_id: str = ""


@dataclass
class Bool:
    ros_type: ClassVar[str] = "std_msgs/msg/Bool"
    data: bool = False


@dataclass
class String:
    ros_type: ClassVar[str] = "std_msgs/msg/String"
    data: str = ""


@dataclass
class MultiArrayDimension:
    ros_type: ClassVar[str] = "std_msgs/msg/MultiArrayDimension"
    label: str = ""
    size: int = 0
    stride: int = 0


@dataclass
class MultiArrayLayout:
    ros_type: ClassVar[str] = "std_msgs/msg/MultiArrayLayout"
    dim: list[MultiArrayDimension] = field(default_factory=list)
    data_offset: int = 0


@dataclass
class Float64MultiArray:
    """std_msgs/Float64MultiArray: what ros2_control's forward_position_controller takes on `/…/commands`."""

    ros_type: ClassVar[str] = "std_msgs/msg/Float64MultiArray"
    layout: MultiArrayLayout = field(default_factory=MultiArrayLayout)
    data: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))

    def __post_init__(self):
        self.data = _f64(self.data)


@dataclass
class JointState:
    """sensor_msgs/JointState. Joints are matched by `name`, never by index."""

    ros_type: ClassVar[str] = "sensor_msgs/msg/JointState"
    header: Header = field(default_factory=Header)
    name: list[str] = field(default_factory=list)
    position: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    velocity: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    effort: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))

    def __post_init__(self):
        self.name = list(self.name)
        self.position, self.velocity, self.effort = _f64(self.position), _f64(self.velocity), _f64(self.effort)


@dataclass
class Image:
    """sensor_msgs/Image. `data` is the raw row-major payload as bytes."""

    ros_type: ClassVar[str] = "sensor_msgs/msg/Image"
    header: Header = field(default_factory=Header)
    height: int = 0
    width: int = 0
    encoding: str = ""
    is_bigendian: int = 0
    step: int = 0
    data: bytes = b""

    @classmethod
    def from_array(cls, rgb: np.ndarray, header: Header | None = None) -> "Image":
        """An (H, W, 3) uint8 RGB array as an `rgb8` image."""
        rgb = np.ascontiguousarray(rgb)
        if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
            raise ValueError(f"Image.from_array expects an (H, W, 3) uint8 array, got {rgb.dtype} {rgb.shape}")
        h, w, _ = rgb.shape
        return cls(header=header or Header(), height=h, width=w, encoding="rgb8", step=3 * w, data=rgb.tobytes())

    def to_array(self) -> np.ndarray:
        """The image as an (H, W, 3) uint8 RGB array; `rgb8` and `bgr8` are understood."""
        if self.encoding not in ("rgb8", "bgr8"):
            raise ValueError(f"unsupported image encoding {self.encoding!r}; expected 'rgb8' or 'bgr8'")
        expected = self.height * self.step
        if self.step < 3 * self.width or len(self.data) != expected:
            raise ValueError(
                f"image payload of {len(self.data)} bytes does not match height={self.height}, "
                f"width={self.width}, step={self.step} (expected {expected} bytes, step >= {3 * self.width})"
            )
        rows = np.frombuffer(self.data, np.uint8).reshape(self.height, self.step)
        rgb = rows[:, : 3 * self.width].reshape(self.height, self.width, 3)
        return rgb[..., ::-1].copy() if self.encoding == "bgr8" else rgb.copy()


@dataclass
class CompressedImage:
    """sensor_msgs/CompressedImage; `format` is e.g. "jpeg" or "png"."""

    ros_type: ClassVar[str] = "sensor_msgs/msg/CompressedImage"
    header: Header = field(default_factory=Header)
    format: str = ""
    data: bytes = b""


@dataclass
class Joy:
    ros_type: ClassVar[str] = "sensor_msgs/msg/Joy"
    header: Header = field(default_factory=Header)
    axes: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    buttons: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def __post_init__(self):
        self.axes = np.ascontiguousarray(self.axes, dtype=np.float32).reshape(-1)
        self.buttons = np.ascontiguousarray(self.buttons, dtype=np.int32).reshape(-1)


@dataclass
class JointTrajectoryPoint:
    ros_type: ClassVar[str] = "trajectory_msgs/msg/JointTrajectoryPoint"
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    velocities: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    accelerations: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    effort: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    time_from_start: Duration = field(default_factory=Duration)

    def __post_init__(self):
        self.positions, self.velocities = _f64(self.positions), _f64(self.velocities)
        self.accelerations, self.effort = _f64(self.accelerations), _f64(self.effort)


@dataclass
class JointTrajectory:
    """trajectory_msgs/JointTrajectory: what JointTrajectoryController takes on `/…/joint_trajectory`."""

    ros_type: ClassVar[str] = "trajectory_msgs/msg/JointTrajectory"
    header: Header = field(default_factory=Header)
    joint_names: list[str] = field(default_factory=list)
    points: list[JointTrajectoryPoint] = field(default_factory=list)


MESSAGE_TYPES: dict[str, type] = {
    cls.ros_type: cls
    for cls in (
        Time, Duration, Header, Bool, String, MultiArrayDimension, MultiArrayLayout, Float64MultiArray,
        JointState, Image, CompressedImage, Joy, JointTrajectoryPoint, JointTrajectory,
    )
}

# ros_type -> its upstream .msg text: field order and exact types. The one source for the wire formats (the DDS
# codec's integer widths, the MCAP schemas); a test checks the dataclasses above follow it field for field. Types of the same package may be named without
# their package, as upstream does (`MultiArrayDimension[] dim`).
MSG_DEFINITIONS: dict[str, str] = {
    "builtin_interfaces/msg/Time": "int32 sec\nuint32 nanosec\n",
    "builtin_interfaces/msg/Duration": "int32 sec\nuint32 nanosec\n",
    "std_msgs/msg/Header": "builtin_interfaces/Time stamp\nstring frame_id\n",
    "std_msgs/msg/Bool": "bool data\n",
    "std_msgs/msg/String": "string data\n",
    "std_msgs/msg/MultiArrayDimension": "string label\nuint32 size\nuint32 stride\n",
    "std_msgs/msg/MultiArrayLayout": "MultiArrayDimension[] dim\nuint32 data_offset\n",
    "std_msgs/msg/Float64MultiArray": "MultiArrayLayout layout\nfloat64[] data\n",
    "sensor_msgs/msg/JointState": (
        "std_msgs/Header header\nstring[] name\nfloat64[] position\nfloat64[] velocity\nfloat64[] effort\n"
    ),
    "sensor_msgs/msg/Image": (
        "std_msgs/Header header\nuint32 height\nuint32 width\nstring encoding\nuint8 is_bigendian\nuint32 step\n"
        "uint8[] data\n"
    ),
    "sensor_msgs/msg/CompressedImage": "std_msgs/Header header\nstring format\nuint8[] data\n",
    "sensor_msgs/msg/Joy": "std_msgs/Header header\nfloat32[] axes\nint32[] buttons\n",
    "trajectory_msgs/msg/JointTrajectoryPoint": (
        "float64[] positions\nfloat64[] velocities\nfloat64[] accelerations\nfloat64[] effort\n"
        "builtin_interfaces/Duration time_from_start\n"
    ),
    "trajectory_msgs/msg/JointTrajectory": (
        "std_msgs/Header header\nstring[] joint_names\nJointTrajectoryPoint[] points\n"
    ),
}


def msg_fields(ros_type: str) -> list[tuple[str, str]]:
    """(type, name) per field of `ros_type`'s .msg text, e.g. [("int32", "sec"), ("uint32", "nanosec")]."""
    if ros_type not in MSG_DEFINITIONS:
        raise KeyError(f"no .msg definition for {ros_type!r}; known: {', '.join(sorted(MSG_DEFINITIONS))}")
    return [tuple(line.split()[:2]) for line in MSG_DEFINITIONS[ros_type].splitlines() if line.strip()]


# ROS 2's type hash (REP 2011, "RIHS01"), which Iron and later put in every endpoint's USER_DATA QoS
# (`typehash=RIHS01_<hex>;`) and show in `ros2 topic info -v`. It is the SHA-256 of the type description (this type's
# fields and those of every type it nests, sorted by name) as rosidl serialises it to JSON, default values left out.
# Field type ids are rosidl's (type_description_interfaces/msg/FieldType); an unbounded sequence adds 144.
_FIELD_TYPE_IDS = {"int8": 2, "uint8": 3, "int16": 4, "uint16": 5, "int32": 6, "uint32": 7, "int64": 8, "uint64": 9,
                   "float32": 10, "float64": 11, "char": 13, "bool": 15, "byte": 16, "string": 17, "wstring": 18}
_NESTED_TYPE, _UNBOUNDED_SEQUENCE = 1, 144


def _field_type(ros_type: str, ftype: str) -> dict:
    sequence = ftype.endswith("[]")
    base = ftype[:-2] if sequence else ftype
    if base in _FIELD_TYPE_IDS:
        type_id, nested = _FIELD_TYPE_IDS[base], ""
    else:  # `Pkg/Name`, or `Name` for a type of the same package
        pkg, name = base.split("/") if "/" in base else (ros_type.split("/")[0], base)
        type_id, nested = _NESTED_TYPE, f"{pkg}/msg/{name}"
    if sequence:
        type_id += _UNBOUNDED_SEQUENCE
    return {"type_id": type_id, "capacity": 0, "string_capacity": 0, "nested_type_name": nested}


def _type_description(ros_type: str) -> dict:
    fields = [{"name": name, "type": _field_type(ros_type, ftype)} for ftype, name in msg_fields(ros_type)]
    return {"type_name": ros_type, "fields": fields}


@lru_cache(maxsize=None)
def type_hash(ros_type: str) -> str:
    """`RIHS01_<sha256 hex>`: the type hash ROS 2 (Iron and later) gives `ros_type` (REP 2011)."""
    referenced: dict[str, dict] = {}
    todo = [ros_type]
    while todo:
        for field_ in _type_description(todo.pop())["fields"]:
            nested = field_["type"]["nested_type_name"]
            if nested and nested not in referenced:
                referenced[nested] = _type_description(nested)
                todo.append(nested)
    hashable = {"type_description": _type_description(ros_type),
                "referenced_type_descriptions": [referenced[name] for name in sorted(referenced)]}
    text = json.dumps(hashable, separators=(", ", ": "), sort_keys=False)
    return "RIHS01_" + hashlib.sha256(text.encode()).hexdigest()
