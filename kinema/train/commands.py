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

    from kinema.train.evaluate import SPLITS, batch1_latency_ms, evaluate
    from policies import load_policy
    from sim.tasks import SplitNotApplicable, check_task

    check_task(args.task)
    # Every argument is checked before the first episode, so that a typo cannot cost an evaluation or its old report.
    splits = [split.strip() for split in args.splits.split(",")]
    if bad := [split for split in splits if split not in SPLITS]:
        raise ValueError(f"--splits: unknown split(s) {bad}; valid: {', '.join(SPLITS)} (comma-separated)")
    if args.episodes < 1 or args.workers < 0 or args.videos < 0:
        raise ValueError(f"--episodes must be >= 1, --workers and --videos >= 0; got {args.episodes}, {args.workers}, {args.videos}")
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
    if args.planning is not None and args.planning < 1:
        raise ValueError(f"--planning must be >= 1 (1: no planning); got {args.planning}")
    policy = load_policy(args.policy)
    plans = hasattr(policy.config, "planning_candidates")
    if (args.planning is not None or args.video_predictions) and not plans:
        raise ValueError(f"--planning and --video-predictions need a video policy (policy.type video); {args.policy} is a {type(policy).__name__}")
    # Planning is its own column: the plain policy (N = 1) first, then best-of-N, on the same seeds (paired).
    candidates = (args.planning or policy.config.planning_candidates) if plans else 1
    variants = [("", 1)] + ([("planning", candidates)] if candidates > 1 else [])
    seen = policy.config.extra.get("tasks", [])
    if seen and args.task not in seen:
        console.print(f"[yellow]note: this checkpoint was trained on {seen}, not on {args.task!r}: evaluating anyway")
    out.mkdir(parents=True, exist_ok=True)
    results, planning, latency = {}, {}, {}
    for name, n in variants:
        if plans:
            policy.config.planning_candidates = n
        latency[str(n)] = batch1_latency_ms(policy, args.task, image_size=policy.config.image_size, task_config=task_config)
        for split in splits:
            try:
                res, _ = evaluate(
                    policy, args.task, episodes=args.episodes, split=split, num_workers=args.workers,
                    image_size=policy.config.image_size, task_config=task_config,
                )  # fmt: skip
            except SplitNotApplicable:
                console.print(f"{split}: not applicable to {args.task}")
                continue
            (planning if name else results)[split] = res.as_dict()
            label = f" with planning (N={n})" if name else ""
            console.print(f"{split}{label}: success {res.success:.0%} ± {res.success_se:.0%} over {res.episodes} episodes")
    summary = {"policy": args.policy, "task": args.task, "task_config": task_config, "seen_tasks": seen, "results": results,
               "latency_ms": latency}  # batch-1 predict_action_chunk, by number of candidates
    if planning:
        summary.update(planning_candidates=candidates, planning_results=planning)
    (out / "eval.json").write_text(json.dumps(summary, indent=2))
    lines = [f"# kinema eval: {args.policy} on {args.task}", ""]
    if seen and args.task not in seen:
        lines += [f"Note: the checkpoint was trained on {seen}; {args.task} is unseen.", ""]
    plan_col = f" with planning (N={candidates}) |" if planning else ""
    lines += [f"| split | success | steps to success |{plan_col}", "|---|---|---|" + ("---|" if planning else "")]
    for split, r in results.items():
        steps = f"{r['steps_to_success']:.1f}" if r["steps_to_success"] else "–"
        row = f"| {split} | {100 * r['success']:.0f} ± {100 * r['success_se']:.0f}% (n={r['episodes']}) | {steps} |"
        if split in planning:
            p = planning[split]
            row += f" {100 * p['success']:.0f} ± {100 * p['success_se']:.0f}% (n={p['episodes']}) |"
        lines.append(row)
    lines += ["", "Batch-1 latency per chunk: " + ", ".join(
        f"{ms:.0f} ms" + (f" with planning (N={n})" if n != "1" else "") for n, ms in latency.items())]  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if plans:
        policy.config.planning_candidates = candidates
    if args.video_predictions:
        from kinema.train.report import record_video_predictions

        shown = record_video_predictions(policy, args.task, task_config, policy.config.image_size, out / "videos" / "predictions.mp4")
        console.print(f"predicted futures: {out / 'videos' / 'predictions.mp4'} ({shown['chunks']} chunks, columns: {', '.join(shown['columns'])})")
    if args.videos:
        from kinema.train.config import TrainConfig
        from kinema.train.report import record_video_grid

        cfg = TrainConfig(task=args.task, task_config=task_config or {})
        cfg.eval.videos = args.videos
        cfg.policy.image_size = policy.config.image_size
        record_video_grid(policy, cfg, out / "videos", "eval")
    console.print(f"report: {out / 'report.md'}")
    return 0
