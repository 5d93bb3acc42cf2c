"""`kinema`: the command line. Each command is a thin shell over a workflow in `kinema/` or a package function."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_sim_commands(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("sim", help="MuJoCo tasks: list them, collect demonstrations, render rollouts")
    sim_sub = sim.add_subparsers(dest="sim_command", metavar="COMMAND", required=True)

    sim_sub.add_parser("list", help="tasks, with their instruction templates")

    collect = sim_sub.add_parser("collect", help="scripted-expert episodes to a LeRobotDataset v3 folder")
    collect.add_argument("--task", required=True, help="task name (see `kinema sim list`)")
    collect.add_argument("--episodes", type=int, required=True, help="number of episodes")
    collect.add_argument("--out", required=True, help="dataset folder (new, or an existing kinema dataset to extend)")
    collect.add_argument("--expert-noise", type=float, default=0.0, help="std of Gaussian action noise (0 = clean)")
    collect.add_argument("--hesitation", type=float, default=0.0, help="per-step probability of a pause")
    collect.add_argument("--wrong-grasp", type=float, default=0.0, help="per-episode probability of a mis-aimed grasp")
    collect.add_argument(
        "--interventions",
        action="store_true",
        help="an imperfect autopilot acts, and a simulated human takes over before it fails",
    )
    collect.add_argument("--seed", type=int, default=0, help="seed of the first episode (then +1 per episode)")
    collect.add_argument("--image-size", type=int, default=96, help="camera height and width in pixels")
    collect.add_argument("--instructions", choices=("train", "heldout"), default="train")
    collect.add_argument("--objects", choices=("train", "heldout"), default="train")
    collect.add_argument("--num-envs", type=int, default=4, help="envs stepped together")
    collect.add_argument("--workers", type=int, default=0, help="worker processes (0 = in this process)")
    collect.add_argument("--video", default=None, help="also write a preview MP4 of the first episodes here")

    render = sim_sub.add_parser("render", help="a scripted rollout as an MP4 video")
    render.add_argument("--task", required=True, help="task name (see `kinema sim list`)")
    render.add_argument("--out", required=True, help="output .mp4 file")
    render.add_argument("--episodes", type=int, default=1, help="episodes, one after another")
    render.add_argument("--seed", type=int, default=0)
    render.add_argument("--expert-noise", type=float, default=0.0)
    render.add_argument("--interventions", action="store_true", help="show simulated-human takeovers (red border)")
    render.add_argument("--cameras", action="store_true", help="add the policy's agentview and wrist cameras")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kinema",
        description="Post-train robot policies and video generators with reinforcement learning.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_sim_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sim":
            from kinema import sim_commands

            return {"list": sim_commands.list_tasks, "collect": sim_commands.collect, "render": sim_commands.render}[
                args.sim_command
            ](args)
    except (ValueError, FileExistsError, FileNotFoundError) as err:
        print(f"kinema: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
