"""PA-RL's critic-selected chunks and DSRL's steered noise in the rollout runner, and both methods end to end in
`kinema train` and `kinema eval` (tiny runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_in_process import kinema_in_process
from method_regression import TINY
from test_train_ppo import tiny_policy
from test_vla import fake_batch

from diffusion_rl.chunk_q import ChunkQ
from diffusion_rl.data.lerobot_v3 import read_episodes
from diffusion_rl.dsrl import NoiseActor
from kinema.train.evaluate import ChunkPolicy, SelectChunkPolicy, SteeredChunkPolicy

torch.set_num_threads(1)


def obs(B: int) -> dict:
    batch = fake_batch(B, tiny_policy().config)
    batch.pop("action")
    return {k: (v.numpy() if torch.is_tensor(v) else v) for k, v in batch.items()}


def act(runner: ChunkPolicy, batch: dict, seeds: list[int], step: int = 3) -> np.ndarray:
    runner.about_to_act(seeds, [step] * len(seeds))
    return runner(batch)


def test_selection_of_one_sample_is_the_plain_policy_and_of_n_the_critics_argmax():
    policy = tiny_policy().eval()
    critic = ChunkQ(policy.config.hidden_dim, policy.config.n_action_steps, 7, hidden_dim=16)
    batch, seeds = obs(3), [5, 6, 7]
    plain = act(ChunkPolicy(policy), batch, seeds)
    np.testing.assert_allclose(act(SelectChunkPolicy(policy, critic, num_samples=1), batch, seeds), plain, atol=1e-6)

    runner = SelectChunkPolicy(policy, critic, num_samples=5, record=True)
    chosen = act(runner, batch, seeds)
    # The same candidates, drawn and scored one by one: the runner executed the best of them.
    noise = runner._episode_noise(3, samples=5)
    with torch.no_grad():
        candidates = torch.stack([policy.predict_action_chunk(batch, noise=noise[:, k]) for k in range(5)], 1)
        f = policy.features(batch)
        values = torch.stack([critic(f, candidates[:, k, : critic.horizon]) for k in range(5)], 1)
    best = candidates[torch.arange(3), values.argmax(1)]
    np.testing.assert_allclose(chosen, best[:, : policy.config.n_action_steps].numpy(), atol=1e-5)
    assert torch.equal(runner._last[1]["sample_index"], values.argmax(1))
    assert not np.allclose(chosen, plain)  # five candidates are not one


def test_selection_from_zero_noise_keeps_the_deterministic_chunk_as_its_first_candidate():
    policy = tiny_policy().eval()
    critic = ChunkQ(policy.config.hidden_dim, policy.config.n_action_steps, 7, hidden_dim=16)
    batch, seeds = obs(2), [5, 6]
    deterministic = act(ChunkPolicy(policy, noise_scale=0.0), batch, seeds)
    np.testing.assert_allclose(act(SelectChunkPolicy(policy, critic, num_samples=1, noise_scale=0.0), batch, seeds), deterministic, atol=1e-6)
    # With N = 4, candidate 0 is that chunk and the other three are sampled: a critic that values closeness to it
    # picks candidate 0, one that values distance picks a sampled chunk.
    target = torch.from_numpy(deterministic[:, 0])

    class Closeness(ChunkQ):  # Q = ± the squared distance of the chunk's first action to the deterministic one's
        sign = 1.0

        def forward(self, features, chunk):
            rows = target.repeat_interleave(len(chunk) // len(target), 0)
            return -self.sign * ((chunk[:, 0] - rows) ** 2).sum(-1)

    critic = Closeness(policy.config.hidden_dim, policy.config.n_action_steps, 7, hidden_dim=16)
    runner = SelectChunkPolicy(policy, critic, num_samples=4, record=True, noise_scale=0.0)
    chosen = act(runner, batch, seeds)
    assert runner._last[1]["sample_index"].tolist() == [0, 0] and np.allclose(chosen, deterministic, atol=1e-5)
    critic.sign = -1.0
    chosen = act(runner, batch, seeds)
    assert (runner._last[1]["sample_index"] > 0).all() and not np.allclose(chosen, deterministic)


def test_the_steered_runner_starts_the_sampler_from_the_actors_noise():
    policy = tiny_policy().eval()
    torch.manual_seed(1)
    actor = NoiseActor(policy.config.hidden_dim, policy.config.chunk_size * 7, hidden_dim=16, bound=1.5)
    batch = obs(2)
    steered = act(SteeredChunkPolicy(policy, actor, deterministic=True), batch, [1, 2])
    with torch.no_grad():
        noise, _ = actor(policy.features(batch), deterministic=True)
        expected = policy.predict_action_chunk(batch, noise=noise.reshape(2, policy.config.chunk_size, 7))
    np.testing.assert_allclose(steered, expected[:, : policy.config.n_action_steps].numpy(), atol=1e-6)
    assert noise.abs().max() <= 1.5
    # Sampled: ε is the episode's own noise, so the same seed and step replay the same chunk.
    sampled = SteeredChunkPolicy(policy, actor, deterministic=False)
    np.testing.assert_array_equal(act(sampled, batch, [1, 2]), act(sampled, batch, [1, 2]))
    assert not np.allclose(act(sampled, batch, [1, 2]), steered)


def kinema(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kinema.cli", *args], capture_output=True, text=True, timeout=600)


def train_tiny(tmp_path: Path, *args: str) -> Path:
    from rich.console import Console

    from kinema.common import load_config
    from kinema.train.config import TrainConfig
    from kinema.train.workflow import train

    cfg = load_config(None, [*TINY, *args, "--out", str(tmp_path / "run")], config_class=TrainConfig)
    return train(cfg, console=Console(file=open("/dev/null", "w")))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def eval_as_the_run_did(run: Path, out: Path, *, seed: int) -> tuple[list[str], dict]:
    """`kinema eval` of a tiny run's final checkpoint on its own final evaluation's episodes (`--seed`): the command's
    arguments and its eval.json, after checking that it acted as the run did (the same seeds, the same outcomes)."""
    args = ["eval", "--policy", str(run / "checkpoints" / "final"), "--task", "drawer", "--episodes", "2", "--splits", "train",
            "--workers", "0", "--videos", "0", "--task-config", '{"horizon": 100}', "--out", str(out), "--seed", str(seed)]  # fmt: skip
    done = kinema(*args)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    final = next(r for r in reversed(records(run)) if r["kind"] == "eval" and r["stage"] == "final")
    assert report["results"]["train"]["seeds"] == final["train/seeds"] and report["results"]["train"]["outcomes"] == final["train/outcomes"]
    return args, report


@pytest.mark.slow
def test_pa_rl_trains_its_critic_reports_calibration_and_selection_and_kinema_eval_selects(tmp_path: Path):
    run = train_tiny(tmp_path, "--rl.method", "pa_rl", "--rl.pa_rl.num_samples", "3", "--rl.pa_rl.critic_steps", "5",
                     "--rl.pa_rl.demo_episodes", "2", "--rl.pa_rl.eval_samples", "3", "--rl.pa_rl.eval_margin", "0.01", "--rl.interventions", "false", "--eval.noise_scale", "0")  # fmt: skip
    rec = records(run)
    round_ = next(r for r in rec if r["kind"] == "round")
    # Calibration on the fresh rollouts before the critic trains on them, beside the success model's.
    assert {"q/mse", "q/mse_base_rate", "q/ece", "success_model/brier"} <= round_.keys()
    # One selected chunk per decision of every rollout: ⌈T / n_action_steps⌉ per episode.
    lengths = [len(ep) for ep in read_episodes(run / "rollouts" / "round-001")]
    assert round_["pa_rl/selected_chunks"] == sum(-(-T // 4) for T in lengths)
    selection = next(r for r in rec if r["kind"] == "selection_eval")
    assert selection["num_samples"] == 3 and selection["margin"] == 0.01 and selection["latency_ms"] > 0 and selection["train/episodes"] == 2
    saved = torch.load(run / "checkpoints" / "final" / "method.pt", weights_only=False)
    assert saved["name"] == "pa_rl" and "critic" in saved["state"]
    out = tmp_path / "eval"
    done = kinema("eval", "--policy", str(run / "checkpoints" / "final"), "--task", "drawer", "--episodes", "1", "--splits", "train",
                  "--workers", "0", "--videos", "0", "--select", "3", "--select-margin", "0.02", "--task-config", '{"horizon": 100}', "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    # The policy alone and best-of-3 by the critic, each its own column on the same seeds, with batch-1 latencies.
    assert report["select"] == 3 and "pa_rl checkpoint's chunk critic" in report["selection"] and "valued 0.02 higher" in report["selection"]
    # The plain column from zero noise: the run's eval.noise_scale, which its checkpoint keeps for eval and deploy.
    assert report["acting"] == "policy, initial noise scaled by 0" and report["noise_scale"] == 0.0 and report["seed"] == 0
    assert report["results"]["train"]["episodes"] == report["selection_results"]["train"]["episodes"] == 1
    assert set(report["latency_ms"]) == {"1", "3"} and report["latency_ms"]["3"] > 0


@pytest.mark.slow
def test_dsrl_keeps_the_vla_frozen_saves_its_actor_and_kinema_eval_steers_with_it(tmp_path: Path):
    run = train_tiny(tmp_path, "--rl.method", "dsrl", "--rl.dsrl.sac_steps", "5", "--seed", "2")
    sft = torch.load(run / "checkpoints" / "sft" / "trainer.pt", weights_only=False)["online"]
    after = torch.load(run / "checkpoints" / "round-001" / "trainer.pt", weights_only=False)["online"]
    assert all(torch.equal(sft[k], after[k]) for k in sft)
    round_ = next(r for r in records(run) if r["kind"] == "round")
    assert round_["dsrl/new_transitions"] == round_["dsrl/transitions"] > 0 and "actor/loss" not in round_
    saved = torch.load(run / "checkpoints" / "final" / "method.pt", weights_only=False)
    assert saved["name"] == "dsrl" and "agent" in saved["state"] and "transitions" not in saved["state"]  # eval needs no replay
    args, report = eval_as_the_run_did(run, tmp_path / "eval", seed=2)
    assert "DSRL noise actor" in report["acting"]
    refused = kinema_in_process(*args, "--select", "2")
    assert refused.returncode != 0 and "--select needs a value for the chunks" in refused.stderr
    refused = kinema_in_process(*args, "--select", "2", "--select-margin", "0.1")  # a margin needs a pa_rl critic
    assert refused.returncode != 0 and "--select-margin applies to --select N > 1 with a pa_rl checkpoint" in refused.stderr
    refused = kinema_in_process(*args, "--noise-scale", "0")  # its actor chooses the noise
    assert refused.returncode != 0 and "acts with the noise its DSRL actor chooses" in refused.stderr
    # kinema deploy acts as kinema eval did (load_acting): steered by the actor's mean noise, so the same observation
    # gives the same chunk twice, where the VLA alone samples its noise.
    from kinema.robot_policies import load_policy as deploy_policy

    deployed = deploy_policy(str(run / "checkpoints" / "final"))
    assert "DSRL noise actor" in deployed.description
    batch = obs(2)
    np.testing.assert_array_equal(deployed.predict_action_chunk(batch), deployed.predict_action_chunk(batch))
    tensors = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}
    assert not torch.allclose(deployed.policy.predict_action_chunk(tensors), deployed.policy.predict_action_chunk(tensors))
