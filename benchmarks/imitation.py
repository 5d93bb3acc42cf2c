"""Imitation against the implementations users already trust: kinema's VLA, LeRobot's ACT and LeRobot's Diffusion
Policy, trained from scratch on the same kinema demonstration folder and scored by kinema's own evaluation on the same
episodes, seeds and splits (strict success; wrong-target outcomes are failures).

The kinema arm is `kinema train --rl.method none --sft.steps N` (the default config's demos and seed). Each peer is
LeRobot's own code, in LeRobot's venv (`--lerobot-python`, or KINEMA_LEROBOT_PYTHON; see benchmarks/lerobot_peer.py
for how the instruction reaches a policy that takes no language), trained on the kinema arm's `demos/` folder at the
same gradient steps and batch; one peer run also saves its checkpoint where its CPU time reaches the kinema arm's SFT
CPU time (`<peer>@cpu`: equal CPU-minutes). Peer settings beyond LeRobot's defaults, for kinema's 20 Hz control and
its CPU: ACT chunk_size 20 with n_action_steps 10 (LeRobot's 100 is 2 s at 50 Hz); DP acts with DDIM in 10 steps
(its 100 DDPM steps cost about 1 s a chunk here), trained as LeRobot trains it.

    python benchmarks/imitation.py --lerobot-python /path/to/lerobot-venv/bin/python           # drawer, 2000 steps
    python benchmarks/imitation.py --steps 1000 --arms kinema,act --episodes 100
    python benchmarks/imitation.py --quick           # kinema and a tiny ACT, 6 demos, 10 steps, 4 episodes: under a minute

LeRobot's venv: `python3.11 -m venv V && V/bin/pip install torch==2.14.1 torchvision==0.29.1 && V/bin/pip install
--no-deps lerobot==0.4.4 && V/bin/pip install "datasets>=4,<5" "diffusers<0.36" "huggingface-hub<0.36" "einops<0.9"
draccus==0.10.0 "gymnasium>=1.1.1,<2" "av>=15,<16" jsonlines "imageio[ffmpeg]" termcolor "deepdiff<9" "packaging<26"
"accelerate>=1.10,<2" "opencv-python-headless<4.13" pyserial` (torchvision is ACT's and DP's ResNet-18; lerobot's own
torch < 2.11 pin is why --no-deps).

Arms already finished under --out are reused (a killed benchmark continues). Last line: one JSON object, per arm
`success` (training templates), `heldout_success` (mean of the held-out splits), `ablated_success`, `cpu_minutes`
(training only), `steps`; and `kinema_over_best_peer` (kinema's success over the better peer's at equal steps).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PEERS = ("act", "diffusion")
PEER_SETTINGS = {
    "act": ["chunk_size=20", "n_action_steps=10"],
    "diffusion": ['noise_scheduler_type="DDIM"', "num_inference_steps=10"],
}
# --quick: LeRobot's architectures at a size that trains in seconds (the ResNet-18 encoders stay).
QUICK_SETTINGS = {
    "act": ["chunk_size=8", "n_action_steps=4", "dim_model=32", "n_heads=2", "dim_feedforward=64", "n_encoder_layers=1",
            "n_vae_encoder_layers=1", "latent_dim=8"],  # fmt: skip
    "diffusion": ['noise_scheduler_type="DDIM"', "num_inference_steps=2", "num_train_timesteps=10", "horizon=8",
                  "n_action_steps=4", "drop_n_last_frames=3", "down_dims=[16,32]", "diffusion_step_embed_dim=16",
                  "n_groups=4", "spatial_softmax_num_keypoints=8"],  # fmt: skip
}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def kinema_arm(run: Path, *, task: str, steps: int, seed: int, extra: list[str]) -> dict:
    """kinema's SFT (skipped when `run` holds it): steps, SFT CPU-minutes, the demos folder."""
    if not (run / "checkpoints" / "sft").is_dir() or not any(r.get("kind") == "sft" for r in _records(run)):
        command = [sys.executable, "-m", "kinema.cli", "train", "--task", task, "--out", str(run), "--seed", str(seed),
                   "--rl.method", "none", "--sft.steps", str(steps), "--eval.episodes", "1", "--eval.heldout", "false",
                   "--eval.videos", "0", *extra]  # fmt: skip
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    records = _records(run)
    demos = next(r for r in records if r.get("kind") == "demos")
    trained = next(r for r in records if r.get("kind") == "sft")  # logged as SFT ends, before its evaluation
    return {"steps": steps, "cpu_minutes": round((trained["cpu_s"] - demos["cpu_s"]) / 60, 2), "demos": str(run / "demos")}


def peer_arm(python: str, arm: Path, budget: Path, *, policy: str, demos: str, steps: int, batch_size: int, seed: int,
             budget_cpu_minutes: float, settings: list[str]) -> None:  # fmt: skip
    """Train one peer in LeRobot's venv (skipped when both its checkpoints exist)."""
    if (arm / "peer.json").is_file() and (budget / "peer.json").is_file():
        return
    command = [python, str(HERE / "lerobot_peer.py"), "train", "--policy", policy, "--dataset", demos, "--out", str(arm),
               "--steps", str(steps), "--batch-size", str(batch_size), "--seed", str(seed),
               "--budget-cpu-minutes", str(budget_cpu_minutes), "--budget-out", str(budget),
               *[f"--set={s}" for s in settings]]  # fmt: skip
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


class PeerProcess:
    """A LeRobot checkpoint acting for kinema's `collect` from LeRobot's venv (lerobot_peer.py serve): the batched
    policy interface (`__call__(obs) -> (B, action_dim)`, `reset(env_indices)`) over a pipe."""

    def __init__(self, python: str, checkpoint: Path) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([python, str(HERE / "lerobot_peer.py"), "serve", "--checkpoint", str(checkpoint)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)  # fmt: skip
        self.info = self._receive()["ready"]

    def _send(self, obj: Any) -> Any:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(struct.pack("<Q", len(data)) + data)
        self.proc.stdin.flush()
        return self._receive()

    def _receive(self) -> Any:
        head = self.proc.stdout.read(8)
        if len(head) < 8:
            raise RuntimeError(f"the LeRobot peer process ended (exit {self.proc.wait()}); its stderr says why")
        answer = pickle.loads(self.proc.stdout.read(struct.unpack("<Q", head)[0]))
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer

    def reset(self, env_indices: Any) -> None:
        self._send({"cmd": "reset", "envs": [int(i) for i in np.atleast_1d(env_indices)]})

    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        return self._send({"cmd": "act", "obs": obs})["actions"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def evaluate_arm(folder: Path, make_runner: Any, *, task: str, splits: list[str], episodes: int, seed: int, workers: int,
                 image_size: int) -> dict:  # fmt: skip
    """Success per split through kinema's evaluation (`make_runner()`: what acts), kept in `folder` (a rerun reads it
    back)."""
    from kinema.train.evaluate import evaluate
    from policies.checkpoint import write_text_atomic
    from sim.tasks import SplitNotApplicable

    kept = folder / f"imitation-eval-seed{seed}-{episodes}.json"
    results = json.loads(kept.read_text()) if kept.is_file() else {}
    for split in splits:
        if split in results:
            continue
        try:
            res, _ = evaluate(None, task, episodes=episodes, split=split, num_workers=workers, seed=seed, image_size=image_size,
                              runner=make_runner())  # fmt: skip
        except SplitNotApplicable:
            results[split] = None
        else:
            results[split] = {"success": round(res.success, 3), "wrong_target": res.wrong_target, "episodes": res.episodes}
        write_text_atomic(kept, json.dumps(results, indent=2))
        print(json.dumps({"arm": folder.name, split: results[split]}), flush=True)
    return results


def summary(results: dict, cpu_minutes: float, steps: int) -> dict:
    held = [r["success"] for s, r in results.items() if s.startswith("heldout") and r is not None]
    ablated = results.get("ablated_instructions")
    return {"success": results["train"]["success"], "heldout_success": round(float(np.mean(held)), 3) if held else None,
            "ablated_success": ablated["success"] if ablated else None, "cpu_minutes": cpu_minutes, "steps": steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="drawer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=2000, help="gradient steps for every arm (kinema's default sft.steps)")
    parser.add_argument("--batch-size", type=int, default=64, help="kinema's sft.batch_size")
    parser.add_argument("--arms", default=None, help="default kinema,act,diffusion (--quick: kinema,act)")
    parser.add_argument("--episodes", type=int, default=100, help="per split")
    parser.add_argument("--splits", default="train,heldout_instructions,heldout_objects,ablated_instructions")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lerobot-python", default=os.environ.get("KINEMA_LEROBOT_PYTHON"))
    parser.add_argument("--peer-set", action="append", default=[], metavar="POLICY:KEY=VALUE",
                        help="a peer config field on top of the settings above, e.g. diffusion:down_dims=[128,256,512]; "
                             "the arm's folder and JSON name say so")  # fmt: skip
    parser.add_argument("--out", default="runs/imitation")
    parser.add_argument("--quick", action="store_true")
    args, extra = parser.parse_known_args()
    os.environ.setdefault("MUJOCO_GL", "egl")
    arms = [a.strip() for a in (args.arms or ("kinema,act" if args.quick else "kinema,act,diffusion")).split(",")]
    if bad := [a for a in arms if a not in ("kinema", *PEERS)]:
        raise SystemExit(f"--arms: unknown {bad}; valid: kinema, {', '.join(PEERS)}")
    if "kinema" not in arms:
        raise SystemExit("--arms must include kinema: its run collects the demos the peers train on, and is the reference")
    settings = PEER_SETTINGS
    if args.quick:
        args.steps, args.batch_size, args.episodes, args.workers = 10, 4, 4, 0
        args.splits = "train"
        extra += ["--demos.episodes", "6", "--sft.batch_size", "8"]
        settings = QUICK_SETTINGS
        args.out += "-quick"
    if any(a in PEERS for a in arms) and not args.lerobot_python:
        raise SystemExit("the ACT and Diffusion Policy arms run LeRobot's code from its own venv: give --lerobot-python "
                         "(or KINEMA_LEROBOT_PYTHON); the module docstring says how to build it")  # fmt: skip
    extra_settings: dict[str, list[str]] = {}
    for item in args.peer_set:
        policy, sep, setting = item.partition(":")
        if not sep or policy not in PEERS or "=" not in setting:
            raise SystemExit(f"--peer-set {item!r}: expected POLICY:KEY=VALUE with POLICY one of {', '.join(PEERS)}")
        extra_settings.setdefault(policy, []).append(setting)
    splits = [s.strip() for s in args.splits.split(",")]
    root = Path(args.out) / args.task / f"s{args.seed}"
    run = root / f"kinema-steps{args.steps}"
    kin = kinema_arm(run, task=args.task, steps=args.steps, seed=args.seed, extra=extra)

    from kinema.train.acting import load_acting

    loaded = load_acting(run / "checkpoints" / "sft")
    image_size = loaded.policy.config.image_size
    common = dict(task=args.task, splits=splits, episodes=args.episodes, seed=args.seed, workers=args.workers, image_size=image_size)
    rows = {"kinema": summary(evaluate_arm(run, loaded.acting.make, **common), kin["cpu_minutes"], args.steps)}
    for policy in (a for a in arms if a in PEERS):
        variant = policy + "".join("-" + re.sub(r"[^A-Za-z0-9_]+", "_", s).strip("_") for s in extra_settings.get(policy, []))
        arm, budget = root / f"{variant}-steps{args.steps}", root / f"{variant}-cpu{kin['cpu_minutes']:g}"
        peer_arm(args.lerobot_python, arm, budget, policy=policy, demos=kin["demos"], steps=args.steps, batch_size=args.batch_size,
                 seed=args.seed, budget_cpu_minutes=kin["cpu_minutes"], settings=settings[policy] + extra_settings.get(policy, []))  # fmt: skip
        if variant != policy:
            print(f"{policy}: {variant} ({', '.join(extra_settings[policy])} on top of {settings[policy]})", flush=True)
        for name, folder in ((policy, arm), (f"{policy}@cpu", budget)):
            peer = PeerProcess(args.lerobot_python, folder)
            try:
                results = evaluate_arm(folder, lambda: peer, **common)
            finally:
                peer.close()
            rows[name] = {**summary(results, peer.info["cpu_minutes"], peer.info["steps"]), "parameters": peer.info["parameters"],
                          "settings": settings[policy] + extra_settings.get(policy, [])}  # fmt: skip
        print(json.dumps({policy: rows[policy], f"{policy}@cpu": rows[f"{policy}@cpu"]}), flush=True)
    peers = [rows[p]["success"] for p in PEERS if p in rows]
    best = max(peers) if peers else None
    print(json.dumps({
        "task": args.task, "seed": args.seed, "episodes": args.episodes, "steps": args.steps, "batch_size": args.batch_size,
        **rows, "kinema_over_best_peer": None if not best else round(rows["kinema"]["success"] / best, 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
