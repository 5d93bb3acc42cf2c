"""A robot described by a Rosetta contract (the ROS 2 ⇄ LeRobot bridge's YAML: topics ↔ LeRobot features), as well
as by kinema's robot YAML; one file serves both tools.

The contract says which topics are which features; kinema reads from it:
- `robot_type` → the robot's name, `fps` → `rates.control_hz`;
- `observations["observation.state"]`: a `sensor_msgs/msg/JointState` channel selecting `position.<joint>` for every
  commanded joint (the arm's, then the fingers'), in that order → `topics.joint_states`;
- `observations["observation.images.<camera>"]`: an `Image` (raw) or `CompressedImage` (compressed) channel ending in
  `apply: [resize: [h, w]]` → the camera, at that size;
- `actions["action"]`: a `std_msgs/msg/Float64MultiArray` channel (ros2_control's forward_position controller) or a
  `trajectory_msgs/msg/JointTrajectory` one → the controller and its topic;
- `tasks["task"]` → `topics.instruction`; `signals["next.success"]` (a Bool) → `topics.success`.

What a contract has no words for (joint limits and step bounds, the gripper's open/closed positions, the kinematics
for the EE-delta actions, the workspace box, watchdog timeouts, kinema's takeover/e-stop/episode topics) sits in an
`x-kinema` block with the robot YAML's own keys; Rosetta ignores `x-` keys, and kinema refuses a contract that
contradicts it (a joint its state does not select, a camera without a fixed size).

    robot = load_robot_config("assets/robots/sim_panda.contract.yaml")   # `kinema deploy --robot` takes either
    kinema robot-contract sim_panda > my_arm.contract.yaml               # a robot YAML written as a contract
"""

from __future__ import annotations

from typing import Any

from robot.config import RobotConfig, robot_config_from_dict

KINEMA_BLOCK = "x-kinema"
STATE, ACTION, TASK, SUCCESS = "observation.state", "action", "task", "next.success"
IMAGE_PREFIX = "observation.images."
IMAGE_TYPES = {"sensor_msgs/msg/Image": "raw", "sensor_msgs/msg/CompressedImage": "compressed"}
CONTROLLER_TYPES = {"std_msgs/msg/Float64MultiArray": "forward_position", "trajectory_msgs/msg/JointTrajectory": "joint_trajectory"}
# Rosetta's top-level keys (its loader refuses others; `x-` keys are free)
CONTRACT_KEYS = ("robot_type", "robot_interface", "fps", "observations", "actions", "rewards", "signals", "info",
                 "complementary_data", "tasks", "adjunct", "teleop")  # fmt: skip


def is_contract(data: Any) -> bool:
    """A Rosetta contract rather than a kinema robot YAML (it has `robot_type` and `observations`)."""
    return isinstance(data, dict) and "robot_type" in data and "observations" in data


def _source(section: dict, key: str, where: str) -> dict:
    """A feature's single source (Rosetta allows a list of sources concatenated; kinema's features have one)."""
    value = section.get(key)
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"{where}: {key} concatenates {len(value)} sources; kinema reads it from one channel")
        value = value[0]
    if not isinstance(value, dict) or not isinstance(value.get("channel"), dict):
        raise ValueError(f"{where}: {key} needs a source with a channel {{topic, type}}")
    return value


def _selected_joints(source: dict, field: str, where: str) -> list[str]:
    names = []
    for path in source.get("select") or []:
        head, _, joint = str(path).partition(".")
        if head != field or not joint:
            raise ValueError(f"{where}: select entry {path!r} is not {field}.<joint name>")
        names.append(joint)
    return names


def robot_config_from_contract(contract: dict[str, Any], *, source: str = "<contract>") -> RobotConfig:
    """The RobotConfig a contract (with its `x-kinema` block) describes."""
    unknown = sorted(k for k in contract if k not in CONTRACT_KEYS and not str(k).startswith("x-"))
    if unknown:
        raise ValueError(f"contract {source}: unknown top-level keys {unknown}; a Rosetta contract has {list(CONTRACT_KEYS)} and x-* keys")
    if contract.get("robot_interface", "ros2") != "ros2":
        raise ValueError(f"contract {source}: robot_interface {contract.get('robot_interface')!r}; kinema drives ros2 robots")
    extra = dict(contract.get(KINEMA_BLOCK) or {})
    if taken := sorted({"name", "cameras", "controller"} & set(extra)):
        raise ValueError(f"contract {source}: {KINEMA_BLOCK} sets {taken}, which the contract itself says (robot_type, "
                         "observations.images, actions); remove them there")  # fmt: skip
    observations, actions = contract.get("observations") or {}, contract.get("actions") or {}
    where = f"contract {source}"
    state = _source(observations, STATE, f"{where} observations")
    if state["channel"].get("type") != "sensor_msgs/msg/JointState":
        raise ValueError(f"{where}: observations.{STATE} is {state['channel'].get('type')!r}; kinema reads joint positions from a sensor_msgs/msg/JointState channel")
    topics = {**(extra.pop("topics", None) or {}), "joint_states": state["channel"]["topic"]}
    cameras = []
    for key in [k for k in observations if k.startswith(IMAGE_PREFIX)]:
        cam = _source(observations, key, f"{where} observations")
        kind = IMAGE_TYPES.get(cam["channel"].get("type"))
        if kind is None:
            raise ValueError(f"{where}: {key} is {cam['channel'].get('type')!r}; valid camera types: {list(IMAGE_TYPES)}")
        sizes = [op["resize"] for op in cam.get("apply") or [] if isinstance(op, dict) and "resize" in op]
        if not sizes:
            raise ValueError(f"{where}: {key} has no `apply: [resize: [h, w]]`; the policy needs frames of a fixed size")
        height, width = (int(v) for v in sizes[-1])
        cameras.append({"name": key[len(IMAGE_PREFIX):], "topic": cam["channel"]["topic"], "format": kind, "width": width, "height": height})
    command = _source(actions, ACTION, f"{where} actions")
    controller_type = CONTROLLER_TYPES.get(command["channel"].get("type"))
    if controller_type is None:
        raise ValueError(f"{where}: actions.{ACTION} is {command['channel'].get('type')!r}; valid: {list(CONTROLLER_TYPES)} (ros2_control's controllers)")
    topic_key = "commands_topic" if controller_type == "forward_position" else "trajectory_topic"
    controller = {"type": controller_type, topic_key: command["channel"]["topic"]}
    if task := (contract.get("tasks") or {}).get(TASK):
        topics["instruction"] = task["channel"]["topic"]
    if SUCCESS in (contract.get("signals") or {}):
        topics["success"] = _source(contract["signals"], SUCCESS, f"{where} signals")["channel"]["topic"]
    rates = {**(extra.pop("rates", None) or {}), "control_hz": float(contract["fps"])}
    robot = robot_config_from_dict({"name": contract["robot_type"], "cameras": cameras, "controller": controller, "topics": topics,
                                    "rates": rates, **extra}, source=source)  # fmt: skip
    selected = _selected_joints(state, "position", f"{where} observations.{STATE}")
    if selected != robot.command_joint_names:
        raise ValueError(f"{where}: observations.{STATE} selects positions of {selected}; the robot commands {robot.command_joint_names} "
                         f"({KINEMA_BLOCK}.joints, then gripper.joints), in that order")  # fmt: skip
    return robot


def contract_from_robot_config(robot: RobotConfig) -> dict[str, Any]:
    """A kinema robot written as a Rosetta contract: its raw topics as LeRobot features (what Rosetta records and
    converts to a dataset), the rest in `x-kinema`. `robot_config_from_contract` reads it back to the same robot."""
    import dataclasses

    def hold() -> dict[str, str]:  # a fresh mapping per feature: YAML would otherwise write anchors
        return {"strategy": "hold", "timeline": "header"}

    observations: dict[str, Any] = {
        STATE: {"channel": {"topic": robot.topics.joint_states, "type": "sensor_msgs/msg/JointState"}, "align": hold(),
                "select": [f"position.{name}" for name in robot.command_joint_names]},
    }  # fmt: skip
    for cam in robot.cameras:
        kind = {v: k for k, v in IMAGE_TYPES.items()}[cam.format]
        observations[cam.key] = {"channel": {"topic": cam.topic, "type": kind}, "align": hold(), "apply": [{"resize": [cam.height, cam.width]}]}
    forward = robot.controller.type == "forward_position"
    command = {"topic": robot.controller.commands_topic if forward else robot.controller.trajectory_topic,
               "type": {v: k for k, v in CONTROLLER_TYPES.items()}[robot.controller.type], "safety": "hold"}  # fmt: skip
    action: dict[str, Any] = {"channel": command, "align": {"strategy": "hold", "timeline": "receive"}}
    if not forward:
        action["select"] = [f"positions.{name}" for name in robot.command_joint_names]
    topics = {k: v for k, v in dataclasses.asdict(robot.topics).items() if k not in ("joint_states", "instruction", "success")}
    rates = {k: v for k, v in dataclasses.asdict(robot.rates).items() if k != "control_hz"}
    fps = robot.rates.control_hz
    if fps != int(fps):
        raise ValueError(f"robot {robot.name!r}: control_hz {fps} is not a whole number; a contract's fps is an integer")
    return {
        "robot_type": robot.name,
        "robot_interface": "ros2",
        "fps": int(fps),
        "observations": observations,
        "actions": {ACTION: action},
        "tasks": {TASK: {"channel": {"topic": robot.topics.instruction, "type": "std_msgs/msg/String"}}},
        "signals": {SUCCESS: {"channel": {"topic": robot.topics.success, "type": "std_msgs/msg/Bool", "dtype": "bool"},
                              "align": {"strategy": "hold", "timeline": "receive"}}},
        KINEMA_BLOCK: {
            "joints": [dataclasses.asdict(j) for j in robot.joints],
            "gripper": dataclasses.asdict(robot.gripper),
            "kinematics": dataclasses.asdict(robot.kinematics),
            "workspace": {"min": list(robot.workspace.min), "max": list(robot.workspace.max)},
            "rates": rates,
            "topics": topics,
        },
    }  # fmt: skip
