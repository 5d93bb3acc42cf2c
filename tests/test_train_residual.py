"""Residual RL (`rl.method residual`): the runner adds the actor's bounded correction to the frozen VLA's chunk, SAC
on that correction learns an action the base never takes, and the method end to end in `kinema train` and
`kinema eval` (tiny runs)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_in_process import kinema_in_process
from test_train_pa_rl_dsrl import (
    act,
    eval_as_the_run_did,
    kinema,
    obs,
    records,
    train_tiny,
)
from test_train_ppo import tiny_policy
from test_vla import fake_batch

from diffusion_rl.dsrl import DSRLAgent, NoiseActor
from kinema.robot_policies import load_policy as deploy_policy
from kinema.sim_commands import acting_policy
from kinema.train.evaluate import ChunkPolicy, ResidualChunkPolicy

torch.set_num_threads(1)


def test_the_residual_runner_adds_the_bounded_correction_to_the_deterministic_chunk():
    policy = tiny_policy().eval()
    n, A = policy.config.n_action_steps, policy.config.action_dim
    torch.manual_seed(1)
    actor = NoiseActor(policy.config.hidden_dim + n * A, n * A, hidden_dim=16, bound=1.0)
    batch, seeds = obs(2), [1, 2]
    base = act(ChunkPolicy(policy, noise_scale=0.0), batch, seeds)
    runner = ResidualChunkPolicy(policy, actor, scale=0.1, record=True)
    executed = act(runner, batch, seeds)
    with torch.no_grad():
        features = policy.features({k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()})
        z, _ = actor(torch.cat([features, torch.from_numpy(base).flatten(1)], -1), deterministic=True)
    expected = np.clip(base + 0.1 * z.reshape(2, n, A).numpy(), -1, 1)
    np.testing.assert_allclose(executed, expected, atol=1e-5)
    assert 0 < np.abs(executed - base).max() <= 0.1 + 1e-6
    np.testing.assert_allclose(runner._last[1]["base"].numpy(), base.reshape(2, -1), atol=1e-6)
    # Sampled: the actor's ε is the episode's own draw, so the same seed and step replay the same actions.
    sampled = ResidualChunkPolicy(policy, actor, scale=0.1, deterministic=False)
    np.testing.assert_array_equal(act(sampled, batch, seeds), act(sampled, batch, seeds))
    assert not np.allclose(act(sampled, batch, seeds), executed)
    with pytest.raises(ValueError, match="the residual's scale must be > 0"):
        ResidualChunkPolicy(policy, actor, scale=0.0)


def test_a_residual_learns_an_action_the_frozen_base_never_takes():
    """SAC (the agent `residual` trains) on a bounded correction, in a one-step bandit: the base always acts 0.3;
    success needs an action in [0.42, 0.48]. The base never succeeds, and no choice of its noise could help (it is
    deterministic); the correction, bounded by ±0.2, finds +0.15."""
    torch.manual_seed(0)
    agent = DSRLAgent(2, 1, hidden_dim=64, bound=1.0, lr=1e-3, tau=0.05)
    base = torch.full((256, 1), 0.3)
    x = torch.cat([torch.ones(256, 1), base], -1)

    def success(deterministic: bool = False) -> float:
        action = base + 0.2 * agent.act(x, deterministic=deterministic)
        return float(((action - 0.45).abs() < 0.03).float().mean())

    before = success()
    for _ in range(80):
        z = agent.act(x)
        reward = ((base + 0.2 * z - 0.45).abs() < 0.03).float().squeeze(-1)
        batch = {"x": x, "noise": z, "reward": reward, "x_next": x, "done": torch.ones(256), "discount": torch.full((256,), 0.99)}
        for _ in range(5):
            agent.update(batch)
    assert before < 0.2 and success(deterministic=True) == 1.0, (before, success(deterministic=True))


def test_clipped_targets_stop_a_critic_that_overvalues_every_action_from_feeding_itself():
    """A target critic that says 5 everywhere, where no return exceeds 1: the unclipped TD target carries its 5 into
    the critics; with `target_range` (0, 1) the target is 1, and the critics' loss is measured against 1."""
    torch.manual_seed(0)
    batch = {"x": torch.randn(32, 2), "noise": torch.rand(32, 1) * 2 - 1, "reward": torch.zeros(32), "x_next": torch.randn(32, 2),
             "done": torch.zeros(32), "discount": torch.ones(32)}  # fmt: skip
    losses = {}
    for clip in (None, (0.0, 1.0)):
        agent = DSRLAgent(2, 1, hidden_dim=16, bound=1.0, target_range=clip)
        for head in (agent.target.q1, agent.target.q2):
            head[-1].weight.data.zero_()
            head[-1].bias.data.fill_(5.0)
        with torch.no_grad():
            q1, q2 = agent.critic(batch["x"], batch["noise"])
        target = 5.0 if clip is None else 1.0
        expected = float((q1 - target).pow(2).mean() + (q2 - target).pow(2).mean())
        losses[clip] = agent.update(batch)["critic_loss"]
        assert losses[clip] == pytest.approx(expected, rel=1e-5), (clip, losses[clip], expected)
    assert losses[None] > 10 * losses[(0.0, 1.0)]
    with pytest.raises(ValueError, match="without backup_entropy"):
        DSRLAgent(2, 1, target_range=(0.0, 1.0), backup_entropy=True)


def test_the_bc_term_holds_the_actor_on_the_stored_actions():
    """TD3+BC's term (`bc_weight`): the critic sees no reward anywhere, so only the term pulls; the actor's mean
    correction moves to the stored 0.5 with it, and wanders with the untrained critic without."""
    batch = {"x": torch.randn(64, 2), "noise": torch.full((64, 1), 0.5), "reward": torch.zeros(64), "x_next": torch.randn(64, 2),
             "done": torch.ones(64), "discount": torch.ones(64)}  # fmt: skip
    means = {}
    for weight in (0.0, 10.0):
        torch.manual_seed(0)
        agent = DSRLAgent(2, 1, hidden_dim=32, bound=1.0, lr=3e-3, init_alpha=0.001, bc_weight=weight)
        for _ in range(150):
            agent.update(batch)
        means[weight] = float(agent.act(batch["x"], deterministic=True).mean())
    assert abs(means[10.0] - 0.5) < 0.02 and abs(means[0.0] - 0.5) > 0.1, means
    with pytest.raises(ValueError, match="bc_weight must be >= 0"):
        DSRLAgent(2, 1, bc_weight=-1.0)


@pytest.mark.slow
def test_residual_keeps_the_vla_frozen_saves_its_actor_and_kinema_eval_acts_with_it(tmp_path: Path):
    run = train_tiny(tmp_path, "--rl.method", "residual", "--rl.residual.sac_steps", "5", "--rl.residual.scale", "0.2",
                     "--rl.residual.init_std", "0.5", "--rl.residual.critic_layer_norm", "true", "--eval.noise_scale", "0", "--seed", "2")  # fmt: skip
    sft = torch.load(run / "checkpoints" / "sft" / "trainer.pt", weights_only=False)["online"]
    after = torch.load(run / "checkpoints" / "round-001" / "trainer.pt", weights_only=False)["online"]
    assert all(torch.equal(sft[k], after[k]) for k in sft)
    round_ = next(r for r in records(run) if r["kind"] == "round")
    assert round_["residual/new_transitions"] == round_["residual/transitions"] > 0
    saved = torch.load(run / "checkpoints" / "final" / "method.pt", weights_only=False)
    shape = saved["state"]["shape"]
    # The base acts from the evaluations' noise (eval.noise_scale 0): the arm is evaluated as the others are.
    assert saved["name"] == "residual" and shape["scale"] == 0.2 and shape["base_noise_scale"] == 0.0

    # Before any SAC step (the SFT checkpoint's actor) the correction has mean 0 and std init_std before tanh.
    untrained = torch.load(run / "checkpoints" / "sft" / "method.pt", weights_only=False)["state"]
    agent = DSRLAgent(shape["input_dim"], shape["noise_dim"], hidden_dim=shape["hidden_dim"], bound=1.0, critic_layer_norm=True)
    agent.load_state_dict(untrained["agent"])
    mean, log_std = agent.actor.net(torch.randn(5, shape["input_dim"])).chunk(2, dim=-1)
    assert torch.equal(mean, torch.zeros_like(mean)) and torch.allclose(log_std.exp(), torch.full_like(log_std, 0.5))

    # One transition per executed chunk, in order within each episode: the actor's input is the features, then the
    # base's executed steps; the next input is the next decision's (the base recorded there), zeros past the end.
    transitions = torch.load(run / "checkpoints" / "round-001" / "trainer.pt", weights_only=False)["method"]["transitions"]
    hidden = json.loads((run / "checkpoints" / "final" / "config.json").read_text())["hidden_dim"]
    x, x_next, done = transitions["x"], transitions["x_next"], transitions["done"].bool()
    assert x.shape[1] == shape["input_dim"] == hidden + shape["noise_dim"]
    assert int(done.sum()) == 4 and bool(done[-1])  # the round's 4 episodes end once each
    going_on = torch.nonzero(~done).squeeze(-1)
    assert torch.equal(x_next[going_on], x[going_on + 1])
    assert torch.equal(x_next[done, hidden:], torch.zeros(4, shape["noise_dim"]))
    assert 0 < transitions["noise"].abs().max() <= 1.0 and transitions["noise"].shape[1] == shape["noise_dim"]

    # --resume with another bound would reread the stored corrections at another scale: refused, by name.
    refused = kinema_in_process("train", "--resume", str(run), "--rl.rounds", "2", "--rl.residual.scale", "0.3")
    assert refused.returncode != 0 and "rl.residual differs from the run's: scale 0.3 (the run's 0.2)" in refused.stderr
    _, report = eval_as_the_run_did(run, tmp_path / "eval", seed=2)
    assert "residual correction (bound ±0.2)" in report["acting"] and report["noise_scale"] == 0.0
    # kinema deploy and kinema sim act as kinema eval did: the VLA's zero-noise chunk plus the mean correction on the
    # executed steps (load_acting, the one loader).
    deployed = deploy_policy(str(run / "checkpoints" / "final"))
    assert "residual correction (bound ±0.2)" in deployed.description
    batch = {k: (v.numpy() if torch.is_tensor(v) else v) for k, v in fake_batch(2, deployed.config).items() if k != "action"}
    chunk, n = deployed.predict_action_chunk(batch), deployed.config.n_action_steps
    alone = deployed.policy.predict_action_chunk({k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()},
                                                 noise=torch.zeros(2, deployed.config.chunk_size, 7)).numpy()  # fmt: skip
    correction = np.abs(chunk[:, :n] - alone[:, :n])
    assert 0 < correction.max() <= 0.2 + 1e-6 and np.allclose(chunk[:, n:], alone[:, n:], atol=1e-6)
    np.testing.assert_allclose(acting_policy(str(run / "checkpoints" / "final"))(batch), chunk[:, :n], atol=1e-6)


def test_residual_refuses_what_it_cannot_honour(tmp_path: Path):
    from kinema.common import load_config
    from kinema.train.config import TrainConfig

    def load(*args: str):
        return load_config(None, ["--task", "drawer", "--rl.method", "residual", *args, "--out", str(tmp_path)], config_class=TrainConfig)

    with pytest.raises(ValueError, match=r"rl.residual.scale is the correction's bound in action units, in \(0, 2\]; got 3"):
        load("--rl.residual.scale", "3")
    with pytest.raises(ValueError, match=r"rl.residual.init_std must lie in the actor's std range \(0.0067, 7.39\); got 0"):
        load("--rl.residual.init_std", "0")
    with pytest.raises(ValueError, match="rl.method residual acts on the VLA's chunk from rl.residual.base_noise_scale's noise; rl.rollout_noise_scale must be 1"):
        load("--rl.rollout_noise_scale", "0.5")
    with pytest.raises(ValueError, match="rl.method residual learns from autonomous rollouts only"):
        load("--rl.interventions", "true")
    with pytest.raises(ValueError, match=r"rl.residual.gamma and rl.residual.tau must be in \(0, 1\]"):
        load("--rl.residual.gamma", "0")
