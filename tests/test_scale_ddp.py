"""The distributed learner: with 2 gloo processes on 127.0.0.1, one update step (the actor's flow-matching step and a
critic's plain optimiser step) leaves the same weights as one process's step on the two batches concatenated, and
the ranks' shards of the training steps are disjoint and cover them."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_train_ppo import tiny_policy

from kinema.train.actor import actor_step
from kinema.train.buffer import StepBuffer
from sim.env import CAMERAS
from sim.rollout import collect_demos

pytestmark = pytest.mark.timeout(120)
torch.set_num_threads(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_step(batch: dict, critic_x: torch.Tensor) -> dict[str, torch.Tensor]:
    """An actor step and a critic step from the same starting weights; the weights after them."""
    policy = tiny_policy().eval()  # eval: no image augmentation, so the loss is a function of the batch alone
    # SGD: the step is the gradient itself (Adam's g / sqrt(v) would blow last-bit differences of tiny gradients up).
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5, momentum=0.9)
    actor_step(policy, optimizer, batch)
    torch.manual_seed(1)
    critic = torch.nn.Linear(critic_x.shape[1], 1)
    critic_opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    (critic(critic_x).squeeze(-1) - critic_x.sum(1)).pow(2).mean().backward()
    critic_opt.step()  # no explicit sync: the optimiser hook averages the ranks' gradients
    return {**{f"policy.{k}": v.clone() for k, v in policy.state_dict().items()},
            **{f"critic.{k}": v.clone() for k, v in critic.state_dict().items()}}  # fmt: skip


def rows(batch: dict, index: slice) -> dict:
    return {k: v[index] for k, v in batch.items()}


def rank_main(rank: int, port: int, batch: dict, critic_x: torch.Tensor, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from kinema.train import distributed

    assert distributed.init_from_env() and distributed.world() == (rank, 2)
    half = len(critic_x) // 2
    part = slice(rank * half, (rank + 1) * half)
    weights = one_step(rows(batch, part), critic_x[part])
    shard = distributed.shard(np.arange(11))
    if rank == 0:
        torch.save({"weights": weights}, out)
    torch.save(torch.from_numpy(shard), f"{out}.shard{rank}")
    distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def batch():
    demos = collect_demos("push", 1, seeds=[3], num_envs=1, image_size=32, config={"horizon": 12, "num_distractors": 0})
    buffer = StepBuffer.from_episodes(demos, CAMERAS)
    policy = tiny_policy()
    b = buffer.batch(np.arange(8) % len(buffer), policy.config.chunk_size)
    g = torch.Generator().manual_seed(0)
    # The flow-matching time and noise given with the batch, as the ranks' own draws would differ from one process's.
    b["t"] = torch.rand(8, generator=g)
    b["noise"] = torch.randn(b["action"].shape, generator=g)
    return b


def test_a_step_on_2_gloo_ranks_equals_one_process_on_the_concatenated_batch(batch, tmp_path):
    critic_x = torch.randn(8, 5, generator=torch.Generator().manual_seed(2))
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(rank_main, args=(free_port(), batch, critic_x, out), nprocs=2, start_method="spawn")
    ranks = torch.load(out)["weights"]
    single = one_step(batch, critic_x)
    start = {f"policy.{k}": v for k, v in tiny_policy().state_dict().items()}
    moved = 0
    for key, value in single.items():
        torch.testing.assert_close(ranks[key], value, rtol=1e-5, atol=1e-6, msg=key)
        moved += key in start and not torch.equal(start[key], value)
    assert moved > 10  # the step did change the weights (so equal weights are not equal because nothing moved)
    # Each rank its own half: half of the batch alone gives other weights.
    half = one_step(rows(batch, slice(0, 4)), critic_x[:4])
    assert any(not torch.allclose(half[k], single[k]) for k in single if k.startswith("policy.expert"))
    shards = [torch.load(f"{out}.shard{r}").numpy() for r in range(2)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(11)) and not set(shards[0]) & set(shards[1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kinema_train_under_torchrun_on_2_gloo_ranks_writes_one_run(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from test_train_workflow import TINY

    run = tmp_path / "run"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "LP_NUM_THREADS": "1", "MUJOCO_GL": "egl"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "kinema.cli", "train", *TINY, "--rl.rounds", "1", "--out", str(run)],
        capture_output=True, text=True, timeout=560, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    kinds = [json.loads(line)["kind"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert kinds == ["demos", "sft", "eval", "round", "eval", "eval"]  # once each: rank 0 alone logs
    assert (run / "checkpoints" / "round-001").is_dir() and (run / "report.md").exists()
    assert len(list((run / "rollouts" / "round-001" / "data").rglob("*.parquet"))) >= 1
    assert result.stdout.count("report:") + result.stderr.count("report:") == 1  # rank 1 prints nothing


def test_the_cli_leaves_the_process_group_it_ran_in(tmp_path, capsys):
    # A rank that exits with its gloo group still open aborts now and then at interpreter exit ("terminate called
    # without an active exception"), and torchrun kills the ranks still writing the run.
    import torch.distributed as dist

    from kinema.cli import main

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert main(["sim", "list"]) == 0
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
