"""What a person looks at after `kinema train`: curves.png, rollout MP4s, report.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from diffusion_rl.data import ExecutedBy
from kinema.media import write_mp4
from kinema.train.evaluate import EVAL_SEED_OFFSET, ChunkPolicy
from policies.checkpoint import atomic_file, write_text_atomic
from sim.env import CONTROL_HZ
from sim.monitor import MonitorConfig, SimulatedHuman
from sim.tasks import make

SPLITS = ("train", "heldout_instructions", "heldout_objects")


def record_videos(policy: Any, cfg: Any, folder: Path, label: str) -> list[Path]:
    """`cfg.eval.videos` evaluation episodes as MP4: the overview camera beside the policy's two cameras."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    runner = ChunkPolicy(policy)
    for i in range(cfg.eval.videos):
        env = make(cfg.task, cfg.task_config or None, image_size=cfg.policy.image_size)
        actor = SimulatedHuman(env, MonitorConfig()) if cfg.rl.interventions else env
        obs, _ = actor.reset(seed=EVAL_SEED_OFFSET + 500_000 + i)
        frames, queue = [], []
        for _ in range(env.config.horizon):
            if not queue:
                batch = {k: (v[None] if isinstance(v, np.ndarray) else [v]) for k, v in obs.items()}
                queue = list(runner(batch)[0])
            obs, _, terminated, truncated, info = actor.step(queue.pop(0))
            if info.get("executed_by") == ExecutedBy.HUMAN:
                queue = []
            side = np.concatenate([obs["observation.images.agentview"], obs["observation.images.wrist"]], axis=0)
            overview = env.render()
            side = np.pad(side, ((0, max(0, overview.shape[0] - side.shape[0])), (0, 0), (0, 0)))[: overview.shape[0]]
            frame = np.concatenate([overview, side], axis=1)
            if info["is_success"]:
                frame[:6] = (40, 200, 40)
            frames.append(frame)
            if terminated or truncated:
                break
        env.close()
        paths.append(write_mp4(folder / f"{label}-{i}.mp4", np.stack(frames), CONTROL_HZ))
    return paths


def write_curves(records: list[dict[str, Any]], path: Path) -> Path:
    evals = [r for r in records if r.get("kind") == "eval"]
    rounds = [r for r in records if r.get("kind") == "round"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    ax = axes[0]
    for split in SPLITS:
        pts = [(r["env_steps"], r[f"{split}/success"], r[f"{split}/success_se"]) for r in evals if f"{split}/success" in r]
        if pts:
            x, y, se = map(np.array, zip(*pts))
            ax.errorbar(x, 100 * y, yerr=100 * se, marker="o", capsize=3, label=split.replace("_", " "))
    ax.set_xlabel("env steps of RL rollouts")
    ax.set_ylabel("success (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("evaluation success (± s.e.)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[1]
    pts = [(r["env_steps"], r["rollout/success"]) for r in rounds if "rollout/success" in r]
    if pts:
        x, y = zip(*pts)
        ax.plot(x, 100 * np.array(y), marker="o", label="rollout success")
    pts = [(r["env_steps"], r["rollout/takeover_rate"]) for r in rounds if r.get("rollout/takeover_rate") is not None]
    if pts and any(y for _, y in pts):  # only runs with the simulated human have takeovers to show
        ax2 = ax.twinx()
        x, y = zip(*pts)
        ax2.plot(x, y, marker="s", color="tab:red", label="takeovers / episode")
        ax2.set_ylabel("takeovers / episode", color="tab:red")
    ax.set_xlabel("env steps of RL rollouts")
    ax.set_ylabel("rollout success (%)")
    ax.set_title("training rollouts")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left")
    else:  # an SFT-only run (or one stopped before its first round)
        ax.text(0.5, 0.5, "no RL rounds in this run", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)
    return path


def _fmt(r: dict[str, Any] | None, split: str) -> str:
    if not r or f"{split}/success" not in r:
        return "–"
    return f"{100 * r[f'{split}/success']:.0f} ± {100 * r[f'{split}/success_se']:.0f}% (n={r[f'{split}/episodes']})"


def write_report(cfg: Any, records: list[dict[str, Any]], root: Path) -> Path:
    evals = [r for r in records if r.get("kind") == "eval"]
    sft = next((r for r in evals if r["stage"] == "sft"), None)
    final = next((r for r in reversed(evals) if r["stage"] == "final"), None)
    lines = [
        f"# kinema train: {cfg.task}, method `{cfg.rl.method}`",
        "",
        f"Demonstrations: {cfg.demos.episodes} (noise {cfg.demos.noise}); SFT {cfg.sft.steps} steps; "
        f"RL {cfg.rl.rounds} rounds × {cfg.rl.episodes_per_round} rollouts × {cfg.rl.updates_per_round} updates"
        + ("; simulated human in the loop" if cfg.rl.interventions else "")
        + ".",
        "",
        "| split | SFT | after RL | gain (points) |",
        "|---|---|---|---|",
    ]
    for split in SPLITS:
        if sft and f"{split}/success" in sft:
            gain = (
                f"{100 * (final[f'{split}/success'] - sft[f'{split}/success']):+.0f} ± "
                f"{100 * np.hypot(final[f'{split}/success_se'], sft[f'{split}/success_se']):.0f}"
                if final and f"{split}/success" in final
                else "–"
            )
            lines.append(f"| {split.replace('_', ' ')} | {_fmt(sft, split)} | {_fmt(final, split)} | {gain} |")
    if final and final.get("train/steps_to_success") and sft and sft.get("train/steps_to_success"):
        lines += ["", f"Mean steps to success: SFT {sft['train/steps_to_success']:.1f} → {final['train/steps_to_success']:.1f}."]
    if records and records[-1].get("cpu_s") is not None:
        lines += ["", f"Compute: {records[-1]['cpu_s'] / 60:.1f} CPU-minutes (the run's process and its env workers; "
                      "work redone after a resume counts once)."]
    lines += [
        "",
        "![curves](curves.png)",
        "",
        "Videos: " + ", ".join(f"[{p.name}](videos/{p.name})" for p in sorted((root / "videos").glob("*.mp4"))),
        "",
        "Metrics: `metrics.jsonl` (one JSON object per line); checkpoints in `checkpoints/` "
        "(`policies.load_policy`); rollouts of every round in `rollouts/` (LeRobotDataset v3).",
    ]
    return write_text_atomic(root / "report.md", "\n".join(lines) + "\n")
