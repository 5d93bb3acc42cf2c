"""The episode recorder: deployment episodes as Episodes, in LeRobotDataset v3 and in MCAP (ros2 profile).

`EpisodeRecorder(transport, config, out_dir)` subscribes through the transport interface (any backend) and samples
the latest joint state, camera frames and sent command into Episode steps, at `config.fps` on a timer, or once per
command received (`sample_on="command"`: steps then pair 1:1 with the commands a streaming controller was sent,
with no aliasing between two loops running at the same nominal rate):

- `observation.state`: float32, the positions of `config.joint_names` in that order, matched by name in
  `/joint_states` (never by index). A `state_fn(joint_positions) -> vector` hook replaces it, e.g. forward kinematics
  to the (8,) end-effector state (position, quaternion wxyz, gripper opening) that the VLA trained in sim reads.
- `observation.images.<camera>`: uint8 (H, W, 3) RGB, from `sensor_msgs/Image` (rgb8/bgr8) or `CompressedImage`.
- `action`: the command actually sent, from the command topic (`Float64MultiArray` in `joint_names` order, as
  ros2_control's forward_position_controller takes it; or the `JointTrajectory` point in effect at the sample time).
  It is what passed the safety layer, for policy and human steps alike. An `action_fn(command, joint_positions)`
  hook maps it into the policy's action space (e.g. end-effector deltas).
- `executed_by` / `segment` from the takeover topic (`std_msgs/Bool`, True while a person has control): human steps
  are HUMAN; policy steps PROGRESS, except the `failure_window` policy steps just before each takeover, which are
  FAILURE_INDUCING (the convention of sim/monitor.py: they led to the takeover, so they are excluded from imitation).
- `task` from the instruction topic (`std_msgs/String`; the last one received when the episode's first step is taken).
- `success` per step from the optional success topic (`std_msgs/Bool`, e.g. the sim-robot node's).

Episode boundaries come from the episode-control topic (`std_msgs/String`) or from `mark()` (a keypress handler,
`KeyControl`, calls it):

    start    begin an episode (ignored, and counted, while one is being recorded)
    success  end it, outcome success          failure  end it, outcome failure
    stop     end it without a label: the outcome is whether the success topic reported success (False without one)
    abort    drop it: nothing is written, its MCAP file is deleted
    reset    (the sim-robot node's reset, "reset seed=N" too) end the current episode as with stop; start a new one

The success topic (`std_msgs/Bool`, default `/kinema/success`, as the sim-robot node publishes it) marks the steps
from the first True on as successful.

Output, under `out_dir`:
- `dataset/`: a LeRobotDataset v3, appended to episode by episode (`kinema train --dataset out_dir/dataset`). It
  holds nothing else, so it can be shared or uploaded as it is;
- `mcap/episode_<index>.mcap`: every message received during episode `<index>` of the dataset, on every subscribed
  topic (state, cameras, command, takeover, episode control, instruction, success), as received, log time = receive
  time. The file starts with the last message received on each topic before the episode began, so it stands alone;
- `spool/`: the episode being recorded, streamed step by step (see below).

Crash safety. Every step is appended to `spool/<id>.spool` as it is sampled (a length- and CRC-framed record, written
through to the OS at once, fsynced every `spool_fsync_s`). A finished episode is committed to the dataset from its
spool, and the spool is deleted after the commit. On the next start (or `EpisodeRecorder.recover(out_dir)`), each
spool left behind is committed: with `complete=True` when the episode had ended (the process died while writing it),
with `complete=False` when it had not (killed mid-episode). A torn last record is dropped. Nothing is committed
twice: a spool records the index its episode was added under before the commit, and a spool whose episode the
dataset already holds is just deleted. MCAP files are written as `*.mcap.recording` and renamed when their footer is
on disk; recovery renames one a crash left open to `episode_<index>.mcap.incomplete` (and reports it), so no
`*.mcap` glob ever picks up a file without its footer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import queue
import struct
import sys
import threading
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from diffusion_rl.data import (
    IMAGE_PREFIX,
    STATE_KEY,
    Episode,
    ExecutedBy,
    LeRobotDatasetReader,
    LeRobotDatasetWriter,
    Segment,
    mark_failure_inducing,
)
from robot import messages as M
from robot.counters import RejectionLog
from robot.inputs import InputRejected, decode_image, joint_positions
from robot.mcap_ros2 import INCOMPLETE_SUFFIX, MCAP_SUFFIX, RECORDING_SUFFIX, McapRos2Writer, mcap_is_complete
from robot.transport.base import QOS_DEFAULT, QOS_SENSOR, Subscription, Transport, check_topic

log = logging.getLogger("kinema.recorder")

EPISODE_EVENTS = ("start", "stop", "success", "failure", "abort")
COMMAND_TYPES = ("forward_position", "joint_trajectory")
SAMPLE_MODES = ("timer", "command")
DATASET_DIR = "dataset"
MCAP_DIR = "mcap"
SPOOL_DIR = "spool"
_MIN_STEP_S = 1e-4  # steps closer than this would share a video frame time (LeRobot's lookup tolerance)


# ---------------------------------------------------------------------------------------------------------- config
@dataclass
class CameraTopic:
    """One camera: recorded as `observation.images.<name>`."""

    name: str
    topic: str
    compressed: bool = False  # sensor_msgs/CompressedImage (jpeg/png) instead of sensor_msgs/Image
    size: tuple[int, int] | None = None  # (H, W) its frames must have; None: RecorderConfig.image_size

    def __post_init__(self) -> None:
        if self.size is not None:
            self.size = tuple(int(v) for v in self.size)  # type: ignore[assignment]
            if len(self.size) != 2 or min(self.size) < 1:
                raise ValueError(f"camera {self.name!r}: size must be (height, width); got {self.size!r}")

    @property
    def key(self) -> str:
        return f"{IMAGE_PREFIX}{self.name}"


@dataclass
class RecorderConfig:
    """What to record and how. Topics are absolute ROS 2 names."""

    joint_names: list[str] = field(default_factory=list)  # observation.state / action order; matched by name
    state_topic: str = "/joint_states"
    cameras: list[CameraTopic] = field(default_factory=list)
    command_topic: str = "/forward_position_controller/commands"
    command_type: str = "forward_position"  # forward_position (Float64MultiArray) | joint_trajectory
    takeover_topic: str = "/kinema/takeover"  # std_msgs/Bool, True while a person has control
    episode_topic: str = "/kinema/episode"  # std_msgs/String: start | success | failure | stop | abort | reset
    instruction_topic: str = "/kinema/instruction"  # std_msgs/String
    success_topic: str = "/kinema/success"  # std_msgs/Bool: task solved (sim robot, or a person); "": no such topic
    instruction: str = ""  # the task when nothing arrives on the instruction topic
    fps: float = 10.0  # sampling (control) rate of the recorded steps
    sample_on: str = "timer"  # timer: a step every 1/fps (start()); command: a step per command received
    image_size: tuple[int, int] | None = None  # (H, W) every frame must have; None: each camera's first frame sets it
    resize: tuple[int, int] | None = None  # store frames at this (H, W) (area interpolation); None: as received
    failure_window: int = 8  # policy steps before a takeover labelled failure_inducing (as MonitorConfig)
    max_age_s: float = 0.5  # an input older than this at sampling time makes the step stale: skipped and counted
    max_steps: int = 0  # end an episode (unlabelled, as "stop") after this many steps; 0: no limit
    allow_extra_joints: bool = True  # joint_states may name joints not in joint_names (grippers, other arms)
    state_names: list[str] | None = None  # LeRobot names of observation.state dims (default: joint_names)
    action_names: list[str] | None = None  # LeRobot names of action dims (default: joint_names)
    task_id: str = ""
    policy_version: str = "deployment"  # not a demo version: batching treats these episodes as policy rollouts
    robot_type: str = "kinema_robot"
    mcap: bool = True
    spool_fsync_s: float = 1.0  # fsync the spool this often (process kills need none; power cuts do)

    def __post_init__(self) -> None:
        self.cameras = [c if isinstance(c, CameraTopic) else CameraTopic(**c) for c in self.cameras]
        if not self.joint_names or len(set(self.joint_names)) != len(self.joint_names):
            raise ValueError(f"RecorderConfig.joint_names: expected distinct joint names; got {self.joint_names!r}")
        fields = {name: getattr(self, name) for name in ("state_topic", "command_topic", "takeover_topic",
                                                          "episode_topic", "instruction_topic", "success_topic")}
        fields.update({f"cameras[{i}].topic": c.topic for i, c in enumerate(self.cameras)})
        if not self.success_topic:
            del fields["success_topic"]
        seen: dict[str, str] = {}
        for name, topic in fields.items():
            try:
                check_topic(topic)
            except ValueError as err:
                raise ValueError(f"RecorderConfig.{name}: {err}") from None
            if topic in seen:
                raise ValueError(f"RecorderConfig.{name} and RecorderConfig.{seen[topic]} are both {topic!r}; "
                                 "every topic must be distinct")
            seen[topic] = name
        names = [c.name for c in self.cameras]
        if len(set(names)) != len(names) or any(not n or "/" in n or "." in n for n in names):
            raise ValueError(f"RecorderConfig.cameras: expected distinct names without '.' or '/'; got {names}")
        if self.command_type not in COMMAND_TYPES:
            raise ValueError(f"RecorderConfig.command_type {self.command_type!r}; expected one of {COMMAND_TYPES}")
        if self.sample_on not in SAMPLE_MODES:
            raise ValueError(f"RecorderConfig.sample_on {self.sample_on!r}; expected one of {SAMPLE_MODES}")
        if self.sample_on == "command" and self.command_type != "forward_position":
            raise ValueError("RecorderConfig.sample_on='command' needs command_type='forward_position' (a streamed "
                             "command per control tick); sample trajectories with sample_on='timer'")
        if not (self.fps > 0 and math.isfinite(self.fps)):
            raise ValueError(f"RecorderConfig.fps must be a positive number; got {self.fps}")
        for name in ("image_size", "resize"):
            value = getattr(self, name)
            if value is not None:
                value = tuple(int(v) for v in value)
                if len(value) != 2 or min(value) < 2 or any(v % 2 for v in value):
                    raise ValueError(f"RecorderConfig.{name}: expected (height, width), even and >= 2 (H.264 "
                                     f"yuv420p needs even sizes); got {getattr(self, name)!r}")
                setattr(self, name, value)
        for name, ok, expected in (("failure_window", self.failure_window >= 0, ">= 0"),
                                   ("max_steps", self.max_steps >= 0, ">= 0 (0: no limit)"),
                                   ("max_age_s", self.max_age_s > 0, "> 0 seconds")):
            if not ok:
                raise ValueError(f"RecorderConfig.{name} must be {expected}; got {getattr(self, name)!r}")

    @classmethod
    def from_robot(cls, robot: Any, **overrides: Any) -> RecorderConfig:
        """The recorder's view of a `robot.config.RobotConfig`: its command joints, topics, cameras and control rate.

        For recordings a sim-trained VLA can learn from, pair it with `robot.kinematics.ActionMapper`:
        `EpisodeRecorder(..., state_fn=mapper.state, action_fn=mapper.to_action)` records the (8,) end-effector
        state and the (7,) end-effector-delta action instead of joint positions.
        """
        controller, topics = robot.controller, robot.topics
        forward = controller.type == "forward_position"
        values: dict[str, Any] = dict(
            joint_names=list(robot.command_joint_names), state_topic=topics.joint_states,
            cameras=[CameraTopic(c.name, c.topic, c.format == "compressed", (c.height, c.width))
                     for c in robot.cameras],
            command_topic=controller.commands_topic if forward else controller.trajectory_topic,
            command_type=controller.type, sample_on="command" if forward else "timer",
            takeover_topic=topics.takeover, episode_topic=topics.episode,
            instruction_topic=topics.instruction, success_topic=topics.success, fps=float(robot.rates.control_hz),
            robot_type=robot.name or "kinema_robot")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"RecorderConfig.from_robot: unknown field(s) {unknown}")
        return cls(**(values | overrides))


# ------------------------------------------------------------------------------------------------ segment labels
def segments_from_takeovers(executed_by: np.ndarray, failure_window: int) -> np.ndarray:
    """Segment labels of a recorded episode from its intervention flags, (T,) int8.

    Human steps are HUMAN; policy steps PROGRESS, except the last `failure_window` policy steps before each
    policy -> human switch, which are FAILURE_INDUCING: the convention sim/monitor.py's simulated human applies at a
    takeover (HELP: they led there; excluded from imitation, never made negatives). Steps of an earlier human
    segment inside the window keep their label.
    """
    executed_by = np.asarray(executed_by)
    human = executed_by == ExecutedBy.HUMAN
    segment = np.where(human, Segment.HUMAN, Segment.PROGRESS).astype(np.int8)
    takeovers = np.flatnonzero(human[1:] & ~human[:-1]) + 1  # first human step of each takeover
    for start in takeovers:
        segment = mark_failure_inducing(segment, int(start), failure_window)
    return segment


# ----------------------------------------------------------------------------------------------------------- spool
_FRAME = struct.Struct("<II")  # payload length, crc32 of the payload
_SPOOL_MAGIC = b"KINEMA-SPOOL-1\n"


class _Spool:
    """An append-only file of framed records: H (header, JSON), S (step), E (end, JSON), C (committing, JSON).

    Written unbuffered, so each record reaches the OS (and survives a killed process) as soon as it is written.
    """

    def __init__(self, path: Path, fsync_s: float) -> None:
        self.path, self.fsync_s = path, fsync_s
        new = not path.exists()
        self._f = path.open("ab", buffering=0)
        if new:
            self._f.write(_SPOOL_MAGIC)
        self._last_sync = time.monotonic()

    def _record(self, kind: bytes, payload: bytes) -> None:
        body = kind + payload
        self._f.write(_FRAME.pack(len(body), zlib.crc32(body)) + body)
        if time.monotonic() - self._last_sync >= self.fsync_s:
            os.fsync(self._f.fileno())
            self._last_sync = time.monotonic()

    def json(self, kind: bytes, obj: dict[str, Any]) -> None:
        self._record(kind, json.dumps(obj).encode())

    def step(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        meta = meta | {"arrays": [[k, str(a.dtype), list(a.shape)] for k, a in arrays.items()]}
        head = json.dumps(meta).encode()
        self._record(b"S", struct.pack("<I", len(head)) + head + b"".join(np.ascontiguousarray(a).tobytes()
                                                                          for a in arrays.values()))

    def close(self, sync: bool = True) -> None:
        if sync:
            os.fsync(self._f.fileno())
        self._f.close()


@dataclass
class _SpoolContents:
    header: dict[str, Any] | None = None
    steps: list[tuple[dict[str, Any], dict[str, np.ndarray]]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    committing: dict[str, Any] | None = None
    torn: bool = False  # the last record was cut short (the process died while writing it)


def _read_spool(path: Path) -> _SpoolContents:
    out = _SpoolContents()
    data = path.read_bytes()
    if not data.startswith(_SPOOL_MAGIC):
        out.torn = bool(data)
        return out
    pos = len(_SPOOL_MAGIC)
    while pos < len(data):
        if pos + _FRAME.size > len(data):
            out.torn = True
            break
        length, crc = _FRAME.unpack_from(data, pos)
        body = data[pos + _FRAME.size: pos + _FRAME.size + length]
        if len(body) != length or zlib.crc32(body) != crc:
            out.torn = True
            break
        pos += _FRAME.size + length
        kind, payload = body[:1], body[1:]
        if kind == b"S":
            (n,) = struct.unpack_from("<I", payload)
            meta = json.loads(payload[4: 4 + n])
            arrays, offset = {}, 4 + n
            for key, dtype, shape in meta.pop("arrays"):
                size = int(np.prod(shape)) * np.dtype(dtype).itemsize
                arrays[key] = np.frombuffer(payload, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
                offset += size
            out.steps.append((meta, arrays))
        elif kind == b"H":
            out.header = json.loads(payload)
        elif kind == b"E":
            out.end = json.loads(payload)
        elif kind == b"C":
            out.committing = json.loads(payload)
    return out


def _episode_from_spool(contents: _SpoolContents) -> Episode:
    """The Episode a spool holds: the one code path for finished and recovered episodes alike."""
    header, steps, end = contents.header, contents.steps, contents.end
    assert header is not None and steps
    keys = list(steps[0][1])
    stacked = {k: np.stack([arrays[k] for _, arrays in steps]) for k in keys}
    executed_by = np.array([meta["executed_by"] for meta, _ in steps], np.int8)
    timestamp = np.array([meta["timestamp"] for meta, _ in steps], np.float64)
    success = np.array([meta["success"] for meta, _ in steps], bool) if header["success_topic"] else None
    outcome = None if end is None else end.get("outcome")
    if outcome is None:  # unlabelled (stop, max_steps, crash): only the success topic can say it succeeded
        outcome = bool(success is not None and success.any())
    if success is not None and outcome and not success.any():
        success[-1] = True  # labelled a success by a person: it counted as solved by the last step
    return Episode(
        observations={k: v for k, v in stacked.items() if k != "action"}, action=stacked["action"],
        task=header["task"], executed_by=executed_by,
        segment=segments_from_takeovers(executed_by, int(header["failure_window"])),
        timestamp=(timestamp - timestamp[0]).astype(np.float32), success=success, outcome=bool(outcome),
        task_id=header["task_id"], policy_version=header["policy_version"], fps=float(header["fps"]),
        complete=bool(end is not None and end.get("complete", False)),
    )


# --------------------------------------------------------------------------------------------------------- results
@dataclass
class RecordedEpisode:
    """One episode written to the dataset."""

    index: int
    length: int
    outcome: bool
    complete: bool
    intervened: bool
    mcap: str | None  # path of its MCAP file (an `.mcap.incomplete` one after a crash), None when not recorded
    recovered: bool = False


@dataclass
class RecoveryReport:
    """What `recover` found and did."""

    episodes: list[RecordedEpisode] = field(default_factory=list)  # committed from spools
    already_committed: int = 0  # spools whose episode the dataset already held (killed between commit and cleanup)
    dropped_empty: int = 0  # spools of episodes that never got a step
    torn_records: int = 0  # spools whose last record was cut short (dropped)
    incomplete_mcap: list[str] = field(default_factory=list)  # MCAP files without a footer, renamed *.mcap.incomplete
    failed: list[str] = field(default_factory=list)  # spools that could not be committed (kept as *.spool.failed)

    def __str__(self) -> str:
        parts = [f"{len(self.episodes)} episode(s) recovered"]
        parts += [f"{sum(not e.complete for e in self.episodes)} of them incomplete"] if self.episodes else []
        parts += [f"{self.already_committed} already committed"] * bool(self.already_committed)
        parts += [f"{len(self.incomplete_mcap)} MCAP file(s) without footer: {', '.join(self.incomplete_mcap)}"] * bool(
            self.incomplete_mcap)
        parts += [f"FAILED: {', '.join(self.failed)}"] * bool(self.failed)
        return "; ".join(parts)


# ------------------------------------------------------------------------------------------------------ the recorder
class _Active:
    """The episode being recorded."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.spool: _Spool | None = None  # opened at the first step, when the task and shapes are known
        self.mcap: McapRos2Writer | None = None
        self.steps = 0
        self.success = False
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.last_time: float | None = None


class EpisodeRecorder:
    """Records deployment episodes from a transport into `out_dir` (see the module docstring).

    `sample()` takes one step now; `start()` runs it at `config.fps` on a thread. Finished episodes are written by a
    background thread; `flush()` waits for it. Use as a context manager, or call `close()`: an episode still being
    recorded is then committed as incomplete.

    Args:
        transport: any `robot.transport` backend.
        state_fn: joint positions (float64, `joint_names` order) -> the `observation.state` vector.
        action_fn: (command positions, joint positions) -> the recorded `action`.
        clock: monotonic seconds; receive times, staleness and step timestamps use it (tests pass a fake one).
    """

    def __init__(self, transport: Transport, config: RecorderConfig, out_dir: str | Path, *,
                 state_fn: Callable[[np.ndarray], np.ndarray] | None = None,
                 action_fn: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.out_dir = config, Path(out_dir)
        self.state_fn, self.action_fn, self.clock = state_fn, action_fn, clock
        # category -> count of rejected messages / skipped samples; logs the first and every 100th
        self.rejections = RejectionLog(log, "recorder rejected")
        self.last_reason = self.rejections.last_reason  # category -> the latest reason, in words
        self.episodes: list[RecordedEpisode] = []  # written in this session
        self.errors: list[str] = []
        self._lock = threading.RLock()
        self._joint_index = {n: i for i, n in enumerate(config.joint_names)}
        self._state: tuple[np.ndarray, float] | None = None
        self._images: dict[str, tuple[np.ndarray, float]] = {}
        self._image_size: dict[str, tuple[int, int]] = {}
        self._command: tuple[str, Any, float] | None = None
        self._takeover = False
        self._instruction = config.instruction
        self._last_msgs: dict[str, tuple[Any, int]] = {}  # topic -> (message, receive time ns) for MCAP snapshots
        self._active: _Active | None = None
        self._closed = False
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue()  # ("episode", spool) | ("barrier", Event)
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()

        names: dict[str, list[str]] = {}
        if config.state_names or state_fn is None:
            names[STATE_KEY] = list(config.state_names or config.joint_names)
        if config.action_names or action_fn is None:
            names["action"] = list(config.action_names or config.joint_names)
        self.dataset_dir = self.out_dir / DATASET_DIR
        self.mcap_dir, self.spool_dir = self.out_dir / MCAP_DIR, self.out_dir / SPOOL_DIR
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # The writer holds the dataset's lock for the whole session: a second recorder on the folder fails here.
        self._writer = LeRobotDatasetWriter(self.dataset_dir, mode="a", fps=config.fps, robot_type=config.robot_type,
                                            names=names)
        self.mcap_dir.mkdir(exist_ok=True)
        self.spool_dir.mkdir(exist_ok=True)
        self.recovery = _recover(self.out_dir, self._writer)
        if self.recovery.episodes or self.recovery.incomplete_mcap or self.recovery.failed:
            log.warning("recovered after an interrupted session: %s", self.recovery)
        self._write_thread = threading.Thread(target=self._write_loop, name="recorder-writer", daemon=True)
        self._write_thread.start()

        cfg = config
        self._subs: list[Subscription] = [
            transport.subscribe(cfg.state_topic, M.JointState, self._on_state, QOS_DEFAULT),
            transport.subscribe(cfg.command_topic,
                                M.Float64MultiArray if cfg.command_type == "forward_position" else M.JointTrajectory,
                                self._on_command, QOS_DEFAULT),
            # Volatile, like the policy node's: a transient-local subscription would not match an ordinary
            # (volatile) takeover publisher, and the human's steps would be recorded as the policy's.
            transport.subscribe(cfg.takeover_topic, M.Bool, self._on_takeover, QOS_DEFAULT),
            transport.subscribe(cfg.episode_topic, M.String, self._on_episode, QOS_DEFAULT),
            transport.subscribe(cfg.instruction_topic, M.String, self._on_instruction, QOS_DEFAULT),
        ]
        for cam in cfg.cameras:
            self._subs.append(transport.subscribe(
                cam.topic, M.CompressedImage if cam.compressed else M.Image,
                lambda msg, cam=cam: self._on_image(cam, msg), QOS_SENSOR))
        if cfg.success_topic:
            self._subs.append(transport.subscribe(cfg.success_topic, M.Bool, self._on_success, QOS_DEFAULT))

    # ----- public API ----------------------------------------------------------------------------------------------
    @property
    def recording(self) -> bool:
        return self._active is not None

    @property
    def takeover(self) -> bool:
        return self._takeover

    def mark(self, event: str | bool) -> None:
        """An episode event: 'start', 'stop', 'success', 'failure', 'abort' (or True/False for success/failure).

        'reset' (what the sim-robot node takes on the same topic, also as 'reset seed=N') starts a new episode:
        one being recorded ends first, unlabelled, as with 'stop'.
        """
        if isinstance(event, bool):
            event = "success" if event else "failure"
        words = str(event).strip().lower().split()
        event = words[0] if words else ""
        with self._lock:
            if event == "reset":
                if self._active is not None:
                    self._end_episode(None, complete=True, reason="reset")
                self._start_episode()
            elif event not in EPISODE_EVENTS:
                self._reject("episode", f"unknown episode event {event!r}; expected one of "
                                        f"{', '.join(EPISODE_EVENTS)}, reset")
            elif event == "start":
                if self._active is not None:
                    self._reject("episode", "'start' while an episode is being recorded (ignored)")
                else:
                    self._start_episode()
            elif self._active is None:
                self._reject("episode", f"{event!r} while no episode is being recorded (ignored)")
            elif event == "abort":
                self._abort_episode()
            else:
                outcome = {"success": True, "failure": False, "stop": None}[event]
                self._end_episode(outcome, complete=True, reason=event)

    def sample(self) -> int | None:
        """Take one step from the latest inputs; returns its index, or None when nothing was recorded (why: counted
        in `rejections` under `sample: ...`)."""
        with self._lock:
            active = self._active
            if active is None or self._closed:
                return None
            now = self.clock()
            if active.last_time is not None and now - active.last_time < _MIN_STEP_S:
                return self._skip(f"sample at {now:.6f} s is not after the previous step ({active.last_time:.6f} s)")
            if self._state is None:
                return self._skip("waiting for joint_states")
            missing = [c.name for c in self.config.cameras if c.name not in self._images]
            if missing:
                return self._skip(f"waiting for camera(s) {', '.join(missing)}")
            if self._command is None:
                return self._skip("waiting for the first command")
            # Commands may legitimately be old (one JointTrajectory per chunk; a held position is not re-sent).
            ages = {"joint_states": now - self._state[1], **{c: now - t for c, (_, t) in self._images.items()}}
            stale = [name for name, age in ages.items() if age > self.config.max_age_s]
            if stale:
                return self._skip(f"stale input(s) {', '.join(stale)} (older than {self.config.max_age_s} s)")
            positions = self._state[0]
            try:
                arrays = {STATE_KEY: self._state_vector(positions)}
                for cam in self.config.cameras:
                    arrays[cam.key] = self._images[cam.name][0]
                arrays["action"] = self._action(now, positions)
            except ValueError as err:
                return self._skip(str(err))
            shapes = {k: a.shape for k, a in arrays.items()}
            if active.shapes and shapes != active.shapes:
                return self._skip(f"per-step shapes changed within the episode: {active.shapes} -> {shapes}")
            if active.spool is None:
                active.shapes = shapes
                active.spool = _Spool(self.spool_dir / f"{active.rid}.spool", self.config.spool_fsync_s)
                active.spool.json(b"H", self._header(active))
            meta = {"t": active.steps, "timestamp": now, "executed_by": int(self._takeover),
                    "success": active.success, "wall": time.time()}
            active.spool.step(meta, arrays)
            active.steps += 1
            active.last_time = now
            index = active.steps - 1
            if self.config.max_steps and active.steps >= self.config.max_steps:
                self._end_episode(None, complete=True, reason="max_steps")
            return index

    def start(self) -> EpisodeRecorder:
        """Sample at `config.fps` on a thread (drift-free: ticks are scheduled from the start time). With
        `sample_on='command'` steps are taken as commands arrive, and this does nothing."""
        if self._sampler is None and self.config.sample_on == "timer":
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample_loop, name="recorder-sampler", daemon=True)
            self._sampler.start()
        return self

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every finished episode is in the dataset."""
        done = threading.Event()
        self._queue.put(("barrier", done))
        if not done.wait(timeout):
            raise TimeoutError(f"the recorder's writer did not finish within {timeout} s")

    def close(self) -> None:
        """Stop sampling, commit an episode still being recorded as incomplete, write everything, unsubscribe."""
        if self._closed:
            return
        for sub in self._subs:
            sub.close()
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join()
        with self._lock:
            if self._active is not None:
                self._end_episode(None, complete=False, reason="recorder closed")
            self._closed = True
        self._queue.put(None)
        self._write_thread.join()
        self._writer.close()

    def __enter__(self) -> EpisodeRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @staticmethod
    def recover(out_dir: str | Path, *, fps: float | None = None) -> RecoveryReport:
        """Commit what an interrupted recorder left in `out_dir` (see the module docstring) and report it."""
        out_dir = Path(out_dir)
        if not (out_dir / SPOOL_DIR).is_dir() and not (out_dir / MCAP_DIR).is_dir():
            return RecoveryReport()
        spools = sorted((out_dir / SPOOL_DIR).glob("*.spool")) if (out_dir / SPOOL_DIR).is_dir() else []
        if fps is None:
            for path in spools:
                header = _read_spool(path).header
                if header is not None:
                    fps = float(header["fps"])
                    break
        writer = LeRobotDatasetWriter(out_dir / DATASET_DIR, mode="a", fps=fps)
        try:
            return _recover(out_dir, writer)
        finally:
            writer.close()

    # ----- episodes ------------------------------------------------------------------------------------------------
    def _start_episode(self) -> None:
        active = _Active(f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}")
        if self.config.mcap:
            active.mcap = McapRos2Writer(self.mcap_dir / f"{active.rid}{MCAP_SUFFIX}",
                                         metadata={"recording_id": active.rid, "fps": str(self.config.fps)})
            for topic, (msg, t_ns) in sorted(self._last_msgs.items(), key=lambda kv: kv[1][1]):
                self._mcap_write(active, topic, msg, t_ns)
        self._active = active
        log.info("episode %s started", active.rid)

    def _end_episode(self, outcome: bool | None, *, complete: bool, reason: str) -> None:
        active, self._active = self._active, None
        assert active is not None
        if active.mcap is not None:
            try:
                active.mcap.finish()
            except Exception as err:  # noqa: BLE001 - the dataset episode matters more than its MCAP copy
                self._error(f"MCAP file of episode {active.rid} could not be finished: {err}")
        if active.spool is None:  # not a single step: nothing for the dataset
            self._reject("episode", f"episode ended ({reason}) before its first step: not written")
            if active.mcap is not None:
                active.mcap.path.unlink(missing_ok=True)
            return
        active.spool.json(b"E", {"outcome": outcome, "complete": complete, "reason": reason, "steps": active.steps})
        active.spool.close()
        log.info("episode %s ended (%s) after %d steps", active.rid, reason, active.steps)
        self._queue.put(("episode", active.spool.path))

    def _abort_episode(self) -> None:
        active, self._active = self._active, None
        assert active is not None
        if active.mcap is not None:
            active.mcap.discard()
        if active.spool is not None:
            active.spool.close(sync=False)
            active.spool.path.unlink(missing_ok=True)
        log.info("episode %s aborted after %d steps: not written", active.rid, active.steps)

    def _header(self, active: _Active) -> dict[str, Any]:
        cfg = self.config
        return {"rid": active.rid, "task": self._instruction, "task_id": cfg.task_id, "fps": cfg.fps,
                "policy_version": cfg.policy_version, "failure_window": cfg.failure_window,
                "success_topic": cfg.success_topic, "joint_names": list(cfg.joint_names), "started": time.time(),
                "config": asdict(cfg)}

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, arg = item
            if kind == "barrier":
                arg.set()
                continue
            try:
                recorded = _commit_spool(Path(arg), self.out_dir, self._writer)
            except Exception as err:  # noqa: BLE001 - keep recording; the spool stays for the next recovery
                self._error(f"could not write episode from {arg}: {err}")
                continue
            if recorded is not None:
                with self._lock:
                    self.episodes.append(recorded)
                log.info("episode %d written (%d steps, outcome=%s)", recorded.index, recorded.length,
                         recorded.outcome)

    def _sample_loop(self) -> None:
        period, tick = 1.0 / self.config.fps, time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as err:  # noqa: BLE001 - a bad step must not stop the recording
                self._error(f"sampling failed: {err}")
            tick += period
            delay = tick - time.monotonic()
            if delay < 0:  # fell behind (a slow disk): skip the missed ticks rather than bursting
                tick += math.ceil(-delay / period) * period
                delay = tick - time.monotonic()
            self._stop.wait(max(delay, 0.0))

    # ----- inputs --------------------------------------------------------------------------------------------------
    def _received(self, topic: str, msg: Any) -> None:
        """Keep the raw message for the MCAP file (before validation: the file holds what arrived)."""
        t_ns = time.time_ns()
        self._last_msgs[topic] = (msg, t_ns)
        if self._active is not None:
            self._mcap_write(self._active, topic, msg, t_ns)

    def _mcap_write(self, active: _Active, topic: str, msg: Any, t_ns: int) -> None:
        if active.mcap is None:
            return
        try:
            active.mcap.write(topic, msg, t_ns)
        except Exception as err:  # noqa: BLE001 - a message CDR cannot encode is counted, not fatal
            self._reject("mcap", f"{topic}: {err}")

    def _on_state(self, msg: M.JointState) -> None:
        with self._lock:
            self._received(self.config.state_topic, msg)
            try:
                positions = joint_positions(msg.name, msg.position, self.config.joint_names,
                                            allow_extra=self.config.allow_extra_joints)
            except InputRejected as err:
                return self._reject("joint_states", err.detail)
            self._state = (positions, self.clock())

    def _on_image(self, cam: CameraTopic, msg: M.Image | M.CompressedImage) -> None:
        with self._lock:
            self._received(cam.topic, msg)
            try:
                frame = self._decode(cam, msg)
            except ValueError as err:
                return self._reject(f"camera {cam.name}", str(err))
            self._images[cam.name] = (frame, self.clock())

    def _decode(self, cam: CameraTopic, msg: M.Image | M.CompressedImage) -> np.ndarray:
        # The size a frame must have: configured, else the one this camera's first frame set.
        frame = decode_image(msg, cam.size or self.config.image_size or self._image_size.get(cam.name))
        self._image_size.setdefault(cam.name, (frame.shape[0], frame.shape[1]))
        if self.config.resize is not None and frame.shape[:2] != self.config.resize:
            import cv2

            frame = cv2.resize(frame, self.config.resize[::-1], interpolation=cv2.INTER_AREA)
        return frame

    def _on_command(self, msg: M.Float64MultiArray | M.JointTrajectory) -> None:
        with self._lock:
            self._received(self.config.command_topic, msg)
            n = len(self.config.joint_names)
            if isinstance(msg, M.Float64MultiArray):
                if len(msg.data) != n:
                    return self._reject("command", f"{len(msg.data)} values, expected {n} ({self.config.joint_names})")
                if not np.isfinite(msg.data).all():
                    return self._reject("command", "non-finite command values")
                self._command = ("positions", msg.data.copy(), self.clock())
                if self.config.sample_on == "command":
                    try:
                        self.sample()
                    except Exception as err:  # noqa: BLE001 - never raise into the transport's thread
                        self._error(f"sampling failed: {err}")
                return
            missing = [j for j in self.config.joint_names if j not in msg.joint_names]
            if missing or not msg.points:
                return self._reject("command", f"trajectory without points or missing joints {missing}")
            index = [list(msg.joint_names).index(j) for j in self.config.joint_names]
            points = []
            for p in msg.points:
                if len(p.positions) != len(msg.joint_names) or not np.isfinite(p.positions).all():
                    return self._reject("command", "trajectory point with wrong length or non-finite positions")
                points.append((p.time_from_start.to_sec(), p.positions[index]))
            self._command = ("trajectory", points, self.clock())

    def _on_takeover(self, msg: M.Bool) -> None:
        with self._lock:
            self._received(self.config.takeover_topic, msg)
            self._takeover = bool(msg.data)

    def _on_instruction(self, msg: M.String) -> None:
        with self._lock:
            self._received(self.config.instruction_topic, msg)
            if not msg.data.strip():
                return self._reject("instruction", "empty instruction (ignored)")
            self._instruction = msg.data

    def _on_success(self, msg: M.Bool) -> None:
        with self._lock:
            self._received(self.config.success_topic, msg)
            if self._active is not None and msg.data:
                self._active.success = True

    def _on_episode(self, msg: M.String) -> None:
        with self._lock:
            self._received(self.config.episode_topic, msg)
            self.mark(msg.data)

    # ----- helpers -------------------------------------------------------------------------------------------------
    def _state_vector(self, positions: np.ndarray) -> np.ndarray:
        state = positions if self.state_fn is None else np.asarray(self.state_fn(positions.copy()))
        state = np.asarray(state, np.float32)
        if state.ndim != 1 or not np.isfinite(state).all():
            raise ValueError(f"state_fn must return a finite 1-D vector; got shape {state.shape}")
        return state

    def _action(self, now: float, positions: np.ndarray) -> np.ndarray:
        assert self._command is not None
        kind, value, t_recv = self._command
        if kind == "positions":
            command = value
        else:  # the trajectory point in effect: the first one not yet due, else the last
            elapsed = now - t_recv
            command = next((p for t, p in value if t >= elapsed), value[-1][1])
        action = command if self.action_fn is None else self.action_fn(np.array(command), positions.copy())
        action = np.asarray(action, np.float32)
        if action.ndim != 1 or not np.isfinite(action).all():
            raise ValueError(f"action_fn must return a finite 1-D vector; got shape {action.shape}")
        return action

    def _skip(self, reason: str) -> None:
        self._reject("sample", reason)
        return None

    def _reject(self, category: str, reason: str) -> None:
        self.rejections.reject(category, reason)

    def _error(self, message: str) -> None:
        self.errors.append(message)
        log.error(message)


# ------------------------------------------------------------------------------------------------- commit/recovery
def _mcap_paths(mcap_dir: Path, rid: str) -> tuple[Path, Path]:
    return mcap_dir / f"{rid}{MCAP_SUFFIX}", mcap_dir / f"{rid}{RECORDING_SUFFIX}"


def _place_mcap(mcap_dir: Path, rid: str, index: int, report: RecoveryReport | None) -> str | None:
    """Give an episode's MCAP file its final name, `episode_<index>.mcap`, or `.mcap.incomplete` without a footer."""
    done, partial = _mcap_paths(mcap_dir, rid)
    final = mcap_dir / f"episode_{index:06d}{MCAP_SUFFIX}"
    if done.exists():
        os.replace(done, final)
        return str(final)
    if partial.exists():
        if mcap_is_complete(partial):  # finished, but killed before the rename
            os.replace(partial, final)
            return str(final)
        broken = mcap_dir / f"episode_{index:06d}{INCOMPLETE_SUFFIX}"
        os.replace(partial, broken)
        if report is not None:
            report.incomplete_mcap.append(str(broken))
        log.warning("MCAP file of episode %d was left open by a crash (no footer): renamed %s", index, broken)
        return str(broken)
    if final.exists():  # placed already, by a session killed just after
        return str(final)
    return None


def _commit_spool(path: Path, out_dir: Path, writer: LeRobotDatasetWriter,
                  report: RecoveryReport | None = None) -> RecordedEpisode | None:
    """Write the episode in a spool to the dataset (exactly once), name its MCAP file, delete the spool."""
    contents = _read_spool(path)
    mcap_dir = out_dir / MCAP_DIR
    if report is not None and contents.torn:
        report.torn_records += 1
    if contents.header is None or not contents.steps:
        if report is not None:
            report.dropped_empty += 1
        path.unlink()
        return None
    rid = contents.header["rid"]
    done = contents.committing
    if done is not None and done["index"] < writer.num_episodes:
        # The process died after the commit, before cleaning up: if the dataset holds this very episode (same index,
        # same length), only the cleanup is left to do.
        row = LeRobotDatasetReader(writer.root).meta.episodes[done["index"]]
        if row["length"] == len(contents.steps):
            _place_mcap(mcap_dir, rid, done["index"], report)
            path.unlink()
            if report is not None:
                report.already_committed += 1
            return None
    episode = _episode_from_spool(contents)
    index = writer.add_episode(episode)  # validated and staged, not yet durable
    with path.open("ab", buffering=0) as f:  # before the commit: a kill after it must not commit the episode again
        body = b"C" + json.dumps({"index": index}).encode()
        f.write(_FRAME.pack(len(body), zlib.crc32(body)) + body)
        os.fsync(f.fileno())
    writer.commit()
    mcap = _place_mcap(mcap_dir, rid, index, report)
    path.unlink()
    return RecordedEpisode(index=index, length=len(episode), outcome=bool(episode.outcome), complete=episode.complete,
                           intervened=episode.intervened, mcap=mcap, recovered=report is not None)


def _recover(out_dir: Path, writer: LeRobotDatasetWriter) -> RecoveryReport:
    report = RecoveryReport()
    spool_dir, mcap_dir = out_dir / SPOOL_DIR, out_dir / MCAP_DIR
    if spool_dir.is_dir():
        for path in sorted(spool_dir.glob("*.spool"), key=lambda p: p.stat().st_mtime):
            try:
                recorded = _commit_spool(path, out_dir, writer, report)
            except Exception as err:  # noqa: BLE001 - one bad spool must not block recording
                failed = path.with_name(path.name + ".failed")
                os.replace(path, failed)
                report.failed.append(f"{failed}: {err}")
                log.error("could not recover %s: %s", path, err)
                continue
            if recorded is not None:
                report.episodes.append(recorded)
    if mcap_dir.is_dir():
        # MCAP files left open whose episode never got a step (or whose spool is gone): keep, but never as *.mcap.
        for partial in sorted(mcap_dir.glob(f"*{RECORDING_SUFFIX}")):
            broken = partial.with_name(partial.name[: -len(RECORDING_SUFFIX)] + INCOMPLETE_SUFFIX)
            os.replace(partial, broken)
            report.incomplete_mcap.append(str(broken))
        for path in sorted(mcap_dir.glob(f"*{MCAP_SUFFIX}")):
            if not mcap_is_complete(path):  # truncated on disk, or renamed by hand
                broken = path.with_name(path.name[: -len(MCAP_SUFFIX)] + INCOMPLETE_SUFFIX)
                os.replace(path, broken)
                report.incomplete_mcap.append(str(broken))
    return report


def pending_spools(path: str | Path) -> list[Path]:
    """Spools an interrupted recorder left behind: episodes that are NOT in the dataset until `recover` commits them.

    `path` is a recording folder (`kinema deploy --record DIR`) or its `dataset/` folder. Readers of the dataset
    (`kinema train --dataset`) call this to warn instead of silently training without the crashed episode.
    """
    path = Path(path)
    root = path.parent if path.name == DATASET_DIR else path
    spool_dir = root / SPOOL_DIR
    return sorted(spool_dir.glob("*.spool")) if spool_dir.is_dir() else []


# ------------------------------------------------------------------------------------------------------- keypresses
class KeyControl:
    """Episode control from the keyboard: space starts/stops, s = success, f = failure, a = abort, q = quit.

    `handle(key)` does the work (and is what tests call); `start()` reads keys from a stream on a thread, one at a
    time when the stream is a terminal (cbreak mode, restored on exit).
    """

    KEYS = {" ": "start/stop", "s": "success", "f": "failure", "a": "abort", "q": "quit"}

    def __init__(self, recorder: EpisodeRecorder, stream: IO[str] | None = None,
                 on_quit: Callable[[], None] | None = None) -> None:
        self.recorder, self.stream, self.on_quit = recorder, stream or sys.stdin, on_quit
        self._thread: threading.Thread | None = None

    def handle(self, key: str) -> str | None:
        """Act on one key; returns the event it triggered (None for keys that mean nothing)."""
        key = key.lower()
        if key == " ":
            event = "stop" if self.recorder.recording else "start"
        elif key in ("s", "f", "a"):
            event = {"s": "success", "f": "failure", "a": "abort"}[key]
        elif key == "q":
            if self.on_quit is not None:
                self.on_quit()
            return "quit"
        else:
            return None
        self.recorder.mark(event)
        return event

    def start(self) -> KeyControl:
        self._thread = threading.Thread(target=self._run, name="recorder-keys", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        restore: Callable[[], None] | None = None
        try:
            if self.stream.isatty():
                import termios
                import tty

                fd, saved = self.stream.fileno(), termios.tcgetattr(self.stream.fileno())
                tty.setcbreak(fd)
                restore = lambda: termios.tcsetattr(fd, termios.TCSADRAIN, saved)  # noqa: E731
            while True:
                key = self.stream.read(1)
                if not key or self.handle(key) == "quit":
                    return
        finally:
            if restore is not None:
                restore()


__all__ = [
    "COMMAND_TYPES", "EPISODE_EVENTS", "CameraTopic", "EpisodeRecorder", "KeyControl", "RecordedEpisode",
    "RecorderConfig", "RecoveryReport", "pending_spools", "segments_from_takeovers",
]
