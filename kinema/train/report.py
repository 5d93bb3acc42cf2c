"""What a person looks at after `kinema train`: curves.png, diagnostics.png, before/after video grids, report.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator
import numpy as np
import torch

import cv2

from diffusion_rl.data import ExecutedBy
from kinema.media import read_mp4, write_mp4
from kinema.train.evaluate import EVAL_SEED_OFFSET, SPLIT_NAMES, ChunkPolicy, final_splits, paired_difference
from policies.checkpoint import atomic_file, write_text_atomic
from sim.env import CONTROL_HZ
from sim.monitor import MonitorConfig, SimulatedHuman
from sim.tasks import make

SPLITS = tuple(SPLIT_NAMES)


VIDEO_SEED_OFFSET = EVAL_SEED_OFFSET + 500_000  # the episodes of the before/after videos: the same seeds both times
TILE = (180, 240)  # height, width of one episode in a grid video
COLUMNS = 4
SUCCESS, FAILURE, RUNNING = (40, 200, 40), (220, 50, 40), (120, 120, 120)


def record_video_grid(policy: Any, cfg: Any, folder: Path, label: str, runner: ChunkPolicy | None = None) -> list[Path]:
    """`cfg.eval.videos` episodes on fixed seeds (the same for "before" and "after"), as one grid MP4 and a PNG of
    each episode's last frame: every tile shows its instruction, and its border turns green on success or red on
    failure. Also `label.json`: the seeds, instructions and outcomes. `runner`: what acts, as the evaluations act
    (default: the policy's ODE chunks from `eval.noise_scale`; a dsrl or residual run's actor steering it)."""
    n = cfg.eval.videos
    if n < 1:
        return []
    runner = runner or ChunkPolicy(policy, noise_scale=cfg.eval.noise_scale)
    episodes = []
    for i in range(n):
        seed = VIDEO_SEED_OFFSET + i
        env = make(cfg.task, cfg.task_config or None, image_size=cfg.policy.image_size)
        actor = SimulatedHuman(env, MonitorConfig()) if cfg.rl.interventions else env
        obs, _ = actor.reset(seed=seed)
        frames, queue, success, step = [], [], False, 0
        for step in range(env.config.horizon):
            if not queue:
                batch = {k: (v[None] if isinstance(v, np.ndarray) else [v]) for k, v in obs.items()}
                runner.about_to_act([seed], [step])
                queue = list(runner(batch)[0])
            obs, _, terminated, truncated, info = actor.step(queue.pop(0))
            if info.get("executed_by") == ExecutedBy.HUMAN:
                queue = []
            success = bool(info["is_success"])
            frames.append(_tile(env.render(), obs["task"], human=info.get("executed_by") == ExecutedBy.HUMAN))
            if terminated or truncated:
                break
        env.close()
        episodes.append({"seed": seed, "instruction": obs["task"], "success": success, "steps": step + 1, "frames": frames})
    length = max(len(ep["frames"]) for ep in episodes)
    grid = []
    for t in range(length):
        tiles = []
        for ep in episodes:
            done = t >= len(ep["frames"]) - 1
            colour = (SUCCESS if ep["success"] else FAILURE) if done else RUNNING
            tiles.append(_border(ep["frames"][min(t, len(ep["frames"]) - 1)], colour))
        grid.append(_grid(tiles))
    folder.mkdir(parents=True, exist_ok=True)
    video = write_mp4(folder / f"{label}.mp4", np.stack(grid), CONTROL_HZ)
    sheet = _write_png(folder / f"{label}.png", grid[-1])
    summary = [{k: v for k, v in ep.items() if k != "frames"} for ep in episodes]
    write_text_atomic(folder / f"{label}.json", json.dumps(summary, indent=2))
    return [video, sheet]


def write_before_after(folder: Path) -> Path | None:
    """`before_after.mp4` and `.png`: the before grid above the after grid (same seeds), where both exist."""
    if not ((folder / "before.mp4").is_file() and (folder / "after.mp4").is_file()):
        return None
    before, after = read_mp4(folder / "before.mp4"), read_mp4(folder / "after.mp4")
    length = max(len(before), len(after))
    before, after = (np.concatenate([v, np.repeat(v[-1:], length - len(v), axis=0)]) for v in (before, after))
    width = max(before.shape[2], after.shape[2])
    frames = np.concatenate([_caption(before, "before RL", width), _caption(after, "after RL", width)], axis=1)
    _write_png(folder / "before_after.png", frames[-1])
    return write_mp4(folder / "before_after.mp4", frames, CONTROL_HZ)


def _tile(frame: np.ndarray, instruction: str, *, human: bool) -> np.ndarray:
    tile = cv2.resize(frame, (TILE[1], TILE[0]), interpolation=cv2.INTER_AREA)
    tile[-22:] = (tile[-22:] * 0.35).astype(np.uint8)  # a dark band under the text
    cv2.putText(tile, instruction[:40], (4, TILE[0] - 7), cv2.FONT_HERSHEY_SIMPLEX, 0.38, (255, 255, 255), 1, cv2.LINE_AA)
    if human:
        cv2.putText(tile, "human", (4, 14), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 80, 80), 1, cv2.LINE_AA)
    return tile


def _border(tile: np.ndarray, colour: tuple[int, int, int], width: int = 4) -> np.ndarray:
    return cv2.copyMakeBorder(tile, width, width, width, width, cv2.BORDER_CONSTANT, value=colour)


def _grid(tiles: list[np.ndarray]) -> np.ndarray:
    rows = []
    blank = np.zeros_like(tiles[0])
    for start in range(0, len(tiles), COLUMNS):
        row = tiles[start : start + COLUMNS]
        if len(tiles) > COLUMNS:
            row = row + [blank] * (COLUMNS - len(row))
        rows.append(np.concatenate(row, axis=1))
    return np.concatenate(rows, axis=0)


def _caption(frames: np.ndarray, text: str, width: int) -> np.ndarray:
    """A title band above every frame (and padding to `width`)."""
    t, h, w, _ = frames.shape
    out = np.zeros((t, h + 26, width, 3), np.uint8)
    out[:, 26:, :w] = frames
    band = np.zeros((26, width, 3), np.uint8)
    cv2.putText(band, text, (6, 19), cv2.FONT_HERSHEY_SIMPLEX, 0.6, (255, 255, 255), 1, cv2.LINE_AA)
    out[:, :26] = band
    return out


def _write_png(path: Path, image: np.ndarray) -> Path:
    with atomic_file(path) as tmp:
        ok, data = cv2.imencode(".png", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        if not ok:
            raise RuntimeError(f"could not encode {path}")
        tmp.write_bytes(data.tobytes())
    return path


STAGE_STYLE = {"sft": dict(marker="s", ms=7), "round": dict(marker="o", ms=5), "final": dict(marker="*", ms=11)}


def evaluation_series(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[tuple[int, float, float, int]]]:
    """What the evaluation panel of curves.png draws: per (split, stage) the measured points (env steps, success,
    its s.e., episodes). Stages: sft, round, final; a split appears only where it was evaluated."""
    series: dict[tuple[str, str], list[tuple[int, float, float, int]]] = {}
    for r in records:
        if r.get("kind") != "eval":
            continue
        for split in SPLITS:
            if f"{split}/success" in r:
                point = (r["env_steps"], r[f"{split}/success"], r[f"{split}/success_se"], r[f"{split}/episodes"])
                series.setdefault((split, r["stage"]), []).append(point)
    return series


def write_curves(records: list[dict[str, Any]], path: Path) -> Path:
    """Evaluation success per split (points only where measured: SFT, each round, final; ± s.e.; n in the legend)
    and rollout success per round (± binomial s.e.), both from 0 to 100 %."""
    rounds = [r for r in records if r.get("kind") == "round"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ax = axes[0]
    colours = dict(zip(SPLITS, ("tab:blue", "tab:orange", "tab:green", "tab:grey")))
    for (split, stage), pts in evaluation_series(records).items():
        x, y, se, n = map(np.array, zip(*pts))
        sizes = sorted(set(int(v) for v in n))
        ax.errorbar(x, 100 * y, yerr=100 * se, linestyle="none", capsize=3, color=colours[split], **STAGE_STYLE[stage],
                    label=f"{SPLIT_NAMES[split]}, {stage} (n={'/'.join(map(str, sizes))})")  # fmt: skip
    ax.set_xlabel("env steps of RL rollouts")
    ax.set_ylabel("success (%)")
    ax.set_ylim(0, 100)
    ax.set_title("evaluation success (± s.e.)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    ax = axes[1]
    pts = [(r["env_steps"], r["rollout/success"], r.get("rollout/episodes")) for r in rounds if "rollout/success" in r]
    if pts:
        x, y, n = zip(*pts)
        y = np.array(y)
        n = np.array([v or 1 for v in n], float)
        ax.errorbar(x, 100 * y, yerr=100 * np.sqrt(y * (1 - y) / n), marker="o", capsize=3, linestyle="none",
                    label=f"rollout success (n={int(n.max())} per round)")  # fmt: skip
    pts = [(r["env_steps"], r["rollout/takeover_rate"]) for r in rounds if r.get("rollout/takeover_rate") is not None]
    if pts and any(y for _, y in pts):  # only runs with the simulated human have takeovers to show
        ax2 = ax.twinx()
        x, y = zip(*pts)
        ax2.plot(x, y, marker="s", linestyle="none", color="tab:red", label="takeovers / episode")
        ax2.set_ylabel("takeovers / episode", color="tab:red")
        ax2.set_ylim(bottom=0)
    ax.set_xlabel("env steps of RL rollouts")
    ax.set_ylabel("rollout success (%)")
    ax.set_ylim(0, 100)
    ax.set_title("training rollouts")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left")
    else:  # an SFT-only run, a run without rollouts (the control), or one stopped before its first round
        ax.text(0.5, 0.5, "no RL rollouts in this run", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, path)


DIAGNOSTIC_SKIP = {"round", "env_steps", "time", "cpu_s", "rollout/success", "rollout/episodes", "replay/episodes"}


def write_diagnostics(records: list[dict[str, Any]], path: Path) -> Path:
    """One small panel per numeric diagnostic the rounds logged (losses, critic fits, the success model's Brier and
    ECE, gate means, takeovers, ...), against the round."""
    rounds = [r for r in records if r.get("kind") == "round"]
    keys = sorted({k for r in rounds for k, v in r.items()
                   if k not in DIAGNOSTIC_SKIP and isinstance(v, (int, float)) and not isinstance(v, bool)})  # fmt: skip
    cols = 4
    rows = max(1, -(-len(keys) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r["round"], r[key]) for r in rounds if isinstance(r.get(key), (int, float)) and r.get(key) is not None]
        x, y = zip(*pts)
        ax.plot(x, y, marker="o")
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("round", fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    if not keys:
        axes.flat[0].text(0.5, 0.5, "no RL rounds in this run", ha="center", va="center", transform=axes.flat[0].transAxes)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path


def _fmt(r: dict[str, Any] | None, split: str) -> str:
    if not r or f"{split}/success" not in r:
        return "–"
    return f"{100 * r[f'{split}/success']:.0f} ± {100 * r[f'{split}/success_se']:.0f} % (n={r[f'{split}/episodes']})"


def _fmt_wrong(r: dict[str, Any] | None, split: str) -> str:
    share = (r or {}).get(f"{split}/wrong_target")
    return "–" if share is None else f"{100 * share:.0f} %"


def steps_to_success_lines(demos: dict[str, Any], sft: dict[str, Any] | None, final: dict[str, Any] | None) -> list[str]:
    """Mean steps to success (successful episodes, training templates) of the demonstrations, SFT and the policy
    after RL, and the demonstrator's over the policy's: above 1, the policy is faster than its demonstrator."""
    steps = {label: r.get(key) for label, r, key in (
        ("demonstrations", demos, "steps_to_success"), ("SFT", sft or {}, "train/steps_to_success"),
        ("after RL", final or {}, "train/steps_to_success"))}  # fmt: skip
    known = {label: v for label, v in steps.items() if v}
    if not known:
        return []
    text = "Mean steps to success: " + "; ".join(f"{label} {v:.1f}" for label, v in known.items())
    ratios = [f"{label} {steps['demonstrations'] / v:.2f}×" for label, v in known.items()
              if label != "demonstrations" and steps.get("demonstrations")]  # fmt: skip
    if ratios:
        text += " (demonstrations' steps over the policy's: " + ", ".join(ratios) + ")"
    return ["", text + "."]


def write_report(cfg: Any, records: list[dict[str, Any]], root: Path) -> Path:
    evals = [r for r in records if r.get("kind") == "eval"]
    sft = next((r for r in evals if r["stage"] == "sft"), None)
    final = next((r for r in reversed(evals) if r["stage"] == "final"), None)
    demos = next((r for r in records if r.get("kind") == "demos"), {})
    sft_record = next((r for r in records if r.get("kind") == "sft"), {})
    rounds = [r for r in records if r.get("kind") == "round"]
    kind = "scripted" if cfg.demos.source == "scripted" else "simulated-teleoperator"
    source = (f"{demos.get('episodes', '?')} successful episodes of {cfg.dataset}" if cfg.dataset else
              f"{demos.get('episodes', cfg.demos.episodes)} {kind} (noise {cfg.demos.noise})")  # fmt: skip
    if demos.get("weighted_steps_to_success"):
        source += (f"; drawn return-weighted (τ = {cfg.demos.temperature:g} steps: "
                   f"{demos['effective_episodes']:.1f} effective episodes, {demos['weighted_steps_to_success']:.1f} "
                   f"steps to success against {demos.get('steps_to_success') or float('nan'):.1f} unweighted)")
    if demos.get("idle_steps_dropped") is not None:
        source += (f"; {demos['idle_steps_dropped']} idle steps cut out (demos.idle drop: {demos.get('steps', '?')} "
                   "steps imitated)")
    sft_text = f"SFT {sft_record.get('steps', cfg.sft.steps)} steps" + (f" from {cfg.init_policy}" if cfg.init_policy else "")
    if cfg.rl.method == "none":
        rl_text = "no RL (rl.method none: SFT only)"
    else:
        rl_text = (f"RL {len(rounds)} of {cfg.rl.rounds} rounds × {cfg.rl.episodes_per_round} rollouts × "
                   f"{cfg.rl.updates_per_round} updates" + ("; simulated human in the loop" if cfg.rl.interventions and not cfg.robot.config else ""))
        if cfg.robot.config:
            taken = sum(r.get("robot/episodes_taken_over", 0) for r in rounds)
            seconds = sum(r.get("robot/seconds", 0.0) for r in rounds)
            rl_text += (f"; the rollouts ran on the robot `{cfg.robot.config}` through the ROS 2 policy node "
                        f"({taken} of {len(rounds) * cfg.rl.episodes_per_round} episodes taken over by a person, "
                        f"{seconds / 60:.1f} minutes on the robot; recorded in `robot/`)")
    evaluated = {split for r in evals for split in SPLITS if f"{split}/success" in r}
    lines = [
        f"# kinema train: {cfg.task}, method `{cfg.rl.method}`, seed {cfg.seed}",
        "",
        f"Demonstrations: {source}; {sft_text}; {rl_text}.",
        "",
        "Success on held-out evaluation seeds. The gain is paired: both evaluations ran the same seeds, and each "
        "episode's sampling noise is drawn from its seed, so the difference and its standard error are per seed.",
        "",
        "| split | SFT | after RL | gain (points, paired) | wrong target: SFT → after RL |",
        "|---|---|---|---|---|",
    ]
    for split in SPLITS:
        if (sft and f"{split}/success" in sft) or (final and f"{split}/success" in final):
            paired = paired_difference(sft, final, split) if sft and final else None
            gain = f"{100 * paired[0]:+.0f} ± {100 * paired[1]:.0f} (n={paired[2]})" if paired else "–"
            wrong = f"{_fmt_wrong(sft, split)} → {_fmt_wrong(final, split)}"
            lines.append(f"| {SPLIT_NAMES[split]} | {_fmt(sft, split)} | {_fmt(final, split)} | {gain} | {wrong} |")
    if any(f"{split}/wrong_target" in r for r in evals for split in SPLITS):
        lines += ["", "Wrong target: the share of episodes that reached a target the instruction did not name (the "
                      "other drawer, another object on the plate); each counts as a failure."]  # fmt: skip
    wanted = final_splits(cfg)
    if missing := [SPLIT_NAMES[s] for s in SPLITS if s not in evaluated and evals and s in wanted]:
        lines += ["", f"Not evaluated (not applicable to {cfg.task}): {', '.join(missing)}."]
    lines += steps_to_success_lines(demos, sft, final)
    first = next((r for r in evals if r.get("train/seeds")), None)
    if first:
        lines += ["", f"Evaluation seeds: {first['train/seeds'][0]}–{first['train/seeds'][-1]} per split at SFT and "
                      f"at the end ({cfg.eval.episodes} episodes); the evaluations between rounds run the first "
                      f"{cfg.eval.round_episodes} of them on the training templates."]  # fmt: skip
    if records and records[-1].get("cpu_s") is not None:
        wall = records[-1]["time"] - records[0]["time"] if len(records) > 1 and "time" in records[0] else None
        lines += ["", f"Compute: {records[-1]['cpu_s'] / 60:.1f} CPU-minutes (the run's process and its env workers; "
                      "work redone after a resume counts once)"
                      + (f"; {wall / 60:.1f} minutes of wall time from the first record to the last." if wall else ".")]
    videos = root / "videos"
    lines += [
        "",
        "![curves](curves.png)",
        "",
        "![diagnostics](diagnostics.png)",
        "",
    ]
    if (videos / "before_after.png").is_file():
        lines += [f"The same {cfg.eval.videos} seeds before and after RL ([video](videos/before_after.mp4); green "
                  "border: success, red: failure):", "", "![before and after](videos/before_after.png)", ""]  # fmt: skip
    lines += [
        "Videos: " + (", ".join(f"[{p.name}](videos/{p.name})" for p in sorted(videos.glob("*.mp4"))) or "none"),
        "",
        "Metrics: `metrics.jsonl` (one JSON object per line); checkpoints in `checkpoints/` "
        "(`policies.load_policy`); rollouts of every round in `rollouts/` (LeRobotDataset v3).",
    ]
    return write_text_atomic(root / "report.md", "\n".join(lines) + "\n")


def record_video_predictions(policy: Any, task: str, task_config: dict | None, image_size: int, path: Path, *, seed: int = VIDEO_SEED_OFFSET) -> dict:
    """One episode of a policy that predicts futures (`predicted_future_images`, the video policy), as an MP4: one
    frame per planned chunk, a row per camera with [observed now | predicted end of the chunk | observed then]
    (the chunk's end, t + chunk_size, clamped to the episode's last step). Returns what the MP4 shows (also written
    as `path` with .json)."""
    if not policy.predicts_frames:
        raise ValueError(f"{type(policy).__name__} does not predict future frames (--video-predictions needs policy.type video)")
    cameras, horizon = policy.config.cameras, policy.config.chunk_size
    runner = ChunkPolicy(policy)
    env = make(task, task_config, image_size=image_size)
    try:
        obs, _ = env.reset(seed=seed)
        seen, predicted, queue, success, planned_at = [], {}, [], False, []
        for step in range(env.config.horizon):
            seen.append({c: obs[f"observation.images.{c}"] for c in cameras})
            if not queue:
                batch = {k: (v[None] if isinstance(v, np.ndarray) else [v]) for k, v in obs.items()}
                runner.about_to_act([seed], [step])
                queue = list(runner(batch)[0])
                with torch.no_grad():
                    predicted[step] = {c: img[0].permute(1, 2, 0).cpu().numpy() for c, img in policy.predicted_future_images().items()}
                planned_at.append(step)
            obs, _, terminated, truncated, info = env.step(queue.pop(0))
            success = bool(info["is_success"])
            if terminated or truncated:
                break
        seen.append({c: obs[f"observation.images.{c}"] for c in cameras})
    finally:
        env.close()
    last = len(seen) - 1
    frames = []
    for t in planned_at:
        rows = []
        for c in cameras:
            guess = cv2.resize((predicted[t][c] * 255).round().astype(np.uint8), (image_size, image_size), interpolation=cv2.INTER_NEAREST)
            rows.append(np.concatenate([seen[t][c], guess, seen[min(t + horizon, last)][c]], axis=1))
        frames.append(np.concatenate(rows, axis=0))
    write_mp4(path, np.stack(frames), max(1.0, CONTROL_HZ / policy.config.n_action_steps))
    info = {"seed": seed, "success": success, "chunks": len(planned_at), "columns": ["observed now", "predicted (chunk end)", "observed (chunk end)"],
            "rows": list(cameras), "chunk_size": horizon}
    write_text_atomic(Path(path).with_suffix(".json"), json.dumps(info, indent=2))
    return info
