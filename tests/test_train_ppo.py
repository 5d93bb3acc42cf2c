"""The Flow-SDE GRPO baseline's bookkeeping: every executed chunk recorded, ratio 1 before the first update."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kinema.train.evaluate import ChunkPolicy
from kinema.train.ppo import (
    flow_ppo_updates,
    gae_chunk_advantages,
    grpo_chunk_advantages,
    restrict_to_flow_grpo_settings,
)
from policies.vla import VLAConfig, VLAPolicy
from sim.rollout import collect, make_vector

torch.set_num_threads(1)


def flow_grpo_updates(policy, optimizer, episodes, chunks, **kwargs) -> dict:
    """Flow-GRPO: group-relative chunk advantages, then the PPO epochs (what rl.method flow_ppo does by default)."""
    advantages, stats = grpo_chunk_advantages(episodes, chunks)
    return {**flow_ppo_updates(policy, optimizer, chunks, advantages, **kwargs), **stats}


def tiny_policy() -> VLAPolicy:
    torch.manual_seed(0)
    return VLAPolicy(
        VLAConfig(
            image_size=32, vision_channels=(8, 16, 16), vision_dim=32, text_dim=16, hidden_dim=32, expert_hidden=64,
            expert_layers=2, state_hidden=16, chunk_size=4, n_action_steps=2, num_flow_steps=4, augment_shift=4,
        )  # fmt: skip
    )


def test_every_executed_chunk_is_recorded_and_ratios_start_at_one():
    policy = tiny_policy()
    runner = ChunkPolicy(policy, sde_noise=0.5)
    vector = make_vector("push", 3, image_size=32, config={"horizon": 10})
    seeds = [0, 0, 1, 1]  # two GRPO groups
    episodes = collect(vector, runner, seeds, task_id="push")
    chunks = runner.chunk_records()  # keyed by the episode's index in the list collect returned
    assert sorted(runner.finished) == [0, 1, 2, 3] and len(episodes) == 4
    for i, ep in enumerate(episodes):
        starts = sorted(step for (index, step) in chunks if index == i)
        assert starts == list(range(0, len(ep), 2))  # a new chunk every n_action_steps
        for step in starts:
            rec = chunks[(i, step)]
            # The executed actions are the recorded chunk's first actions (clipped like the env clips them).
            chunk = rec["x_next"][-1].clamp(-1, 1).numpy()
            np.testing.assert_allclose(ep.action[step], chunk[0], atol=1e-5)
            np.testing.assert_allclose(ep.observations["observation.state"][step], rec["obs"]["observation.state"].numpy())
    # Re-evaluated under the unchanged policy, every stochastic step's ratio is exactly 1 (augmentation is off).
    policy.eval()
    for rec in list(runner.records.values())[:5]:
        batch = {k: (v[None] if torch.is_tensor(v) else [v]) for k, v in rec["obs"].items()}
        assert rec["log_prob"].shape[0] == 4  # every denoising step is stochastic, the last one included
        for k in range(rec["log_prob"].shape[0]):
            step = policy.sde_log_prob(
                {**batch, "x_t": rec["x_t"][k][None], "t": rec["t"][k][None], "t_next": rec["t_next"][k][None],
                 "x_next": rec["x_next"][k][None]},
                noise_level=0.5,
            )  # fmt: skip
            torch.testing.assert_close(step.log_prob, rec["log_prob"][k][None], atol=1e-5, rtol=0)


def test_grpo_update_uses_only_informative_groups():
    policy = tiny_policy()
    runner = ChunkPolicy(policy, sde_noise=0.5)
    vector = make_vector("push", 2, image_size=32, config={"horizon": 6})
    episodes = collect(vector, runner, [0, 0, 1, 1], task_id="push")
    episodes[0].outcome = True  # make this episode's group informative; the other group stays all-failure
    before = [p.detach().clone() for p in policy.parameters()]
    chunk_records = runner.chunk_records()
    stats = flow_grpo_updates(
        policy, torch.optim.SGD(policy.parameters(), lr=1e-3), episodes, chunk_records, epochs=1,
        batch_size=16, clip_range=0.2, noise_level=0.5, rng=np.random.default_rng(0),
    )  # fmt: skip
    assert stats["grpo/n_degenerate_groups"] == 1.0 and stats["grpo/n_groups"] == 2.0
    group = {i for i, ep in enumerate(episodes) if ep.seed == episodes[0].seed}
    chunks = sum(1 for (i, _) in chunk_records if i in group)
    assert len(group) == 2 and stats["ppo/samples"] == chunks * 4  # K = 4 stochastic steps per chunk
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def one_informative_group():
    """Two push rollouts of one seed, one of them marked successful: a GRPO group with a signal."""
    policy = tiny_policy()
    runner = ChunkPolicy(policy, sde_noise=0.5)
    vector = make_vector("push", 2, image_size=32, config={"horizon": 8})
    episodes = collect(vector, runner, [0, 0], task_id="push")
    episodes[0].outcome = True
    return policy, runner, episodes


def test_target_kl_stops_the_rounds_updates_once_the_policy_has_moved():
    """With target_kl, the round ends at the first minibatch whose approximate KL passes 1.5 x target_kl; without
    it every minibatch of every epoch is used."""
    policy, runner, episodes = one_informative_group()
    state = {k: v.clone() for k, v in policy.state_dict().items()}
    kwargs = dict(epochs=2, batch_size=2, clip_range=0.2, noise_level=0.5)

    def run(target_kl: float) -> dict:
        policy.load_state_dict(state)
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)  # large steps: the KL passes any small target
        return flow_grpo_updates(policy, optimizer, episodes, runner.chunk_records(), rng=np.random.default_rng(0),
                                 target_kl=target_kl, **kwargs)

    full = run(0.0)
    assert full["ppo/updates"] == 2 * -(-full["ppo/samples"] // 2)  # every minibatch of both epochs
    stopped = run(1e-6)
    assert 1 <= stopped["ppo/updates"] < full["ppo/updates"]


def test_kl_to_the_reference_anchors_the_update():
    """Flow-GRPO's β·KL to the frozen reference: logged once the policy has moved, and with a large β the update
    stays nearer the reference than without (same data, same steps)."""
    policy, runner, episodes = one_informative_group()
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    reference = tiny_policy().eval()
    reference.load_state_dict(start)

    def drift(kl_weight: float) -> tuple[float, dict]:
        policy.load_state_dict(start)
        stats = flow_grpo_updates(
            policy, torch.optim.SGD(policy.parameters(), lr=0.05), episodes, runner.chunk_records(), epochs=3,
            batch_size=4, clip_range=0.2, noise_level=0.5, rng=np.random.default_rng(0), reference=reference,
            kl_weight=kl_weight,
        )  # fmt: skip
        return sum(float((p - start[k]).pow(2).sum()) for k, p in policy.state_dict().items() if p.dtype.is_floating_point), stats

    free, free_stats = drift(0.0)
    anchored, stats = drift(50.0)
    assert "ppo/kl_to_reference" not in free_stats and stats["ppo/kl_to_reference"] > 0
    assert anchored < free
    with pytest.raises(ValueError, match="needs the reference policy"):
        flow_grpo_updates(policy, torch.optim.SGD(policy.parameters(), lr=0.0), episodes, runner.chunk_records(),
                          epochs=1, batch_size=4, clip_range=0.2, noise_level=0.5, rng=np.random.default_rng(0),
                          kl_weight=0.1)


def test_expert_only_updates_move_the_action_expert_and_nothing_else():
    """πRL's train_expert_only: after an update the encoders are bit-identical, the expert moved, and the
    baseline's own learning rate replaced the optimiser's."""
    policy, runner, episodes = one_informative_group()
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-4, weight_decay=0.01)
    restrict_to_flow_grpo_settings(policy, optimizer, lr=1e-3, expert_only=True)
    assert [g["lr"] for g in optimizer.param_groups] == [1e-3]
    stats = flow_grpo_updates(policy, optimizer, episodes, runner.chunk_records(), epochs=1, batch_size=4,
                              clip_range=0.2, noise_level=0.5, rng=np.random.default_rng(0))
    assert stats["ppo/updates"] > 0
    moved = {k for k, v in policy.state_dict().items() if v.dtype.is_floating_point and not torch.equal(v, start[k])}
    assert moved and all(k.startswith("expert.") for k in moved)


def _episodes_with_outcomes(outcomes):
    """Real push episodes (the Episode contract), their outcomes then set by hand."""
    vector = make_vector("push", 2, image_size=32, config={"horizon": 6})
    policy = tiny_policy()
    episodes = collect(vector, ChunkPolicy(policy), list(range(len(outcomes))), task_id="push")
    for ep, outcome in zip(episodes, outcomes):
        ep.outcome = outcome
    return episodes


def test_gae_advantages_with_a_zero_critic_are_the_discounted_outcome_and_the_critic_learns_the_returns():
    """On the chunk-level MDP with V = 0, the advantage of chunk j of m in an episode that ends in success is
    (γ^n·λ)^(m-1-j), and 0 after a failure: after normalisation every chunk of the success beats every chunk of
    the failure, and later chunks of the success beat earlier ones. The critic is then regressed on the λ-returns."""
    episodes = _episodes_with_outcomes([True, False])
    records = {(i, step): None for i, ep in enumerate(episodes) for step in range(0, len(ep), 2)}
    value = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    torch.nn.init.zeros_(value[2].weight), torch.nn.init.zeros_(value[2].bias)
    torch.manual_seed(0)
    features = [torch.randn(len(ep), 4) for ep in episodes]
    optimizer = torch.optim.Adam(value.parameters(), lr=1e-2)
    adv, stats = gae_chunk_advantages(value, optimizer, episodes, features, records, chunk_steps=2,
                                      gamma=0.9, lam=0.5, critic_steps=300)  # fmt: skip
    assert set(adv) == set(records)
    m = len(range(0, len(episodes[0]), 2))
    raw = {key: (0.9**2 * 0.5) ** (m - 1 - key[1] // 2) if key[0] == 0 else 0.0 for key in records}
    expected = torch.tensor([raw[k] for k in records])
    expected = (expected - expected.mean()) / expected.std()
    torch.testing.assert_close(torch.tensor([adv[k] for k in records]), expected, atol=1e-5, rtol=1e-5)
    success = sorted((step, a) for (i, step), a in adv.items() if i == 0)
    assert all(a1 < a2 for (_, a1), (_, a2) in zip(success, success[1:]))
    assert min(a for (i, _), a in adv.items() if i == 0) > max(a for (i, _), a in adv.items() if i == 1)
    # The critic sees the chunks' first steps; the λ-return of the success's last chunk is its outcome, 1, and of
    # the failure's, 0 (V was 0 everywhere).
    last = 2 * (m - 1)
    with torch.no_grad():
        assert abs(float(value(features[0][last])) - 1.0) < 0.1 and abs(float(value(features[1][last]))) < 0.1
    # Measured before the fit: the zero critic explained none of the returns' variance.
    assert stats["gae/explained_variance"] == pytest.approx(0.0, abs=1e-6)


def test_grpo_weighs_every_episode_the_same_however_many_chunks_it_has():
    """A success with 1 chunk and a failure with 3 in one group: GRPO advantages ±a per episode, scaled so that
    the per-sample advantages sum to zero (unscaled they would sum to -2a: 'make every sample less likely')."""
    episodes = _episodes_with_outcomes([True, False])
    for ep in episodes:
        ep.seed = 7
    records = {(0, 0): None, (1, 0): None, (1, 2): None, (1, 4): None}
    adv, stats = grpo_chunk_advantages(episodes, records)
    assert stats["grpo/n_groups"] == 1.0
    assert adv[(0, 0)] > 0 and all(adv[(1, s)] < 0 for s in (0, 2, 4))
    assert sum(adv.values()) == pytest.approx(0.0, abs=1e-6)
    assert adv[(0, 0)] == pytest.approx(-3 * adv[(1, 0)])


def test_gae_needs_aligned_inputs():
    episodes = _episodes_with_outcomes([True, False])
    value = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match="one feature array per episode; got 1 for 2 episodes"):
        gae_chunk_advantages(value, torch.optim.SGD(value.parameters(), lr=0.1), episodes, [torch.zeros(3, 4)], {},
                             chunk_steps=2)  # fmt: skip
