"""RL rounds on a robot through ROS 2 against the same rounds in simulation, from the same SFT checkpoint.

Per seed: one SFT run (`kinema train --rl.method none`), then two arms branched from its checkpoint with the same
method, rounds, episodes per round, updates and takeover budget (the simulated human's default monitor):

    loop     `kinema train --robot sim_panda` against `kinema sim-robot --person` over loopback DDS in real time: each
             episode through the policy node, a simulated person taking over through the takeover and Joy topics,
             every episode recorded, the round's checkpoint swapped into the running node
    in_sim   `kinema train --rl.interventions true`: the same rounds in simulation with the in-sim simulated human

Both arms end with the same evaluation in simulation (the run's seed's episodes, paired). Beside them, deploy
parity: the SFT checkpoint through `kinema deploy` against `kinema sim-robot` on the scenes of the first
`--parity-episodes` evaluation seeds, against `kinema eval`'s outcomes on the same seeds.

    python benchmarks/robot_loop.py                   # drawer, 2 seeds, 2 rounds x 8 episodes, habc with IR
    python benchmarks/robot_loop.py --quick           # 1 seed, 1 round x 2 episodes, tiny SFT: about a minute

Runs are folders under --out; a finished one is reused. Last line: one JSON object with loop.success,
in_sim.success, sft.success (means over seeds, training templates), takeovers_first_round and
takeovers_last_round (per episode, loop arm), episodes_recorded, steps_lost (recorded on the robot but missing from
what the rounds trained on: must be 0), seconds_per_round (on the robot) and deploy_parity (success through the
bridge minus `kinema eval` on the same checkpoint and seeds, points).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHOD = ["--rl.method", "habc", "--rl.interventions", "true", "--rl.habc.intervention_reweighting", "true",
          "--rl.habc.intervention_reweighting_after", "3"]  # fmt: skip  # vla_rl.py's habc_hil_ir
EVAL_SEED_OFFSET, RUN_SEED_STRIDE = 1_000_000, 10_000  # kinema.train.evaluate's: the episodes of a run's seed


def _env() -> dict[str, str]:
    from robot.transport.loopback import loopback_environment

    env = {**os.environ, "PYTHONPATH": str(ROOT), "MUJOCO_GL": "egl", "LP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("ROS_DOMAIN_ID", str(100 + os.getpid() % 100))  # a domain of its own
    return loopback_environment(env)


def _kinema(*args: str, log: Path, env: dict[str, str]) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "kinema.cli", *args], cwd=ROOT, env=env, stdout=open(log, "w"),
                            stderr=open(log.with_suffix(".err"), "w"))  # fmt: skip


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _finished(run: Path) -> bool:
    return (run / "state.json").exists() and bool(json.loads((run / "state.json").read_text()).get("final_done"))


def _train(run: Path, args: list[str], env: dict[str, str]) -> None:
    if _finished(run) or (run / "checkpoints" / "sft").is_dir() and "none" in args:
        return
    resume = ["--resume", str(run)] if (run / "state.json").exists() else [*args, "--out", str(run)]
    print(f"$ kinema train {' '.join(resume)}", flush=True)
    proc = _kinema("train", *resume, log=run.parent / "logs" / f"{run.name}.out", env=env)
    if proc.wait() != 0:
        raise SystemExit(f"{run}: kinema train failed; see {run.parent / 'logs' / f'{run.name}.err'}")


def _sim_robot(task: str, seed: int, person: bool, log: Path, env: dict[str, str], camera_rate: float) -> subprocess.Popen:
    return _kinema("sim-robot", "--task", task, "--seed", str(seed), "--backend", "dds", "--camera-rate", str(camera_rate),
                   *(["--person"] if person else []), log=log, env=env)  # fmt: skip


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _success(run: Path, stage: str) -> dict:
    record = next(r for r in reversed(_records(run)) if r.get("kind") == "eval" and r.get("stage") == stage)
    return {"success": record["train/success"], "outcomes": dict(zip(record["train/seeds"], record["train/outcomes"]))}


def deploy_parity(sft: Path, task: str, seed: int, episodes: int, seconds: float, folder: Path, env: dict[str, str],
                  camera_rate: float, inference: str) -> dict:
    """The SFT checkpoint through the bridge on the scenes of the first `episodes` evaluation seeds of run seed `seed`,
    against `kinema eval`'s outcomes (the SFT run's own evaluation) on the same seeds."""
    kept = folder / f"parity-{inference}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    first = EVAL_SEED_OFFSET + seed * RUN_SEED_STRIDE
    robot = _sim_robot(task, first, False, folder / "logs" / f"parity-{inference}-sim.out", env, camera_rate)
    try:
        time.sleep(3.0)
        deploy = _kinema("deploy", "--policy", str(sft / "checkpoints" / "sft"), "--backend", "dds", "--episodes",
                         str(episodes), "--duration", str(seconds), "--inference", inference,
                         log=folder / "logs" / f"parity-{inference}-deploy.out", env=env)  # fmt: skip
        if deploy.wait(episodes * (seconds + 30) + 60) != 0:
            raise SystemExit(f"kinema deploy failed; see {folder / 'logs' / f'parity-{inference}-deploy.err'}")
    finally:
        _stop(robot)
    lines = (folder / "logs" / f"parity-{inference}-deploy.out").read_text().splitlines()
    events = [json.loads(x) for x in lines if x.startswith("{")]
    bridge = [bool(r["success"]) for r in events if r.get("event") == "episode"]
    outcomes = _success(sft, "sft")["outcomes"]
    in_eval = [outcomes[s] for s in range(first, first + len(bridge))]
    result = {"episodes": len(bridge), "bridge": sum(bridge) / len(bridge), "eval": sum(in_eval) / len(in_eval)}
    # How the node acted: --inference auto turns asynchronous when inference slows (a loaded CPU), which costs success.
    stats = next((r["stats"] for r in events if r.get("event") == "summary"), {})
    result["sync_chunk_share"] = round(stats.get("sync_requests", 0) / max(1, stats.get("requests", 0)), 3)
    result["starved_ticks"] = stats.get("starved_ticks", 0)
    kept.write_text(json.dumps(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="drawer")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=8, help="episodes per round, on the robot and in simulation")
    parser.add_argument("--updates", type=int, default=300, help="actor updates per round")
    parser.add_argument("--eval-episodes", type=int, default=100, help="per split, final evaluation in simulation")
    parser.add_argument("--parity-episodes", type=int, default=20)
    parser.add_argument("--camera-rate", type=float, default=30.0,
                        help="the sim robot's cameras in Hz (kinema sim-robot's; the state is 100 Hz, control 20 Hz)")
    from robot.policy_node import INFERENCE_MODES

    parser.add_argument("--inference", choices=INFERENCE_MODES, default="auto",
                        help="the policy node's, in the loop and the parity run (kinema deploy --inference); the loop "
                        "trains in loop-<mode>/")
    parser.add_argument("--out", default="runs/robot_loop")
    parser.add_argument("--quick", action="store_true")
    args, extra = parser.parse_known_args()
    sft_args = ["--task", args.task, "--rl.method", "none", "--eval.videos", "0", "--eval.heldout", "false"]
    arm_args = [*METHOD, "--task", args.task, "--rl.rounds", str(args.rounds), "--rl.episodes_per_round", str(args.episodes),
                "--rl.updates_per_round", str(args.updates), "--eval.baseline", "false", "--eval.videos", "0",
                "--eval.heldout", "false"]  # fmt: skip
    if args.quick:
        args.seeds, args.rounds, args.episodes, args.parity_episodes, args.eval_episodes = 1, 1, 2, 2, 4
        sft_args += ["--demos.episodes", "4", "--sft.steps", "20", "--workers", "0"]
        arm_args = [*METHOD, "--task", args.task, "--rl.rounds", "1", "--rl.episodes_per_round", "2",
                    "--rl.updates_per_round", "5", "--eval.baseline", "false", "--eval.videos", "0", "--eval.heldout",
                    "false", "--eval.round_episodes", "2", "--workers", "0", "--num_envs", "2"]  # fmt: skip
        args.out += "-quick"
    sft_args += ["--eval.episodes", str(args.eval_episodes), *extra]
    arm_args += ["--eval.episodes", str(args.eval_episodes), *extra]
    env = _env()
    from sim.tasks import make

    probe = make(args.task, cameras=())
    seconds = probe.config.horizon / 20.0  # the sim's horizon at the robot's 20 Hz: the same time either way
    probe.close()
    per_seed = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        folder = Path(args.out) / args.task / f"s{seed}"
        sft = folder / "sft"
        _train(sft, [*sft_args, "--seed", str(seed)], env)
        start = ["--init_policy", str(sft / "checkpoints" / "sft"), "--seed", str(seed)]
        _train(folder / "in_sim", [*arm_args, *start], env)
        loop = folder / f"loop-{args.inference}"
        if not _finished(loop):
            robot = _sim_robot(args.task, 5000 + 100 * seed, True, folder / "logs" / f"{loop.name}-sim.out", env, args.camera_rate)
            try:
                _train(loop, [*arm_args, *start, "--robot", "sim_panda", "--robot.backend", "dds",
                              "--robot.episode_seconds", str(seconds), "--robot.inference", args.inference], env)  # fmt: skip
            finally:
                _stop(robot)
        parity = deploy_parity(sft, args.task, seed, args.parity_episodes, seconds, folder, env, args.camera_rate, args.inference)
        rounds = [r for r in _records(loop) if r.get("kind") == "round"]
        from diffusion_rl.data.lerobot_v3 import LeRobotDatasetReader

        recorded = [r for r in LeRobotDatasetReader(loop / "robot" / "dataset").meta.episodes if r.get("complete", True)]
        trained = sum(LeRobotDatasetReader(p).meta.info["total_frames"] for p in sorted((loop / "rollouts").glob("round-*")))
        per_seed.append({
            "seed": seed, "sft": _success(sft, "sft")["success"], "loop": _success(loop, "final")["success"],
            "in_sim": _success(folder / "in_sim", "final")["success"],
            "takeovers_first_round": rounds[0].get("rollout/takeover_rate"), "takeovers_last_round": rounds[-1].get("rollout/takeover_rate"),
            "episodes_recorded": len(recorded), "steps_lost": sum(int(r["length"]) for r in recorded) - trained,
            "seconds_per_round": sum(r.get("robot/seconds", 0.0) for r in rounds) / len(rounds),
            "deploy_parity": round(100 * (parity["bridge"] - parity["eval"]), 1), "parity": parity,
        })  # fmt: skip
        print(json.dumps(per_seed[-1]), flush=True)

    def mean(key: str) -> float:
        return round(sum(s[key] for s in per_seed) / len(per_seed), 3)

    print(json.dumps({
        "task": args.task, "seeds": len(per_seed), "rounds": args.rounds, "episodes_per_round": args.episodes,
        "camera_rate": args.camera_rate, "inference": args.inference,
        "loop": {"success": mean("loop")}, "in_sim": {"success": mean("in_sim")}, "sft": {"success": mean("sft")},
        "loop_minus_in_sim": round(mean("loop") - mean("in_sim"), 3),
        "takeovers_first_round": mean("takeovers_first_round"), "takeovers_last_round": mean("takeovers_last_round"),
        "episodes_recorded": sum(s["episodes_recorded"] for s in per_seed), "steps_lost": sum(s["steps_lost"] for s in per_seed),
        "seconds_per_round": mean("seconds_per_round"), "deploy_parity": mean("deploy_parity"), "per_seed": per_seed,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
