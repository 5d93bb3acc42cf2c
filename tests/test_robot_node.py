"""The policy node, the robot config, the kinematics and the sim-robot node, in one process on the inproc transport.

Time is a fake clock the tests advance, and ticks are called directly, so every assertion is about behaviour
(what was published, in which tick), never about wall-clock speed.
"""

import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from robot import messages as msg
from robot.config import RatesConfig, load_robot_config, replace, robot_config_from_dict
from robot.kinematics import ActionMapper, Kinematics
from robot.policy_node import ConstantPolicy, PolicyNode
from robot.safety import SafetyStatus
from robot.transport import QOS_LATCHED
from robot.transport.inproc import DEFAULT_BUS, InprocBus, InprocTransport

ROBOT = load_robot_config("sim_panda")
HOME = np.concatenate([ROBOT.home, [0.04, 0.04]])
PERIOD = 1.0 / ROBOT.rates.control_hz


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeRobot:
    """Publishes /joint_states and camera frames on demand; records every command the node sends."""

    def __init__(self, bus: InprocBus, robot=ROBOT) -> None:
        self.robot = robot
        self.tr = InprocTransport(bus)
        self.state_pub = self.tr.publisher(robot.topics.joint_states, msg.JointState)
        self.cam_pubs = {
            c.name: self.tr.publisher(c.topic, msg.Image if c.format == "raw" else msg.CompressedImage) for c in robot.cameras
        }
        self.q = HOME.copy()
        self.commands: list[np.ndarray] = []
        self.trajectories: list[msg.JointTrajectory] = []
        self.tr.subscribe(robot.controller.commands_topic, msg.Float64MultiArray, lambda m: self.commands.append(m.data.copy()))
        self.tr.subscribe(robot.controller.trajectory_topic, msg.JointTrajectory, self.trajectories.append)

    def publish(self, images: bool = True) -> None:
        """Frames first, then the joint state (a state-triggered node ticks on the state)."""
        names = self.robot.command_joint_names
        if images:
            for cam in self.robot.cameras:
                frame = np.full((cam.height, cam.width, 3), 128, np.uint8)
                if cam.format == "raw":
                    self.cam_pubs[cam.name].publish(msg.Image.from_array(frame))
                else:
                    self.cam_pubs[cam.name].publish(msg.CompressedImage(format="png", data=cv2.imencode(".png", frame)[1].tobytes()))
        # Extra joints and a shuffled order: the node must match by name.
        order = list(reversed(range(len(names))))
        self.state_pub.publish(msg.JointState(name=["base_rail", *[names[i] for i in order]], position=[0.0, *self.q[order]]))


class ScriptedJointPolicy:
    """Joint-space chunks: action k of the chunk from call n moves joint1 to 0.1 * n + 0.01 * k."""

    action_space = "joint"
    n_action_steps = 4

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls, self.resets, self.gate = 0, 0, gate
        self.started = threading.Event()
        self.batches = []

    def reset(self) -> None:
        self.resets += 1

    def predict_action_chunk(self, batch):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10), "test never released the policy"
        self.batches.append(batch)
        n = self.calls
        self.calls += 1
        chunk = np.tile(np.concatenate([ROBOT.home, [-1.0]]), (8, 1))
        chunk[:, 0] = 0.1 * n + 0.01 * np.arange(8)
        return chunk[None]


def wait_result(node: PolicyNode) -> None:
    for _ in range(500):
        if not node.worker.busy:
            return
        threading.Event().wait(0.002)
    raise AssertionError("inference worker did not finish")


def make(policy, robot=ROBOT, **kwargs):
    bus, clock = InprocBus(), Clock()
    fake = FakeRobot(bus, robot)
    node = PolicyNode(InprocTransport(bus), robot, policy, instruction="open the drawer", clock=clock, **kwargs)
    return node, fake, clock, bus


def step(node, fake, clock, *, images=True, dt=PERIOD):
    """Advance the clock one period, publish fresh inputs, tick."""
    clock.t += dt
    fake.publish(images=images)
    return node.tick()


# ----- config and kinematics -------------------------------------------------------------------------------------
def test_robot_config_rejects_unknown_keys_and_bad_values_by_name():
    with pytest.raises(ValueError, match=r"unknown robot config key 'rates.control_rate'.*valid keys here: control_hz"):
        robot_config_from_dict({"joints": [{"name": "j1", "lower": -1, "upper": 1}], "rates": {"control_rate": 10}})
    with pytest.raises(ValueError, match=r"unknown robot config key 'joints\[0\].limit'"):
        robot_config_from_dict({"joints": [{"name": "j1", "limit": 1}]})
    with pytest.raises(ValueError, match=r"controller.type 'velocity'.*forward_position, joint_trajectory"):
        robot_config_from_dict({"joints": [{"name": "j1", "lower": -1, "upper": 1}], "controller": {"type": "velocity"}})
    with pytest.raises(ValueError, match=r"joint 'j1': expected finite lower < upper"):
        robot_config_from_dict({"joints": [{"name": "j1", "lower": 1, "upper": -1}]})
    with pytest.raises(ValueError, match=r"'joints\[1\].name' in <dict>: a non-empty name is required; got ''"):
        robot_config_from_dict({"joints": [{"name": "j1", "lower": -1, "upper": 1}, {"name": "", "upper": 1}]})
    with pytest.raises(ValueError, match=r"'gripper.joints\[0\].name'.*got None"):
        robot_config_from_dict({"joints": [{"name": "j1", "lower": -1, "upper": 1}], "gripper": {"joints": [{"upper": 1}]}})
    assert ROBOT.command_joint_names[-2:] == ["finger_joint1", "finger_joint2"]
    np.testing.assert_allclose(ROBOT.gripper_targets(-1.0), [0.04, 0.04])
    np.testing.assert_allclose(ROBOT.gripper_targets(1.0), [0.0, 0.0])
    assert ROBOT.gripper_opening(np.array([0.01, 0.01])) == pytest.approx(0.25)


def test_fk_state_and_ik_targets_match_the_simulator_exactly():
    """robot/kinematics.py repeats sim conventions (robot/ may not import sim/): pin them to the simulator."""
    import mujoco

    import sim.tasks
    from sim.env import POS_SCALE, ROT_SCALE

    env = sim.tasks.make("drawer", cameras=())
    env.reset(seed=0)
    mapper = ActionMapper(ROBOT, Kinematics.from_config(ROBOT))
    assert (ROBOT.kinematics.pos_scale, ROBOT.kinematics.rot_scale) == (POS_SCALE, ROT_SCALE)
    rng = np.random.default_rng(0)
    for _ in range(10):
        q = rng.uniform(ROBOT.lower[:7], ROBOT.upper[:7])
        env.data.qpos[env.arm.qpos_idx] = q
        env.data.qpos[env.arm.finger_qpos_idx] = rng.uniform(0, 0.04, 2)
        mujoco.mj_forward(env.model, env.data)
        measured = np.concatenate([q, env.data.qpos[env.arm.finger_qpos_idx]])
        np.testing.assert_allclose(mapper.state(measured), env.state_vector(), atol=1e-6)
        action = rng.uniform(-1, 1, 7)
        sim_targets = env.arm.joint_targets(env.data, action[:3] * POS_SCALE, action[3:6] * ROT_SCALE)
        np.testing.assert_allclose(mapper.to_command(action, q)[:7], sim_targets, atol=1e-9)
        np.testing.assert_allclose(mapper.to_command(action, q)[7:], 0.04 * (1 - action[6]) / 2)
    env.close()


def test_recorded_action_inverts_the_command_for_small_steps():
    mapper = ActionMapper(ROBOT)
    action = np.array([0.3, -0.2, 0.1, 0.1, 0.0, -0.2, 0.5])
    command = mapper.to_command(action, ROBOT.home)
    np.testing.assert_allclose(mapper.to_action(command, HOME), action, atol=0.02)


# ----- asynchronous inference -------------------------------------------------------------------------------------
def test_inference_runs_in_the_background_and_the_loop_never_waits():
    gate = threading.Event()
    policy = ScriptedJointPolicy(gate)
    node, fake, clock, _ = make(policy, inference="async")
    try:
        d = step(node, fake, clock)  # tick 0: requests a chunk; the policy is now blocked inside predict
        assert policy.started.wait(5)
        statuses = [d.status] + [step(node, fake, clock).status for _ in range(3)]
        # Four ticks ran while the model was stuck: each held (the arm keeps its measured position).
        assert statuses == [SafetyStatus.HOLD_NO_COMMAND] * 4 and node.tick_count == 4
        assert all(np.allclose(c, HOME) for c in fake.commands)
        gate.set()
        wait_result(node)
        d = step(node, fake, clock)  # tick 4: the chunk planned at tick 0 is used at index 4
        assert d.status is SafetyStatus.OK
        assert d.command[0] == pytest.approx(0.04)
    finally:
        gate.set()
        node.close()


def test_chunks_are_time_aligned_and_requested_before_the_queue_runs_dry():
    policy = ScriptedJointPolicy()
    node, fake, clock, _ = make(policy, inference="async")
    try:
        joint1 = []
        for _ in range(14):
            d = step(node, fake, clock)
            if d.status is SafetyStatus.OK:
                joint1.append(round(d.command[0], 4))
            wait_result(node)
        # Chunk n (planned at tick 4n) runs its actions 1..4 at ticks 4n+1..4n+4; tick 0 held (nothing planned yet).
        assert joint1[:8] == [0.01, 0.02, 0.03, 0.04, 0.11, 0.12, 0.13, 0.14]
        assert node.stats["starved_ticks"] == 1
        # The batch is the VLA's: (1, H, W, 3) uint8 frames, an (1, 8) EE state, the task, the timestamp.
        batch = policy.batches[1]
        assert batch["observation.images.agentview"].shape == (1, 64, 64, 3) and batch["observation.images.agentview"].dtype == np.uint8
        assert batch["observation.state"].shape == (1, 8) and batch["observation.state"].dtype == np.float32
        assert batch["task"] == ["open the drawer"] and batch["timestamp"][0] == pytest.approx(4 * PERIOD)
    finally:
        node.close()


# ----- takeover ---------------------------------------------------------------------------------------------------
def test_takeover_passes_the_human_through_safety_and_hand_back_restarts_the_chunk():
    policy = ScriptedJointPolicy()
    node, fake, clock, bus = make(policy, inference="async")
    human = InprocTransport(bus)
    takeover = human.publisher(ROBOT.topics.takeover, msg.Bool)
    teleop = human.publisher(ROBOT.topics.teleop, msg.Float64MultiArray)
    try:
        for _ in range(3):
            step(node, fake, clock)
            wait_result(node)
        calls_before = policy.calls
        takeover.publish(msg.Bool(data=True))
        d = step(node, fake, clock)
        assert d.status is SafetyStatus.HOLD_NO_COMMAND  # taken over, no teleop command yet: hold
        target = HOME.copy()
        target[0] = 2.0  # far beyond one step: the same step bound applies to the human
        teleop.publish(msg.Float64MultiArray(data=target))
        d = step(node, fake, clock)
        assert d.status is SafetyStatus.CLIPPED
        assert d.command[0] == pytest.approx(fake.commands[-2][0] + 0.35)
        teleop.publish(msg.Float64MultiArray(data=np.full(9, np.nan)))  # rejected at the door
        assert node.rejected["teleop_nonfinite"] == 1
        wait_result(node)
        assert policy.calls == calls_before  # no inference while the human drives
        resets = policy.resets
        takeover.publish(msg.Bool(data=False))
        d = step(node, fake, clock)  # hand-back: a fresh chunk is requested from this state; the arm holds meanwhile
        assert d.status is SafetyStatus.HOLD_NO_COMMAND and node.stats["handbacks"] == 1
        assert policy.resets == resets  # the episode goes on: a hand-back is not a reset
        wait_result(node)
        d = step(node, fake, clock)
        assert d.status in (SafetyStatus.OK, SafetyStatus.CLIPPED) and policy.calls == calls_before + 1
        assert node.stats["source_human"] == 2
    finally:
        node.close()


def test_joy_teleop_moves_the_end_effector_in_action_units():
    node, fake, clock, bus = make(ConstantPolicy(np.zeros(7)))
    human = InprocTransport(bus)
    human.publisher(ROBOT.topics.takeover, msg.Bool).publish(msg.Bool(data=True))
    human.publisher(ROBOT.topics.teleop_joy, msg.Joy).publish(msg.Joy(axes=[0, 0, 0.5, 0, 0, 0, -1]))
    try:
        d = step(node, fake, clock)
        ee0, ee1 = node.mapper.ee_position(HOME), node.mapper.ee_position(d.command)
        assert ee1[2] - ee0[2] == pytest.approx(0.5 * ROBOT.kinematics.pos_scale, abs=2e-3)
        human.publisher(ROBOT.topics.teleop_joy, msg.Joy).publish(msg.Joy(axes=[0.1, 0.2]))
        assert node.rejected["joy_axes"] == 1
    finally:
        node.close()


# ----- faults -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("action", [np.nan, 1e6, -np.inf])
def test_a_bad_policy_never_gets_anything_outside_limits_on_the_wire(action):
    node, fake, clock, _ = make(ConstantPolicy(action))
    try:
        for _ in range(12):
            step(node, fake, clock)
            wait_result(node)
        assert fake.commands, "the node must keep holding (publishing the safe position)"
        commands = np.stack(fake.commands)
        assert np.isfinite(commands).all()
        assert (commands >= ROBOT.lower - 1e-12).all() and (commands <= ROBOT.upper + 1e-12).all()
        steps = np.abs(np.diff(np.vstack([HOME, commands]), axis=0))
        assert (steps <= ROBOT.max_step + 1e-9).all()
        if not np.isfinite(action):
            assert node.safety.fault and node.safety.counters["hold_nonfinite"] >= 8
            np.testing.assert_allclose(commands, np.tile(HOME, (len(commands), 1)))
    finally:
        node.close()


def test_a_stopped_camera_holds_commands_within_two_control_periods():
    node, fake, clock, bus = make(ScriptedJointPolicy())
    try:
        for _ in range(6):
            step(node, fake, clock)
            wait_result(node)
        assert node.last_decision.status is SafetyStatus.OK
        held_after = None
        for k in range(1, 6):  # the cameras stop; joint states keep coming
            d = step(node, fake, clock, images=False)
            wait_result(node)
            if d.status is SafetyStatus.HOLD_STALE_IMAGE and held_after is None:
                held_after = k
                held_command = d.command.copy()
        assert held_after is not None and held_after <= 2
        np.testing.assert_allclose(fake.commands[-1], held_command)  # holding: the same command, again and again
        assert "frame is" in node.last_decision.reason
    finally:
        node.close()


def test_malformed_messages_are_rejected_counted_and_the_node_keeps_running():
    node, fake, clock, bus = make(ScriptedJointPolicy())
    bad = InprocTransport(bus)
    js = bad.publisher(ROBOT.topics.joint_states, msg.JointState)
    cam = bad.publisher(ROBOT.cameras[0].topic, msg.Image)
    instr = bad.publisher(ROBOT.topics.instruction, msg.String)
    teleop = bad.publisher(ROBOT.topics.teleop, msg.Float64MultiArray)
    try:
        step(node, fake, clock)
        js.publish(msg.JointState(name=["joint1", "joint2"], position=[0.0]))
        js.publish(msg.JointState(name=["joint1"], position=[0.0]))
        js.publish(msg.JointState(name=ROBOT.command_joint_names, position=np.full(9, np.nan)))
        js.publish(msg.JointState(name=["joint1", "joint1"], position=[0.0, 0.0]))
        cam.publish(msg.Image.from_array(np.zeros((480, 640, 3), np.uint8)))  # oversized for a 64x64 camera
        cam.publish(msg.Image(height=64, width=64, encoding="rgb8", step=192, data=b"\x00" * 10))  # truncated payload
        cam.publish(msg.Image(height=64, width=64, encoding="mono16", step=128, data=b"\x00" * 8192))
        instr.publish(msg.String(data="x" * 5000))
        teleop.publish(msg.Float64MultiArray(data=np.zeros(3)))
        assert dict(node.rejected) == {
            "joint_state_length": 1, "joint_state_missing_joints": 1, "joint_state_nonfinite": 1,
            "joint_state_duplicate_names": 1, "image_size": 1, "image_malformed": 2, "instruction_length": 1,
            "teleop_length": 1,
        }
        assert node.instruction == "open the drawer"
        statuses = []
        for _ in range(4):
            wait_result(node)
            statuses.append(step(node, fake, clock).status)
        assert SafetyStatus.OK in statuses  # still controlling
        # The rejected NaN state never reached the safety layer as a measurement.
        assert node.safety.counters["invalid_state"] == 0
    finally:
        node.close()


def test_compressed_camera_frames_are_decoded_and_checked():
    robot = robot_config_from_dict(
        {**_robot_dict(), "cameras": [{"name": "agentview", "topic": "/cam/compressed", "format": "compressed", "width": 32, "height": 24}]},
        source=ROBOT.source,
    )
    node, fake, clock, bus = make(ConstantPolicy(np.zeros(7)), robot=robot)
    pub = InprocTransport(bus).publisher("/cam/compressed", msg.CompressedImage)
    try:
        rgb = np.zeros((24, 32, 3), np.uint8)
        rgb[..., 0] = 200  # red
        ok, png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        pub.publish(msg.CompressedImage(format="png", data=png.tobytes()))
        assert node._images["agentview"][0, 0].tolist() == [200, 0, 0]
        pub.publish(msg.CompressedImage(format="jpeg", data=b"not a jpeg"))
        ok, big = cv2.imencode(".png", np.zeros((48, 64, 3), np.uint8))
        pub.publish(msg.CompressedImage(format="png", data=big.tobytes()))
        assert node.rejected["image_undecodable"] == 1 and node.rejected["image_size"] == 1
    finally:
        node.close()


def test_estop_topic_latches_a_hold():
    node, fake, clock, bus = make(ScriptedJointPolicy())
    estop = InprocTransport(bus).publisher(ROBOT.topics.estop, msg.Bool)
    try:
        for _ in range(4):
            step(node, fake, clock)
            wait_result(node)
        estop.publish(msg.Bool(data=True))
        estop.publish(msg.Bool(data=False))
        held = [step(node, fake, clock) for _ in range(3)]
        assert all(d.status is SafetyStatus.HOLD_ESTOP for d in held)
        assert all(np.array_equal(d.command, held[0].command) for d in held)
    finally:
        node.close()


def test_no_command_before_the_first_joint_state():
    node, fake, clock, _ = make(ScriptedJointPolicy())
    try:
        clock.t = 0.05
        assert node.tick().status is SafetyStatus.BLOCKED_NO_STATE
        assert fake.commands == []
    finally:
        node.close()


def _robot_dict():
    import yaml

    return yaml.safe_load(open(ROBOT.source).read())


def test_joint_trajectory_controller_gets_safe_chunks_and_empty_holds():
    data = _robot_dict()
    data["controller"]["type"] = "joint_trajectory"
    robot = robot_config_from_dict(data, source=ROBOT.source)
    node, fake, clock, _ = make(ScriptedJointPolicy(), robot=robot, inference="async")
    try:
        for _ in range(3):
            step(node, fake, clock)
            wait_result(node)
        traj = [t for t in fake.trajectories if t.points]
        assert traj and traj[0].joint_names == robot.command_joint_names
        first = traj[0]
        # The chunk's remaining actions (0.01 .. 0.04 on joint1), 50 ms apart.
        assert [round(p.positions[0], 4) for p in first.points] == [0.01, 0.02, 0.03, 0.04]
        assert [round(p.time_from_start.to_sec(), 3) for p in first.points] == [0.05, 0.1, 0.15, 0.2]
        n = len(fake.trajectories)
        step(node, fake, clock, images=False)
        step(node, fake, clock, images=False)
        step(node, fake, clock, images=False)
        assert any(not t.points for t in fake.trajectories[n:])  # stale camera: an empty trajectory stops the arm
    finally:
        node.close()


# ----- the sim-robot node -----------------------------------------------------------------------------------------
def test_sim_robot_follows_commands_and_trajectories_and_resets():
    from robot.sim_robot import SimRobotNode

    robot = replace(ROBOT, cameras=[], rates=RatesConfig())
    bus = InprocBus()
    sim = SimRobotNode(InprocTransport(bus), robot, "drawer", seed=3)
    ctl = InprocTransport(bus)
    states, success, instructions = [], [], []
    ctl.subscribe(robot.topics.joint_states, msg.JointState, states.append)
    ctl.subscribe(robot.topics.success, msg.Bool, lambda m: success.append(m.data))
    ctl.subscribe(robot.topics.instruction, msg.String, lambda m: instructions.append(m.data), qos=QOS_LATCHED)
    cmd = ctl.publisher(robot.controller.commands_topic, msg.Float64MultiArray)
    traj = ctl.publisher(robot.controller.trajectory_topic, msg.JointTrajectory)
    episode = ctl.publisher(robot.topics.episode, msg.String)
    try:
        assert instructions and "drawer" in instructions[-1]
        target = HOME.copy()
        target[0] += 0.2
        cmd.publish(msg.Float64MultiArray(data=target))
        for _ in range(60):  # 0.6 s of sim time
            sim.step()
        assert states[-1].name == robot.command_joint_names
        assert states[-1].position[0] == pytest.approx(target[0], abs=0.01)
        # A trajectory (by name, a subset of joints, another order) is interpolated from the current targets.
        traj.publish(msg.JointTrajectory(joint_names=["joint2", "joint1"], points=[
            msg.JointTrajectoryPoint(positions=[HOME[1], 0.0], time_from_start=msg.Duration.from_sec(0.5)),
        ]))
        sim.step()
        sim.step()
        mid = sim.data.ctrl[sim._act_idx[0]]
        assert 0.0 < mid < target[0]  # on its way, not jumped
        for _ in range(80):
            sim.step()
        assert states[-1].position[0] == pytest.approx(0.0, abs=0.01)
        # An empty trajectory holds where the arm is: read by the physics thread at its next step.
        cmd.publish(msg.Float64MultiArray(data=target))
        sim.step()
        before = sim.data.ctrl[sim._act_idx].copy()
        traj.publish(msg.JointTrajectory(joint_names=robot.command_joint_names, points=[]))
        np.testing.assert_array_equal(sim.data.ctrl[sim._act_idx], before)  # nothing written from this thread
        q_now = sim.data.qpos[sim._qpos_idx].copy()
        sim.step()
        np.testing.assert_allclose(sim.data.ctrl[sim._act_idx], np.clip(q_now, sim._ctrl_lo, sim._ctrl_hi))
        cmd.publish(msg.Float64MultiArray(data=np.zeros(4)))
        traj.publish(msg.JointTrajectory(joint_names=["elbow"], points=[]))
        assert sim.counters["rejected_command"] == 1 and sim.counters["rejected_trajectory_joints"] == 1
        assert success and not any(success)
        episode.publish(msg.String(data="reset seed=11"))
        sim.step()
        assert sim.seed == 11 and sim.counters["resets"] == 2
        np.testing.assert_allclose(states[-1].position[:7], ROBOT.home, atol=0.02)
    finally:
        sim.close()


# ----- kinema deploy: policies and the command line --------------------------------------------------------------
def test_deploy_policy_specs_are_parsed_or_rejected_with_the_valid_choices(tmp_path):
    from kinema.robot_policies import ExpertReplayPolicy, load_policy

    zero = load_policy("scripted:zero")
    assert zero.predict_action_chunk({"task": ["x"]}).shape == (1, 8, 7)
    assert np.isnan(load_policy("scripted:nan").predict_action_chunk({"task": ["x"]})).all()
    replay = load_policy("scripted:replay:task=drawer:seed=4")
    assert isinstance(replay, ExpertReplayPolicy) and replay.first_seed == 4
    with pytest.raises(ValueError, match="unknown scripted policy 'wave'; valid: zero, nan, replay"):
        load_policy("scripted:wave")
    with pytest.raises(ValueError, match="replay takes task=<name>"):
        load_policy("scripted:replay:seed=1")
    with pytest.raises(ValueError, match="unknown task 'nope'; valid tasks: drawer"):
        load_policy("scripted:replay:task=nope")
    with pytest.raises(ValueError, match="seed must be an integer; got 'abc'"):
        load_policy("scripted:replay:task=drawer:seed=abc")
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        load_policy(str(tmp_path))


def test_expert_replay_is_indexed_by_episode_time_with_the_nodes_lag():
    from kinema.robot_policies import ExpertReplayPolicy, load_policy

    replay = ExpertReplayPolicy("drawer", seed=0)
    replay.reset()
    assert replay.expert_success and replay.targets.shape[1] == 8
    # Synchronous inference (the node's default for a policy this fast) runs a chunk from index 0 at its own tick.
    chunk = replay.predict_action_chunk({"timestamp": np.array([0.0])})[0]
    np.testing.assert_allclose(chunk[0], replay.targets[0], rtol=1e-6)
    later = replay.predict_action_chunk({"timestamp": np.array([0.25])})[0]  # 5 ticks in
    np.testing.assert_allclose(later[0], replay.targets[5], rtol=1e-6)
    replay.reset()
    assert replay.episode == 1  # the next episode replays the next seed, as the sim robot resets to it
    # Asynchronous inference runs a chunk from index 1, a tick after it was asked for: the replay lags that tick.
    lagged = load_policy("scripted:replay:task=drawer:seed=0", inference="async")
    assert lagged.lag_ticks == 1 and load_policy("scripted:replay:task=drawer:seed=0").lag_ticks == 0
    lagged.reset()
    np.testing.assert_allclose(lagged.predict_action_chunk({"timestamp": np.array([0.25])})[0][1], lagged.targets[5], rtol=1e-6)


def test_deploy_without_a_robot_fails_with_a_clear_error(capsys):
    from kinema.cli import main

    code = main(["deploy", "--policy", "scripted:zero", "--backend", "inproc", "--wait-robot", "0.2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no valid /joint_states within 0.2 s" in err and "kinema sim-robot" in err


@pytest.mark.parametrize("record", [False, True], ids=["plain", "recording"])
def test_deploy_refuses_a_robot_whose_controller_does_not_listen(capsys, monkeypatch, tmp_path, record):
    """Joint states arrive but nothing subscribes to the command topic (a controller not loaded or not configured):
    deploy says so and commands nothing, rather than streaming into the void for the whole episode. Its own
    recorder, which listens to the commands too, does not count as the controller."""
    from kinema.cli import main

    monkeypatch.setenv("ROS_DOMAIN_ID", "0")  # deploy's inproc transport joins the default bus on domain 0
    with InprocTransport(DEFAULT_BUS) as tr:
        state_pub = tr.publisher(ROBOT.topics.joint_states, msg.JointState)
        stop = threading.Event()

        def robot_loop():
            while not stop.is_set():
                state_pub.publish(msg.JointState(name=list(ROBOT.command_joint_names), position=list(HOME)))
                stop.wait(0.02)

        thread = threading.Thread(target=robot_loop)
        thread.start()
        try:
            code = main(["deploy", "--policy", "scripted:zero", "--backend", "inproc", "--wait-robot", "0.5",
                         *(["--record", str(tmp_path / "rec")] if record else [])])
        finally:
            stop.set()
            thread.join(10)
    assert code == 2
    err = capsys.readouterr().err
    assert f"nothing subscribes to {ROBOT.controller.commands_topic} within 0.5 s" in err and "forward_position controller" in err


def test_deploy_records_with_the_robots_own_recorder_config(tmp_path):
    """`deploy --record`: RecorderConfig.from_robot (per-camera sizes, a step per streamed command) and the mapper's
    EE state/action names; cameras of different sizes each keep their own."""
    from robot.session import episode_recorder
    from robot.config import CameraConfig
    from robot.recorder import RecorderConfig

    robot = replace(ROBOT, cameras=[CameraConfig("agentview", "/cam/a", width=64, height=48),
                                    CameraConfig("wrist", "/cam/w", width=32, height=32)])
    mapper = ActionMapper(robot)
    with InprocTransport(InprocBus()) as tr:
        recorder = episode_recorder(tr, robot, mapper, str(tmp_path), "open the drawer")
        try:
            cfg = recorder.config
            assert [(c.name, c.size) for c in cfg.cameras] == [("agentview", (48, 64)), ("wrist", (32, 32))]
            assert cfg.sample_on == "command" and cfg.fps == robot.rates.control_hz
            assert cfg.state_names == list(ActionMapper.STATE_NAMES) and len(cfg.state_names) == 8
            assert cfg.action_names == list(ActionMapper.ACTION_NAMES) and len(cfg.action_names) == 7
            expected = RecorderConfig.from_robot(robot, instruction="open the drawer", state_names=cfg.state_names,
                                                 action_names=cfg.action_names)
            assert cfg == expected
        finally:
            recorder.close()


def test_deploy_keys_need_a_recording(capsys):
    from kinema.cli import main

    assert main(["deploy", "--policy", "scripted:zero", "--backend", "inproc", "--keys"]) == 2
    assert "--keys marks recorded episodes: it needs --record DIR" in capsys.readouterr().err


def test_an_unknown_inference_mode_is_refused_with_the_valid_ones(capsys):
    from kinema.cli import main
    from kinema.common import load_config
    from kinema.train.config import TrainConfig

    assert main(["deploy", "--policy", "scripted:zero", "--backend", "inproc", "--inference", "later"]) == 2
    assert "--inference 'later' is not known; valid: auto, sync, async" in capsys.readouterr().err
    with pytest.raises(ValueError, match="robot.inference 'later' is not known; valid: auto, sync, async"):
        load_config(None, ["--robot.config", "sim_panda", "--robot.inference", "later"], config_class=TrainConfig)


def test_a_policy_reading_cameras_the_robot_lacks_is_refused_at_startup():
    class Config:
        cameras = ("agentview", "side")
        state_dim = 8
        n_action_steps = 4

    policy = ConstantPolicy(np.zeros(7))
    policy.config = Config()
    with pytest.raises(ValueError, match=r"reads cameras \['agentview', 'side'\] but robot config 'sim_panda' has \['agentview', 'wrist'\]"):
        make(policy)


def test_a_failing_policy_is_counted_and_the_arm_holds():
    class Broken(ScriptedJointPolicy):
        def predict_action_chunk(self, batch):
            raise RuntimeError("CUDA out of memory")

    node, fake, clock, _ = make(Broken())
    try:
        statuses = []
        for _ in range(5):
            statuses.append(step(node, fake, clock).status)
            wait_result(node)
        assert set(statuses) == {SafetyStatus.HOLD_NO_COMMAND} and node.stats["policy_errors"] >= 3
        assert all(np.allclose(c, HOME) for c in fake.commands)
    finally:
        node.close()


def test_state_triggered_node_answers_every_fresh_state_with_one_command():
    node, fake, clock, _ = make(ScriptedJointPolicy(), trigger="state", inference="async")
    node.start()
    try:
        for k in range(6):
            clock.t += PERIOD
            fake.publish()  # the tick runs inside this call, on the publisher's (transport) thread
            wait_result(node)
        assert len(fake.commands) == 6 and node.tick_count == 6
        assert [round(c[0], 2) for c in fake.commands[1:5]] == [0.01, 0.02, 0.03, 0.04]
    finally:
        node.close()


def test_synchronous_inference_runs_each_chunk_from_index_0_at_the_tick_it_was_planned_at():
    """`inference="sync"`: as kinema eval acts (a chunk's action 0 at the tick of its observation, n_action_steps
    actions, then a new chunk), where the asynchronous default runs a chunk from index 1, a tick later."""
    policy = ScriptedJointPolicy()
    node, fake, clock, _ = make(policy, inference="sync")
    try:
        for _ in range(8):
            step(node, fake, clock)
        assert policy.calls == 2 and len(policy.batches) == 2
        assert [round(c[0], 2) for c in fake.commands] == [0.0, 0.01, 0.02, 0.03, 0.1, 0.11, 0.12, 0.13]
        assert not node.worker.busy and node.stats.get("starved_ticks", 0) == 0
    finally:
        node.close()
    asynchronous, fake, clock, _ = make(ScriptedJointPolicy(), inference="async")
    try:
        step(asynchronous, fake, clock)
        wait_result(asynchronous)
        for _ in range(3):
            step(asynchronous, fake, clock)
        assert [round(c[0], 2) for c in fake.commands[-3:]] == [0.01, 0.02, 0.03]  # from index 1, a tick after tick 0
    finally:
        asynchronous.close()
    with pytest.raises(ValueError, match="inference 'later' is not known; valid: auto, sync, async"):
        make(ScriptedJointPolicy(), inference="later")


class SlowJointPolicy(ScriptedJointPolicy):
    """ScriptedJointPolicy taking `seconds` per chunk."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def predict_action_chunk(self, batch):
        threading.Event().wait(self.seconds)
        return super().predict_action_chunk(batch)


def test_auto_inference_is_synchronous_while_the_policy_fits_half_a_tick_and_asynchronous_once_it_does_not():
    """The default: a policy fast enough acts as under "sync" (chunks from index 0 at their own tick); one that takes
    more than half a tick has its first chunk computed in its tick (to measure it), then the loop stops waiting."""
    fast = ScriptedJointPolicy()
    node, fake, clock, _ = make(fast)
    try:
        assert node.inference == "auto" and node.status()["inference"] == "auto"
        for _ in range(8):
            step(node, fake, clock)
        assert [round(c[0], 2) for c in fake.commands] == [0.0, 0.01, 0.02, 0.03, 0.1, 0.11, 0.12, 0.13]
        assert node.stats["sync_requests"] == node.stats["requests"] == 2
    finally:
        node.close()
    slow = SlowJointPolicy(0.6 * PERIOD)
    node, fake, clock, _ = make(slow)
    try:
        step(node, fake, clock)  # tick 0: no measurement yet, so computed here and run from index 0
        assert slow.calls == 1 and [round(c[0], 2) for c in fake.commands] == [0.0]
        for _ in range(5):
            step(node, fake, clock)
            wait_result(node)
        # Then in the background: chunk 1, asked for while actions of chunk 0 remained, runs from a later index.
        assert node.stats["sync_requests"] == 1 and node.stats["requests"] >= 2
        assert [round(c[0], 2) for c in fake.commands[:4]] == [0.0, 0.01, 0.02, 0.03]
        assert round(fake.commands[5][0], 2) in (0.11, 0.12, 0.13)
    finally:
        node.close()


# ----- threads: episode control against a running tick and a running inference ---------------------------------------
class RecordingPolicy(ScriptedJointPolicy):
    """Logs when predictions start and end and when reset runs, to check their order across threads."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(gate)
        self.events: list[str] = []

    def reset(self) -> None:
        self.events.append("reset")
        super().reset()

    def predict_action_chunk(self, batch):
        self.events.append("predict")
        out = super().predict_action_chunk(batch)
        self.events.append("predicted")
        return out


def test_start_episode_resets_the_policy_only_after_a_running_prediction_ends():
    gate = threading.Event()
    policy = RecordingPolicy(gate)
    node, fake, clock, _ = make(policy, inference="async")
    try:
        step(node, fake, clock)
        assert policy.started.wait(5)  # a prediction is running (held by the gate)
        done = threading.Event()
        thread = threading.Thread(target=lambda: (node.start_episode(), done.set()))
        thread.start()
        assert not done.wait(0.2)  # start_episode waits for the worker
        assert policy.events == ["predict"]
        gate.set()
        assert done.wait(5)
        thread.join()
        assert policy.events == ["predict", "predicted", "reset"]
        # The chunk planned before the new episode is never executed.
        step(node, fake, clock)
        assert node.stats["discarded_chunks"] == 1 and node.stats["chunks"] == 0
    finally:
        gate.set()
        node.close()


def test_pause_waits_for_a_running_tick_and_nothing_publishes_after_it():
    node, fake, clock, _ = make(ConstantPolicy(np.zeros(7)))
    entered, release = threading.Event(), threading.Event()
    real_filter = node.safety.filter

    def slow_filter(command, now):
        entered.set()
        assert release.wait(5)
        return real_filter(command, now)

    try:
        step(node, fake, clock)
        node.safety.filter = slow_filter
        clock.t += PERIOD
        fake.publish()
        ticking = threading.Thread(target=node.tick)
        ticking.start()
        assert entered.wait(5)
        paused = threading.Event()
        pauser = threading.Thread(target=lambda: (node.pause(), paused.set()))
        pauser.start()
        assert not paused.wait(0.2)  # the tick in progress finishes first
        release.set()
        ticking.join(5)
        assert paused.wait(5)
        pauser.join()
        published = len(fake.commands)
        node.safety.filter = real_filter
        assert step(node, fake, clock) is None and len(fake.commands) == published
    finally:
        release.set()
        node.close()


def test_stats_and_rejections_are_safe_to_read_while_other_threads_count():
    node, fake, clock, bus = make(ConstantPolicy(np.zeros(7)))
    bad = InprocTransport(bus).publisher(ROBOT.topics.teleop, msg.Float64MultiArray)
    stop = threading.Event()
    errors: list[BaseException] = []

    def reader():
        try:
            while not stop.is_set():
                node.status()
        except BaseException as err:  # noqa: BLE001 - the test reports it
            errors.append(err)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(300):
            node.stats.add(f"k{i}")  # new keys while status() copies the table
            bad.publish(msg.Float64MultiArray(data=np.zeros(2)))
    finally:
        stop.set()
        for t in threads:
            t.join()
        node.close()
    assert not errors, errors
    assert node.rejected["teleop_length"] == 300 and len(node.stats) >= 300


# ----- oversized messages over real DDS ------------------------------------------------------------------------------
_FLOOD = r"""
import re, sys, time
import numpy as np
import robot.messages as m
from robot.transport.dds import LOOPBACK_CONFIG, DDSTransport

# This sender has no size cap (as a misbehaving node elsewhere might not): the receiver's own cap must hold.
xml = re.sub(r"<Internal>.*?</Internal>", "", LOOPBACK_CONFIG.read_text(), flags=re.S)
domain, cam_topic, js_topic = int(sys.argv[1]), sys.argv[2], sys.argv[3]
with DDSTransport(domain, "flood", config=xml) as t:
    cam = t.publisher(cam_topic, m.Image)
    js = t.publisher(js_topic, m.JointState)
    deadline = time.monotonic() + 20
    while (cam.subscription_count() < 1 or js.subscription_count() < 1) and time.monotonic() < deadline:
        time.sleep(0.01)
    side = 2600  # 2600 x 2600 rgb8: ~20 MB, over the loopback config's 16 MiB cap
    cam.publish(m.Image(height=side, width=side, encoding="rgb8", step=3 * side, data=bytes(3 * side * side)))
    names = [f"joint_{i}" for i in range(100_000)]
    js.publish(m.JointState(name=names, position=np.zeros(len(names))))
    time.sleep(0.3)
    cam.publish(m.Image.from_array(np.full((64, 64, 3), 7, np.uint8)))  # a good frame after the bad ones
    time.sleep(1.0)
print("FLOOD DONE", flush=True)
"""


def test_oversized_samples_over_dds_are_dropped_or_rejected_and_the_node_keeps_running(capfd):
    """A ~20 MB frame is dropped by Cyclone's MaxSampleSize before Python sees it; a JointState naming 10^5 joints
    is rejected by the node; a good frame after both is taken."""
    import os
    import subprocess
    import sys

    dds = pytest.importorskip("robot.transport.dds")
    domain = int(os.environ["ROS_DOMAIN_ID"])
    ns = f"/oversize{os.getpid()}"
    cams = [replace(ROBOT.cameras[0], topic=f"{ns}/agentview")]
    robot = replace(ROBOT, cameras=cams, topics=replace(ROBOT.topics, joint_states=f"{ns}/joint_states"))
    node = PolicyNode(dds.DDSTransport(domain, "oversize_node"), robot, ConstantPolicy(np.zeros(7)), "x")
    images: list[int] = []
    original = node._subs[-1]._callback
    node._subs[-1]._callback = lambda m: (images.append(len(m.data)), original(m))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", _FLOOD, str(domain), cams[0].topic, robot.topics.joint_states],
                            cwd=repo, env={**os.environ, "PYTHONPATH": repo}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
    try:
        assert "FLOOD DONE" in out, err[-3000:]
        assert "dropping oversize" in capfd.readouterr().err  # Cyclone's log line (C, fd 2), from this side's cap
        assert images == [64 * 64 * 3]  # the huge frame never reached Python; the good one did
        assert node.rejected["joint_state_too_many_joints"] == 1
        assert "agentview" in node._images and node.transport._thread.is_alive()
    finally:
        transport = node.transport
        node.close()
        transport.close()


def test_deploy_keys_mark_the_recorded_episode_and_q_quits(tmp_path, monkeypatch):
    """`kinema deploy --record DIR --keys`: space starts recording, s ends it as a success, q ends deploy."""
    import os
    import time

    from kinema.cli import main

    read_fd, write_fd = os.pipe()
    keyboard = os.fdopen(read_fd, "r")
    monkeypatch.setattr("sys.stdin", keyboard)
    monkeypatch.setenv("ROS_DOMAIN_ID", "0")  # deploy's inproc transport joins the default bus on domain 0, as fake does
    fake = FakeRobot(DEFAULT_BUS)
    stop = threading.Event()
    codes: list[int] = []

    def robot_loop():
        while not stop.is_set():
            fake.publish()
            stop.wait(0.02)

    def keys():
        deadline = time.monotonic() + 30
        while len(fake.commands) < 5 and time.monotonic() < deadline:  # deploy commands the arm
            time.sleep(0.02)
        for key, pause in ((" ", 0.6), ("s", 0.3), ("q", 0.0)):
            os.write(write_fd, key.encode())
            time.sleep(pause)

    threads = [threading.Thread(target=robot_loop), threading.Thread(target=keys)]
    for t in threads:
        t.start()
    try:
        codes.append(main(["deploy", "--policy", "scripted:zero", "--backend", "inproc", "--episodes", "3",
                           "--duration", "20", "--record", str(tmp_path), "--keys", "--wait-robot", "10"]))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        os.close(write_fd)
        keyboard.close()
        fake.tr.close()
    assert codes == [0]
    from diffusion_rl.data import read_episodes

    (episode,) = read_episodes(tmp_path / "dataset")  # one episode, the one the keys marked
    assert episode.outcome is True and episode.complete and 5 <= len(episode) <= 30


class SwappedInPolicy(ScriptedJointPolicy):
    """Joint-space chunks moving joint1 to 0.2 + 0.001 * k: nothing the ScriptedJointPolicy of these tests sends."""

    fingerprint = "swapped-in"

    def predict_action_chunk(self, batch):
        chunk = super().predict_action_chunk(batch)
        chunk[0, :, 0] = 0.2 + 0.001 * np.arange(8)
        return chunk


def test_a_swapped_in_policy_acts_from_its_first_chunk_and_no_chunk_of_the_old_one_runs_after():
    gate = threading.Event()
    gate.set()
    old = ScriptedJointPolicy(gate)
    node, fake, clock, _ = make(old, inference="async")
    try:
        for _ in range(4):  # chunk 0 (planned at tick 0) runs at ticks 1-3
            step(node, fake, clock)
            wait_result(node)
        gate.clear()
        old.started.clear()  # set by chunk 0's prediction: wait for chunk 1's to begin, not merely to be queued
        step(node, fake, clock)  # tick 4 asks the old policy for chunk 1, which is held mid-prediction
        assert old.started.wait(5)
        swapped = threading.Event()
        swapping = threading.Thread(target=lambda: (node.swap_policy(SwappedInPolicy()), swapped.set()))
        swapping.start()
        assert not swapped.wait(0.2)  # the swap waits for the running prediction
        gate.set()
        assert swapped.wait(5)
        swapping.join()
        joint1 = []
        for _ in range(10):
            d = step(node, fake, clock)
            if d.status in (SafetyStatus.OK, SafetyStatus.CLIPPED):
                joint1.append(round(d.command[0], 4))
            wait_result(node)
        assert joint1 and all(0.2 <= j < 0.21 for j in joint1), joint1  # the old chunk 1 (0.11-0.14) never ran
        assert node.stats["discarded_chunks"] == 1 and node.stats["policy_swaps"] == 1
        assert node.status()["policy"] == "swapped-in"
        ee_policy = ConstantPolicy(np.zeros(7))  # acts in end-effector deltas, not joints
        with pytest.raises(ValueError, match="action_space"):
            node.swap_policy(ee_policy)
    finally:
        gate.set()
        node.close()


def test_a_rosetta_contract_describes_the_same_robot_and_contradictions_are_named(tmp_path):
    """A Rosetta contract (topics <-> LeRobot features) with kinema's x-kinema block reads back to the robot YAML it
    was written from; the shipped contract is what `kinema robot-contract sim_panda` prints; a contract that
    contradicts kinema's block, or lacks what the node needs, is refused naming the key."""
    import copy
    import dataclasses
    import subprocess
    import sys

    import yaml

    from robot.config import load_robot_config
    from robot.contract import contract_from_robot_config, robot_config_from_contract

    robot = load_robot_config("sim_panda")
    shipped = Path(__file__).resolve().parent.parent / "assets" / "robots" / "sim_panda.contract.yaml"
    printed = subprocess.run([sys.executable, "-m", "kinema.cli", "robot-contract", "sim_panda"], capture_output=True, text=True, check=True)
    assert printed.stdout == shipped.read_text()
    contract = yaml.safe_load(shipped.read_text())
    assert contract["observations"]["observation.state"]["select"][0] == "position.joint1"
    assert dataclasses.replace(load_robot_config(shipped), source="") == dataclasses.replace(robot, source="")
    trajectory = dataclasses.replace(robot, controller=dataclasses.replace(robot.controller, type="joint_trajectory"))
    assert robot_config_from_contract(contract_from_robot_config(trajectory)).controller.type == "joint_trajectory"

    def refused(change, match):
        bad = copy.deepcopy(contract)
        change(bad)
        with pytest.raises(ValueError, match=match):
            robot_config_from_contract(bad, source="bad.yaml")

    refused(lambda c: c["observations"]["observation.state"]["select"].pop(), r"selects positions of .*'finger_joint1'\]; the robot commands")
    refused(lambda c: c["observations"]["observation.images.wrist"].pop("apply"), r"observation.images.wrist has no `apply: \[resize")
    refused(lambda c: c["actions"]["action"]["channel"].update(type="geometry_msgs/msg/Twist"), "actions.action is 'geometry_msgs/msg/Twist'")
    refused(lambda c: c["x-kinema"].update(cameras=[]), r"x-kinema sets \['cameras'\]")
    refused(lambda c: c.update(policy={}), r"unknown top-level keys \['policy'\]")
    refused(lambda c: c["x-kinema"]["joints"][0].update(lower=5.0), "joint 'joint1'")
