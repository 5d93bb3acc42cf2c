"""Where does supervised flow matching on the demos stop paying? SFT budgets chosen on validation episodes.

Each arm is one `kinema train --rl.method none` run (the default config's demos, its seed, one SFT of `steps` gradient
steps on its own cosine schedule at `lr`). Every arm is scored on two disjoint sets of evaluation episodes:
validation (the episodes of `kinema eval --seed VAL_SEED`, training templates) chooses the budget; test (the run's own
SFT evaluation on its seed's episodes, every split) reports it. The chosen budget is the smallest whose validation
success is within one standard error of the best arm's. The reference is the default budget (`sft.steps` 1000),
measured in the same run.

    python benchmarks/sft_plateau.py                              # drawer, 1000-6000 steps, 100 episodes per split
    python benchmarks/sft_plateau.py --steps 1000,3000 --lrs 3e-4,1e-3
    python benchmarks/sft_plateau.py --quick                      # 2 tiny budgets, 6 demos, 8 episodes: under a minute

Arms already finished under --out are reused (a killed benchmark continues). Last line: one JSON object with each
arm's validation and test success, CPU-minutes, the chosen arm and chosen_over_reference (test success ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REFERENCE_STEPS = 1000  # kinema train's default sft.steps when this benchmark was written


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_arm(run: Path, *, task: str, steps: int, lr: float, episodes: int, seed: int, extra: list[str]) -> dict:
    """The arm's SFT (skipped when `run` already holds it) and its test evaluation record."""
    if not (run / "checkpoints" / "sft").is_dir() or not any(r.get("stage") == "sft" for r in _records(run)):
        command = [sys.executable, "-m", "kinema.cli", "train", "--task", task, "--out", str(run), "--seed", str(seed),
                   "--rl.method", "none", "--sft.steps", str(steps), "--sft.lr", str(lr), "--eval.episodes", str(episodes),
                   "--eval.videos", "0", *extra]  # fmt: skip
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    records = _records(run)
    test = next(r for r in records if r.get("kind") == "eval" and r.get("stage") == "sft")
    cpu = next((r["cpu_s"] for r in reversed(records) if "cpu_s" in r), None)
    return {"test": test, "cpu_minutes": None if cpu is None else round(cpu / 60, 2)}


def validate(run: Path, *, task: str, episodes: int, seed: int) -> dict:
    """Success of the arm's SFT checkpoint on the validation episodes (training templates), kept in the run."""
    kept = run / f"validation-seed{seed}-{episodes}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    from kinema.train.acting import load_acting
    from kinema.train.evaluate import evaluate
    from policies.checkpoint import write_text_atomic

    cfg = json.loads(json.dumps(__import__("yaml").safe_load((run / "config.yaml").read_text())))
    loaded = load_acting(run / "checkpoints" / "sft")
    result, _ = evaluate(loaded.policy, task, episodes=episodes, split="train", num_envs=cfg["num_envs"],
                         num_workers=cfg["workers"], image_size=cfg["policy"]["image_size"],
                         task_config=cfg.get("task_config") or None, seed=seed, runner=loaded.acting.make())  # fmt: skip
    record = {"success": result.success, "episodes": episodes, "seed": seed}
    write_text_atomic(kept, json.dumps(record))
    return record


def _se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 1e-12) / max(n, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="drawer")
    parser.add_argument("--steps", default="1000,2000,3000,4500,6000", help="comma-separated SFT budgets (gradient steps)")
    parser.add_argument("--lrs", default="3e-4", help="comma-separated SFT learning rates (each budget at each)")
    parser.add_argument("--episodes", type=int, default=100, help="episodes per split, validation and test alike")
    parser.add_argument("--seed", type=int, default=0, help="the runs' seed (demos, SFT, test episodes)")
    parser.add_argument("--val-seed", type=int, default=1, help="validation episodes: those of `kinema eval --seed`")
    parser.add_argument("--out", default="runs/sft_plateau")
    parser.add_argument("--quick", action="store_true")
    args, extra = parser.parse_known_args()
    os.environ.setdefault("MUJOCO_GL", "egl")
    if args.quick:
        args.steps, args.episodes = "20,60", 8
        extra += ["--demos.episodes", "6", "--eval.heldout", "false"]
        args.out += "-quick"
    budgets = [int(s) for s in args.steps.split(",")]
    lrs = [float(x) for x in args.lrs.split(",")]
    reference = (REFERENCE_STEPS if not args.quick else budgets[0], 3e-4 if 3e-4 in lrs else lrs[0])
    arms = sorted({(s, lr) for s in budgets for lr in lrs} | {reference})
    rows = {}
    for steps, lr in arms:
        name = f"steps{steps}-lr{lr:g}"
        run = Path(args.out) / args.task / f"s{args.seed}" / name
        arm = train_arm(run, task=args.task, steps=steps, lr=lr, episodes=args.episodes, seed=args.seed, extra=extra)
        val = validate(run, task=args.task, episodes=args.episodes, seed=args.val_seed)
        splits = {k.split("/")[0]: round(v, 3) for k, v in arm["test"].items() if k.endswith("/success")}
        rows[name] = {"steps": steps, "lr": lr, "validation_success": round(val["success"], 3), "test": splits,
                      "cpu_minutes": arm["cpu_minutes"]}  # fmt: skip
        print(json.dumps({name: rows[name]}), flush=True)
    best = max(rows.values(), key=lambda r: r["validation_success"])
    floor = best["validation_success"] - _se(best["validation_success"], args.episodes)
    chosen_name, chosen = min(((n, r) for n, r in rows.items() if r["validation_success"] >= floor),
                              key=lambda item: (item[1]["steps"], -item[1]["validation_success"]))  # fmt: skip
    ref_name = f"steps{reference[0]}-lr{reference[1]:g}"
    ref_test, chosen_test = rows[ref_name]["test"].get("train"), chosen["test"].get("train")
    print(json.dumps({
        "task": args.task, "seed": args.seed, "val_seed": args.val_seed, "episodes": args.episodes, "arms": rows,
        "reference": ref_name, "chosen": chosen_name,
        "chosen_over_reference": None if not ref_test else round(chosen_test / ref_test, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
