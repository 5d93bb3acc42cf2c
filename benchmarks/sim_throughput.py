"""Simulation throughput: kinema's env steps/s against the raw MuJoCo physics and render limits, in one run.

- physics limit: the same model replaying the same joint targets with raw `mj_step` (no Python env layer),
  converted to control steps/s (25 physics steps each);
- render limit: raw `mujoco.Renderer` frames of the same two cameras at the same size;
- ratio_state  = state-only env steps/s / physics limit;
- ratio_camera = camera env steps/s / (1 / (physics time per control step + render time of both cameras));
  each the median over short blocks that measure the subject and its reference back to back, with its IQR.

`--teleop` measures the demonstrators instead: per task, the simulated teleoperator's success and mean steps to
success (`demos.source teleop`) against the scripted expert's on the same seeds, and their ratio.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("LP_NUM_THREADS", "1")

import mujoco
import numpy as np

from sim.env import SUBSTEPS
from sim.experts import ExpertConfig, make_expert
from sim.rollout import make_vector
from sim.tasks import TASKS, make


def env_rate(task: str, steps: int, cameras: tuple[str, ...], size: int) -> tuple[float, np.ndarray, np.ndarray]:
    """Env steps/s under random actions; also returns the start state and the joint targets it produced."""
    env = make(task, image_size=size, cameras=cameras)
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, (steps, 7)).astype(np.float32)
    env.reset(seed=0)
    start = env.get_state()
    ctrls = np.zeros((steps, env.model.nu))
    for a in actions[:20]:  # warm-up: renderer context, caches
        env.step(a)
    env.set_state(start)
    t0 = time.perf_counter()
    for i, a in enumerate(actions):
        env.step(a)
        ctrls[i] = env.data.ctrl
    dt = time.perf_counter() - t0
    env.close()
    return steps / dt, start, ctrls


def physics_rate(task: str, start: np.ndarray, ctrls: np.ndarray) -> float:
    env = make(task, cameras=())
    env.reset(seed=0)
    m, d = env.model, env.data
    mujoco.mj_setState(m, d, start, mujoco.mjtState.mjSTATE_INTEGRATION)
    t0 = time.perf_counter()
    for ctrl in ctrls:
        d.ctrl[:] = ctrl
        mujoco.mj_step(m, d, nstep=SUBSTEPS)
    return len(ctrls) / (time.perf_counter() - t0)


def render_rate(task: str, size: int, frames: int) -> float:
    """Frames/s of raw Renderer calls for the two policy cameras, alternating like the env does."""
    env = make(task, cameras=())
    env.reset(seed=0)
    renderer = mujoco.Renderer(env.model, size, size)
    for _ in range(10):
        renderer.update_scene(env.data, camera="agentview")
        renderer.render()
    t0 = time.perf_counter()
    for i in range(frames):
        renderer.update_scene(env.data, camera="agentview" if i % 2 == 0 else "wrist")
        renderer.render()
    rate = frames / (time.perf_counter() - t0)
    renderer.close()
    return rate


def vector_rate(task: str, num_envs: int, workers: int, steps: int, size: int, cameras: tuple[str, ...]) -> float:
    vector = make_vector(task, num_envs, num_workers=workers, image_size=size, cameras=cameras)
    rng = np.random.default_rng(0)
    try:
        for i in range(num_envs):
            vector.reset_at(i, i)
        for _ in range(5):
            vector.step(rng.uniform(-1, 1, (num_envs, 7)))
        t0 = time.perf_counter()
        for _ in range(steps):
            _, _, term, trunc, _ = vector.step(rng.uniform(-1, 1, (num_envs, 7)))
            for i in np.flatnonzero(term | trunc):
                vector.reset_at(int(i), int(i) + 100)
        return steps * num_envs / (time.perf_counter() - t0)
    finally:
        vector.close()


def demonstrator(task: str, operator: str, seeds: range) -> tuple[float, float]:
    """Success rate and mean steps to success (successful episodes) of one demonstrator over `seeds`."""
    env = make(task, cameras=())
    steps = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        expert = make_expert(env, ExpertConfig(operator=operator), seed=seed)
        for t in range(env.config.horizon):
            obs, _, terminated, truncated, info = env.step(expert(obs))
            if terminated or truncated:
                if info["is_success"]:
                    steps.append(t + 1)
                break
    env.close()
    return len(steps) / len(seeds), float(np.mean(steps)) if steps else float("nan")


def teleop_quality(seeds: range) -> dict:
    out = {}
    for task in TASKS:
        (clean_success, clean_steps), (success, steps) = (demonstrator(task, op, seeds) for op in ("scripted", "teleop"))
        out[task] = {"scripted_success": clean_success, "scripted_steps_to_success": round(clean_steps, 1),
                     "teleop_success": success, "teleop_steps_to_success": round(steps, 1),
                     "steps_ratio": round(steps / clean_steps, 2)}  # fmt: skip
        print(f"{task:<11} scripted {clean_success:.0%} in {clean_steps:.1f} steps; teleop {success:.0%} in {steps:.1f} "
              f"steps ({steps / clean_steps:.2f}x)", flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (< 1 minute)")
    parser.add_argument("--teleop", action="store_true",
                        help="the demonstrators instead: the simulated teleoperator against the scripted expert, per task")
    parser.add_argument("--task", default="pick_place")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=4)
    args = parser.parse_args()
    if args.teleop:
        seeds = range(20 if args.quick else 100)
        print(json.dumps({"benchmark": "sim_throughput --teleop", "quick": args.quick, "seeds": len(seeds),
                          "tasks": teleop_quality(seeds)}))  # fmt: skip
        return
    cams = ("agentview", "wrist")
    # Each ratio is measured in short blocks, the subject and its reference back to back, so that whatever else the
    # machine does in a block hits both sides of that block's ratio alike; the median over blocks is reported, with
    # its spread (the 25th-75th percentiles).
    blocks, steps = (20, 60) if args.quick else (40, 150)
    state_rates, physics_rates, camera_rates, frame_rates, ratio_state, ratio_camera = ([] for _ in range(6))
    for _ in range(blocks):
        rate, start, ctrls = env_rate(args.task, steps, (), args.size)
        physics = physics_rate(args.task, start, ctrls)
        state_rates.append(rate), physics_rates.append(physics), ratio_state.append(rate / physics)
        camera = env_rate(args.task, steps, cams, args.size)[0]
        frames = render_rate(args.task, args.size, 2 * steps)
        physics = physics_rate(args.task, start, ctrls)
        camera_rates.append(camera), frame_rates.append(frames)
        ratio_camera.append(camera / (1.0 / (1.0 / physics + 2.0 / frames)))
    state_rate, physics, camera_rate, frames = map(np.median, (state_rates, physics_rates, camera_rates, frame_rates))
    combined_limit = 1.0 / (1.0 / physics + 2.0 / frames)
    num_envs = args.workers * args.envs_per_worker
    vec_steps = max(250 // num_envs, 40) * (2 if args.quick else 6)
    vec = vector_rate(args.task, num_envs, args.workers, vec_steps, args.size, cams)
    vec_state = vector_rate(args.task, num_envs, args.workers, vec_steps, args.size, ())

    result = {
        "benchmark": "sim_throughput",
        "task": args.task,
        "quick": args.quick,
        "image_size": args.size,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}, mujoco {mujoco.__version__}",
        "state_steps_per_s": round(state_rate, 1),
        "camera_steps_per_s": round(camera_rate, 1),
        "vector_camera_steps_per_s": round(vec, 1),
        "vector_state_steps_per_s": round(vec_state, 1),
        # Reference for the vector rates: perfect scaling of the single-env rates over the workers.
        "vector_camera_scaling": round(vec / (args.workers * camera_rate), 3),
        "vector_state_scaling": round(vec_state / (args.workers * state_rate), 3),
        "vector_workers": args.workers,
        "vector_envs": num_envs,
        "physics_limit_steps_per_s": round(physics, 1),
        "render_limit_steps_per_s": round(frames / 2, 1),
        "combined_limit_steps_per_s": round(combined_limit, 1),
        "blocks": blocks,
        "ratio_state": round(float(np.median(ratio_state)), 3),
        "ratio_state_iqr": [round(float(q), 3) for q in np.percentile(ratio_state, [25, 75])],
        "ratio_camera": round(float(np.median(ratio_camera)), 3),
        "ratio_camera_iqr": [round(float(q), 3) for q in np.percentile(ratio_camera, [25, 75])],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
