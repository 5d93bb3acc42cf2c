"""Robot descriptions for the ROS 2 bridge: typed dataclasses loaded from YAML (`assets/robots/<arm>.yaml`).

    robot = load_robot_config("sim_panda")           # a shipped name, or a path to a YAML file

A robot config says everything the policy node must know about an arm and nothing about a policy:
- the arm joints, matched by name in `/joint_states` (never by index), with position limits and a step bound;
- the gripper: its finger joints and how the policy's gripper action in [-1, 1] maps onto them;
- the controller (`forward_position` streaming on `/…/commands`, or `joint_trajectory` chunks) and its topics;
- the cameras (topic, raw or compressed, size), the rates and watchdog timeouts;
- the kinematics (an MJCF, its end-effector site, the EE-delta action scales) and the workspace box.

An unknown key, at any level, is an error that lists the valid keys there (the `kinema train` config's style).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import draccus
import numpy as np

from robot.paths import assets_dir, read_yaml, resolve_shipped_yaml

CONTROLLER_TYPES = ("forward_position", "joint_trajectory")
IMAGE_FORMATS = ("raw", "compressed")


@dataclass
class JointConfig:
    name: str = ""  # the joint's name in /joint_states and in the controller's joint list
    lower: float = 0.0  # position limit (rad, or m for prismatic joints)
    upper: float = 0.0
    max_step: float = 0.1  # largest change of the commanded position per control tick

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("joints[].name must be a non-empty joint name")
        if not (np.isfinite(self.lower) and np.isfinite(self.upper) and self.lower < self.upper):
            raise ValueError(f"joint {self.name!r}: expected finite lower < upper; got lower={self.lower}, upper={self.upper}")
        if not (np.isfinite(self.max_step) and self.max_step > 0):
            raise ValueError(f"joint {self.name!r}: max_step must be a positive number; got {self.max_step}")


@dataclass
class GripperConfig:
    """The policy's gripper action g in [-1, 1] (-1 open, +1 closed: robosuite's and the sim's convention) maps to
    every finger joint's position `open + (closed - open) * (g + 1) / 2`; the observed opening in [0, 1] is the mean
    over fingers of `(position - closed) / (open - closed)`."""

    joints: list[JointConfig] = field(default_factory=list)  # finger joints, commanded together
    open: float = 0.04  # finger position when fully open
    closed: float = 0.0  # finger position when fully closed

    def __post_init__(self) -> None:
        if self.joints and self.open == self.closed:
            raise ValueError(f"gripper.open and gripper.closed must differ; both are {self.open}")


@dataclass
class ControllerConfig:
    type: str = "forward_position"  # forward_position (stream /…/commands) | joint_trajectory (chunks)
    commands_topic: str = "/forward_position_controller/commands"  # std_msgs/Float64MultiArray
    trajectory_topic: str = "/joint_trajectory_controller/joint_trajectory"  # trajectory_msgs/JointTrajectory

    def __post_init__(self) -> None:
        if self.type not in CONTROLLER_TYPES:
            raise ValueError(f"controller.type {self.type!r} is not known; valid: {', '.join(CONTROLLER_TYPES)}")


@dataclass
class CameraConfig:
    name: str = ""  # the policy sees it as observation.images.<name>
    topic: str = ""  # sensor_msgs/Image (raw) or sensor_msgs/CompressedImage (compressed)
    format: str = "raw"  # raw | compressed
    width: int = 64  # expected size; frames of another size are rejected
    height: int = 64

    def __post_init__(self) -> None:
        if not self.name or not self.topic:
            raise ValueError(f"cameras[]: name and topic are required; got name={self.name!r}, topic={self.topic!r}")
        if self.format not in IMAGE_FORMATS:
            raise ValueError(f"camera {self.name!r}: format {self.format!r} is not known; valid: {', '.join(IMAGE_FORMATS)}")
        if self.width <= 0 or self.height <= 0:
            raise ValueError(f"camera {self.name!r}: width and height must be positive; got {self.width}x{self.height}")

    @property
    def key(self) -> str:
        return f"observation.images.{self.name}"


@dataclass
class TopicsConfig:
    joint_states: str = "/joint_states"  # sensor_msgs/JointState
    instruction: str = "/kinema/instruction"  # std_msgs/String: the task, e.g. "open the top drawer"
    takeover: str = "/kinema/takeover"  # std_msgs/Bool: true while a human drives
    teleop: str = "/kinema/teleop/joint_targets"  # std_msgs/Float64MultiArray: command-joint targets from a human
    teleop_joy: str = "/kinema/teleop/joy"  # sensor_msgs/Joy: axes 0-5 EE delta, axis 6 gripper, in action units
    estop: str = "/kinema/estop"  # std_msgs/Bool: true latches an emergency stop
    success: str = "/kinema/success"  # std_msgs/Bool: the episode's success signal (sim robot, or a human)
    episode: str = "/kinema/episode"  # std_msgs/String: episode control ("reset", "reset seed=N", ...)
    status: str = "/kinema/status"  # std_msgs/String: the policy node's JSON status, once a second
    # std_msgs/String: a sim robot's privileged state (JSON: seed, sim time, MuJoCo integration state), for a simulated
    # person (`kinema sim-robot --person`); a real robot has no such topic
    privileged: str = "/kinema/sim/privileged"


@dataclass
class RatesConfig:
    control_hz: float = 20.0  # policy/command rate; the rate the policy was trained at
    max_command_hz: float = 40.0  # bounded command rate: commands closer together than 1/this are dropped
    state_timeout_ms: float = 100.0  # no fresh /joint_states for this long: hold
    image_timeout_ms: float = 100.0  # no fresh frame from any camera for this long: hold

    def __post_init__(self) -> None:
        for name in ("control_hz", "max_command_hz", "state_timeout_ms", "image_timeout_ms"):
            value = getattr(self, name)
            if not (np.isfinite(value) and value > 0):
                raise ValueError(f"rates.{name} must be a positive number; got {value}")
        if self.max_command_hz < self.control_hz:
            raise ValueError(
                f"rates.max_command_hz ({self.max_command_hz}) must be >= rates.control_hz ({self.control_hz})"
            )


@dataclass
class KinematicsConfig:
    mjcf: str = ""  # MJCF of the arm for FK/IK; a relative path is looked up next to the YAML file, then in assets/robots
    ee_site: str = "ee"  # end-effector site in the MJCF
    pos_scale: float = 0.04  # metres of EE translation per control tick at |action| = 1 (the sim's POS_SCALE)
    rot_scale: float = 0.25  # radians of EE rotation per control tick at |action| = 1 (the sim's ROT_SCALE)
    damping: float = 1e-3  # damped least squares: J^T (J J^T + damping I)^-1
    nullspace_gain: float = 0.2  # pull of the redundant joints toward `home`
    home: list[float] = field(default_factory=list)  # home posture of the arm joints (rad)


@dataclass
class WorkspaceConfig:
    """Axis-aligned box (m, robot base frame) the end effector must stay in."""

    min: tuple[float, float, float] = (-1.0, -1.0, -1.0)
    max: tuple[float, float, float] = (1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        lo, hi = np.asarray(self.min, float), np.asarray(self.max, float)
        if lo.shape != (3,) or hi.shape != (3,) or not (lo < hi).all():
            raise ValueError(f"workspace: expected min < max, each 3 numbers; got min={self.min}, max={self.max}")


@dataclass
class RobotConfig:
    name: str = ""
    joints: list[JointConfig] = field(default_factory=list)  # the arm joints, in the order IK uses
    gripper: GripperConfig = field(default_factory=GripperConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    cameras: list[CameraConfig] = field(default_factory=list)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    rates: RatesConfig = field(default_factory=RatesConfig)
    kinematics: KinematicsConfig = field(default_factory=KinematicsConfig)
    workspace: WorkspaceConfig = field(default_factory=WorkspaceConfig)
    source: str = ""  # the YAML file it came from (set by the loader; resolves relative paths)

    def __post_init__(self) -> None:
        if not self.joints:
            raise ValueError("robot config: `joints` must list the arm joints")
        names = self.command_joint_names
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"robot config: joint names must be unique across joints and gripper.joints; repeated: {dup}")
        cams = [c.name for c in self.cameras]
        if len(set(cams)) != len(cams):
            raise ValueError(f"robot config: camera names must be unique; got {cams}")
        if self.kinematics.home and len(self.kinematics.home) != len(self.joints):
            raise ValueError(
                f"kinematics.home has {len(self.kinematics.home)} values; expected one per arm joint ({len(self.joints)})"
            )

    # ----- derived views -------------------------------------------------------------------------------------------
    @property
    def arm_joint_names(self) -> list[str]:
        return [j.name for j in self.joints]

    @property
    def command_joint_names(self) -> list[str]:
        """The controller's joints, in the order of every command vector: the arm joints, then the fingers."""
        return [j.name for j in self.joints] + [j.name for j in self.gripper.joints]

    def _all_joints(self) -> list[JointConfig]:
        return [*self.joints, *self.gripper.joints]

    @property
    def lower(self) -> np.ndarray:
        return np.array([j.lower for j in self._all_joints()], np.float64)

    @property
    def upper(self) -> np.ndarray:
        return np.array([j.upper for j in self._all_joints()], np.float64)

    @property
    def max_step(self) -> np.ndarray:
        return np.array([j.max_step for j in self._all_joints()], np.float64)

    @property
    def home(self) -> np.ndarray:
        if self.kinematics.home:
            return np.asarray(self.kinematics.home, np.float64)
        return np.clip(np.zeros(len(self.joints)), self.lower[: len(self.joints)], self.upper[: len(self.joints)])

    def mjcf_path(self) -> Path:
        if not self.kinematics.mjcf:
            raise ValueError(f"robot {self.name!r}: kinematics.mjcf is not set; FK/IK need the arm's MJCF")
        path = Path(self.kinematics.mjcf)
        if path.is_absolute():
            candidates = [path]
        else:  # next to the YAML; then among the shipped ones, so that a copy of a shipped robot file still works
            candidates = [Path(self.source).parent / path] if self.source else []
            candidates.append(assets_dir() / "robots" / path)
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        raise FileNotFoundError(
            f"robot {self.name!r}: kinematics.mjcf {self.kinematics.mjcf} is in none of {', '.join(map(str, candidates))}"
        )

    def gripper_targets(self, action: float) -> np.ndarray:
        """Finger positions for a gripper action in [-1, 1] (non-finite stays non-finite: the safety layer rejects it)."""
        g = float(np.clip(action, -1.0, 1.0)) if np.isfinite(action) else float("nan")
        value = self.gripper.open + (self.gripper.closed - self.gripper.open) * (g + 1.0) / 2.0
        return np.full(len(self.gripper.joints), value, np.float64)

    def gripper_opening(self, finger_positions: np.ndarray) -> float:
        """Opening in [0, 1] (1 = fully open) from finger positions; 1.0 for a robot without a gripper."""
        if not self.gripper.joints:
            return 1.0
        span = self.gripper.open - self.gripper.closed
        return float(np.mean((np.asarray(finger_positions, float) - self.gripper.closed) / span))


# ----- loading ---------------------------------------------------------------------------------------------------
def _dataclass_of(tp: Any) -> type | None:
    """The dataclass a field holds directly or as `list[...]` elements, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _check_keys(cls: type, data: Any, where: str, source: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'robot config'} in {source}: expected a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        if key not in valid:
            raise ValueError(f"unknown robot config key '{where}{key}' in {source}; valid keys here: {', '.join(valid)}")
        inner = _dataclass_of(hints[key])
        if inner is None:
            continue
        if typing.get_origin(hints[key]) is list:
            if not isinstance(value, list):
                raise ValueError(f"robot config key '{where}{key}' in {source}: expected a list, got {type(value).__name__}")
            for i, item in enumerate(value):
                _check_keys(inner, item, f"{where}{key}[{i}].", source)
                # Said here, where the index is known (the dataclass's own check cannot say which entry).
                if "name" in {f.name for f in dataclasses.fields(inner)} and not item.get("name"):
                    raise ValueError(f"robot config key '{where}{key}[{i}].name' in {source}: a non-empty name is "
                                     f"required; got {item.get('name')!r}")
        else:
            _check_keys(inner, value, f"{where}{key}.", source)


def resolve_robot_path(name: str | Path) -> Path:
    """A robot YAML by path, or by name among the shipped ones (`sim_panda` = assets/robots/sim_panda.yaml)."""
    return resolve_shipped_yaml(name, "robots", "robot config")


def robot_config_from_dict(data: dict[str, Any], *, source: str = "<dict>") -> RobotConfig:
    _check_keys(RobotConfig, data, "", source)
    try:
        config = draccus.decode(RobotConfig, {**data, "source": data.get("source", source)})
    except Exception as err:  # draccus wraps our own __post_init__ errors: surface the one that names the field
        cause: BaseException = err
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__  # type: ignore[assignment]
        raise ValueError(f"robot config {source}: {cause}") from None
    return config


def load_robot_config(name: str | Path = "sim_panda") -> RobotConfig:
    """A robot YAML, or a Rosetta contract with an `x-kinema` block (robot/contract.py), by path or shipped name."""
    from robot.contract import is_contract, robot_config_from_contract

    path = resolve_robot_path(name)
    data = read_yaml(path) or {}
    if is_contract(data):
        return robot_config_from_contract(data, source=str(path.resolve()))
    return robot_config_from_dict(data, source=str(path.resolve()))


def replace(config: RobotConfig, **changes: Any) -> RobotConfig:
    """A copy with top-level sections replaced, e.g. `replace(robot, rates=RatesConfig(control_hz=200))`."""
    return dataclasses.replace(config, **changes)
