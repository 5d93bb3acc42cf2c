"""`kinema video train` under torchrun: with 2 gloo processes on 127.0.0.1, each rolling out half of a round's
prompt groups, one round's update leaves the LoRA weights one process leaves on the whole round, and rank 0 logs
the round's statistics; end to end, rank 0 alone writes the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from test_scale_ddp import free_port
from test_video_train import PROMPTS, TINY

from kinema.video.config import load_video_config
from kinema.video.methods import TRAINED
from kinema.video.rollout import Rollout
from kinema.video.trainer import VideoTrainer
from policies.video.generator import VideoGenerator
from policies.video.rewards import make_rewards

pytestmark = pytest.mark.timeout(180)
torch.set_num_threads(1)

# Flow-GRPO with every SDE step in each update (2 of 3: the last is left out) and the whole round in the minibatch:
# its loss is then a function of the round alone, not of the ranks' own random draws. A small grad_clip, so that
# clipping acts (it must read the norm of the ranks' mean gradient).
ARGS = [*TINY, "--train.method", "flow_grpo", "--train.flow_grpo.steps_per_update", "2", "--train.updates_per_round", "1",
        "--train.grad_clip", "0.002"]  # fmt: skip


def grpo_trainer() -> VideoTrainer:
    torch.manual_seed(0)  # the adapters' initial weights
    gen = VideoGenerator.from_preset("tiny", seed=0, num_frames=5, height=16, width=16)
    trainer = VideoTrainer(load_video_config(None, ARGS), gen, make_rewards(["exposure", "sharpness"]), PROMPTS)
    # SGD: the step is the gradient itself (AdamW's first step, g / |g|, would blow last-bit differences up).
    trainer.optimizer = torch.optim.SGD(trainer.params, lr=10.0)
    return trainer


def replaying(trainer: VideoTrainer, full: Rollout) -> None:
    """The trainer's rollouts become `full`'s samples of the prompts asked for (a round drawn once, so that one
    process and the ranks see the same samples); the rest of the round (collect, scoring, advantages) is as is."""

    def rollout(prompts: list[str], embeds: torch.Tensor):
        rows = torch.tensor([i for p in dict.fromkeys(prompts) for i, q in enumerate(full.prompts) if q == p])
        ex = full.extra
        per_step = {k: ex[k][:, rows] for k in ("states", "nexts", "log_probs")}
        return full.latents[rows], {**per_step, "sched": ex["sched"]}

    trainer.method.rollout = rollout


def one_round(full: Rollout) -> tuple[dict[str, torch.Tensor], dict]:
    trainer = grpo_trainer()
    replaying(trainer, full)
    record = trainer.train_round()
    return {k: v.clone() for k, v in trainer.generator.adapter_state_dict(TRAINED).items()}, record


def rank_main(rank: int, port: int, full: Rollout, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    torch.set_num_threads(1)
    from kinema.train import distributed

    assert distributed.init_from_env()
    weights, record = one_round(full)
    torch.save({"weights": weights, "record": record}, f"{out}.{rank}")
    distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def full_round() -> Rollout:
    ro = grpo_trainer().collect()
    assert len(set(ro.prompts)) == 2 and len(ro.prompts) == 4  # two groups of two: one group per rank
    return ro


def test_a_video_round_on_2_gloo_ranks_equals_one_process_on_the_whole_round(full_round, tmp_path):
    out = str(tmp_path / "rank")
    mp.start_processes(rank_main, args=(free_port(), full_round, out), nprocs=2, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    single, single_record = one_round(full_round)
    start = grpo_trainer().generator.adapter_state_dict(TRAINED)
    assert sum(not torch.equal(start[k], v) for k, v in single.items()) == len(single) // 2  # lora_B moved (A: zero grad at B = 0)
    for rank in ranks:
        for key, value in single.items():
            torch.testing.assert_close(rank["weights"][key], value, rtol=1e-5, atol=1e-7, msg=key)
    # Rank 0's record is the round's: rewards, advantages balanced over both ranks' groups, the mean loss.
    assert single_record["train/grad_norm"] > 0.002  # clipping acted
    for key in ("rollout/exposure", "rollout/sharpness", "reward/exposure/std", "adv/std", "adv/abs_max", "train/loss",
                "train/grad_norm", "rollout/diversity", "grpo/clipfrac"):  # fmt: skip
        assert ranks[0]["record"][key] == pytest.approx(single_record[key], rel=1e-5, abs=1e-7), key


def test_prompts_per_round_must_split_into_whole_groups_over_the_ranks(monkeypatch, tmp_path):
    from kinema.train import distributed
    from kinema.video.workflow import train_video

    monkeypatch.setattr(distributed, "init_from_env", lambda: True)
    monkeypatch.setattr(distributed, "world", lambda: (0, 2))
    cfg = load_video_config(None, [*TINY, "--train.prompts_per_round", "3", "--out", str(tmp_path / "run")])
    with pytest.raises(ValueError, match="prompts_per_round 3 does not split over 2 ranks"):
        train_video(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kinema_video_train_under_torchrun_on_2_gloo_ranks_writes_one_run(tmp_path):
    run = tmp_path / "run"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MUJOCO_GL": "egl", "GLOO_SOCKET_IFNAME": "lo"}
    args = [
        "--data.episodes", "4", "--data.frames", "5", "--data.size", "16", "--pretrain.steps", "2", "--train.updates_per_round", "1",
        "--train.prompts_per_round", "2", "--train.group_size", "2", "--train.batch_size", "4", "--model.num_inference_steps", "2",
        "--eval.interval", "1", "--eval.prompts", "2", "--eval.samples_per_prompt", "2", "--rewards.names", "[exposure, sharpness]",
        "--threads", "1",
    ]  # fmt: skip

    def torchrun(*cli: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port()), "-m", "kinema.cli", "video", "train", *cli],
            capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path,
        )  # fmt: skip

    first = torchrun(*args, "--train.rounds", "1", "--out", str(run))
    assert first.returncode == 0, first.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Once each: rank 0 alone logs (the judge's fit, the pre-training, the evaluations, the round).
    assert [r["kind"] for r in records if r["kind"] in ("pretrain", "round", "eval")] == ["pretrain", "eval", "round", "eval", "eval"]
    assert np.isfinite(next(r for r in records if r["kind"] == "round")["train/loss"])
    assert (run / "checkpoints" / "round-001" / "adapters.safetensors").is_file()
    assert (run / "final" / "model_index.json").is_file() and (run / "report.md").is_file()
    assert (first.stdout + first.stderr).count("report:") == 1  # rank 1 prints nothing

    # Resumed: every rank loads rank 0's checkpoint and runs round 2.
    second = torchrun("--resume", str(run), "--train.rounds", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"] == [1, 2]
    assert json.loads((run / "state.json").read_text())["latest_checkpoint"] == "checkpoints/round-002"
