"""What a person looks at after `kinema video train`: reward curves, sample grids, MP4s, report.md.

Every file is written to a temporary name and renamed, so an interrupted run never leaves a broken picture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import Tensor

from kinema.media import write_mp4
from policies.checkpoint import atomic_file, write_text_atomic


def _save(fig: Any, path: Path, dpi: int = 110) -> Path:
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=dpi)
    finally:
        plt.close(fig)
    return path


def to_uint8(videos: Tensor) -> np.ndarray:
    """(B, F, C, H, W) in [0, 1] -> uint8 (B, F, H, W, C)."""
    return (videos.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).cpu().numpy()


def tile(videos: Tensor, *, scale: int = 4, gap: int = 2) -> np.ndarray:
    """Samples side by side, each frame enlarged `scale`× (nearest): uint8 (F, H·s, B·(W·s + gap) − gap, 3)."""
    frames = to_uint8(videos).repeat(scale, axis=2).repeat(scale, axis=3)  # (B, F, H, W, C)
    b, f, h, w, c = frames.shape
    out = np.full((f, h, b * (w + gap) - gap, c), 255, np.uint8)
    for i in range(b):
        out[:, :, i * (w + gap) : i * (w + gap) + w] = frames[i]
    return out


def write_grid(videos: Tensor, path: Path, *, prompts: list[str] | None = None, title: str = "") -> Path:
    """A sample grid PNG: one row per sample, one column per frame."""
    frames = to_uint8(videos)
    b, f = frames.shape[:2]
    fig, axes = plt.subplots(b, f, figsize=(1.0 * f + 0.2, 1.05 * b + 0.4), squeeze=False)
    for i in range(b):
        for j in range(f):
            ax = axes[i][j]
            ax.imshow(frames[i, j], interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0 and prompts:
                ax.set_ylabel(prompts[i][:28], fontsize=5, rotation=0, ha="right", va="center")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, path)


def write_videos_mp4(videos: Tensor, path: Path, *, fps: float = 4.0) -> Path:
    """The samples side by side as one MP4 (frames enlarged so that 32-pixel videos can be seen)."""
    return write_mp4(path, tile(videos), fps)


def judge_names(records: list[dict[str, Any]]) -> list[str]:
    """Scores the held-out judge gave (`eval/judge_<name>`)."""
    return sorted({k.removeprefix("eval/judge_") for r in records if r.get("kind") == "eval" for k in r
                   if k.startswith("eval/judge_")})  # fmt: skip


def write_reward_curves(records: list[dict[str, Any]], path: Path) -> Path:
    """One panel per reward (evaluation samples at fixed noise, and the round's rollouts), plus diversity; with a
    held-out judge, a panel per judged score: the training reward's and the judge's gain since round 0 and the gap
    between them (the reward-hacking signal)."""
    evals = [r for r in records if r.get("kind") == "eval"]
    rounds = [r for r in records if r.get("kind") == "round"]
    judged = judge_names(records)
    names = sorted({k.split("/", 1)[1] for r in evals for k in r
                    if k.startswith("eval/") and k != "eval/diversity" and not k.startswith("eval/judge_")})  # fmt: skip
    panels = names + ["diversity"] + [f"judge:{n}" for n in judged]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
    for ax, name in zip(axes[0], panels):
        if name.startswith("judge:"):
            _judge_panel(ax, evals, name.removeprefix("judge:"))
            continue
        key = f"eval/{name}"
        pts = [(r["round"], r[key]) for r in evals if key in r]
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker="o", label="evaluation (CFG-free, fixed noise)")
        rkey = f"rollout/{name}"
        pts = [(r["round"], r[rkey]) for r in rounds if rkey in r]
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, marker=".", alpha=0.6, label="rollouts")
        ax.set_xlabel("round")
        ax.set_title(name if name != "diversity" else "diversity (mean pairwise RMS distance)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, path)


def _judge_panel(ax: Any, evals: list[dict[str, Any]], name: str) -> None:
    """Gains since the evaluation before post-training: the training reward `eval/<name>`, the held-out judge
    `eval/judge_<name>`, and the gap between them shaded."""
    start = next((r for r in evals if r.get("stage") == "before"), evals[0] if evals else None)
    jkey, rkey = f"eval/judge_{name}", f"eval/{name}"
    pts = [r for r in evals if jkey in r and r.get("stage") != "after"]
    if start is None or jkey not in start or not pts:
        return
    x = [r["round"] for r in pts]
    judge = [r[jkey] - start[jkey] for r in pts]
    ax.plot(x, judge, marker="s", color="tab:green", label=f"held-out judge ({name})")
    if rkey in start and all(rkey in r for r in pts):
        reward = [r[rkey] - start[rkey] for r in pts]
        ax.plot(x, reward, marker="o", color="tab:blue", label=f"training reward ({name})")
        ax.fill_between(x, judge, reward, color="tab:red", alpha=0.15, label="gap: reward gain − judge gain")
    ax.axhline(0.0, color="k", lw=0.6)
    ax.set_xlabel("round")
    ax.set_title(f"{name} gain since round 0: reward vs judge", fontsize=9)
    ax.legend(fontsize=7)


MATERIAL_GAIN = 0.02  # a success-probability gain below this is within evaluation noise: no hacking warning


def _pct(x: Any) -> str:
    return f"{x:.0%}" if isinstance(x, (int, float)) else "–"


def _fmt(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else "–"


def write_report(cfg: Any, records: list[dict[str, Any]], root: Path) -> Path:
    evals = [r for r in records if r.get("kind") == "eval"]
    before = next((r for r in evals if r.get("stage") == "before"), None)
    after = next((r for r in reversed(evals) if r.get("stage") == "after"), None)
    pre = next((r for r in records if r.get("kind") == "pretrain"), None)
    succ = next((r for r in records if r.get("kind") == "success_reward"), None)
    rounds = [r for r in records if r.get("kind") == "round"]
    t = cfg.train
    lines = [
        f"# kinema video train: method `{t.method}`, rewards {', '.join(cfg.rewards.names)}",
        "",
        f"Model `{cfg.model.path or cfg.model.preset}`, {cfg.data.frames} frames of {cfg.data.size}×{cfg.data.size}, "
        f"{cfg.model.num_inference_steps} sampling steps, LoRA rank {cfg.model.lora_rank}. "
        f"Post-training: {t.rounds} rounds × {t.prompts_per_round} prompts × {t.group_size} samples, "
        f"{t.updates_per_round} updates per round; reference anchor weight {cfg.anchor.ref_weight}"
        + (f", KL weight {cfg.anchor.kl_weight}" if t.method == "flow_grpo" else "")
        + f"; rewards balanced by {cfg.rewards.balancing}.",
        "",
    ]
    if pre:
        lines += [
            f"Pre-training on {pre.get('clips', '?')} sim clips of `{cfg.data.task}` ({pre.get('prompts', '?')} prompts): "
            f"{pre.get('steps', 0)} steps, flow loss {_fmt(pre.get('loss_first'))} → {_fmt(pre.get('loss_last'))}"
            + (" (loaded from the run folder)" if pre.get("loaded") else "")
            + ".",
            "",
        ]
    if succ:
        lines += [
            f"Success reward (held-out sim clips): AUC {_fmt(succ.get('auc'))}, Brier {_fmt(succ.get('brier'))}, "
            f"ECE {_fmt(succ.get('ece'))} (n={int(succ.get('n', 0))}). Calibration: [success_calibration.png](success_calibration.png).",
            "",
        ]
    judge = next((r for r in records if r.get("kind") == "judge"), None)
    lines += judge_section(judge, before, after)
    keys = sorted({k for r in (before or {}, after or {}) for k in r if k.startswith("eval/") and not k.startswith("eval/judge_")})
    if keys:
        lines += ["Evaluation samples (CFG-free, the same noise before and after):", "", "| metric | before | after | change |", "|---|---|---|---|"]
        for k in keys:
            b, a = (before or {}).get(k), (after or {}).get(k)
            change = f"{a - b:+.4g}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) else "–"
            lines.append(f"| {k.removeprefix('eval/')} | {_fmt(b)} | {_fmt(a)} | {change} |")
        if before and after and before.get("eval/diversity"):
            lines += ["", f"Diversity after / before: {after['eval/diversity'] / before['eval/diversity']:.2f}."]
        lines.append("")
    if rounds and "time_s" in rounds[-1]:
        lines += [f"Wall clock of the whole run (sim videos, reward, pre-training, post-training): {rounds[-1]['time_s']:.0f} s.", ""]
    if records and records[-1].get("cpu_s") is not None:
        lines += [f"Compute: {records[-1]['cpu_s'] / 60:.1f} CPU-minutes.", ""]
    lines += [
        "![reward curves](reward_curves.png)",
        "",
        "Samples before: ![before](samples/before.png)",
        "",
        "Samples after: ![after](samples/after.png)",
        "",
        "Videos: " + ", ".join(f"[{p.name}](samples/{p.name})" for p in sorted((root / "samples").glob("*.mp4"))),
        "",
        "Metrics: `metrics.jsonl` (one JSON object per line). Checkpoints in `checkpoints/` (LoRA adapters, optimiser, "
        "EMA reference, RNG states); the pre-trained generator in `pretrained/` (`VideoGenerator.from_pretrained`).",
        "",
        "**The post-trained generator: [`final/`](final/README.md)**, a diffusers folder: "
        "`WanPipeline.from_pretrained(\"final\", trust_remote_code=True)` then "
        "`pipe.load_lora_weights(\"final/adapters/default\")`, with the sampling arguments in `final/README.md`; or "
        "`kinema video sample RUN_DIR --prompt \"...\" --out sample.mp4`. `kinema video export RUN_DIR --round N [--fuse]` "
        "writes another round, or the LoRA fused into the weights.",
    ]
    return write_text_atomic(root / "report.md", "\n".join(lines) + "\n")


def judge_section(judge: dict[str, Any] | None, before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[str]:
    """report.md's paragraph on the held-out judge: how it was made, its agreement with the ground truth, and the
    training reward's gain beside its own (the reward-hacking signal)."""
    if judge is None:
        return []
    if judge.get("skipped"):
        return [f"Held-out judge: skipped ({judge['skipped']}).", ""]
    arch = judge.get("arch", {})
    lines = [
        "**Held-out judge.** A second success model, another architecture (convs "
        f"{'-'.join(str(c) for c in arch.get('channels', []))}, head {arch.get('hidden_dim', '?')} × {arch.get('num_layers', '?')}) "
        f"and seed ({judge.get('seed', '?')}), fitted on {judge.get('train_clips', '?')} sim clips of episodes of its own (seeds "
        "disjoint from the reward's) and never used in training. Against the sim's ground truth on "
        f"{judge.get('heldout_clips', '?')} clips neither model was fitted on: AUC {_fmt(judge.get('judge/auc'))}, accuracy "
        f"{_fmt(judge.get('judge/accuracy'))}, Brier {_fmt(judge.get('judge/brier'))}"
        + (f" (the training reward on the same clips: AUC {_fmt(judge.get('reward/auc'))}, accuracy "
           f"{_fmt(judge.get('reward/accuracy'))}; their verdicts (p > 0.5) agree on {_pct(judge.get('agreement'))} of them, "
           "correlation of their probabilities "
           f"{_fmt(judge.get('correlation'))})" if "reward/auc" in judge else "")
        + ". Calibration: [judge_calibration.png](judge_calibration.png).",
        "",
    ]
    names = sorted({k.removeprefix("eval/judge_") for k in (after or {}) if k.startswith("eval/judge_")})
    if before and after and names:
        lines += ["| score | before | after | gain |", "|---|---|---|---|"]
        for name in names:
            for label, key in ((f"training reward ({name})", f"eval/{name}"), (f"held-out judge ({name})", f"eval/judge_{name}")):
                b, a = before.get(key), after.get(key)
                if isinstance(a, (int, float)) and isinstance(b, (int, float)):
                    lines.append(f"| {label} | {_fmt(b)} | {_fmt(a)} | {a - b:+.4g} |")
        lines.append("")
        for name in names:
            rkey, jkey = f"eval/{name}", f"eval/judge_{name}"
            if not all(k in d for k in (rkey, jkey) for d in (before, after)):
                continue
            r_gain, j_gain = after[rkey] - before[rkey], after[jkey] - before[jkey]
            text = f"Reward-hacking signal ({name}): reward gain {r_gain:+.4g}, judge gain {j_gain:+.4g}, gap {r_gain - j_gain:+.4g}"
            if r_gain > 0:
                share = j_gain / r_gain
                text += f"; the judge confirms {share:.0%} of the reward's gain"
                if share < 0.5 and r_gain >= MATERIAL_GAIN:
                    text += " (**under half: look at the samples for reward hacking**)"
            if all(0.0 <= d[k] < 1.0 for k in (rkey, jkey) for d in (before,)):  # probabilities: headroom to 1
                text += (f". Of the way to 1 they started from, the reward closed {r_gain / (1 - before[rkey]):.0%} and the "
                         f"judge {j_gain / (1 - before[jkey]):.0%}")
            lines += [text + ". The curves show both gains at every evaluation.", ""]
    return lines
