"""Recap (rl.method recap): its returns, value and advantages on problems with known answers, the VLA's
improvement-indicator input on a bimodal toy, and the method end to end in `kinema train` and `kinema eval`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_nft import episode, synthetic_batch
from test_train_pa_rl_dsrl import train_tiny
from test_train_ppo import tiny_policy
from test_train_workflow import train_two_rounds_with_a_resume

from diffusion_rl.data import ExecutedBy, Segment
from diffusion_rl.data.lerobot_v3 import read_episodes
from diffusion_rl.recap import (
    NEGATIVE,
    POSITIVE,
    DistributionalValue,
    fit_value,
    improvement_indicator,
    improvement_threshold,
    normalised_returns,
    nstep_advantages,
    two_hot,
)
from kinema import common
from kinema.train.actor import actor_updates
from kinema.train.buffer import StepBuffer
from kinema.train.config import TrainConfig

torch.set_num_threads(1)


def test_returns_count_the_steps_left_and_a_failure_costs_its_horizon_more():
    success, failure = normalised_returns([3, 2], [1.0, 0.0], horizon=10, failure_cost=1.0)  # norm 10 × 2
    np.testing.assert_allclose(success, [-3 / 20, -2 / 20, -1 / 20])
    np.testing.assert_allclose(failure, [-12 / 20, -11 / 20])


def test_nstep_advantage_is_the_rewards_ahead_plus_the_value_there_less_the_value_here():
    (G,) = normalised_returns([5], [1.0], horizon=10, failure_cost=1.0)
    V = np.array([-0.30, -0.20, -0.25, -0.10, -0.04], np.float32)
    (A,) = nstep_advantages([G], [V], lookahead=2)
    # t = 0..2: two steps of −1/20 then V(t + 2); t = 3, 4: the Monte-Carlo return to the end.
    expected = [-0.1 + V[2] - V[0], -0.1 + V[3] - V[1], -0.1 + V[4] - V[2], G[3] - V[3], G[4] - V[4]]
    np.testing.assert_allclose(A, expected, atol=1e-6)
    # With the exact value of a deterministic chain, no step is better or worse than expected.
    (A_exact,) = nstep_advantages([G], [G], lookahead=2)
    np.testing.assert_allclose(A_exact, 0.0, atol=1e-7)


def test_the_threshold_labels_the_asked_share_and_corrections_are_always_improvements():
    adv = np.linspace(-1, 1, 100)
    threshold = improvement_threshold(adv, 0.3)
    indicator = improvement_indicator(adv, threshold)
    assert (indicator == POSITIVE).sum() == 30 and indicator[-1] == POSITIVE and indicator[0] == NEGATIVE
    forced = np.zeros(100, bool)
    forced[:5] = True
    assert (improvement_indicator(adv, threshold, always_positive=forced) == POSITIVE).sum() == 35
    with pytest.raises(ValueError, match="positive_fraction must be in"):
        improvement_threshold(adv, 1.0)


def test_two_hot_keeps_the_value_and_the_distributional_value_learns_the_steps_left_on_a_chain():
    atoms = torch.linspace(-1, 0, 11)
    values = torch.tensor([-1.0, -0.37, -0.05, 0.0])
    target = two_hot(values, atoms)
    np.testing.assert_allclose(target.sum(-1), 1.0, atol=1e-6)
    np.testing.assert_allclose((target * atoms).sum(-1), values, atol=1e-6)
    # A chain of 10 states, one step right each, success at the end: from state s, 10 − s steps are left.
    torch.manual_seed(0)
    lengths = [10 - s for s in range(10)]
    returns = torch.from_numpy(np.concatenate(normalised_returns(lengths, [1.0] * 10, horizon=10, failure_cost=1.0)))
    features = torch.cat([torch.eye(10)[s:] for s in range(10)])  # each episode's states, one-hot
    value = DistributionalValue(10, bins=201, hidden_dim=64)
    fit_value(value, torch.optim.Adam(value.parameters(), lr=3e-3), features, returns, steps=600, batch_size=64)
    with torch.no_grad():
        v = value(torch.eye(10))
    np.testing.assert_allclose(v.numpy(), [-(10 - s) / 20 for s in range(10)], atol=0.015)


def test_a_value_drawn_half_from_a_rare_kind_of_step_learns_it():
    """9,900 steps of one kind (return −0.1) and 100 of another (−0.9), told apart by their feature: drawn alike, 30
    value steps barely see the rare kind and value it as the common one; drawn half and half, the value learns both."""
    features = torch.cat([torch.tensor([[1.0, 0.0]]).repeat(9900, 1), torch.tensor([[0.0, 1.0]]).repeat(100, 1)])
    returns = torch.cat([torch.full((9900,), -0.1), torch.full((100,), -0.9)])
    rare = torch.tensor([[0.0, 1.0]])

    def fitted(sampling):
        torch.manual_seed(0)
        value = DistributionalValue(2, bins=51, hidden_dim=32)
        fit_value(value, torch.optim.Adam(value.parameters(), lr=1e-2), features, returns, steps=30, batch_size=64,
                  generator=torch.Generator().manual_seed(0), sampling=sampling)  # fmt: skip
        with torch.no_grad():
            return float(value(rare))

    balanced = torch.cat([torch.full((9900,), 0.5 / 9900), torch.full((100,), 0.5 / 100)])
    assert abs(fitted(balanced) + 0.9) < 0.05
    assert fitted(None) > -0.2


def indicator_buffer(policy, observation: dict) -> StepBuffer:
    """One observation, two recorded chunks: +0.6 labelled an improvement, −0.6 labelled not one."""
    n = policy.config.chunk_size
    buffer = StepBuffer.from_episodes([episode(True, n, 0.6, observation), episode(True, n, -0.6, observation)], policy.config.cameras)
    buffer.advantage = np.repeat(np.array([POSITIVE, NEGATIVE], np.int8), n)
    return buffer


def test_the_vla_learns_what_the_indicator_means_on_a_bimodal_toy():
    """A known answer: the same observation was followed by +0.6 (an improvement) and −0.6 (not one). Given the
    indicator input, the policy acts as before (zero embedding), then learns to produce +0.6 when asked for an
    improvement and −0.6 when asked for the other; guidance β = 2 pushes further towards +0.6."""
    policy = tiny_policy().eval()
    batch = synthetic_batch(policy, n=1)
    observation = {k: v for k, v in batch.items() if k.startswith("observation.")}
    noise = torch.randn(64, policy.config.chunk_size, policy.config.action_dim, generator=torch.Generator().manual_seed(0))
    obs = {k: np.repeat(v, 64, axis=0) for k, v in observation.items()} | {"task": ["open the drawer"] * 64}
    before = policy.predict_action_chunk(obs, noise=noise)
    policy.add_advantage_input()
    assert policy.config.advantage_input and torch.equal(policy.predict_action_chunk(obs, noise=noise), before)
    policy.config.advantage_dropout = 0.3
    buffer = indicator_buffer(policy, observation)
    actor_updates(
        policy, torch.optim.Adam(policy.parameters(), lr=2e-3), steps=300, batch_size=16, demos=buffer, replay=None,
        replay_weights=None, demo_fraction=1.0, aux_weight=0.0, rng=np.random.default_rng(0),
    )  # fmt: skip (train mode: the indicator is dropped for 30 % of the samples, so the unconditioned branch trains)
    policy.eval()

    def mean_chunk(condition: int, guidance: float = 1.0) -> float:
        asked = copy.deepcopy(policy)
        asked.config.advantage_condition, asked.config.advantage_guidance = condition, guidance
        return float(asked.predict_action_chunk(obs, noise=noise).mean())

    improvement, other, plain = mean_chunk(POSITIVE), mean_chunk(NEGATIVE), mean_chunk(0)
    assert improvement > 0.4 and other < -0.4, (improvement, other)
    assert other < plain < improvement  # unconditioned: the mixture of both
    guided = mean_chunk(POSITIVE, guidance=2.0)  # v_plain + 2 (v_improvement − v_plain): past the improvement
    assert guided > improvement, (guided, improvement)


def load_config(args):
    return common.load_config(None, args, config_class=TrainConfig)


def test_recap_refuses_what_it_cannot_honour():
    with pytest.raises(ValueError, match=r"rl.recap.positive_fraction must be in \(0, 1\); got 1.0"):
        load_config(["--rl.method", "recap", "--rl.recap.positive_fraction", "1"])
    with pytest.raises(ValueError, match="rl.recap.labels 'return' is not known; valid: advantage, outcome"):
        load_config(["--rl.method", "recap", "--rl.recap.labels", "return"])
    with pytest.raises(ValueError, match="only rl.recap.indicator_dropout > 0 trains"):
        load_config(["--rl.method", "recap", "--rl.recap.guidance", "2", "--rl.recap.indicator_dropout", "0"])
    with pytest.raises(ValueError, match="rl.recap.guidance must be >= 1"):
        load_config(["--rl.method", "recap", "--rl.recap.guidance", "0.5"])
    with pytest.raises(ValueError, match="rl.method 'recap' does not train a 'video' policy"):
        load_config(["--rl.method", "recap", "--policy.type", "video"])


def kinema(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kinema.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_recap_runs_resumes_and_its_checkpoint_acts_asking_for_improvements(tmp_path: Path):
    run = tmp_path / "run"
    args = ["--rl.method", "recap", "--rl.recap.value_steps", "5", "--rl.recap.guidance", "1.5", "--eval.heldout", "false", "--eval.videos", "0"]
    rounds = train_two_rounds_with_a_resume(run, args)
    for r in rounds:
        assert {"value/loss", "value/mse", "value/mse_base_rate", "recap/threshold", "recap/positive_demos"} <= set(r)
        assert r["weights/nonzero_share"] == 1.0  # every rollout step is imitated, with its indicator
        # The threshold labels positive_fraction of the data (demos and the replay window together) an improvement.
        assert r["recap/positive_share"] == pytest.approx(0.3, abs=0.01)
    config = json.loads((run / "checkpoints" / "final" / "config.json").read_text())
    assert config["advantage_input"] and config["advantage_condition"] == 1 and config["advantage_guidance"] == 1.5
    assert config["advantage_scale"] == 100.0  # rl.recap.indicator_scale, kept through the resume
    sft = json.loads((run / "checkpoints" / "sft" / "config.json").read_text())
    assert not sft["advantage_input"]  # the value reads this frozen SFT policy, on resume as at the start
    saved = torch.load(run / "checkpoints" / "final" / "method.pt", weights_only=False)
    assert saved["name"] == "recap" and "value" in saved["state"]
    out = tmp_path / "eval"
    done = kinema("eval", "--policy", str(run / "checkpoints" / "final"), "--task", "drawer", "--episodes", "1", "--splits", "train",
                  "--workers", "0", "--videos", "0", "--task-config", '{"horizon": 100}', "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "eval.json").read_text())
    assert report["acting"].endswith("asking for improvements (Recap's indicator, guidance 1.5)"), report["acting"]


@pytest.mark.slow
def test_recap_on_outcomes_labels_every_step_by_its_episode_and_fits_no_value(tmp_path: Path):
    run = train_tiny(tmp_path, "--rl.method", "recap", "--rl.recap.labels", "outcome", "--rl.recap.guidance", "2",
                     "--rl.interventions", "true")  # fmt: skip
    (r,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "round"' in line]
    assert "value/loss" not in r and r["recap/positive_demos"] == 1.0
    episodes = read_episodes(run / "rollouts" / "round-001")
    if any(ep.outcome for ep in episodes):
        assert r["recap/positive_rollout_successes"] == 1.0
    failures = [ep for ep in episodes if not ep.outcome]
    if failures:  # a failure's steps are not improvements, but for the human's corrections
        corrections = sum(int(((ep.executed_by == ExecutedBy.HUMAN) & (ep.segment != Segment.RECOVERY)).sum()) for ep in failures)
        assert r["recap/positive_rollout_failures"] == pytest.approx(corrections / sum(len(ep) for ep in failures))
