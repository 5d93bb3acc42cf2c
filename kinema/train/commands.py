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

    overrides = [("--robot.config" + arg[len("--robot"):]) if arg == "--robot" or arg.startswith("--robot=") else arg for arg in overrides]
    train(load_run_config(args.config, overrides, args.resume, config_class=TrainConfig), resume=bool(args.resume))
    return 0


def eval_command(args: argparse.Namespace) -> int:
    import torch

    from kinema.train.acting import load_acting
    from kinema.train.evaluate import SPLITS, batch1_latency_ms, evaluate
    from policies.checkpoint import write_text_atomic
    from sim.tasks import SplitNotApplicable, check_task

    check_task(args.task)
    # Every argument is checked before the first episode, so that a typo cannot cost an evaluation or its old report.
    splits = list(SPLITS) if args.splits.strip() == "all" else [split.strip() for split in args.splits.split(",")]
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
    loaded = load_acting(args.policy, noise_scale=args.noise_scale, select=args.select, margin=args.select_margin)
    policy, acting, select, args.noise_scale = loaded.policy, loaded.acting, loaded.selection, loaded.noise_scale
    if args.video_predictions and not policy.predicts_frames:
        raise ValueError(f"--video-predictions needs a policy that predicts future frames (policy.type video); {args.policy} is a {type(policy).__name__}")
    seen = policy.config.extra.get("tasks", [])
    if seen and args.task not in seen:
        console.print(f"[yellow]note: this checkpoint was trained on {seen}, not on {args.task!r}: evaluating anyway")
    if acting.description != "policy":
        console.print(f"acting: {acting.description}")
    out.mkdir(parents=True, exist_ok=True)
    # Best-of-N is its own column: the policy as it acts alone first, then with selection, on the same seeds (paired).
    columns = [(1, acting)] + ([(select.num_samples, select)] if select else [])
    results, selected = {}, {}
    latency = batch1_latency_ms({str(n): runner.make() for n, runner in columns}, args.task, image_size=policy.config.image_size, task_config=task_config)
    for n, runner in columns:
        for split in splits:
            try:
                res, _ = evaluate(
                    policy, args.task, episodes=args.episodes, split=split, num_workers=args.workers, seed=args.seed,
                    image_size=policy.config.image_size, task_config=task_config, runner=runner.make(),
                )  # fmt: skip
            except SplitNotApplicable:
                console.print(f"{split}: not applicable to {args.task}")
                continue
            (selected if n > 1 else results)[split] = res.as_dict()
            label = f" with selection (N={n})" if n > 1 else ""
            steps = f", {res.steps_to_success:.1f} steps to success" if res.steps_to_success else ""
            wrong = f", {res.wrong_target:.0%} reached a wrong target" if res.wrong_target else ""
            console.print(f"{split}{label}: success {res.success:.0%} ± {res.success_se:.0%} over {res.episodes} episodes{steps}{wrong}")
    summary = {"policy": args.policy, "task": args.task, "task_config": task_config, "seen_tasks": seen, "seed": args.seed,
               "noise_scale": args.noise_scale, "acting": acting.description, "results": results,
               "latency_ms": latency}  # batch-1 latency per chunk, by number of candidates  # fmt: skip
    if select:
        summary.update(select=select.num_samples, selection=select.description, selection_results=selected)
    write_text_atomic(out / "eval.json", json.dumps(summary, indent=2))
    lines = [f"# kinema eval: {args.policy} on {args.task}", ""]
    if seen and args.task not in seen:
        lines += [f"Note: the checkpoint was trained on {seen}; {args.task} is unseen.", ""]
    if acting.description != "policy":
        lines += [f"Acting: {acting.description}.", ""]
    sel_col = f" with selection (N={select.num_samples}) |" if selected else ""
    lines += [f"| split | success | steps to success | wrong target |{sel_col}", "|---|---|---|---|" + ("---|" if selected else "")]
    for split, r in results.items():
        steps = f"{r['steps_to_success']:.1f}" if r["steps_to_success"] else "–"
        wrong = "–" if r["wrong_target"] is None else f"{100 * r['wrong_target']:.0f}%"
        row = f"| {split} | {100 * r['success']:.0f} ± {100 * r['success_se']:.0f}% (n={r['episodes']}) | {steps} | {wrong} |"
        if split in selected:
            p = selected[split]
            row += f" {100 * p['success']:.0f} ± {100 * p['success_se']:.0f}% (n={p['episodes']}) |"
        lines.append(row)
    if any(r["wrong_target"] is not None for r in results.values()):
        lines += ["", "Wrong target: the share of episodes that reached a target the instruction did not name; each "
                      "is a failure. `ablated_instructions`: the training templates with no target named (chance)."]  # fmt: skip
    if select:
        lines += ["", f"Selection: {select.description}."]
    lines += ["", "Batch-1 latency per chunk: " + ", ".join(
        f"{ms:.0f} ms" + (f" with selection (N={n})" if n != "1" else "") for n, ms in latency.items())]  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    if args.video_predictions:
        from kinema.train.report import record_video_predictions

        shown = record_video_predictions(policy, args.task, task_config, policy.config.image_size, out / "videos" / "predictions.mp4")
        console.print(f"predicted futures: {out / 'videos' / 'predictions.mp4'} ({shown['chunks']} chunks, columns: {', '.join(shown['columns'])})")
    if args.videos:
        from kinema.train.config import TrainConfig
        from kinema.train.report import record_video_grid

        cfg = TrainConfig(task=args.task, task_config=task_config or {})
        cfg.eval.videos, cfg.eval.noise_scale = args.videos, args.noise_scale
        cfg.policy.image_size = policy.config.image_size
        record_video_grid(policy, cfg, out / "videos", "eval", runner=acting.make())
    console.print(f"report: {out / 'report.md'}")
    return 0
