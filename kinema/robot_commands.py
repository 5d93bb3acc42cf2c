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
import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

DEFAULT_ROBOT = "sim_panda"
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
    deploy.add_argument(
        "--inference", default="auto", metavar="auto|sync|async",
        help="sync: a tick with no action left computes the chunk and runs it from index 0, as kinema eval acts (the "
        "tick waits for the policy); async: the next chunk is computed while the current one runs, and runs from its "
        "index 1 (on drawer async cost 12 points of success in simulation: benchmarks/RESULTS.md); auto: sync while "
        "the measured inference takes at most half a control tick, else async",
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

    contract = sub.add_parser(
        "robot-contract",
        help="print a robot config as a Rosetta contract (topics <-> LeRobot features; kinema's own keys under x-kinema)",
        description="Write a kinema robot YAML as a Rosetta contract that both Rosetta and `kinema deploy --robot` read.",
        formatter_class=DefaultsHelpFormatter,
    )
    contract.add_argument("robot", nargs="?", default=DEFAULT_ROBOT, help="robot config YAML (or contract), or a shipped name")

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
    simr.add_argument(
        "--person", action="store_true",
        help="a simulated person beside the robot: it reads the scene's privileged state (published on the robot "
        "config's topics.privileged) and takes over on the takeover and teleop topics before the policy fails, as "
        "`kinema train --rl.interventions true`'s simulated human does in simulation (robot/sim_person.py)",
    )


def robot_contract(args: argparse.Namespace) -> int:
    import yaml

    from robot.config import load_robot_config
    from robot.contract import contract_from_robot_config

    robot = load_robot_config(args.robot)
    sys.stdout.write(f"# {robot.name} as a Rosetta contract (topics <-> LeRobot features), written by `kinema robot-contract`.\n"
                     "# Rosetta reads the contract and ignores x-kinema; `kinema deploy --robot THIS_FILE` reads both.\n")
    sys.stdout.write(yaml.safe_dump(contract_from_robot_config(robot), sort_keys=False))
    return 0


def run_robot_command(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    commands = {"deploy": deploy, "sim-robot": sim_robot, "robot-contract": robot_contract}
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


def sim_robot(args: argparse.Namespace) -> int:
    from robot.config import load_robot_config
    from robot.sim_robot import SimRobotNode
    from sim.tasks import task_class

    if args.rate <= 0 or args.camera_rate <= 0 or args.seed < 0:
        raise ValueError(f"--rate and --camera-rate must be > 0 and --seed >= 0; got {args.rate}, {args.camera_rate}, {args.seed}")
    task_class(args.task)  # an unknown task lists the valid ones
    robot = load_robot_config(args.robot)
    person = None
    with contextlib.ExitStack() as stack:
        transport = stack.enter_context(_transport(args, "kinema_sim_robot"))
        privileged_hz = robot.rates.control_hz if args.person else 0.0  # the person looks once a control step
        node = SimRobotNode(transport, robot, args.task, seed=args.seed, state_hz=args.rate, camera_hz=args.camera_rate,
                            privileged_hz=privileged_hz)  # fmt: skip
        if args.person:
            from robot.sim_person import SimulatedPerson

            # A node of its own: it sees the scene only through the privileged topic, and acts only through topics.
            person = SimulatedPerson(stack.enter_context(_transport(args, "kinema_sim_person")), robot)
        node.start()
        _emit({"event": "ready", "task": args.task, "seed": node.seed, "instruction": node.instruction, "person": args.person})
        start = time.monotonic()
        try:
            while args.duration <= 0 or time.monotonic() - start < args.duration:
                time.sleep(0.1)
        except KeyboardInterrupt:
            pass
        finally:
            node.close()
            if person is not None:
                person.close()
        stopped = {"event": "stopped", "seconds": round(time.monotonic() - start, 2), "counters": node.counters.snapshot()}
        if person is not None:
            stopped["person"] = person.counters.snapshot()
        _emit(stopped)
    return 0


def deploy(args: argparse.Namespace) -> int:
    from kinema.robot_policies import load_policy
    from robot.config import load_robot_config
    from robot.session import RobotSession

    if args.episodes < 1 or args.duration <= 0 or args.wait_robot < 0:
        raise ValueError(
            f"--episodes must be >= 1, --duration > 0 and --wait-robot >= 0; got {args.episodes}, {args.duration}, {args.wait_robot}"
        )
    if args.record and Path(args.record).exists() and not Path(args.record).is_dir():
        raise ValueError(f"--record {args.record} is a file; recordings go to a folder (LeRobotDataset v3 + MCAP)")
    if args.keys and not args.record:
        raise ValueError("--keys marks recorded episodes: it needs --record DIR")
    from robot.policy_node import check_inference

    check_inference(args.inference, "--inference")  # before the checkpoint loads
    robot = load_robot_config(args.robot)
    policy = load_policy(args.policy, control_hz=robot.rates.control_hz, noise_scale=args.noise_scale, inference=args.inference)
    if description := getattr(policy, "description", ""):
        print(f"acting: {description}", file=sys.stderr, flush=True)
    results: list[dict[str, Any]] = []
    with _transport(args, "kinema_policy") as transport:
        session = RobotSession(transport, robot, policy, instruction=args.instruction, record=args.record, marks_by_person=args.keys,
                               inference=args.inference)  # fmt: skip
        if args.keys:
            from robot.recorder import KeyControl

            KeyControl(session.recorder, on_quit=session.quit.set).start()
            print("keys: space start/stop recording, s success, f failure, a abort, q quit", file=sys.stderr)
        interrupted = False
        try:
            session.wait_ready(args.wait_robot)
            for episode in range(args.episodes):
                if session.quit.is_set():
                    break
                result = session.run_episode(duration=args.duration, reset=episode > 0, index=episode)
                results.append(result)
                _emit(result)
                if result["estopped"]:
                    print("e-stop latched: no further episode starts (release the robot's e-stop, then start deploy again)",
                          file=sys.stderr, flush=True)  # fmt: skip
                    break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            session.close()
        summary = {
            "event": "summary", "episodes": len(results), "successes": sum(bool(r["success"]) for r in results),
            "interrupted": interrupted, "quit": session.quit.is_set(), **session.node.status(),
        }
        if session.recorder is not None:
            summary["recorded"] = str(session.recorder.dataset_dir)
        _emit(summary)
    return 130 if interrupted else 0
