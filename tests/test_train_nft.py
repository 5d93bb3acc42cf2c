"""The DiffusionNFT arm of `kinema train` (rl.method nft): its credit per rollout, and its loss on the VLA."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train_ppo import tiny_policy
from test_train_workflow import train_two_rounds_with_a_resume

from diffusion_rl.data import Episode
from kinema import common
from kinema.train.actor import actor_updates
from kinema.train.buffer import StepBuffer
from kinema.train.config import TrainConfig
from kinema.train.methods.nft import nft_actor_loss, nft_step_weights
from policies.vla import VLAPolicy

torch.set_num_threads(1)


def load_config(path, overrides):
    return common.load_config(path, overrides, config_class=TrainConfig)


def synthetic_batch(policy: VLAPolicy, n: int = 6) -> dict:
    rng = np.random.default_rng(0)
    size, cfg = policy.config.image_size, policy.config
    batch = {f"observation.images.{cam}": rng.integers(0, 255, (n, size, size, 3), dtype=np.uint8) for cam in cfg.cameras}
    batch["observation.state"] = rng.normal(size=(n, cfg.state_dim)).astype(np.float32)
    batch["task"] = ["open the drawer"] * n
    batch["action"] = rng.uniform(-1, 1, (n, cfg.chunk_size, cfg.action_dim)).astype(np.float32)
    return batch


def expert_gradient(policy: VLAPolicy, old: VLAPolicy, batch: dict, r: float) -> torch.Tensor:
    policy.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same t and noise for every r
    policy.nft_loss(batch, old=old, r=torch.full((len(batch["task"]),), r)).mean().backward()
    return torch.cat([p.grad.flatten() for p in policy.expert.parameters()])


def test_nft_loss_on_the_vla_imitates_positives_repels_negatives_and_holds_at_one_half():
    """With the sampler's own weights as `old` (v_old = v_θ), NFT's two branches are mirror images: r = 0 pushes
    exactly against r = 1's gradient, and r = ½ is a fixed point. r = 1 also points where plain flow matching does."""
    policy = tiny_policy().eval()
    old = copy.deepcopy(policy).requires_grad_(False)
    batch = synthetic_batch(policy)
    g_pos, g_neg, g_half = (expert_gradient(policy, old, batch, r) for r in (1.0, 0.0, 0.5))
    assert g_pos.norm() > 0
    torch.testing.assert_close(g_neg, -g_pos, rtol=1e-4, atol=1e-6)
    assert g_half.norm() < 1e-5 * g_pos.norm()
    policy.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    policy.flow_loss(batch).mean().backward()
    g_fm = torch.cat([p.grad.flatten() for p in policy.expert.parameters()])
    assert torch.nn.functional.cosine_similarity(g_pos, g_fm, dim=0) > 0.5


def episode(outcome: bool, length: int, action: float = 0.0, observation: dict | None = None) -> Episode:
    observations = observation or {"observation.state": np.zeros((1, 3), np.float32)}
    return Episode(
        observations={k: np.repeat(v[:1], length, axis=0) for k, v in observations.items()},
        action=np.full((length, 2 if observation is None else 7), action, np.float32), task="open the drawer",
        outcome=outcome, seed=0,
    )  # fmt: skip


def test_nft_credit_is_each_rollouts_outcome_advantage_and_weighs_every_episode_the_same():
    episodes = [episode(True, 20), episode(False, 100), episode(False, 100), episode(False, 100)]
    r, sampling, diag = nft_step_weights(episodes, adv_clip_max=5.0)
    assert [len(x) for x in r] == [len(ep) for ep in episodes]
    # A = (R − mean) / std over the round: success +√3, failures −1/√3; r = A / (2 A_max) + ½.
    np.testing.assert_allclose(r[0], 0.5 + np.sqrt(3) / 10, rtol=1e-3)
    np.testing.assert_allclose(r[1], 0.5 - 1 / np.sqrt(3) / 10, rtol=1e-3)
    np.testing.assert_allclose([s.sum() for s in sampling], 1.0)  # a 20-step success counts as much as a failure
    assert diag["nft/r_success"] > 0.5 > diag["nft/r_failure"]
    r_same, _, _ = nft_step_weights([episode(False, 50)] * 3, adv_clip_max=5.0)
    np.testing.assert_allclose(np.concatenate(r_same), 0.5)  # no contrast in the round: hold where the sampler is


def test_nft_discounted_reward_ranks_a_faster_success_above_a_slower_one():
    """rl.nft.reward discounted: a success in T steps earns γ^(T−1), so in one round the 20-step success gets the
    larger weight, the 60-step one less, the failure least; with the outcome reward (γ = 1) the two successes tie."""
    episodes = [episode(True, 20), episode(True, 60), episode(False, 100)]
    r, _, _ = nft_step_weights(episodes, adv_clip_max=5.0, gamma=0.98)
    rewards = np.array([0.98**19, 0.98**59, 0.0])
    expected = np.clip((rewards - rewards.mean()) / (rewards.std() + 1e-4) / 5.0, -1, 1) / 2 + 0.5
    np.testing.assert_allclose([x[0] for x in r], expected, rtol=1e-4)
    assert r[0][0] > r[1][0] > r[2][0]
    r_outcome, _, _ = nft_step_weights(episodes, adv_clip_max=5.0)
    assert r_outcome[0][0] == pytest.approx(r_outcome[1][0])
    with pytest.raises(ValueError, match="rl.nft.reward 'speed' is not known; valid: outcome, discounted"):
        load_config(None, ["--rl.method", "nft", "--rl.nft.reward", "speed"])


@pytest.mark.parametrize("demo_loss", ["nft", "flow"])
def test_nft_actor_update_moves_towards_successful_chunks_and_away_from_failed_ones(demo_loss):
    """A known answer: replay holds one observation with two recorded chunks, +0.8 (success) and −0.8 (failure).
    After NFT updates (no demos) the policy's chunks for it lie nearer the success than before, and nearer it than
    the failure; in either loss form (flow: NFT's velocity form on the rollouts)."""
    policy = tiny_policy().eval()
    batch = synthetic_batch(policy, n=1)
    observation = {k: v for k, v in batch.items() if k.startswith("observation.")}
    n = policy.config.chunk_size
    buffer = StepBuffer.from_episodes(
        [episode(True, n, 0.8, observation), episode(False, n, -0.8, observation)], policy.config.cameras
    )
    noise = torch.randn(64, n, policy.config.action_dim, generator=torch.Generator().manual_seed(0))
    obs = {k: np.repeat(v, 64, axis=0) for k, v in observation.items()} | {"task": ["open the drawer"] * 64}

    def mean_chunk() -> float:
        policy.eval()
        return float(policy.predict_action_chunk(obs, noise=noise).mean())

    before = mean_chunk()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    loss = nft_actor_loss(copy.deepcopy(policy).requires_grad_(False), np.repeat(np.array([1.0, 0.0], np.float32), n), beta=1.0, adv_clip_max=5.0,
                          demo_loss=demo_loss)
    actor_updates(
        policy, optimizer, steps=60, batch_size=8, demos=buffer, replay=buffer, replay_weights=np.ones(len(buffer)),
        demo_fraction=0.0, aux_weight=0.0, rng=np.random.default_rng(0), loss_fn=loss, train_mode=False,
    )  # fmt: skip
    after = mean_chunk()
    assert after > before + 0.2 and after > 0.0, (before, after)


def test_nft_flow_demo_loss_is_the_controls_augmented_flow_loss_on_demos_and_nfts_on_rollouts():
    """rl.nft.demo_loss flow: a batch's demonstration rows get exactly SFT's per-sample flow loss in train mode (with
    its random-shift augmentation), its rollout rows NFT's velocity-form loss on the unaugmented context, and the
    policy is back in eval mode for the rest of the step."""
    policy = tiny_policy().eval()
    assert policy.config.augment_shift > 0
    old = copy.deepcopy(policy).requires_grad_(False)
    batch = synthetic_batch(policy, n=6)
    r_replay = np.array([0.9, 0.1, 0.5], np.float32)
    replay_index = np.array([0, 1, 2])
    loss = nft_actor_loss(old, r_replay, beta=1.0, adv_clip_max=5.0, demo_loss="flow")
    torch.manual_seed(3)
    context, _ = policy.encode(batch)
    got = loss(policy, batch, context, replay_index)
    assert not policy.training and got.shape == (6,)
    torch.manual_seed(3)
    policy.encode(batch)  # the same draws as above, up to the loss
    policy.train(True)
    demo = {k: v[:3] for k, v in batch.items()}
    want_demo = policy.flow_loss(demo)
    policy.train(False)
    rollout = {k: v[3:] for k, v in batch.items()}
    want_rollout = policy.nft_loss(rollout, old=old, r=torch.from_numpy(r_replay), context=context[3:], space="velocity")
    torch.testing.assert_close(got, torch.cat([want_demo, want_rollout]))
    with pytest.raises(ValueError, match="rl.nft.demo_loss 'sft' is not known; valid: nft, flow"):
        load_config(None, ["--rl.method", "nft", "--rl.nft.demo_loss", "sft"])


def test_nft_refuses_interventions_and_nonpositive_settings():
    with pytest.raises(ValueError, match="rl.interventions false"):
        load_config(None, ["--rl.method", "nft", "--rl.interventions", "true"])
    with pytest.raises(ValueError, match=r"rl.nft.beta must be > 0; got 0"):
        load_config(None, ["--rl.method", "nft", "--rl.nft.beta", "0"])
    with pytest.raises(ValueError, match="replay_mixing must be fixed"):
        load_config(None, ["--rl.method", "nft", "--rl.replay_mixing", "pooled"])


@pytest.mark.slow
def test_nft_runs_and_resumes_on_the_newest_round_only(tmp_path: Path):
    """rl.method nft end to end, and resumed: each round's credit covers that round's rollouts alone (NFT is
    on-policy: r and v_old belong to the policy that sampled them), however many rounds the replay keeps."""
    run = tmp_path / "run"
    args = ["--rl.method", "nft", "--eval.heldout", "false", "--eval.videos", "0", "--rl.replay_rounds", "3"]
    for r in train_two_rounds_with_a_resume(run, args):
        assert r["replay/episodes"] == 3  # rl.episodes_per_round, not the 6 of two rounds
        assert 0.0 <= r["nft/r_failure"] <= 0.5 and r["actor/replay_share"] == 0.5
