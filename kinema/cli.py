"""`kinema`: the command line. Each command is a thin shell over a workflow in `kinema/` or a package function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kinema.common import DefaultsHelpFormatter

def _add_sim_commands(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="MuJoCo tasks: list them, collect demonstrations, render rollouts")
    sim_sub = sim.add_subparsers(dest="sim_command", metavar="COMMAND", required=True)

    sim_sub.add_parser("list", help="tasks, with their instruction templates")

    collect = sim_sub.add_parser(
        "collect", help="scripted-expert episodes to a LeRobotDataset v3 folder", formatter_class=DefaultsHelpFormatter
    )
    collect.add_argument("--task", required=True, help="task name (see `kinema sim list`)")
    collect.add_argument("--episodes", type=int, required=True, help="number of episodes")
    collect.add_argument("--out", required=True, help="dataset folder: new, or an existing kinema dataset to extend")
    collect.add_argument("--overwrite", action="store_true", help="replace an existing kinema dataset instead of extending it")
    collect.add_argument("--expert-noise", type=float, default=0.0, help="std of Gaussian action noise (0 = clean)")
    collect.add_argument("--expert-perturb", type=float, default=0.0,
                         help="DART: std of slowly varying noise on the executed command, the clean one recorded (0 = off)")
    collect.add_argument("--hesitation", type=float, default=0.0, help="per-step probability of a pause")
    collect.add_argument("--wrong-grasp", type=float, default=0.0, help="per-episode probability of a mis-aimed grasp")
    collect.add_argument("--demo-source", choices=("scripted", "teleop"), default="scripted",
                         help="who demonstrates: the scripted expert, or a simulated teleoperator (slower, pauses, "
                         "hesitates, detours; as demos.source of kinema train)")
    collect.add_argument(
        "--interventions",
        action="store_true",
        help="an imperfect autopilot acts, and a simulated human takes over before it fails",
    )
    collect.add_argument(
        "--seed", type=int, default=None,
        help="seed of the first episode, then +1 per episode (default: 0, or after the last seed of the dataset extended)",
    )
    collect.add_argument("--image-size", type=int, default=96, help="camera height and width in pixels")
    collect.add_argument("--instructions", choices=("train", "heldout"), default="train",
                         help="instruction templates: the training ones or the held-out paraphrases")
    collect.add_argument("--objects", choices=("train", "heldout"), default="train",
                         help="object colours: the training ones or the held-out combinations")
    collect.add_argument("--num-envs", type=int, default=4, help="envs stepped together")
    collect.add_argument("--workers", type=int, default=0, help="worker processes (0 = in this process)")
    collect.add_argument("--video", default=None, help="also write a preview MP4 of the first episodes here")
    collect.add_argument("--policy", default=None, metavar="CKPT|zero|random",
                         help="act with this policy instead of the scripted expert (tasks without one: external tasks)")
    collect.add_argument("--task-config", default="", help="JSON overrides of the task's config (external tasks: constructor arguments)")

    render = sim_sub.add_parser("render", help="a scripted rollout as an MP4 video", formatter_class=DefaultsHelpFormatter)
    render.add_argument("--task", required=True, help="task name (see `kinema sim list`)")
    render.add_argument("--out", required=True, help="output .mp4 file")
    render.add_argument("--episodes", type=int, default=1, help="episodes, one after another")
    render.add_argument("--seed", type=int, default=0, help="seed of the first episode, then +1 per episode")
    render.add_argument("--expert-noise", type=float, default=0.0, help="std of Gaussian action noise (0 = clean)")
    render.add_argument("--demo-source", choices=("scripted", "teleop"), default="scripted",
                        help="who demonstrates: the scripted expert, or a simulated teleoperator")
    render.add_argument("--interventions", action="store_true", help="show simulated-human takeovers (red border)")
    render.add_argument("--cameras", action="store_true", help="add the policy's agentview and wrist cameras")
    render.add_argument("--policy", default=None, metavar="CKPT|zero|random",
                        help="act with this policy instead of the scripted expert (tasks without one: external tasks)")
    render.add_argument("--task-config", default="", help="JSON overrides of the task's config (external tasks: constructor arguments)")


def _add_train_commands(sub: argparse._SubParsersAction) -> None:
    from kinema.common import config_keys_help
    from kinema.train.config import TrainConfig
    from kinema.train.methods import METHODS

    train = sub.add_parser(
        "train",
        help="demos -> SFT -> online RL of a policy (the VLA, or --policy.type video) in simulation, with evaluation and a report",
        description="Train a policy (the VLA by default; --policy.type video for the video-diffusion policy): scripted demonstrations, SFT, then RL rounds (HABC by default). "
        "Any config key can be overridden as --key.sub value (e.g. --rl.rounds 3 --task stack).",
        epilog="RL methods (--rl.method):\n" + "".join(f"  {name}: {cls.summary}\n" for name, cls in METHODS.items())
        + "\n" + config_keys_help(TrainConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", default=None, help="YAML config: a path, or a shipped name (drawer_habc, ...); default: the embedded config")
    train.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")

    ev = sub.add_parser("eval", help="evaluate a policy checkpoint in simulation and write a report", formatter_class=DefaultsHelpFormatter)
    ev.add_argument("--policy", required=True, help="checkpoint folder (config.json + model.safetensors)")
    ev.add_argument("--task", required=True, help="task name (see `kinema sim list`)")
    ev.add_argument("--episodes", type=int, default=100, help="episodes per split, on held-out seeds")
    ev.add_argument("--seed", type=int, default=0,
                    help="the evaluation episodes of a `kinema train` run of this seed: the same episodes as its "
                    "evaluations (paired with them and with every other run of that seed)")
    ev.add_argument("--splits", default="all",
                    help="comma-separated, of train, heldout_instructions, heldout_objects and ablated_instructions (the "
                    "training templates naming no target: chance); all: every one")
    ev.add_argument("--out", default=None, help="report folder (default: <checkpoint>/eval-<task>)")
    ev.add_argument("--workers", type=int, default=2, help="env worker processes")
    ev.add_argument("--videos", type=int, default=2, help="rollout MP4s written per split")
    ev.add_argument("--task-config", default="", help='JSON overrides of the task\'s difficulty, e.g. \'{"num_distractors": 0}\'')
    ev.add_argument("--threads", type=int, default=1, help="torch threads (one is fastest on a shared CPU)")
    ev.add_argument("--select", type=int, default=None, metavar="N",
                    help="best-of-N by value, as its own column beside the policy alone, with its batch-1 latency: N "
                    "sampled chunks per decision, the one valued most executed; valued by a pa_rl checkpoint's chunk critic "
                    "(its method.pt) or by the policy's own prediction (policy.type video's planning); 1: off; default: "
                    "a video policy's planning_candidates")
    ev.add_argument("--select-margin", type=float, default=0.0, metavar="M",
                    help="with a pa_rl checkpoint's critic: keep the policy's own chunk unless another is valued more "
                    "than M above it (Q is a discounted success probability in [0, 1]; 0: the plain argmax)")
    ev.add_argument("--noise-scale", type=float, default=None, metavar="S",
                    help="the flow sampler's initial noise times S for the policy alone (1: sampled; 0: zero noise, "
                    "deterministic and mode-seeking); compare checkpoints at the same S. Default: the checkpoint's "
                    "inference_noise_scale, the eval.noise_scale of the run that wrote it (1 for other checkpoints)")
    ev.add_argument("--video-predictions", action="store_true",
                    help="video policy: write videos/predictions.mp4, its predicted future frames beside the observed ones")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kinema",
        description="Post-train robot policies and video generators with reinforcement learning.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_sim_commands(sub)
    _add_train_commands(sub)
    from kinema.robot_commands import add_robot_commands

    add_robot_commands(sub)
    from kinema.video.commands import add_video_commands

    add_video_commands(sub)
    from kinema.dataset_commands import add_dataset_commands

    add_dataset_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("train", "video"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if args.command == "train":
            from kinema.train.commands import train_command

            return train_command(args, extra)
        if args.command == "eval":
            from kinema.train.commands import eval_command

            return eval_command(args)
        if args.command == "video":
            from kinema.video.commands import run_video_command

            return run_video_command(args, extra)
        if args.command == "dataset":
            from kinema.dataset_commands import run_dataset_command

            return run_dataset_command(args)
        if args.command in ("deploy", "sim-robot", "robot-contract"):
            from kinema.robot_commands import run_robot_command

            return run_robot_command(args)
        if args.command == "sim":
            from kinema import sim_commands

            return {"list": sim_commands.list_tasks, "collect": sim_commands.collect, "render": sim_commands.render}[
                args.sim_command
            ](args)
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        print(f"kinema: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kinema: interrupted", file=sys.stderr)
        return 130
    finally:
        if "torch.distributed" in sys.modules:  # joined under torchrun by `kinema train` / `kinema video train`
            from kinema.train import distributed

            distributed.leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
