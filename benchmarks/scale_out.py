"""Scale-out: Ray rollout actors against local env worker processes, the weight broadcast, and the data-parallel
learner's step against one process, measured in one run; then a projection to 8 and 64 nodes.

- rollouts: env steps/s of one round (the same seeds, the same tiny VLA acting, push) on `rollout.backend ray` with
  1 and 2 actors against `local` (ProcessVector) with as many worker processes and the same envs per worker;
  `ray_vs_local_ratio` is Ray's over local's at 2 workers. Both are timed once started (the local workers' start,
  paid every `kinema train` round, is `local_worker_start_s_N`; the Ray actors', once per run, `ray_actor_start_s`).
  Also per CPU second of this process tree (env workers, the local Ray and its actors): the fair measure on a machine
  whose other load decides each process's share of the cores (`ray_vs_local_cpu_ratio_N`);
- broadcast: the weights' ray.put per round, its time and bytes (the tiny VLA that acts here, and the default one);
- DDP: the actor step's time with 2 gloo ranks on half the batch each against one process on the whole batch
  (`ddp_step_ratio` = 2-rank step time / 1-process step time; < 1 is a speed-up);
- projection (labelled as such): a round's time on N nodes of this machine's size from the measured per-part costs.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("LP_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.multiprocessing as mp

from kinema.train.actor import actor_step
from kinema.cputime import tree_cpu_seconds
from kinema.train.buffer import StepBuffer
from kinema.train.evaluate import ChunkPolicy
from policies.vla import VLAConfig, VLAPolicy
from sim.env import CAMERAS
from sim.rollout import collect, collect_demos, make_vector


def tiny_policy(image_size: int) -> VLAPolicy:
    torch.manual_seed(0)
    return VLAPolicy(VLAConfig(
        image_size=image_size, vision_channels=(8, 16, 16), vision_dim=32, text_dim=16, hidden_dim=32, expert_hidden=64,
        expert_layers=2, state_hidden=16, chunk_size=4, n_action_steps=2, num_flow_steps=4,
    )).eval()  # fmt: skip


def note(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def local_rate(policy, workers: int, envs_per_worker: int, seeds: list[int], env_kwargs: dict) -> tuple[float, float, float]:
    """(env steps per wall second and per CPU second (this process tree) of one round on a started ProcessVector,
    the seconds its workers took to start)."""
    t0 = time.perf_counter()
    vector = make_vector("push", workers * envs_per_worker, num_workers=workers, **env_kwargs)
    for i in range(vector.num_envs):
        vector.reset_at(i, 0)  # every worker up, its renderer made
    started = time.perf_counter() - t0
    try:
        t0, c0 = time.perf_counter(), tree_cpu_seconds()
        episodes = collect(vector, ChunkPolicy(policy), seeds, task_id="push")
        steps = sum(len(ep) for ep in episodes)
        return steps / (time.perf_counter() - t0), steps / (tree_cpu_seconds() - c0), started
    finally:
        vector.close()


def ray_rate(pool, policy, seeds: list[int]) -> tuple[float, float, dict]:
    """(env steps per wall second and per CPU second (this process tree: the local Ray's processes are in it) of one
    round on started actors, the round's weight broadcast)."""
    t0, c0 = time.perf_counter(), tree_cpu_seconds()
    episodes, _, _ = pool.run(policy, seeds, runner_options={"n_action_steps": policy.config.n_action_steps, "sde_noise": None},
                              task_id="push", policy_version="bench")  # fmt: skip
    steps = sum(len(ep) for ep in episodes)
    return steps / (time.perf_counter() - t0), steps / (tree_cpu_seconds() - c0), dict(pool.last_broadcast)


def ddp_rank(rank: int, port: int, batch: dict, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    from kinema.train import distributed

    distributed.init_from_env()
    half = len(batch["t"]) // 2
    mine = {k: (v if k == "image_size" else v[rank * half : (rank + 1) * half]) for k, v in batch.items()}
    seconds = step_time(mine, steps)
    if rank == 0:
        torch.save(torch.tensor(seconds), out)
    torch.distributed.destroy_process_group()


def step_time(batch: dict, steps: int) -> float:
    batch = dict(batch)
    policy = tiny_policy(int(batch.pop("image_size")))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    actor_step(policy, optimizer, batch)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        actor_step(policy, optimizer, batch)
    return (time.perf_counter() - start) / steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (< 1 minute)")
    args = parser.parse_args()
    args.image_size = 32 if args.quick else 64
    args.horizon = 20 if args.quick else 60
    episodes_per_worker = 2 if args.quick else 6
    envs_per_worker = 2
    ddp_steps, ddp_batch = (5, 32) if args.quick else (30, 64)
    torch.set_num_threads(1)
    result: dict = {"benchmark": "scale_out", "quick": args.quick, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "task": "push", "image_size": args.image_size, "horizon": args.horizon, "envs_per_worker": envs_per_worker}  # fmt: skip
    policy = tiny_policy(args.image_size)

    # Rollouts ------------------------------------------------------------------------------------------------------
    from kinema.train import ray_rollout

    t0 = time.perf_counter()
    ray_rollout.connect("", num_cpus=2, object_store_mb=128)
    result["ray_start_s"] = round(time.perf_counter() - t0, 2)
    note(f"local Ray started in {result['ray_start_s']} s")
    env_kwargs = dict(image_size=args.image_size, config={"horizon": args.horizon, "num_distractors": 0})
    t0 = time.perf_counter()
    pool = ray_rollout.RayRolloutPool("push", num_workers=2, envs_per_worker=envs_per_worker, env_kwargs=env_kwargs)
    ray_rate(pool, policy, list(range(900, 900 + 2 * envs_per_worker)))  # actors up, weights loaded, renderers made
    result["ray_actor_start_s"] = round(time.perf_counter() - t0, 2)
    actors = pool.actors
    rates: dict = {}
    for workers in (2,) if args.quick else (1, 2):  # quick: the ratio the target names, without the 1-worker round
        seeds = list(range(500, 500 + workers * episodes_per_worker))
        pool.actors = actors[:workers]  # the 1-worker round: the first actor alone
        ray_steps, ray_cpu, broadcast = ray_rate(pool, policy, seeds)
        local_steps, local_cpu, local_start = local_rate(policy, workers, envs_per_worker, seeds, env_kwargs)
        rates[workers] = (ray_steps, local_steps)
        note(f"{workers} worker(s): ray {ray_steps:.1f} steps/s ({ray_cpu:.1f} per CPU-s), local {local_steps:.1f} ({local_cpu:.1f})")
        result[f"ray_steps_per_s_{workers}"] = round(ray_steps, 1)
        result[f"local_steps_per_s_{workers}"] = round(local_steps, 1)
        result[f"ray_vs_local_ratio_{workers}"] = round(ray_steps / local_steps, 3)
        result[f"ray_steps_per_cpu_s_{workers}"] = round(ray_cpu, 1)
        result[f"local_steps_per_cpu_s_{workers}"] = round(local_cpu, 1)
        result[f"ray_vs_local_cpu_ratio_{workers}"] = round(ray_cpu / local_cpu, 3)
        result[f"local_worker_start_s_{workers}"] = round(local_start, 2)
        result["broadcast_ms"] = round(broadcast["ms"], 2)
        result["broadcast_bytes"] = int(broadcast["bytes"])
    pool.actors = actors
    result["ray_vs_local_ratio"] = result["ray_vs_local_ratio_2"]
    pool.close()
    import ray

    big = VLAPolicy(VLAConfig())  # the default (kinema train) VLA's weights
    state = {k: v.detach().numpy() for k, v in big.state_dict().items()}
    t0 = time.perf_counter()
    ref = ray.put(state)
    result["broadcast_ms_default_vla"] = round((time.perf_counter() - t0) * 1e3, 2)
    result["broadcast_bytes_default_vla"] = int(sum(v.nbytes for v in state.values()))
    del ref
    ray_rollout.shutdown()

    # DDP step -------------------------------------------------------------------------------------------------------
    demos = collect_demos("push", 2, seeds=[3, 4], num_envs=2, image_size=args.image_size, config={"horizon": 20, "num_distractors": 0})
    buffer = StepBuffer.from_episodes(demos, CAMERAS)
    batch = buffer.batch(np.arange(ddp_batch) % len(buffer), policy.config.chunk_size)
    g = torch.Generator().manual_seed(0)
    batch["t"] = torch.rand(ddp_batch, generator=g)
    batch["noise"] = torch.randn(batch["action"].shape, generator=g)
    batch["image_size"] = args.image_size
    single = step_time(batch, ddp_steps)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.start_processes(ddp_rank, args=(free_port(), batch, ddp_steps, out), nprocs=2, start_method="spawn")
        ddp = float(torch.load(out))
    result.update(single_step_ms=round(single * 1e3, 2), ddp_step_ms=round(ddp * 1e3, 2), ddp_batch=ddp_batch,
                  ddp_step_ratio=round(ddp / single, 3))  # fmt: skip

    # Projection (not a measurement) ----------------------------------------------------------------------------------
    # A round on N nodes of this machine's size: its env steps spread over every node's actors at the measured
    # per-actor rate; the weights' put plus one fetch per level of a broadcast tree over the nodes; U actor steps, one
    # rank per node, each 1/N of the single-process compute plus the all-reduce cost measured here
    # (ddp step − single step / 2, on loopback: a network adds its own).
    per_actor = rates[2][0] / 2
    actors_per_node = os.cpu_count() or 2
    comm = max(0.0, ddp - single / 2)
    steps_per_round, updates = 144 * 80, 600  # HABC on push: 144 rollouts of <= 80 steps, 600 actor updates
    proj = {}
    for nodes in (1, 8, 64):
        rollout_s = steps_per_round / (per_actor * actors_per_node * nodes)
        broadcast_s = result["broadcast_ms_default_vla"] / 1e3 * (1 + math.ceil(math.log2(nodes)))
        update_s = updates * (single / nodes + (comm if nodes > 1 else 0.0))
        proj[nodes] = rollout_s + broadcast_s + update_s
        result[f"projection_round_s_{nodes}_nodes"] = round(proj[nodes], 1)
    result["projection_speedup_8_nodes"] = round(proj[1] / proj[8], 2)
    result["projection_speedup_64_nodes"] = round(proj[1] / proj[64], 2)
    result["projection_note"] = (f"projection, not measured: {actors_per_node} Ray actors per node at the measured per-actor "
                                 f"rate, {steps_per_round} env steps and {updates} actor updates per round (push HABC), "
                                 f"one learner rank per node paying the loopback all-reduce {comm * 1e3:.1f} ms per step")  # fmt: skip
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
