"""The `kinema video ...` commands:

    kinema video train [--config NAME] [--key.sub value ...] [--resume RUN_DIR]
    kinema video export RUN_DIR [--round N] [--fuse] [--out DIR]
    kinema video sample RUN_DIR_or_FOLDER --prompt "..." [--seed S] [--steps N] [--guidance G] --out FILE.mp4
"""

from __future__ import annotations

import argparse

VIDEO_COMMANDS = ("train", "export", "sample")


def add_video_commands(sub: argparse._SubParsersAction) -> None:
    """Register `kinema video` and its subcommands on the top-level parser's subparsers."""
    from kinema.common import DefaultsHelpFormatter
    from kinema.video.config import config_keys_help
    from kinema.video.methods import VIDEO_METHODS

    video = sub.add_parser("video", help="post-train video generators: VideoAWR, NFT, distillation, AFD, OPSD, Flow-GRPO")
    video_sub = video.add_subparsers(dest="video_command", metavar="COMMAND", required=True)
    train = video_sub.add_parser(
        "train",
        help="pre-train a tiny video flow model on sim videos, then post-train it toward rewards",
        description="With no arguments: collect sim rollout videos, fit the task-success reward on them (and a held-out "
        "judge of success on other episodes), pre-train a tiny video flow model, then post-train it with VideoAWR "
        "toward task success (about 10 minutes on 2 CPU cores). The post-trained generator ends up in RUN_DIR/final, "
        "a diffusers folder (see `kinema video export --help`). Any config key can be overridden as --key.sub value "
        "(e.g. --train.method nft --train.rounds 4).",
        epilog="Post-training methods (--train.method):\n"
        + "".join(f"  {name}: {cls.summary}\n" for name, cls in VIDEO_METHODS.items()) + "\n" + config_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", default=None, help="YAML config: a path, or a shipped name (video_awr, ...); default: the embedded config")
    train.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue an interrupted run from its last checkpoint")

    export = video_sub.add_parser(
        "export",
        help="write a run's post-trained generator as a diffusers folder (RUN_DIR/final)",
        description="Write the generator of a `kinema video train` run as a diffusers WanPipeline folder, atomically: "
        "the pre-trained weights plus the post-trained LoRA in adapters/default (diffusers' LoRA format, what "
        "`pipe.load_lora_weights(DIR/adapters/default)` reads), or fused into the weights with --fuse. Stock diffusers "
        "loads it without kinema: `WanPipeline.from_pretrained(DIR, trust_remote_code=True)` (the flag runs the code "
        "of kinema's own tiny components, saved in the folder); DIR/README.md has the snippet and the sampling "
        "arguments. `kinema video train` writes RUN_DIR/final at the end of every run.",
        formatter_class=DefaultsHelpFormatter,
    )
    export.add_argument("run_dir", metavar="RUN_DIR", help="a `kinema video train` run folder")
    export.add_argument("--round", type=int, default=None,
                        help="the checkpointed round to export (0: the pre-trained model); default: the latest checkpoint")
    export.add_argument("--fuse", action="store_true", help="merge the LoRA into the transformer weights (no adapters/ folder)")
    export.add_argument("--out", default=None,
                        help="destination folder; default RUN_DIR/final for the latest checkpoint, RUN_DIR/exports/round-NNN[-fused] otherwise")

    sample = video_sub.add_parser(
        "sample",
        help="sample videos from an exported generator (RUN_DIR/final or any saved folder) to an MP4 and a PNG grid",
        description="Sample through diffusers' WanPipeline from a generator folder, with the sampling arguments of the "
        "run that exported it (kinema_export.json) unless given. Writes FILE.mp4 (the samples side by side) and "
        "FILE.png (one row of frames per sample).",
        formatter_class=DefaultsHelpFormatter,
    )
    sample.add_argument("source", metavar="RUN_DIR_or_FOLDER", help="a run folder (its final/ is used) or a generator folder")
    sample.add_argument("--prompt", required=True, help="the text prompt")
    sample.add_argument("--out", required=True, help="output .mp4 file (the PNG grid goes beside it)")
    sample.add_argument("--seed", type=int, default=0, help="noise seed (the batch's noise is drawn from one generator seeded with it)")
    sample.add_argument("--steps", type=int, default=None, help="sampling steps (default: the run's model.num_inference_steps)")
    sample.add_argument("--guidance", type=float, default=None, help="CFG scale, 1 = CFG-free (default: the run's model.guidance_scale)")
    sample.add_argument("--samples", type=int, default=1, help="videos to sample")
    sample.add_argument("--device", default="cpu", help="torch device")
    sample.add_argument("--threads", type=int, default=1, help="torch CPU threads (one is fastest for the tiny models on a shared CPU)")


def run_video_command(args: argparse.Namespace, extra: list[str]) -> int:
    """Run a `kinema video` subcommand; `extra` holds the dotted config overrides (train only)."""
    if args.video_command not in VIDEO_COMMANDS:
        raise ValueError(f"unknown video command {args.video_command!r}; valid: {', '.join(VIDEO_COMMANDS)}")
    if args.video_command != "train" and extra:
        raise ValueError(f"unrecognized arguments for `kinema video {args.video_command}`: {' '.join(extra)}")
    if args.video_command == "export":
        from kinema.video.export import export_run

        out = export_run(args.run_dir, round=args.round, fuse=args.fuse, out=args.out)
        print(f"exported {out} (load: see {out / 'README.md'})")
        return 0
    if args.video_command == "sample":
        import torch

        from kinema.video.export import sample_folder

        torch.set_num_threads(max(1, args.threads))
        mp4, png, _ = sample_folder(args.source, args.prompt, args.out, seed=args.seed, steps=args.steps,
                                    guidance=args.guidance, samples=args.samples, device=args.device)
        print(f"wrote {mp4} and {png}")
        return 0
    from kinema.common import load_run_config
    from kinema.video.config import VideoTrainConfig
    from kinema.video.workflow import train_video

    train_video(load_run_config(args.config, extra, args.resume, config_class=VideoTrainConfig), resume=bool(args.resume))
    return 0
