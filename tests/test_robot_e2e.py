"""End to end over real DDS on loopback: `kinema sim-robot` and `kinema deploy` in separate processes.

tests/conftest.py pins the environment to loopback (robot.transport.loopback) and picks a random ROS_DOMAIN_ID for the
session; the child processes inherit both, and `--local` (the default) pins them again. The commands run through
`python -m kinema.cli`, the console script's own parser. Every process is stopped by its PID in a
`finally`, whatever the test's outcome.
"""

import json
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("cyclonedds")

from robot import messages as msg  # noqa: E402
from robot.config import load_robot_config  # noqa: E402
from robot_processes import ROOT, procs  # noqa: E402,F401 (procs: the fixture)

ROBOT = load_robot_config("sim_panda")


@pytest.fixture
def listener():
    """This test process on the same loopback DDS domain, collecting the commands the policy node sends."""
    from robot.transport import make_transport

    transport = make_transport("dds", node_name="kinema_test_listener", config="loopback")
    commands: list[np.ndarray] = []
    transport.subscribe(ROBOT.controller.commands_topic, msg.Float64MultiArray, lambda m: commands.append(m.data.copy()))
    try:
        yield transport, commands
    finally:
        transport.close()


def assert_in_limits(commands: list[np.ndarray]) -> None:
    c = np.stack(commands)
    assert c.shape[1] == len(ROBOT.command_joint_names)
    assert np.isfinite(c).all()
    assert (c >= ROBOT.lower - 1e-9).all() and (c <= ROBOT.upper + 1e-9).all()


def test_a_scripted_policy_completes_episodes_over_dds_and_they_are_recorded(procs, listener, tmp_path):
    _, commands = listener
    sim = procs.start("sim", "sim-robot", "--task", "drawer", "--seed", "0", "--backend", "dds")
    # deploy reads the robot from its Rosetta contract (robot/contract.py), the sim robot from sim_panda.yaml
    deploy = procs.start(
        "deploy", "deploy", "--policy", "scripted:replay:task=drawer:seed=0", "--backend", "dds",
        "--episodes", "2", "--duration", "15", "--record", str(tmp_path / "rec"),
        "--robot", str(ROOT / "assets" / "robots" / "sim_panda.contract.yaml"),
    )
    assert procs.wait(deploy, 120) == 0, procs.logs()
    os.kill(sim.pid, signal.SIGTERM)  # what Ctrl-C does: a clean stop, with the sim's counters
    assert procs.wait(sim, 30) == 0, procs.logs()
    stopped = procs.records("sim")[-1]
    assert stopped["event"] == "stopped" and stopped["counters"]["resets"] == 2 and stopped["counters"]["commands"] > 20
    episodes = [r for r in procs.records("deploy") if r["event"] == "episode"]
    summary = procs.records("deploy")[-1]
    assert [e["success"] for e in episodes] == [True, True], procs.logs()
    # Seeds 0 and 1 ("pull the top drawer open", "pull the red drawer open"): the sim robot reset in between.
    assert episodes[0]["instruction"] != episodes[1]["instruction"]
    assert summary["safety"]["fault"] is False and summary["stats"]["commands_published"] > 20
    assert_in_limits(commands)

    from diffusion_rl.data import ExecutedBy, LeRobotDatasetReader

    dataset = LeRobotDatasetReader(tmp_path / "rec" / "dataset")
    recorded = [dataset[i] for i in range(len(dataset))]
    assert len(recorded) == 2 and all(ep.outcome for ep in recorded)
    for ep, result in zip(recorded, episodes):
        # Sampled at 20 Hz from the episode's start to its success (the reset in between is not recorded). A loaded CPU
        # makes the real-time loop drop ticks (CI with five busy processes: 22 steps in 1.73 s), never add them.
        assert 0.5 * 20 * result["seconds"] - 6 <= len(ep) <= 20 * result["seconds"] + 6, (len(ep), result)
        assert ep.observations["observation.state"].shape[1] == 8 and ep.action.shape[1] == 7
        assert (ep.executed_by == ExecutedBy.POLICY).all() and (np.abs(ep.action) <= 1).all()


@pytest.mark.slow
def test_the_tiny_vla_runs_unchanged_and_publishes_in_limit_commands(procs, listener, tmp_path):
    from policies.vla import VLAConfig, VLAPolicy

    ckpt = tmp_path / "vla"
    VLAPolicy(VLAConfig(cameras=("agentview", "wrist"), image_size=64)).save_pretrained(str(ckpt))
    _, commands = listener
    procs.start("sim", "sim-robot", "--task", "drawer", "--seed", "0", "--backend", "dds")
    deploy = procs.start("deploy", "deploy", "--policy", str(ckpt), "--backend", "dds", "--duration", "4")
    assert procs.wait(deploy, 120) == 0, procs.logs()
    summary = procs.records("deploy")[-1]
    assert summary["event"] == "summary" and summary["episodes"] == 1
    assert summary["stats"]["chunks"] >= 5, summary  # the VLA's chunks arrived and ran
    assert summary["inference_ms"] is not None
    assert len(commands) >= 20
    assert_in_limits(commands)


@pytest.mark.slow
def test_a_lerobot_smolvla_runs_unchanged_against_sim_robot(procs, listener, tmp_path):
    """LeRobot's SmolVLA (the tiny fixture LeRobot's code wrote), saved by kinema with where its VLM lies: `kinema
    deploy` takes the folder as it takes any checkpoint."""
    from policies.smolvla import SmolVLAPolicy

    fixture = ROOT / "tests" / "fixtures" / "smolvla"
    ckpt = tmp_path / "smolvla"
    SmolVLAPolicy.from_pretrained(fixture / "tiny-smolvla", vlm_path=str(fixture / "tiny-smolvlm")).save_pretrained(ckpt)
    _, commands = listener
    procs.start("sim", "sim-robot", "--task", "drawer", "--seed", "0", "--backend", "dds")
    deploy = procs.start("deploy", "deploy", "--policy", str(ckpt), "--backend", "dds", "--duration", "4")
    assert procs.wait(deploy, 120) == 0, procs.logs()
    summary = procs.records("deploy")[-1]
    assert summary["event"] == "summary" and summary["episodes"] == 1
    assert summary["stats"]["chunks"] >= 5, summary
    assert len(commands) >= 20
    assert_in_limits(commands)


def test_the_tiny_video_policy_runs_unchanged_against_sim_robot_for_an_episode(procs, listener, tmp_path):
    from policies.video_policy import VideoPolicy, VideoPolicyConfig

    ckpt = tmp_path / "video"
    # Four flow steps and whole chunks: at ten steps a chunk lands after the 20 Hz node's 4-action window on this CPU.
    config = VideoPolicyConfig(cameras=("agentview", "wrist"), image_size=64, num_flow_steps=4, n_action_steps=8)
    VideoPolicy(config).save_pretrained(str(ckpt))
    _, commands = listener
    procs.start("sim", "sim-robot", "--task", "drawer", "--seed", "0", "--backend", "dds")
    deploy = procs.start("deploy", "deploy", "--policy", str(ckpt), "--backend", "dds", "--duration", "4")
    assert procs.wait(deploy, 180) == 0, procs.logs()
    summary = procs.records("deploy")[-1]
    assert summary["event"] == "summary" and summary["episodes"] == 1
    assert summary.get("stats", {}).get("chunks", 0) >= 2, (summary, procs.logs())  # the video policy's planned chunks arrived and ran
    assert summary["inference_ms"] is not None
    assert len(commands) >= 20
    assert_in_limits(commands)


@pytest.mark.slow
def test_takeover_over_dds_is_recorded_as_human_steps(procs, listener, tmp_path):
    from diffusion_rl.data import ExecutedBy, LeRobotDatasetReader
    from robot.teleop import ScriptedTeleop

    transport, commands = listener
    procs.start("sim", "sim-robot", "--task", "drawer", "--seed", "0", "--backend", "dds")
    deploy = procs.start(
        "deploy", "deploy", "--policy", "scripted:zero", "--backend", "dds", "--duration", "6", "--record", str(tmp_path / "rec"),
    )
    # Wait until the node commands the arm, then take over for 1.5 s with the EE moving up (Joy), and hand back.
    deadline = time.monotonic() + 60
    while len(commands) < 5:
        assert time.monotonic() < deadline and deploy.poll() is None, procs.logs()
        time.sleep(0.05)
    teleop = ScriptedTeleop(transport, ROBOT, [(0.5, 2.0)], motion="lift").start()
    try:
        while not teleop.done:
            time.sleep(0.05)
    finally:
        teleop.close()
    handed_back, deadline = len(commands), time.monotonic() + 10
    while len(commands) < handed_back + 3:  # a few policy ticks after the hand-back (a loaded machine may lag them)
        assert time.monotonic() < deadline and deploy.poll() is None, procs.logs()
        time.sleep(0.05)
    # An e-stop from a plain (volatile, reliable) publisher, as `ros2 topic pub` sends it, latches a hold.
    estop = transport.publisher(ROBOT.topics.estop, msg.Bool)
    for _ in range(3):
        estop.publish(msg.Bool(data=True))
        time.sleep(0.1)
    assert procs.wait(deploy, 60) == 0, procs.logs()
    summary = procs.records("deploy")[-1]
    assert summary["safety"]["estopped"] is True and summary["safety"]["counters"]["estop_engaged"] == 1
    # The e-stop ends the episode at once, as a failure (robot.session.RobotSession), before its 6 s were up.
    (episode,) = [r for r in procs.records("deploy") if r["event"] == "episode"]
    assert episode["estopped"] is True and episode["success"] is False and episode["seconds"] < 6, episode
    assert summary["stats"]["handbacks"] == 1
    assert [e for _, e in teleop.events] == [True, False]
    ep = LeRobotDatasetReader(tmp_path / "rec" / "dataset")[0]
    who = ep.executed_by
    human = np.flatnonzero(who == ExecutedBy.HUMAN)
    assert human.size, "no human steps recorded"
    # One contiguous takeover, policy steps before and after, about 1.5 s at 20 Hz.
    assert human[-1] - human[0] + 1 == human.size
    assert human[0] > 0 and human[-1] < len(who) - 1
    assert abs(human.size - 30) <= 6, human.size
    # The human lifted the hand: the EE z rose during the takeover.
    z = ep.observations["observation.state"][:, 2]
    assert z[human[-1]] - z[human[0]] > 0.03


def _rclpy_importable() -> bool:
    try:
        import rclpy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _rclpy_importable(), reason="rclpy not installed (no ROS 2 here): pip install 'kinema[rclpy]'")
@pytest.mark.parametrize(
    ("robot_backend", "policy_backend"), [("rclpy", "dds"), ("dds", "rclpy")], ids=["robot_rclpy-policy_dds", "robot_dds-policy_rclpy"],
)
def test_a_real_ros2_node_and_the_dds_backend_complete_an_episode_together(procs, listener, robot_backend, policy_backend):
    """The deployment path across the interop boundary, both pairings: one side is a real ROS 2 node (rclpy on its
    default rmw, Fast DDS), the other kinema's DDS backend (CycloneDDS). robot_rclpy-policy_dds: the robot
    (`sim-robot --backend rclpy`) is the ROS 2 node, as a robot's drivers are; robot_dds-policy_rclpy: the policy node
    (`deploy --backend rclpy`) is, as where ROS 2 is installed. Joint states, camera images, the instruction, success,
    and commands all cross between CycloneDDS and Fast DDS; the listener (this process, DDS) hears the commands."""
    _, commands = listener
    sim = procs.start("sim", "sim-robot", "--task", "drawer", "--seed", "0", "--backend", robot_backend)
    deploy = procs.start(
        "deploy", "deploy", "--policy", "scripted:replay:task=drawer:seed=0", "--backend", policy_backend,
        "--episodes", "1", "--duration", "15",
    )
    assert procs.wait(deploy, 120) == 0, procs.logs()
    os.kill(sim.pid, signal.SIGTERM)
    assert procs.wait(sim, 30) == 0, procs.logs()
    stopped = procs.records("sim")[-1]
    episodes = [r for r in procs.records("deploy") if r["event"] == "episode"]
    assert [e["success"] for e in episodes] == [True], (procs.records("deploy"), stopped, procs.logs())
    # The replay opens the drawer in about 1 s, some 20 commands at 20 Hz: at least half of those crossed.
    assert stopped["event"] == "stopped" and stopped["counters"]["commands"] >= 10, stopped
    # The instruction crossed too (the sim robot publishes its task's; deploy was given none).
    assert episodes[0]["instruction"] == "pull the top drawer open", episodes
    summary = procs.records("deploy")[-1]
    assert summary["safety"]["fault"] is False and summary["stats"]["commands_published"] >= 10
    assert len(commands) >= 10  # the commands crossed to this process (DDS) too, whichever backend sent them
    assert_in_limits(commands)


@pytest.mark.skipif(not _rclpy_importable(), reason="rclpy not installed (no ROS 2 here): pip install 'kinema[rclpy]'")
def test_a_plain_rclpy_arm_is_driven_by_deploy_on_dds_within_the_safety_limits(procs):
    """`kinema deploy --backend dds` drives a robot that is a plain rclpy node, as a ros2_control arm exposes itself
    (tests/ros2_control_stand_in.py: /joint_states at 100 Hz and two cameras at 30 Hz, the rates sim_panda.yaml's 90 ms
    timeouts are set for; it follows the forward position controller's commands at up to 2.5 rad/s).

    The policy replays the drawer expert's joint targets (open loop: the stand-in has no drawer). The arm starts with
    joint1 0.8 rad away from where the replay begins, so that the step bound must ramp it there. The stand-in sends
    3 s of invalid joint states (a joint missing, NaN) once every endpoint has matched, then valid ones: deploy must
    command nothing until the first valid one. 3 s: a Cyclone reader that matches a Fast DDS writer may deliver
    only from the writer's next periodic heartbeat (every 3 s; see tests/test_robot_transport.py), and deploy has
    to hear some invalid states for their refusal to be checked."""
    from kinema.robot_policies import expert_joint_targets

    stand_in = ROOT / "tests" / "ros2_control_stand_in.py"
    initial = np.r_[ROBOT.home, ROBOT.gripper.open, ROBOT.gripper.open]
    initial[0] += 0.8
    config = {
        "joint_names": ROBOT.command_joint_names, "initial": initial.tolist(),
        "joint_states_topic": ROBOT.topics.joint_states, "commands_topic": ROBOT.controller.commands_topic,
        "cameras": [{"topic": c.topic, "width": c.width, "height": c.height} for c in ROBOT.cameras],
        "state_hz": 100.0, "camera_hz": 30.0, "max_velocity": 2.5, "invalid_s": 3.0, "max_s": 150.0,
    }
    arm = procs.start_script("arm", stand_in, json.dumps(config))
    deploy = procs.start(
        "deploy", "deploy", "--policy", "scripted:replay:task=drawer:seed=0", "--backend", "dds",
        "--instruction", "pull the top drawer open", "--episodes", "1", "--duration", "4", "--wait-robot", "60",
    )
    assert procs.wait(deploy, 120) == 0, procs.logs()
    time.sleep(0.5)  # the arm settles on the last command (it was within reach long before deploy ended)
    arm.stdin.write("stop\n")
    arm.stdin.flush()
    assert procs.wait(arm, 30) == 0, procs.logs()
    report = procs.records("arm")[-1]
    summary = procs.records("deploy")[-1]
    assert report["matched"], report  # Fast DDS (the arm) and CycloneDDS (deploy) found each other, every topic

    # Commands arrived, every one of them, and none before the first valid state.
    times = np.array([t for t, _ in report["commands"]])
    commands = [np.array(c) for _, c in report["commands"]]
    published = summary["stats"]["commands_published"]
    assert published >= 40 and len(commands) == published, (len(commands), summary)
    assert report["invalid_states"] >= 100 and report["first_valid_t"] is not None, report
    assert times.min() > report["first_valid_t"], (times.min(), report["first_valid_t"])
    # deploy heard the invalid states and refused them (the arm did not wait on an unmatched reader)
    refused = {k: v for k, v in summary["rejected"].items() if k.startswith("joint_state_")}
    assert refused.get("joint_state_missing_joints", 0) > 0 and refused.get("joint_state_nonfinite", 0) > 0, summary

    # Safety: 9 finite values within the joint limits; no step beyond max_step, from the measured state to the first
    # command and between commands; the step bound was what brought joint1 over (it was reached, not exceeded).
    assert report["rejected_commands"] == 0
    assert_in_limits(commands)
    c = np.stack(commands)
    steps = np.abs(np.diff(np.vstack([initial, c]), axis=0))
    assert (steps <= ROBOT.max_step + 1e-9).all(), steps.max(axis=0)
    assert steps[:, 0].max() == pytest.approx(ROBOT.max_step[0]), steps[:, 0]
    assert summary["safety"]["fault"] is False and summary["safety"]["counters"].get("clipped", 0) >= 2, summary

    # Tracking: the arm followed the commands: joint1 came over to the replay, joint2 rose to the replay's peak and
    # came back down, and the arm ended where the replay ends (its last target, gripper open).
    targets, _, _ = expert_joint_targets("drawer", 0)
    final = np.array(report["final"])
    trace = np.array([q for _, q in report["trace"]])
    np.testing.assert_allclose(c[-1], final, atol=1e-6)
    np.testing.assert_allclose(final[:7], targets[-1, :7], atol=1e-6)
    np.testing.assert_allclose(final[7:], ROBOT.gripper.open, atol=1e-6)
    assert abs(final[0] - initial[0]) > 0.75
    assert trace[:, 1].max() > targets[:, 1].max() - 0.05, (trace[:, 1].max(), targets[:, 1].max())
    # And it was at its setpoint most of the time: the median distance to the latest command, over the states since
    # the first command, is small (the ramp of joint1 and the replay's motion take about 1.5 s of the 4).
    state_times = np.array([t for t, _ in report["trace"]])
    latest = np.searchsorted(times, state_times, side="right") - 1
    error = np.abs(trace[latest >= 0] - c[latest[latest >= 0]]).max(axis=1)
    assert np.median(error) < 0.02, np.percentile(error, [50, 90, 100])
