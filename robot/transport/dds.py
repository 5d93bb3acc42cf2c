"""ROS 2 over the DDS wire, with no ROS install: the PyPI `cyclonedds` package speaking what rmw_cyclonedds speaks.

What makes a real ROS 2 node (rmw_fastrtps_cpp, ROS 2's default, or rmw_cyclonedds_cpp) see our topics and we see its:
- topic `/x` is the DDS topic `rt/x`;
- type `pkg/msg/T` is the DDS type `pkg::msg::dds_::T_`, with the fields in the upstream `.msg` order and the
  upstream IDL types (int32 sec / uint32 nanosec, sequence<double>, sequence<uint8> for payloads, ...);
- samples are plain CDR (XCDR1), the representation ROS 2 requests;
- QoS follows ROS 2's mapping (reliable/best-effort, keep-last depth, volatile/transient-local; 100 ms max blocking),
  and USER_DATA carries the type hash (`typehash=RIHS01_...;`) as on ROS 2 Iron and later;
- endpoints match on topic and type *names*, not on XTypes type objects (`INTEROP_CONFIG`: without it, Cyclone never
  matches Fast DDS's endpoints, see there);
- the domain is ROS_DOMAIN_ID (`make_transport` passes it);
- the node is announced on `ros_discovery_info`, so that ROS 2 lists it (`ros2 node list`, `get_node_names()`).

The wire types are derived once, generically, from the `robot.messages` dataclasses (their annotations and field
order); integer widths, which a Python `int` cannot say, come from the .msg text in `robot.messages`.

Network rule: unless the caller passes a config or has set CYCLONEDDS_URI, a transport runs on the shipped loopback
configuration (`LOOPBACK_CONFIG`), so that nothing leaves this machine. A robot on a LAN sets CYCLONEDDS_URI or
passes `config=path`.

Note: no `from __future__ import annotations` in this module: the IdlStruct machinery reads the annotations as
objects, and postponed (string) annotations break it.
"""

import dataclasses
import logging
import operator
import os
import re
import threading
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cyclonedds.core import (
    DDSException, GuardCondition, InstanceState, Qos, ReadCondition, SampleState, ViewState, WaitSet,
)
from cyclonedds.domain import Domain, DomainParticipant
from cyclonedds.idl import make_idl_struct
from cyclonedds.idl import types as idl
from cyclonedds.pub import DataWriter
from cyclonedds.qos import Policy
from cyclonedds.sub import DataReader, InvalidSample
from cyclonedds.topic import Topic
from cyclonedds.util import duration

import robot.messages as messages
from robot.messages import msg_fields, type_hash
from robot.transport.base import QOS_DEFAULT, Publisher, QoS, Subscription, Transport, check_topic
from robot.transport.loopback import LOOPBACK_CONFIG, loopback_environment

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# rmw_cyclonedds reserves room for its request/reply prefixes in DDS's 256-character topic names.
_MAX_TOPIC_LEN = 247


def dds_topic_name(topic: str) -> str:
    """`/arm/joint_states` -> `rt/arm/joint_states`, after checking ROS 2's naming rules."""
    check_topic(topic)
    bad = [tok for tok in topic[1:].split("/") if not _TOKEN.fullmatch(tok)]
    if bad:
        raise ValueError(
            f"topic {topic!r}: name token {bad[0]!r} is not valid in ROS 2 (expected letters, digits and '_', "
            "not starting with a digit)"
        )
    if len(topic) > _MAX_TOPIC_LEN:
        raise ValueError(f"topic {topic!r} is {len(topic)} characters long; ROS 2 allows at most {_MAX_TOPIC_LEN}")
    return "rt" + topic


def dds_type_name(ros_type: str) -> str:
    """`sensor_msgs/msg/Image` -> `sensor_msgs::msg::dds_::Image_` (rosidl's DDS type name)."""
    pkg, kind, name = ros_type.split("/")
    return f"{pkg}::{kind}::dds_::{name}_"


# ----------------------------------------------------------------------------------------------------------------
# Wire types and conversion: one generic codec per message dataclass
# ----------------------------------------------------------------------------------------------------------------

# Integer widths come from the upstream .msg text (`robot.messages.MSG_DEFINITIONS`): a Python `int` does not carry
# one. Every other field's IDL type follows from its annotation: bool, str, bytes (uint8[]), list[str], a nested
# message, a list of messages, or an ndarray whose element type is the dtype of the field's default.
_IDL_INTS = {"int8": idl.int8, "uint8": idl.uint8, "int16": idl.int16, "uint16": idl.uint16, "int32": idl.int32,
             "uint32": idl.uint32, "int64": idl.int64, "uint64": idl.uint64}


def _int_widths(ros_type: str) -> dict[str, Any]:
    return {name: _IDL_INTS[ftype] for ftype, name in msg_fields(ros_type) if ftype in _IDL_INTS}


_DTYPES: dict[np.dtype, Any] = {
    np.dtype(np.float64): idl.float64,
    np.dtype(np.float32): idl.float32,
    np.dtype(np.int32): idl.int32,
    np.dtype(np.uint32): idl.uint32,
    np.dtype(np.int64): idl.int64,
    np.dtype(np.uint8): idl.uint8,
}


def _identity(value):
    return value


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value).__name__}")
    return value


def _as_bytes(value: Any) -> bytes:
    return value if type(value) is bytes else bytes(value)  # no copy of a frame that already is bytes


def _as_str_list(values: Any) -> list:
    return [_as_str(v) for v in values]


@dataclasses.dataclass(frozen=True)
class WireCodec:
    """A message dataclass, its DDS wire type, and the conversions between them."""

    msg_type: type
    wire_type: type  # an IdlStruct subclass named like rosidl's
    to_wire: Callable[[Any], Any]
    from_wire: Callable[[Any], Any]
    fast_bytes: bool  # uint8[] fields move as one `bytes` object rather than a list of ints


_CODECS: dict[type, WireCodec] = {}
_CODECS_LOCK = threading.RLock()


def codec_for(msg_type: type) -> WireCodec:
    """The codec for a `robot.messages` dataclass; built on first use, then cached."""
    with _CODECS_LOCK:
        codec = _CODECS.get(msg_type)
        if codec is None:
            codec = _CODECS[msg_type] = _build_codec(msg_type)
        return codec


def _check_message_type(msg_type: Any) -> str:
    ros_type = getattr(msg_type, "ros_type", None)
    if messages.MESSAGE_TYPES.get(ros_type) is not msg_type:
        known = ", ".join(sorted(cls.__name__ for cls in messages.MESSAGE_TYPES.values()))
        raise TypeError(f"{msg_type!r} is not a robot.messages type; expected one of: {known}")
    return ros_type


def _build_codec(msg_type: type) -> WireCodec:
    ros_type = _check_message_type(msg_type)
    widths = _int_widths(ros_type)
    fields = dataclasses.fields(msg_type)
    hints = typing.get_type_hints(msg_type)
    wire_fields: dict[str, Any] = {}
    to_conv: list[tuple[str, Callable]] = []
    from_conv: list[tuple[str, Callable]] = []
    byte_fields: list[str] = []

    for f in fields:
        ann = hints[f.name]
        origin = typing.get_origin(ann)
        if ann is int:
            if f.name not in widths:
                raise TypeError(f"{ros_type}.{f.name}: integer field without an integer type in its .msg definition")
            # operator.index: an int or numpy integer, never a float silently truncated
            wire_fields[f.name], to, back = widths[f.name], operator.index, _identity
        elif ann is bool:
            wire_fields[f.name], to, back = bool, bool, _identity
        elif ann is str:
            wire_fields[f.name], to, back = str, _as_str, _identity
        elif ann is bytes:
            wire_fields[f.name], to, back = idl.sequence[idl.uint8], bytes, _as_bytes
            byte_fields.append(f.name)
        elif ann is np.ndarray:
            dtype = np.asarray(f.default_factory()).dtype  # the field's default states its element type
            if dtype not in _DTYPES:
                raise TypeError(f"{ros_type}.{f.name}: no IDL element type for dtype {dtype}")
            wire_fields[f.name] = idl.sequence[_DTYPES[dtype]]
            to = _array_to_list(dtype)
            back = _list_to_array(dtype)
        elif dataclasses.is_dataclass(ann):
            sub = codec_for(ann)
            wire_fields[f.name], to, back = sub.wire_type, sub.to_wire, sub.from_wire
        elif origin is list and typing.get_args(ann) == (str,):
            wire_fields[f.name], to, back = idl.sequence[str], _as_str_list, list
        elif origin is list and dataclasses.is_dataclass(typing.get_args(ann)[0]):
            sub = codec_for(typing.get_args(ann)[0])
            wire_fields[f.name] = idl.sequence[sub.wire_type]
            to, back = _map_list(sub.to_wire), _map_list(sub.from_wire)
        else:
            raise TypeError(f"{ros_type}.{f.name}: no wire mapping for annotation {ann!r}")
        to_conv.append((f.name, to))
        from_conv.append((f.name, back))

    name = ros_type.rsplit("/", 1)[1] + "_"
    wire_type = make_idl_struct(name, dds_type_name(ros_type), wire_fields)
    fast = _bytes_fast_path(wire_type, byte_fields)
    if byte_fields and not fast:
        # Correct but slow (~20 ms per 640x480 frame): this cyclonedds version's internals differ from 11.x's.
        log.warning("cyclonedds: no bytes fast path for %s; uint8[] fields move as lists of ints", ros_type)
        to_conv = [(n, (lambda v: list(bytes(v))) if n in byte_fields else c) for n, c in to_conv]

    def to_wire(msg: Any) -> Any:
        try:
            return wire_type(*[conv(getattr(msg, n)) for n, conv in to_conv])
        except (TypeError, ValueError, AttributeError, OverflowError):
            for n, conv in to_conv:  # find the field to name; only on the error path
                try:
                    conv(getattr(msg, n))
                except Exception as e:
                    shown = repr(getattr(msg, n, None))
                    shown = shown if len(shown) <= 60 else shown[:57] + "..."
                    raise ValueError(f"{ros_type}.{n}={shown}: {e}") from e
            raise

    def from_wire(sample: Any) -> Any:
        return msg_type(**{n: conv(getattr(sample, n)) for n, conv in from_conv})

    return WireCodec(msg_type, wire_type, to_wire, from_wire, fast or not byte_fields)


def _array_to_list(dtype: np.dtype) -> Callable[[Any], list]:
    def convert(values: Any) -> list:
        return np.asarray(values, dtype=dtype).reshape(-1).tolist()

    return convert


def _list_to_array(dtype: np.dtype) -> Callable[[Any], np.ndarray]:
    def convert(values: Any) -> np.ndarray:
        return np.asarray(values, dtype=dtype)

    return convert


def _map_list(conv: Callable) -> Callable[[Any], list]:
    def convert(values: Any) -> list:
        return [conv(v) for v in values]

    return convert


def _bytes_fast_path(wire_type: type, byte_fields: list[str]) -> bool:
    """Serialise uint8[] fields as one `bytes` object.

    cyclonedds-python moves `sequence[uint8]` as a Python list of ints (~20 ms per 640x480 frame), and a `bytes`
    annotation serialises fast but has no XTypes type object, so a Topic cannot be made from it. The two encode
    identically in CDR (uint32 length, then the octets), so keep the `sequence[uint8]` declaration (its type
    information stays that of ROS 2's `uint8[]`) and swap in the library's own bytes machine for the payload.
    """
    if not byte_fields:
        return False
    try:
        from cyclonedds.idl._machinery import BytesMachine, PlainCdrV2SequenceOfPrimitiveMachine

        wire_type.__idl__.populate()
        machines = [wire_type.__idl__.v1_machine, wire_type.__idl__.v2_machine]
        for machine in machines:
            members = machine.members_machines
            for name in byte_fields:
                if not isinstance(members[name], (PlainCdrV2SequenceOfPrimitiveMachine, BytesMachine)):
                    return False
        for machine in machines:
            for name in byte_fields:
                machine.members_machines[name] = BytesMachine()
        return True
    except (ImportError, AttributeError, KeyError):
        return False


# ----------------------------------------------------------------------------------------------------------------
# QoS and domains
# ----------------------------------------------------------------------------------------------------------------

# How long a reliable write may block on unacknowledged data: DDS's default, which ROS 2 keeps.
_MAX_BLOCKING = duration(milliseconds=100)


def dds_qos(qos: QoS, ros_type: str | None = None) -> Qos:
    """ROS 2's QoS mapping for `robot.transport.QoS`, plus XCDR1 (plain CDR), which is what ROS 2 nodes use.

    With `ros_type`, USER_DATA carries its type hash as ROS 2 Iron and later put it there (`typehash=RIHS01_...;`):
    ROS 2's graph (`ros2 topic info -v`, rclpy's `get_publishers_info_by_topic`) shows it, and shows INVALID without.
    """
    if not isinstance(qos.depth, int) or qos.depth < 1:
        raise ValueError(f"QoS.depth must be an int >= 1 (keep-last history), got {qos.depth!r}")
    policies = [
        Policy.Reliability.Reliable(max_blocking_time=_MAX_BLOCKING) if qos.reliable else Policy.Reliability.BestEffort,
        Policy.History.KeepLast(depth=qos.depth),
        Policy.Durability.TransientLocal if qos.transient_local else Policy.Durability.Volatile,
        Policy.DataRepresentation(use_cdrv0_representation=True),
    ]
    if ros_type is not None:
        policies.append(Policy.Userdata(data=f"typehash={type_hash(ros_type)};".encode()))
    return Qos(*policies)


# ----------------------------------------------------------------------------------------------------------------
# Interoperability with the other DDS implementations ROS 2 runs on
# ----------------------------------------------------------------------------------------------------------------

# RTPS vendor id of eProsima Fast DDS: rmw_fastrtps_cpp, ROS 2's default middleware.
FAST_DDS_VENDOR_ID = "1.15"

# Match Fast DDS endpoints on topic and type names, as every ROS 2 middleware does, not on XTypes type objects.
#
# Why (measured against rclpy 9.1.2 / rmw_fastrtps_cpp 9.3.3 / Fast DDS 3.2.3, ROS 2 Kilted): cyclonedds-python
# attaches XTypes type information to every topic (it needs it), and Fast DDS 3 sends type information too. When
# both ends of a match carry it, Cyclone matches only once it has fetched the remote type objects (TypeLookup
# service) and found them assignable. Fast DDS's type objects leave both "try construct" flags of sequence
# elements at 0, which Cyclone's validation rejects ("ddsi_xt_type_add_typeobj with invalid type object"), so every
# type with a sequence in it (JointState, Image, CompressedImage, Float64MultiArray, JointTrajectory, Joy) never
# resolves and Cyclone never matches a Fast DDS reader or writer of it: 0 samples either way (Bool, String, Time,
# Header, which have no sequence, do match). Fast DDS itself ignores type information from other vendors and
# matches on names, and rmw_cyclonedds sends none, so ROS 2 nodes never match on type objects anyway.
# `IgnoreTypeInformation` (Cyclone DDS 11+) makes Cyclone do the same with Fast DDS's announcements.
INTEROP_CONFIG = (
    '<CycloneDDS xmlns="https://cdds.io/config"><Domain Id="any"><Compatibility>'
    f"<IgnoreTypeInformation>{FAST_DDS_VENDOR_ID}</IgnoreTypeInformation>"
    "</Compatibility></Domain></CycloneDDS>"
)

# Discovery on the loopback config is unicast: we announce ourselves to 127.0.0.1's participant ports, and a node
# that only multicasts (Fast DDS with the default discovery range) finds us only through those announcements.
# Cyclone's defaults send them at start, then every 30 s, and stop after 30 s without an answer, so a ROS 2 node
# started after us would wait 30 s, or forever. Every second, and for as long as we run, instead (33 datagrams a
# second on loopback). Cyclone DDS 11+ (InitialLocatorPruneDelay).
LOOPBACK_DISCOVERY_CONFIG = (
    '<CycloneDDS xmlns="https://cdds.io/config"><Domain Id="any"><Discovery>'
    "<SPDPInterval>1s</SPDPInterval><InitialLocatorPruneDelay>inf</InitialLocatorPruneDelay>"
    "</Discovery></Domain></CycloneDDS>"
)


def domain_config(config: str | None) -> str:
    """The configuration string a domain is created from: `INTEROP_CONFIG`, then the transport's config (None:
    CYCLONEDDS_URI), then, on the loopback config, `LOOPBACK_DISCOVERY_CONFIG`. Later entries override earlier ones,
    so a user's config may still set `Compatibility/IgnoreTypeInformation` its own way."""
    base = config if config is not None else os.environ.get("CYCLONEDDS_URI", "")
    parts = [INTEROP_CONFIG, base]
    if base.strip() == LOOPBACK_CONFIG.resolve().as_uri():
        parts.append(LOOPBACK_DISCOVERY_CONFIG)
    return ",".join(part for part in parts if part.strip())


def _create_domain(domain_id: int, config: str | None) -> Domain:
    try:
        return Domain(domain_id, domain_config(config))
    except DDSException:
        # Cyclone DDS before 11.0 knows neither option (an unknown element is a configuration error); the transport's
        # own config alone then, which raises the real error if that config is what failed.
        domain = Domain(domain_id, config if config is not None else os.environ.get("CYCLONEDDS_URI", ""))
        log.warning(
            "this Cyclone DDS predates Compatibility/IgnoreTypeInformation (Cyclone DDS 11): DDS endpoints will not "
            "match those of ROS 2 nodes on Fast DDS (rmw_fastrtps_cpp); use cyclonedds>=11 or the rclpy backend"
        )
        return domain


def resolve_config(config: str | os.PathLike | None) -> str | None:
    """The CycloneDDS configuration a transport will use, as Domain() takes it; None means CYCLONEDDS_URI.

    None: CYCLONEDDS_URI if it is set, else the loopback file. "loopback": the loopback file. A path: that file.
    A string starting with "<": inline XML.
    """
    if config is None:
        if os.environ.get("CYCLONEDDS_URI"):
            return None
        config = LOOPBACK_CONFIG
    elif isinstance(config, str) and config == "loopback":
        config = LOOPBACK_CONFIG
    elif isinstance(config, str) and config.lstrip().startswith("<"):
        return config
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(
            f"DDS config {str(config)!r} is not a file; expected None, 'loopback', a CycloneDDS XML file or inline XML"
        )
    return path.resolve().as_uri()


class _DomainRegistry:
    """One Cyclone domain per id per process: its configuration is fixed by whoever creates it first."""

    def __init__(self):
        self._lock = threading.Lock()
        self._domains: dict[int, list] = {}  # id -> [config key, Domain, users]

    def acquire(self, domain_id: int, config: str | None) -> None:
        with self._lock:
            entry = self._domains.get(domain_id)
            if entry is not None:
                if entry[0] != config:
                    running, wanted = entry[0] or "CYCLONEDDS_URI", config or "CYCLONEDDS_URI"
                    raise RuntimeError(
                        f"DDS domain {domain_id} already runs in this process with config {running!r}; "
                        f"cannot also use {wanted!r} (use one config per domain per process)"
                    )
                entry[2] += 1
                return
            self._domains[domain_id] = [config, _create_domain(domain_id, config), 1]

    def release(self, domain_id: int) -> None:
        with self._lock:
            entry = self._domains.get(domain_id)
            if entry is None:
                return
            entry[2] -= 1
            if entry[2] == 0:
                del self._domains[domain_id]
                _delete(entry[1])


_DOMAINS = _DomainRegistry()


def _delete(entity: Any) -> None:
    """Delete a DDS entity now. cyclonedds-python ties deletion to `__del__` and has no public delete; its
    `__del__` is idempotent (it forgets the handle), so calling it early is safe and garbage collection later
    does not delete a reused handle."""
    if entity is not None:
        entity.__del__()


# ----------------------------------------------------------------------------------------------------------------
# The ROS 2 graph: which node owns which endpoints (rmw_dds_common's ros_discovery_info)
# ----------------------------------------------------------------------------------------------------------------

# Every ROS 2 participant publishes, on the DDS topic `ros_discovery_info` (reliable, transient-local, keep-last 1),
# its nodes and the GIDs (DDS GUIDs) of each node's readers and writers; `ros2 node list` and rclpy's
# `get_node_names()` are built from it. Participants also say `enclave=/;` in their USER_DATA.
# Limit: rmw_fastrtps ties a remote endpoint to its participant by the PARTICIPANT_GUID parameter of the endpoint's
# discovery data, which Cyclone does not send, so `ros2 topic info -v` under Fast DDS still names our endpoints'
# node `_CREATED_BY_BARE_DDS_APP_` (their type and type hash are right).
GRAPH_TOPIC = "ros_discovery_info"
PARTICIPANT_USER_DATA = b"enclave=/;"
_GRAPH_QOS = Qos(
    Policy.Reliability.Reliable(max_blocking_time=_MAX_BLOCKING),
    Policy.History.KeepLast(depth=1),
    Policy.Durability.TransientLocal,
    Policy.DataRepresentation(use_cdrv0_representation=True),
)
_Gid = make_idl_struct("Gid_", "rmw_dds_common::msg::dds_::Gid_", {"data": idl.array[idl.uint8, 16]})
_NodeEntitiesInfo = make_idl_struct("NodeEntitiesInfo_", "rmw_dds_common::msg::dds_::NodeEntitiesInfo_", {
    "node_namespace": idl.bounded_str[256],
    "node_name": idl.bounded_str[256],
    "reader_gid_seq": idl.sequence[_Gid],
    "writer_gid_seq": idl.sequence[_Gid],
})
_ParticipantEntitiesInfo = make_idl_struct(
    "ParticipantEntitiesInfo_", "rmw_dds_common::msg::dds_::ParticipantEntitiesInfo_",
    {"gid": _Gid, "node_entities_info_seq": idl.sequence[_NodeEntitiesInfo]},
)


def _gid(entity: Any) -> Any:
    """An entity's DDS GUID as rmw's GID: the 16 bytes of the GUID (prefix, then entity id)."""
    return _Gid(list(entity.guid.bytes))


# ----------------------------------------------------------------------------------------------------------------
# The transport
# ----------------------------------------------------------------------------------------------------------------


class DDSPublisher(Publisher):
    def __init__(self, transport: "DDSTransport", topic: str, msg_type: type, qos: QoS, writer: DataWriter):
        self.topic, self.msg_type, self.qos = topic, msg_type, qos
        self._transport, self._writer = transport, writer
        self._codec = codec_for(msg_type)

    def publish(self, msg: Any) -> None:
        if not isinstance(msg, self.msg_type):
            raise TypeError(f"publisher on {self.topic!r} takes {self.msg_type.__name__}, got {type(msg).__name__}")
        if self._writer is None:
            raise RuntimeError(f"publisher on {self.topic!r} is closed")
        try:
            wire = self._codec.to_wire(msg)
        except (TypeError, ValueError) as e:
            raise ValueError(f"cannot convert {self.msg_type.__name__} for {self.topic!r}: {e}") from e
        try:
            self._writer.write(wire)
        except DDSException as e:
            # The usual cause: a sample over the config's Internal/MaxSampleSize (16 MiB in the loopback config).
            raise RuntimeError(
                f"DDS write on {self.topic!r} failed: {e} (a sample larger than the DDS config's "
                "Internal/MaxSampleSize, 16 MiB in the loopback config, is refused)"
            ) from e
        except Exception as e:  # the serialiser names the member and value that did not fit its IDL type
            cause = f" ({e.__cause__})" if e.__cause__ else ""
            raise ValueError(f"cannot encode {self.msg_type.ros_type} for {self.topic!r}: {e}{cause}") from e

    def subscription_count(self) -> int:
        return 0 if self._writer is None else len(self._writer.get_matched_subscriptions())

    def close(self) -> None:
        self._transport._forget(self)
        _delete(self._writer)
        self._writer = None


class DDSSubscription(Subscription):
    def __init__(self, transport: "DDSTransport", topic: str, msg_type: type, callback, qos: QoS, reader: DataReader):
        self.topic, self.msg_type, self.qos = topic, msg_type, qos
        self._transport, self._callback, self._reader = transport, callback, reader
        self._codec = codec_for(msg_type)
        self._condition = ReadCondition(reader, SampleState.Any | ViewState.Any | InstanceState.Any)
        self.received = 0  # delivered to the callback
        self.dropped = 0  # malformed samples, and callbacks that raised

    def _drain(self) -> None:
        """Take and deliver every waiting sample; runs on the transport's reader thread."""
        while True:
            with self._transport._lock:
                if self._reader is None:
                    return
                try:
                    # One at a time: cyclonedds deserialises a whole batch after taking it, so one malformed
                    # sample would otherwise lose the good ones around it.
                    samples = self._reader.take(N=1)
                except DDSException as e:
                    log.error("DDS take on %s failed: %s", self.topic, e)
                    return
                except Exception as e:  # malformed CDR: the sample is already taken, so dropping it is enough
                    self.dropped += 1
                    log.warning("dropped a malformed %s sample on %s: %r", self.msg_type.ros_type, self.topic, e)
                    continue
            if not samples:
                return
            if isinstance(samples[0], InvalidSample):  # instance state news (a writer left), not data
                continue
            self._deliver(self._codec.from_wire, samples[0], self._callback)

    def publisher_count(self) -> int:
        """Matched publishers, local and remote (rclpy's `get_publisher_count`)."""
        with self._transport._lock:
            return 0 if self._reader is None else len(self._reader.get_matched_publications())

    def close(self) -> None:
        with self._transport._lock:
            if self._reader is None:
                return
            self._transport._forget(self)
            if self._transport._waitset is not None:
                self._transport._waitset.detach(self._condition)
            _delete(self._condition)
            _delete(self._reader)
            self._reader = None


class DDSTransport(Transport):
    """A ROS 2 node's connection to the graph over CycloneDDS, without ROS.

    Args:
        domain_id: the DDS domain, ROS_DOMAIN_ID in ROS 2 (0..232; keep it <= 101 on Linux, see the loopback XML).
        node_name: the ROS 2 node name this transport announces (`ros2 node list`), also used for the reader
            thread's name and in errors.
        config: None (CYCLONEDDS_URI if set, else loopback), "loopback", a CycloneDDS XML path, or inline XML.

    Callbacks run on one reader thread per transport; a callback that raises, or a malformed sample, is logged and
    dropped, and the thread carries on.
    """

    backend = "dds"

    def __init__(self, domain_id: int = 0, node_name: str = "kinema", config: str | os.PathLike | None = None):
        if not isinstance(domain_id, int) or not 0 <= domain_id <= 232:
            raise ValueError(f"domain_id must be an int in 0..232 (ROS_DOMAIN_ID), got {domain_id!r}")
        self.domain_id, self.node_name = domain_id, node_name
        self.config = resolve_config(config)
        self._lock = threading.RLock()
        self._topics: dict[str, tuple[type, Topic]] = {}
        self._endpoints: list[DDSPublisher | DDSSubscription] = []
        self._waitset: WaitSet | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        _DOMAINS.acquire(domain_id, self.config)
        try:
            self._participant = DomainParticipant(domain_id, qos=Qos(Policy.Userdata(data=PARTICIPANT_USER_DATA)))
        except DDSException as e:
            _DOMAINS.release(domain_id)
            where = self.config or "CYCLONEDDS_URI"
            raise RuntimeError(f"cannot join DDS domain {domain_id} (config {where}): {e}") from e
        try:
            self._guard = GuardCondition(self._participant)
            self._graph_topic = Topic(self._participant, GRAPH_TOPIC, _ParticipantEntitiesInfo)
            self._graph_writer: DataWriter | None = DataWriter(self._participant, self._graph_topic, qos=_GRAPH_QOS)
        except DDSException as e:
            _delete(self._participant)
            _DOMAINS.release(domain_id)
            raise RuntimeError(f"cannot set up the DDS participant of node {node_name!r}: {e}") from e
        self._announce()

    # -- entities ---------------------------------------------------------------------------------------------------

    def _topic(self, topic: str, msg_type: type) -> Topic:
        name = dds_topic_name(topic)
        codec = codec_for(msg_type)
        known = self._topics.get(name)
        if known is not None:
            if known[0] is not msg_type:
                raise TypeError(f"topic {topic!r} already carries {known[0].ros_type}, not {msg_type.ros_type}")
            return known[1]
        dds_topic = Topic(self._participant, name, codec.wire_type)
        self._topics[name] = (msg_type, dds_topic)
        return dds_topic

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"DDS transport of node {self.node_name!r} is closed")

    def _forget(self, endpoint) -> None:
        with self._lock:
            if endpoint in self._endpoints:
                self._endpoints.remove(endpoint)
                self._announce()

    def _announce(self) -> None:
        """Publish this node and its endpoints on `ros_discovery_info` (latched: late joiners get the last)."""
        with self._lock:
            if self._graph_writer is None:
                return
            readers = [_gid(e._reader) for e in self._endpoints if isinstance(e, DDSSubscription) and e._reader]
            writers = [_gid(e._writer) for e in self._endpoints if isinstance(e, DDSPublisher) and e._writer]
            node = _NodeEntitiesInfo(node_namespace="/", node_name=self.node_name, reader_gid_seq=readers,
                                     writer_gid_seq=writers)
            try:
                self._graph_writer.write(_ParticipantEntitiesInfo(gid=_gid(self._participant),
                                                                  node_entities_info_seq=[node]))
            except Exception as e:  # the graph is informational: never fail a publisher or subscription over it
                log.warning("could not announce node %s on %s: %r", self.node_name, GRAPH_TOPIC, e)

    def publisher(self, topic: str, msg_type: type, qos: QoS = QOS_DEFAULT) -> Publisher:
        with self._lock:
            self._check_open()
            dds_topic = self._topic(topic, msg_type)
            writer = DataWriter(self._participant, dds_topic, qos=dds_qos(qos, msg_type.ros_type))
            pub = DDSPublisher(self, topic, msg_type, qos, writer)
            self._endpoints.append(pub)
            self._announce()
            return pub

    def subscribe(
        self, topic: str, msg_type: type, callback: Callable[[Any], None], qos: QoS = QOS_DEFAULT
    ) -> Subscription:
        if not callable(callback):
            raise TypeError(f"subscribe({topic!r}): callback must be callable, got {type(callback).__name__}")
        with self._lock:
            self._check_open()
            dds_topic = self._topic(topic, msg_type)
            reader = DataReader(self._participant, dds_topic, qos=dds_qos(qos, msg_type.ros_type))
            sub = DDSSubscription(self, topic, msg_type, callback, qos, reader)
            self._endpoints.append(sub)
            self._start_thread()
            self._waitset.attach(sub._condition)
            self._announce()
            return sub

    # -- the reader thread ------------------------------------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is not None:
            return
        self._waitset = WaitSet(self._participant)
        self._waitset.attach(self._guard)
        self._thread = threading.Thread(target=self._spin, name=f"kinema-dds-{self.node_name}", daemon=True)
        self._thread.start()

    def _spin(self) -> None:
        # The timeout is only a safety net: new data and close() both wake the wait.
        while not self._closed:
            try:
                self._waitset.wait(duration(seconds=1))
            except DDSException as e:
                if not self._closed:
                    log.error("DDS wait failed on node %s: %s", self.node_name, e)
                return
            if self._closed:
                return
            with self._lock:
                subs = [e for e in self._endpoints if isinstance(e, DDSSubscription)]
            for sub in subs:
                sub._drain()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            endpoints = list(self._endpoints)
        self._guard.set(True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            graph_writer, self._graph_writer = self._graph_writer, None  # no announcement per endpoint closed
        for endpoint in endpoints:
            endpoint.close()
        with self._lock:
            _delete(graph_writer)
            _delete(self._graph_topic)
            _delete(self._waitset)
            _delete(self._guard)
            for _, dds_topic in self._topics.values():
                _delete(dds_topic)
            self._topics.clear()
            _delete(self._participant)
            self._waitset = self._guard = self._participant = self._graph_topic = None
        _DOMAINS.release(self.domain_id)


__all__ = [
    "DDSPublisher", "DDSSubscription", "DDSTransport", "FAST_DDS_VENDOR_ID", "GRAPH_TOPIC", "INTEROP_CONFIG",
    "LOOPBACK_CONFIG", "LOOPBACK_DISCOVERY_CONFIG", "WireCodec", "codec_for", "dds_qos", "dds_topic_name",
    "dds_type_name", "domain_config", "loopback_environment", "resolve_config",
]
