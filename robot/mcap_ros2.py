"""MCAP files with the `ros2` profile: what `ros2 bag info`, `ros2 bag play` and Foxglove read.

Every message is stored as CDR with its `ros2msg` schema: the upstream `.msg` text of the type, followed by the
definitions of every type it depends on, each after a line of 80 `=` and a `MSG: pkg/Type` line. That is the layout
rosbag2's MCAP storage plugin writes, so ROS 2 tools decode our recordings without a message package installed.

The definitions below are the upstream ones (ros2/common_interfaces, ros2/rcl_interfaces), field for field, without
their comments. They cover `robot.messages.MESSAGE_TYPES`; a test checks the two stay in step.

A file is written under `<name>.mcap.recording` and renamed to `<name>.mcap` only once its footer is written: an
MCAP file that a crash left open never carries the `.mcap` name. `mcap_is_complete` checks a file's footer and
summary, for files renamed by hand or truncated on disk.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from robot.messages import MESSAGE_TYPES, MSG_DEFINITIONS

_PRIMITIVES = {"bool", "byte", "char", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
               "int64", "uint64", "string", "wstring"}
_SEPARATOR = "=" * 80
MCAP_SUFFIX = ".mcap"
RECORDING_SUFFIX = ".mcap.recording"  # a file being written (or left open by a crash)
INCOMPLETE_SUFFIX = ".mcap.incomplete"  # a file a crash left without its footer, renamed so no *.mcap glob takes it


def _dependencies(ros_type: str) -> list[str]:
    """Every type `ros_type` refers to, directly or not, depth-first in first-use order (as rosbag2 lists them)."""
    out: list[str] = []

    def visit(name: str) -> None:
        for line in MSG_DEFINITIONS[name].splitlines():
            ftype = re.sub(r"\[.*\]$", "", line.split()[0])
            if ftype in _PRIMITIVES:
                continue
            parts = ftype.split("/")
            full = f"{parts[0]}/msg/{parts[-1]}" if len(parts) > 1 else f"{name.split('/')[0]}/msg/{parts[0]}"
            if full not in MSG_DEFINITIONS:
                raise KeyError(f"{name} refers to {ftype}, whose definition is not known")
            if full not in out:
                out.append(full)
                visit(full)

    visit(ros_type)
    return out


def schema_text(ros_type: str) -> str:
    """The `ros2msg` schema of `ros_type`: its definition, then each dependency after a separator and `MSG:` line."""
    if ros_type not in MSG_DEFINITIONS:
        raise KeyError(f"no .msg definition for {ros_type!r}; known: {', '.join(sorted(MSG_DEFINITIONS))}")
    parts = [MSG_DEFINITIONS[ros_type].rstrip("\n")]
    for dep in _dependencies(ros_type):
        pkg, _, name = dep.split("/")
        parts += [_SEPARATOR, f"MSG: {pkg}/{name}", MSG_DEFINITIONS[dep].rstrip("\n")]
    return "\n".join(parts) + "\n"


def to_ros2(msg: Any) -> Any:
    """A `robot.messages` dataclass as the nested dicts and lists mcap_ros2's CDR encoder takes (bytes stay bytes)."""
    if dataclasses.is_dataclass(msg) and not isinstance(msg, type):
        return {f.name: to_ros2(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    if isinstance(msg, np.ndarray):
        return msg.tolist()
    if isinstance(msg, (list, tuple)):
        return [to_ros2(v) for v in msg]
    if isinstance(msg, np.generic):
        return msg.item()
    return msg


def from_ros2(decoded: Any, msg_type: type) -> Any:
    """A message decoded by mcap_ros2 back into the `robot.messages` dataclass `msg_type`."""
    kwargs: dict[str, Any] = {}
    hints = {f.name: f for f in dataclasses.fields(msg_type)}
    for name, f in hints.items():
        value = getattr(decoded, name)
        factory = f.default_factory
        default = factory() if factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            value = from_ros2(value, type(default))
        elif isinstance(default, list) and value and not isinstance(value[0], (str, int, float, bool)):
            item_type = _list_item_type(msg_type, name)
            value = [from_ros2(v, item_type) for v in value]
        elif isinstance(default, np.ndarray):
            value = np.asarray(list(value), dtype=default.dtype)
        elif isinstance(default, bytes):
            value = bytes(value)
        kwargs[name] = value
    return msg_type(**kwargs)


def _list_item_type(msg_type: type, field_name: str) -> type:
    """The element type of a list-of-messages field, from the .msg definition (`JointTrajectoryPoint[] points`)."""
    for line in MSG_DEFINITIONS[msg_type.ros_type].splitlines():
        ftype, name = line.split()[:2]
        if name == field_name:
            base = re.sub(r"\[.*\]$", "", ftype).split("/")[-1]
            for ros_type, cls in MESSAGE_TYPES.items():
                if ros_type.split("/")[-1] == base:
                    return cls
    raise KeyError(f"{msg_type.ros_type}.{field_name} is not a list of messages")


def mcap_is_complete(path: str | Path) -> bool:
    """True when the file is an MCAP file with its footer and a readable summary (it was closed properly)."""
    from mcap.reader import make_reader

    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(8)
            f.seek(0, os.SEEK_END)
            if f.tell() < 16 or head != b"\x89MCAP0\r\n":
                return False
            f.seek(-8, os.SEEK_END)
            if f.read(8) != head:
                return False
            f.seek(0)
            make_reader(f).get_summary()
        return True
    except Exception:  # noqa: BLE001 - any reader error means the file is not a usable, finished MCAP file
        return False


class McapRos2Writer:
    """One MCAP file (ros2 profile) being written: schemas registered on first use, channels per topic.

    Written under `<path>.recording` (see `RECORDING_SUFFIX`), renamed to `path` by `finish()` after the footer is
    on disk. Not thread-safe: callers serialise.
    """

    def __init__(self, path: str | Path, *, chunk_size: int = 256 * 1024, metadata: dict[str, str] | None = None):
        from mcap_ros2.writer import Writer

        self.path = Path(path)
        if not self.path.name.endswith(MCAP_SUFFIX):
            raise ValueError(f"MCAP path {self.path} must end with {MCAP_SUFFIX}")
        self.partial = self.path.with_name(self.path.name[: -len(MCAP_SUFFIX)] + RECORDING_SUFFIX)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.partial.open("wb")
        # Small chunks: a crash loses at most one chunk of messages, and `mcap recover` can salvage the rest.
        self._writer = Writer(self._file, chunk_size=chunk_size)
        self._schemas: dict[str, Any] = {}
        self.messages = 0
        if metadata:
            self._writer.add_metadata("kinema", {k: str(v) for k, v in metadata.items()})

    def write(self, topic: str, msg: Any, log_time_ns: int | None = None, publish_time_ns: int | None = None) -> None:
        """Append one message; `log_time_ns` defaults to now (the receive time)."""
        ros_type = msg.ros_type
        schema = self._schemas.get(ros_type)
        if schema is None:
            schema = self._schemas[ros_type] = self._writer.register_msgdef(ros_type, schema_text(ros_type))
        log_time_ns = time.time_ns() if log_time_ns is None else int(log_time_ns)
        self._writer.write_message(topic, schema, to_ros2(msg), log_time=log_time_ns,
                                   publish_time=log_time_ns if publish_time_ns is None else int(publish_time_ns),
                                   sequence=self.messages)
        self.messages += 1

    def finish(self) -> Path:
        """Write the footer, flush to disk, and give the file its final name."""
        self._writer.finish()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        return self.path

    def discard(self) -> None:
        """Drop the file (an aborted episode)."""
        try:
            self._file.close()
        finally:
            self.partial.unlink(missing_ok=True)


def read_mcap(path: str | Path, topics: Iterable[str] | None = None) -> Iterator[tuple[str, int, Any]]:
    """(topic, log_time_ns, message) for every message, as `robot.messages` dataclasses, in log-time order.

    Refuses a file without its footer (a recording a crash left open): use `mcap recover` on it first.
    """
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    if not mcap_is_complete(path):
        raise ValueError(f"{path} is not a complete MCAP file (no footer: the recording was interrupted)")
    with Path(path).open("rb") as f:
        reader = make_reader(f, decoder_factories=[DecoderFactory()])
        for schema, channel, message, decoded in reader.iter_decoded_messages(
                topics=list(topics) if topics is not None else None, log_time_order=True):
            cls = MESSAGE_TYPES.get(schema.name)
            if cls is None:
                raise ValueError(f"{path}: topic {channel.topic} carries {schema.name}, not a robot.messages type")
            yield channel.topic, message.log_time, from_ros2(decoded, cls)
