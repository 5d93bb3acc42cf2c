"""Toy learning (measured): the RL objectives move the bimodal toy's sample mass onto the high-reward mode."""

import pytest
import torch

from diffusion_rl import toy
from diffusion_rl.protocol import FlowPolicy

torch.set_num_threads(1)

BUDGET = 60_000  # model evaluations per method, sampling and training alike


@pytest.fixture(scope="module")
def runs():
    cfg = toy.ToyRLConfig(eval_budget=BUDGET)
    return {m: toy.run_toy_rl(m, cfg, seed=0) for m in ("none", "awm", "nft", "awr")}


def test_pretrained_toy_fits_both_modes_equally():
    assert 0.4 < toy.evaluate_mass(toy.make_pretrained(0)) < 0.6


def test_advantage_weighted_flow_matching_moves_80_percent_of_the_mass(runs):
    steps, evals = runs["awm"].first_reaching(0.8)
    assert steps is not None and evals <= BUDGET, f"awm curve: {runs['awm'].mass}"
    assert runs["awm"].mass[-1] >= 0.8


def test_nft_and_awr_beat_the_no_rl_baseline(runs):
    base = runs["none"].mass[-1]
    assert abs(base - 0.5) < 0.1  # continued imitation alone leaves the modes balanced
    assert runs["nft"].mass[-1] > base + 0.2, runs["nft"].mass
    assert runs["awr"].mass[-1] > base + 0.2, runs["awr"].mass
    # Equal-reward groups were dropped, and counted.
    assert runs["awm"].degenerate_groups > 0


def test_toy_policy_implements_the_flow_policy_protocol():
    policy = toy.ToyFlowPolicy(toy.make_pretrained(0))
    assert isinstance(policy, FlowPolicy)
    x0 = toy.sample_data(8, generator=torch.Generator().manual_seed(0))
    loss = policy.flow_loss({"x0": x0}, weights=torch.ones(8))
    assert loss.shape == (8,)
    assert policy.features({"x0": x0}).shape[0] == 8
