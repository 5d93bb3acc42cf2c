"""The `kinema video ...` commands: `kinema video train [--config NAME] [--key.sub value ...] [--resume RUN_DIR]`."""

from __future__ import annotations

import argparse


def add_video_commands(sub: argparse._SubParsersAction) -> None:
    """Register `kinema video` and its subcommands on the top-level parser's subparsers."""
    from kinema.video.config import config_keys_help

    video = sub.add_parser("video", help="post-train video generators: VideoAWR, NFT, distillation, AFD, OPSD, Flow-GRPO")
    video_sub = video.add_subparsers(dest="video_command", metavar="COMMAND", required=True)
    train = video_sub.add_parser(
        "train",
        help="pre-train a tiny video flow model on sim videos, then post-train it toward rewards",
        description="With no arguments: collect sim rollout videos, fit the task-success reward on them, pre-train "
        "a tiny video flow model, then post-train it with VideoAWR toward task success (about 10 minutes on 2 CPU "
        "cores). Any config key can be overridden as --key.sub value (e.g. --train.method nft --train.rounds 4).",
        epilog=config_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", default=None, help="YAML config: a path, or a shipped name (video_awr, ...); default: the embedded config")
    train.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")


def run_video_command(args: argparse.Namespace, extra: list[str]) -> int:
    """Run a `kinema video` subcommand; `extra` holds the dotted config overrides."""
    from kinema.common import load_run_config
    from kinema.video.config import VideoTrainConfig
    from kinema.video.workflow import train_video

    if args.video_command != "train":
        raise ValueError(f"unknown video command {args.video_command!r}; valid: train")
    train_video(load_run_config(args.config, extra, args.resume, config_class=VideoTrainConfig), resume=bool(args.resume))
    return 0

