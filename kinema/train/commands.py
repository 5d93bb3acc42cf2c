"""The `kinema train` and `kinema eval` commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from kinema.common import load_run_config
from kinema.train.config import TrainConfig


def train_command(args: argparse.Namespace, overrides: list[str]) -> int:
    from kinema.train.workflow import train

    train(load_run_config(args.config, overrides, args.resume, config_class=TrainConfig), resume=bool(args.resume))
    return 0


def eval_command(args: argparse.Namespace) -> int:
    import torch

    from kinema.train.evaluate import SPLITS, evaluate
    from policies import load_policy
    from sim.tasks import SplitNotApplicable, check_task

    check_task(args.task)
    # Every argument is checked before the first episode, so that a typo cannot cost an evaluation or its old report.
    splits = [split.strip() for split in args.splits.split(",")]
    if bad := [split for split in splits if split not in SPLITS]:
        raise ValueError(f"--splits: unknown split(s) {bad}; valid: {', '.join(SPLITS)} (comma-separated)")
    if args.episodes < 1 or args.workers < 0 or args.videos < 0 or args.select < 0:
        raise ValueError(f"--episodes must be >= 1, --workers, --videos and --select >= 0; got {args.episodes}, {args.workers}, {args.videos}, {args.select}")
    saved = _saved_method(Path(args.policy))
    if args.select and (saved is None or saved["name"] != "pa_rl"):
        raise ValueError(f"--select needs the chunk critic of a pa_rl checkpoint ({Path(args.policy) / 'method.pt'}); "
                         f"{args.policy} has {'no method.pt' if saved is None else 'one of method ' + repr(saved['name'])}")
    out = Path(args.out or Path(args.policy) / f"eval-{args.task}")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; the report needs a folder")
    console = Console(stderr=True)
    # More than one intra-op thread spins against the env workers: an evaluation ran >10x slower on 2 cores.
    torch.set_num_threads(max(1, args.threads))
    try:
        task_config = json.loads(args.task_config) if args.task_config else None
    except json.JSONDecodeError as err:
        raise SystemExit(f"--task-config must be a JSON object, e.g. '{{\"num_distractors\": 0}}'; got {args.task_config!r} ({err})") from None
    if task_config is not None and not isinstance(task_config, dict):
        raise SystemExit(f"--task-config must be a JSON object; got {args.task_config!r}")
    policy = load_policy(args.policy)
    seen = policy.config.extra.get("tasks", [])
    if seen and args.task not in seen:
        console.print(f"[yellow]note: this checkpoint was trained on {seen}, not on {args.task!r}: evaluating anyway")
    out.mkdir(parents=True, exist_ok=True)
    make_runner, acting = _runner(policy, saved, args.select)
    if acting != "policy":
        console.print(f"acting: {acting}")
    latency_ms = None
    if args.select:
        from kinema.train.evaluate import batch1_latency_ms

        latency_ms = batch1_latency_ms(make_runner(), args.task, image_size=policy.config.image_size, task_config=task_config)
        console.print(f"batch-1 latency with {args.select} samples: {latency_ms:.1f} ms")
    results = {}
    for split in splits:
        try:
            res, _ = evaluate(
                policy, args.task, episodes=args.episodes, split=split, num_workers=args.workers,
                image_size=policy.config.image_size, task_config=task_config, runner=make_runner(),
            )  # fmt: skip
        except SplitNotApplicable:
            console.print(f"{split}: not applicable to {args.task}")
            continue
        results[split] = res.as_dict()
        steps = f", {res.steps_to_success:.1f} steps to success" if res.steps_to_success else ""
        console.print(f"{split}: success {res.success:.0%} ± {res.success_se:.0%} over {res.episodes} episodes{steps}")
    (out / "eval.json").write_text(
        json.dumps({"policy": args.policy, "task": args.task, "task_config": task_config, "seen_tasks": seen, "acting": acting,
                    "latency_ms": latency_ms, "results": results}, indent=2)
    )
    lines = [f"# kinema eval: {args.policy} on {args.task}", ""]
    if seen and args.task not in seen:
        lines += [f"Note: the checkpoint was trained on {seen}; {args.task} is unseen.", ""]
    lines += ["| split | success | steps to success |", "|---|---|---|"]
    for split, r in results.items():
        steps = f"{r['steps_to_success']:.1f}" if r["steps_to_success"] else "–"
        lines.append(f"| {split} | {100 * r['success']:.0f} ± {100 * r['success_se']:.0f}% (n={r['episodes']}) | {steps} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if args.videos:
        from kinema.train.config import TrainConfig
        from kinema.train.report import record_video_grid

        cfg = TrainConfig(task=args.task, task_config=task_config or {})
        cfg.eval.videos = args.videos
        cfg.policy.image_size = policy.config.image_size
        record_video_grid(policy, cfg, out / "videos", "eval")
    console.print(f"report: {out / 'report.md'}")
    return 0


def _saved_method(checkpoint: Path) -> dict | None:
    """The method's name and state a `kinema train` checkpoint saved beside its weights (None for other checkpoints)."""
    import torch

    path = checkpoint / "method.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


def _runner(policy, saved: dict | None, select: int):
    """What acts in `kinema eval`, and its description: value-guided selection with a pa_rl critic (--select N),
    the DSRL noise actor of a dsrl checkpoint, or the policy's own chunks."""
    if select:
        from kinema.train.methods.pa_rl import selection_runner

        return (lambda: selection_runner(policy, saved["state"], num_samples=select)), f"value-guided selection among {select} chunks"
    if saved is not None and saved["name"] == "dsrl":
        from kinema.train.methods.dsrl import steered_runner

        return (lambda: steered_runner(policy, saved["state"])), "the VLA steered by the checkpoint's DSRL noise actor"
    return (lambda: None), "policy"
