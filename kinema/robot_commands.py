"""`kinema deploy` and `kinema sim-robot`: a policy on a ROS 2 arm, and a MuJoCo task exposed as one.

    kinema sim-robot --task drawer --seed 0                                   # terminal 1: the robot
    kinema deploy --policy runs/drawer/checkpoints/final --episodes 3 --record runs/deploy   # terminal 2

Both talk over ROS 2 topics (the robot config names them). With `--local` (the default) nothing leaves this machine,
with either backend (`dds`, the default where ROS 2 is not installed, or `rclpy`): see robot/transport/loopback.py. Ctrl-C (or SIGTERM) stops cleanly:
the policy node stops commanding, the recorder commits what it has, the transport closes.

`deploy` starts once the robot publishes valid joint states and its controller subscribes to the command topic
(within `--wait-robot` seconds, else it says which is missing). Episodes: the first runs from the robot's current
state; before each later one, "reset" goes out on the episode topic (the sim robot resets its scene to the next seed;
on a real arm, an operator or a reset routine does). An episode ends when the success topic says so, or after
`--duration` seconds (a failure if the success topic said False, unlabelled if it said nothing). With `--record DIR`,
each one is written to DIR/dataset (LeRobotDataset v3) and DIR/mcap (ros2 MCAP) with its takeover segments.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_ROBOT = "sim_panda"
COMMAND_MATCH_SETTLE_S = 0.25
LOCAL_HELP = (
    "keep all ROS 2 traffic on this machine (default), with either backend: CycloneDDS on the loopback config, "
    "ROS_LOCALHOST_ONLY=1 and ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST for rclpy; --no-local uses the environment's "
    "DDS settings (CYCLONEDDS_URI, ROS_*), for a robot on the network"
)


def add_robot_commands(sub: argparse._SubParsersAction) -> None:
    from kinema.common import DefaultsHelpFormatter
    from robot.transport import BACKENDS

    deploy = sub.add_parser(
        "deploy",
        help="run a policy on a ROS 2 arm (or `kinema sim-robot`) behind the safety layer, with human takeover",
        description="Run a policy as a ROS 2 node: /joint_states and cameras in, joint position commands out, "
        "through the safety layer. A human can take over on the takeover topic at any moment.",
        formatter_class=DefaultsHelpFormatter,
    )
    deploy.add_argument(
        "--policy", required=True,
        help="a VLA checkpoint folder, or scripted:zero | scripted:nan | scripted:replay:task=T:seed=N",
    )
    deploy.add_argument(
        "--noise-scale", type=float, default=None, metavar="S",
        help="a VLA's initial flow noise times S (1: sampled; 0: zero noise, deterministic and mode-seeking); "
        "default: the checkpoint's inference_noise_scale, the eval.noise_scale its training run evaluated with",
    )
    deploy.add_argument("--robot", default=DEFAULT_ROBOT, help="robot config YAML, or a shipped name")
    deploy.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: rclpy where ROS 2 is installed, else dds")
    deploy.add_argument("--local", action=argparse.BooleanOptionalAction, default=True, help=LOCAL_HELP)
    deploy.add_argument("--instruction", default="", help="the task in words; a message on the instruction topic replaces it")
    deploy.add_argument("--record", default=None, metavar="DIR", help="record episodes to DIR (LeRobotDataset v3 + MCAP)")
    deploy.add_argument(
        "--keys", action="store_true",
        help="with --record: a person marks the recorded episodes from the keyboard (space start/stop, s success, "
        "f failure, a abort, q quit deploy) instead of deploy marking each one",
    )
    deploy.add_argument("--episodes", type=int, default=1, help="episodes to run")
    deploy.add_argument("--duration", type=float, default=60.0, help="seconds per episode at most")
    deploy.add_argument(
        "--wait-robot", type=float, default=20.0,
        help="seconds to wait for the first /joint_states, and then as long for the controller to subscribe to the "
        "commands",
    )

    simr = sub.add_parser(
        "sim-robot",
        help="a MuJoCo task as a ROS 2 robot: /joint_states, cameras, position/trajectory commands, success",
        description="Expose a sim task as a ros2_control-like robot, stepping physics in real time.",
        formatter_class=DefaultsHelpFormatter,
    )
    simr.add_argument("--task", required=True, help="task name (see `kinema sim list`)")
    simr.add_argument("--robot", default=DEFAULT_ROBOT, help="robot config YAML, or a shipped name")
    simr.add_argument("--seed", type=int, default=0, help="seed of the first episode; each 'reset' takes the next")
    simr.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: rclpy where ROS 2 is installed, else dds")
    simr.add_argument("--local", action=argparse.BooleanOptionalAction, default=True, help=LOCAL_HELP)
    simr.add_argument("--rate", type=float, default=100.0, help="/joint_states rate in Hz")
    simr.add_argument("--camera-rate", type=float, default=30.0, help="camera rate in Hz")
    simr.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: until Ctrl-C)")


def run_robot_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    commands = {"deploy": deploy, "sim-robot": sim_robot}
    if args.command not in commands:
        raise ValueError(f"not a robot command: {args.command!r}")
    # SIGTERM (a supervisor, a test's terminate()) stops as cleanly as Ctrl-C; the caller's handler comes back after.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return commands[args.command](args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _transport(args: argparse.Namespace, node_name: str):
    from robot.transport import make_transport

    # --local pins every backend (rclpy included) to loopback before its first participant: see make_transport.
    return make_transport(args.backend, node_name=node_name, local=args.local)


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def _sleep_until(predicate, timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def sim_robot(args: argparse.Namespace) -> int:
    from robot.config import load_robot_config
    from robot.sim_robot import SimRobotNode
    from sim.tasks import task_class

    if args.rate <= 0 or args.camera_rate <= 0 or args.seed < 0:
        raise ValueError(f"--rate and --camera-rate must be > 0 and --seed >= 0; got {args.rate}, {args.camera_rate}, {args.seed}")
    task_class(args.task)  # an unknown task lists the valid ones
    robot = load_robot_config(args.robot)
    with _transport(args, "kinema_sim_robot") as transport:
        node = SimRobotNode(transport, robot, args.task, seed=args.seed, state_hz=args.rate, camera_hz=args.camera_rate)
        node.start()
        _emit({"event": "ready", "task": args.task, "seed": node.seed, "instruction": node.instruction})
        start = time.monotonic()
        try:
            while args.duration <= 0 or time.monotonic() - start < args.duration:
                time.sleep(0.1)
        except KeyboardInterrupt:
            pass
        finally:
            node.close()
        _emit({"event": "stopped", "seconds": round(time.monotonic() - start, 2), "counters": node.counters.snapshot()})
    return 0


def _recorder(transport, robot, mapper, out_dir: str, instruction: str):
    from robot.recorder import EpisodeRecorder, RecorderConfig

    # The robot's own view (per-camera sizes; a step per streamed command, so no aliasing against the control loop).
    # The recorded state and action are the policy's (EE pose; EE delta), so recordings train like sim data.
    config = RecorderConfig.from_robot(
        robot, instruction=instruction, state_names=list(mapper.STATE_NAMES), action_names=list(mapper.ACTION_NAMES)
    )
    return EpisodeRecorder(transport, config, out_dir, state_fn=mapper.state, action_fn=mapper.to_action)


def deploy(args: argparse.Namespace) -> int:
    from kinema.robot_policies import load_policy
    from robot import messages as msg
    from robot.config import load_robot_config
    from robot.policy_node import PolicyNode

    if args.episodes < 1 or args.duration <= 0 or args.wait_robot < 0:
        raise ValueError(
            f"--episodes must be >= 1, --duration > 0 and --wait-robot >= 0; got {args.episodes}, {args.duration}, {args.wait_robot}"
        )
    if args.record and Path(args.record).exists() and not Path(args.record).is_dir():
        raise ValueError(f"--record {args.record} is a file; recordings go to a folder (LeRobotDataset v3 + MCAP)")
    if args.keys and not args.record:
        raise ValueError("--keys marks recorded episodes: it needs --record DIR")
    robot = load_robot_config(args.robot)
    policy = load_policy(args.policy, control_hz=robot.rates.control_hz, noise_scale=args.noise_scale)
    if description := getattr(policy, "description", ""):
        print(f"acting: {description}", file=sys.stderr, flush=True)
    results: list[dict[str, Any]] = []
    with _transport(args, "kinema_policy") as transport:
        node = PolicyNode(transport, robot, policy, instruction=args.instruction)
        recorder = _recorder(transport, robot, node.mapper, args.record, args.instruction) if args.record else None
        episode_pub = transport.publisher(robot.topics.episode, msg.String)
        quit_requested = threading.Event()
        if args.keys:
            from robot.recorder import KeyControl

            KeyControl(recorder, on_quit=quit_requested.set).start()
            print("keys: space start/stop recording, s success, f failure, a abort, q quit", file=sys.stderr)
        marks = recorder if recorder is not None and not args.keys else None  # who marks episodes: deploy or a person
        interrupted = False
        try:
            if not _sleep_until(lambda: node.safety.has_state, args.wait_robot):
                raise ValueError(
                    f"no valid {robot.topics.joint_states} within {args.wait_robot} s (joints {robot.command_joint_names}): "
                    "is the robot (e.g. `kinema sim-robot`) running on the same backend and ROS_DOMAIN_ID?"
                )
            own = 0 if recorder is None else 1  # the recorder listens to the commands too; it is not the controller
            if not _sleep_until(lambda: node.command_subscriptions() > own, args.wait_robot):
                raise ValueError(
                    f"nothing subscribes to {node.command_topic} within {args.wait_robot} s: is the robot's "
                    f"{robot.controller.type} controller loaded and configured?"
                )
            if not args.instruction:  # the robot side may name the task (the sim robot does, once a second)
                _sleep_until(lambda: bool(node.instruction), 2.0)
            # Each side matches the other on its own: the robot's reader may match this writer a little later, and
            # drops what was sent before it did (benchmarks/RESULTS.md, "The first commands of an rclpy ...").
            time.sleep(COMMAND_MATCH_SETTLE_S)
            node.pause()
            node.start()
            if recorder is not None:
                recorder.start()
            for episode in range(args.episodes):
                if quit_requested.is_set():
                    break
                if episode > 0:
                    episode_pub.publish(msg.String(data="reset"))
                    time.sleep(0.5)  # the robot resets and publishes its new state and instruction
                if recorder is not None and recorder.recording:
                    # The recorder starts an episode on "reset" itself; that one began while the scene was being
                    # reset (its steps pair the old command with the new state), so drop it and start afresh.
                    recorder.mark("abort")
                node.start_episode()
                if marks is not None:
                    marks.mark("start")
                start = time.monotonic()
                _sleep_until(lambda: bool(node.success) or quit_requested.is_set(), args.duration)
                node.pause()
                success = node.success  # None: nobody said (no success topic on this robot)
                if marks is not None:
                    marks.mark("stop" if success is None else ("success" if success else "failure"))
                result = {
                    "event": "episode", "episode": episode, "success": success,
                    "seconds": round(time.monotonic() - start, 2), "instruction": node.instruction,
                    "taken_over": node.was_taken_over,
                }
                results.append(result)
                _emit(result)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            node.close()
            if recorder is not None:
                recorder.close()  # an episode still open is committed as incomplete
        summary = {
            "event": "summary", "episodes": len(results), "successes": sum(bool(r["success"]) for r in results),
            "interrupted": interrupted, "quit": quit_requested.is_set(), **node.status(),
        }
        if recorder is not None:
            summary["recorded"] = str(recorder.dataset_dir)
        _emit(summary)
    return 130 if interrupted else 0

