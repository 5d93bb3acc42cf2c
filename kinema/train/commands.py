"""The `kinema train` and `kinema eval` commands."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    from policies.checkpoint import write_text_atomic
    from sim.tasks import SplitNotApplicable, check_task

    check_task(args.task)
    # Every argument is checked before the first episode, so that a typo cannot cost an evaluation or its old report.
    splits = [split.strip() for split in args.splits.split(",")]
    if bad := [split for split in splits if split not in SPLITS]:
        raise ValueError(f"--splits: unknown split(s) {bad}; valid: {', '.join(SPLITS)} (comma-separated)")
    if args.episodes < 1 or args.workers < 0 or args.videos < 0:
        raise ValueError(f"--episodes must be >= 1, --workers and --videos >= 0; got {args.episodes}, {args.workers}, {args.videos}")
    if args.select is not None and args.select < 1:
        raise ValueError(f"--select must be >= 1 (1: no selection); got {args.select}")
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
    saved = _saved_method(Path(args.policy))
    policy = load_policy(args.policy)
    if args.video_predictions and not hasattr(policy, "predicted_future_images"):
        raise ValueError(f"--video-predictions needs a policy that predicts future frames (policy.type video); {args.policy} is a {type(policy).__name__}")
    if args.noise_scale is None:  # as the checkpoint's run evaluated it
        if saved is not None and saved["name"] == "dsrl":  # its actor picks the noise
            args.noise_scale = 1.0
        elif saved is not None and saved["name"] == "residual":  # the base's noise the correction was trained on
            args.noise_scale = saved["state"]["shape"]["base_noise_scale"]
        else:
            args.noise_scale = getattr(policy.config, "inference_noise_scale", 1.0)
    acting, select = _runners(policy, saved, args.select, args.policy, args.noise_scale, args.select_margin)
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


def _saved_method(checkpoint: Path) -> dict | None:
    """The method's name and state a `kinema train` checkpoint saved beside its weights (None for other checkpoints)."""
    import torch

    path = checkpoint / "method.pt"
    return torch.load(path, weights_only=False) if path.exists() else None


@dataclass
class _Acting:
    """What acts in one column of `kinema eval`: a fresh runner per use (`make`), and what it is, in words."""

    make: Callable[[], Any]
    description: str
    num_samples: int = 1


def _runners(policy: Any, saved: dict | None, select: int | None, checkpoint: str, noise_scale: float = 1.0,
             margin: float = 0.0) -> tuple[_Acting, _Acting | None]:  # fmt: skip
    """The policy as it acts alone (the DSRL noise actor steering it for a dsrl checkpoint; a policy that plans,
    at N = 1), and best-of-N by value when asked (`--select N`) or when the checkpoint plans by default: valued by
    the chunk critic of a pa_rl checkpoint (V-GPS; `margin` keeps the policy's own chunk unless another is valued
    that much higher), else by the policy's own prediction (the video policy)."""
    from kinema.train.evaluate import ChunkPolicy, SelectChunkPolicy

    if margin < 0:
        raise ValueError(f"--select-margin must be >= 0; got {margin}")
    if margin and (select is None or select <= 1 or saved is None or saved["name"] != "pa_rl"):
        raise ValueError(f"--select-margin applies to --select N > 1 with a pa_rl checkpoint's chunk critic; {checkpoint} "
                         f"has {'no method.pt' if saved is None else repr(saved['name'])} and --select is {select}")

    plans = hasattr(policy, "plan")
    if noise_scale != 1.0 and (plans or (saved is not None and saved["name"] == "dsrl")):
        raise ValueError(f"--noise-scale scales the VLA's own initial flow noise; {checkpoint} "
                         f"{'is a video policy' if plans else 'acts with the noise its DSRL actor chooses'} (use 1)")
    if saved is not None and saved["name"] == "dsrl":
        from kinema.train.methods.dsrl import steered_runner

        acting = _Acting(lambda: steered_runner(policy, saved["state"]), "the VLA steered by the checkpoint's DSRL noise actor")
    elif saved is not None and saved["name"] == "residual":
        from kinema.train.methods.residual import residual_runner

        bound = saved["state"]["shape"]["scale"]
        acting = _Acting(lambda: residual_runner(policy, saved["state"], base_noise_scale=noise_scale),
                         f"the VLA's chunk (initial noise scaled by {noise_scale:g}) plus the checkpoint's residual correction (bound ±{bound:g})")  # fmt: skip
    elif plans:  # its chunks alone, whatever planning_candidates the checkpoint keeps
        acting = _Acting(lambda: SelectChunkPolicy(policy, None, num_samples=1), "policy")
    else:
        acting = _Acting(lambda: ChunkPolicy(policy, noise_scale=noise_scale),
                         "policy" if noise_scale == 1.0 else f"policy, initial noise scaled by {noise_scale:g}")
        if getattr(policy.config, "advantage_input", False):  # a recap checkpoint acts asking for its indicator
            asked = {0: "unconditioned", 1: "asking for improvements", 2: "asking for non-improvements"}[policy.config.advantage_condition]
            beta = policy.config.advantage_guidance
            acting.description += f", {asked} (Recap's indicator{f', guidance {beta:g}' if beta != 1 else ''})"
    n = select if select is not None else (policy.config.planning_candidates if plans else 1)
    if n <= 1:
        return acting, None
    if saved is not None and saved["name"] == "pa_rl":
        from kinema.train.methods.pa_rl import selection_runner

        kept = f", the policy's own kept unless another is valued {margin:g} higher" if margin else ""
        return acting, _Acting(lambda: selection_runner(policy, saved["state"], num_samples=n, noise_scale=noise_scale, margin=margin),
                               f"best of {n} sampled chunks by the pa_rl checkpoint's chunk critic{kept}", n)  # fmt: skip
    if plans:
        return acting, _Acting(lambda: SelectChunkPolicy(policy, None, num_samples=n), f"best of {n} sampled chunks by the policy's predicted value", n)
    found = "no method.pt" if saved is None else f"the method.pt of {saved['name']!r}"
    raise ValueError(f"--select needs a value for the chunks: the chunk critic of a pa_rl checkpoint (its method.pt) or a "
                     f"policy that predicts values (policy.type video); {checkpoint} has {found} and is a {type(policy).__name__}")
