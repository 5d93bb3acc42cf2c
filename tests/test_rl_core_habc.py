"""HABC: gate behaviour, actor weights, critic targets, and a trained critic on a chain task."""

import numpy as np
import pytest
import torch

from diffusion_rl import habc
from diffusion_rl.credit import SampleKind

torch.set_num_threads(1)


def test_gate_with_viability_certain_follows_efficiency():
    # p_v ≈ 1: V_e(s) = −10. Reaching V_e(s') = −8 in one step beats the expected −1 per step; staying put loses.
    z_v = torch.full((3,), 12.0)
    z_v_next = torch.tensor([12.0, 12.0, 5.0])  # a drop in viability barely matters once p_v ≈ 1
    v_e = torch.full((3,), -10.0)
    v_e_next = torch.tensor([-8.0, -10.0, -9.0])
    adv = habc.habc_advantages(
        z_v,
        z_v_next,
        v_e,
        v_e_next,
        has_next=torch.ones(3, dtype=torch.bool),
        terminal_success=torch.zeros(3, dtype=torch.bool),
    )
    torch.testing.assert_close(adv.a_e, torch.tensor([1.0, -1.0, 0.0]))
    g = habc.habc_gate(adv.a_v, adv.a_e, adv.p_v)
    assert float(g[0]) > 1.0 > float(g[1])
    torch.testing.assert_close(g, 1 + torch.tanh(adv.a_e), atol=1e-3, rtol=0)
    assert bool(((g > 0) & (g < 2)).all())


def test_gate_with_viability_hopeless_follows_the_viability_advantage():
    z_v = torch.full((4,), -12.0)  # p_v ≈ 0
    a_v = torch.tensor([2.0, -2.0, 0.5, 0.0])
    a_e = torch.tensor([-5.0, 5.0, 3.0, 10.0])  # efficiency must not matter here
    g = habc.habc_gate(a_v, a_e, torch.sigmoid(z_v))
    torch.testing.assert_close(g, 1 + torch.tanh(a_v), atol=1e-4, rtol=0)
    assert float(g[0]) > 1.0 > float(g[1])


def test_viability_advantage_is_taken_in_logit_space():
    z, zn = torch.tensor([4.0]), torch.tensor([6.0])  # p 0.982 -> 0.9975: tiny in p, +2 in logits
    adv = habc.habc_advantages(
        z,
        zn,
        torch.zeros(1),
        torch.zeros(1),
        has_next=torch.ones(1, dtype=torch.bool),
        terminal_success=torch.zeros(1, dtype=torch.bool),
    )
    assert float(adv.a_v) == 2.0


def test_gate_warmup_and_ablations():
    a_v, a_e, p = torch.tensor([1.0]), torch.tensor([-1.0]), torch.tensor([0.5])
    assert float(habc.habc_gate(a_v, a_e, p, step=10)) == 1.0
    assert float(habc.habc_gate(a_v, a_e, p, step=500)) == pytest.approx(1.0)  # mix = 0 here
    assert float(habc.habc_gate(a_v, a_e, p, mode="viability_only")) == pytest.approx(
        1 + torch.tanh(torch.tensor(1.0)).item()
    )
    assert float(habc.habc_gate(a_v, a_e, p, mode="efficiency_only")) == pytest.approx(
        1 - torch.tanh(torch.tensor(1.0)).item()
    )
    fm = habc.habc_gate(a_v, a_e, torch.tensor([0.99]), mode="fixed_mix", fixed_mix=0.5)
    assert float(fm) == pytest.approx(1.0)  # ignores p_v
    assert float(habc.habc_gate(torch.tensor([10.0]), a_e, torch.tensor([0.0]), mode="exp")) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="gate"):
        habc.HABCConfig(gate="softmax")


def test_actor_weights_failed_zero_demo_one_nondemo_mean_one():
    kind = torch.tensor([0, 0, 1, 1, 1, 1, 2, 3, 3, -1])
    outcome = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    g = torch.tensor([1.7, 0.3, 1.5, 0.5, 1.9, 1.9, 1.9, 0.2, 1.8, 1.9])
    w = habc.habc_actor_weights(g, kind=kind, outcome=outcome)
    assert w[:2].tolist() == [1.0, 1.0]  # demonstrations: 1, whatever g says
    assert w[4] == 0 and w[5] == 0  # failed autonomous
    assert w[6] == 0 and w[9] == 0  # unlabelled policy, padding
    kept = torch.tensor([2, 3, 7, 8])
    torch.testing.assert_close(w[kept].mean(), torch.tensor(1.0))
    # Before normalisation: successful autonomous g (1.5, 0.5), human 1 (1, 1): mean 1 already.
    torch.testing.assert_close(w[kept], torch.tensor([1.5, 0.5, 1.0, 1.0]))
    ir = habc.habc_actor_weights(g, kind=kind, outcome=outcome, intervention_reweighting=True, normalize=False)
    torch.testing.assert_close(ir[kept], torch.tensor([1.5, 0.5, 0.2, 1.8]))
    # Normalisation: kept non-demo weights (g = 1.8, 1.6, human 1, 1) are divided by their mean 1.35.
    g2 = torch.tensor([1.7, 0.3, 1.8, 1.6, 1.9, 1.9, 1.9, 0.2, 1.8, 1.9])
    w2 = habc.habc_actor_weights(g2, kind=kind, outcome=outcome)
    torch.testing.assert_close(w2[kept], torch.tensor([1.8, 1.6, 1.0, 1.0]) / 1.35)
    assert w2[:2].tolist() == [1.0, 1.0]  # demonstrations are not renormalised


def test_efficiency_td_target_and_huber_critic_loss():
    v_e_next = torch.tensor([-3.0, -1.0, 7.0])
    tgt = habc.efficiency_td_target(v_e_next, terminal_success=torch.tensor([False, False, True]))
    assert tgt.tolist() == [-4.0, -2.0, -1.0]
    z_v = torch.zeros(3, requires_grad=True)
    v_e = torch.tensor([-4.0, 0.0, -1.0], requires_grad=True)
    loss, parts = habc.habc_critic_loss(
        z_v,
        v_e,
        v_e_next,
        outcome=torch.tensor([1.0, 0.0, 1.0]),
        viability_mask=torch.tensor([True, True, False]),
        efficiency_mask=torch.ones(3, dtype=torch.bool),
        terminal_success=torch.tensor([False, False, True]),
        bootstrap_ok=torch.tensor([True, True, False]),
    )
    # BCE at logit 0 is log 2; Huber(δ=1) of errors (0, 2, 0) is (0, 1.5, 0).
    torch.testing.assert_close(parts["viability_loss"], torch.log(torch.tensor(2.0)))
    torch.testing.assert_close(parts["efficiency_loss"], torch.tensor(0.5))
    loss.backward()
    assert v_e.grad[1] > 0 and z_v.grad[2] == 0


def _chain_batch(n_states: int, starts: list[int]):
    """Successful episodes on a chain: one position forward per step until the goal at n_states − 1."""
    feats, nexts, term = [], [], []
    for s in starts:
        for p in range(s, n_states - 1):
            feats.append(p)
            nexts.append(p + 1)
            term.append(p + 1 == n_states - 1)
    eye = torch.eye(n_states)
    return eye[feats], eye[nexts], torch.tensor(term)


def test_trained_critic_gates_faster_than_expected_transitions_above_one():
    torch.manual_seed(0)
    n = 12
    x, x_next, term = _chain_batch(n, list(range(n - 1)))
    critic = habc.HABCCritic(n, num_layers=0, value_scale=5.0)
    opt = torch.optim.SGD(critic.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 1500)
    ones = torch.ones(len(x), dtype=torch.bool)
    for _ in range(1500):
        out = critic(x)
        with torch.no_grad():
            nxt = critic(x_next)
        loss, _ = habc.habc_critic_loss(
            out.z_v,
            out.v_e,
            nxt.v_e,
            outcome=ones.float(),
            viability_mask=ones,
            efficiency_mask=ones,
            terminal_success=term,
            bootstrap_ok=~term,
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        v = critic(torch.eye(n)).v_e
    # V_e(position p) = −(steps to go) = −(n − 1 − p), up to TD's tolerance.
    torch.testing.assert_close(v[:-1], -torch.arange(n - 1, 0, -1).float(), atol=0.05, rtol=0)
    # Transitions from position 3: a jump of 3 (faster than the critic expects), a normal step, standing still.
    s = torch.eye(n)[[3, 3, 3]]
    s_next = torch.eye(n)[[6, 4, 3]]
    with torch.no_grad():
        o, on = critic(s), critic(s_next)
    w, diag = habc.habc_weights(
        o,
        on,
        kind=torch.full((3,), int(SampleKind.AUTONOMOUS)),
        outcome=torch.ones(3, dtype=torch.bool),
        has_next=torch.ones(3, dtype=torch.bool),
        terminal_success=torch.zeros(3, dtype=torch.bool),
        step=1000,
        config=habc.HABCConfig(normalize=False),
    )
    assert float(torch.sigmoid(o.z_v).min()) > 0.95  # viability is near certain on an all-success chain
    assert float(w[0]) > 1.5 and abs(float(w[1]) - 1.0) < 0.3 and float(w[2]) < 0.5
    # During warm-up the same transitions all get 1.
    w0, _ = habc.habc_weights(
        o,
        on,
        kind=torch.full((3,), 1),
        outcome=torch.ones(3, dtype=torch.bool),
        has_next=torch.ones(3, dtype=torch.bool),
        terminal_success=torch.zeros(3, dtype=torch.bool),
        step=10,
    )
    assert torch.equal(w0, torch.ones(3))


def test_mc_efficiency_targets_are_negative_steps_to_success_and_the_td_fixed_point():
    from diffusion_rl.habc import efficiency_td_target, steps_to_success_targets

    valid = torch.tensor([[True] * 5, [True] * 4 + [False]])
    first = torch.zeros(2, 5, dtype=torch.bool)
    first[0, 3] = True  # succeeds at step 3; the second episode never does
    targets, mask = steps_to_success_targets(first, valid)
    assert mask.tolist() == [[True, True, True, True, False], [False] * 5]
    assert targets[0, :4].tolist() == [-4.0, -3.0, -2.0, -1.0]
    # TD consistency: -1 + V(s') at every step before success, -1 at the success step.
    v_next = torch.cat([targets[:, 1:], torch.zeros(2, 1)], dim=1)
    td = efficiency_td_target(v_next, terminal_success=first)
    assert torch.equal(td[0, :4], targets[0, :4])


def test_habc_step_with_mc_targets_fits_steps_to_go_quickly():
    from diffusion_rl.batching import collate_episodes
    from diffusion_rl.data import Episode
    from diffusion_rl.habc import HABCConfig, HABCCritic, habc_step

    T = 30
    episodes = []
    for n in range(4):
        length = T - 4 * n
        success = np.zeros(length, bool)
        success[-1] = True
        obs = {"observation.state": np.zeros((length, 2))}
        episodes.append(Episode(observations=obs, action=np.zeros((length, 1)), task="t", success=success))
    batch = collate_episodes(episodes)
    # φ(s) = (steps to go) / T one-hot-ish: a linear head can represent V_e exactly.
    steps_to_go = torch.zeros(batch.valid.shape)
    for i, ep in enumerate(episodes):
        steps_to_go[i, : len(ep)] = torch.arange(len(ep), 0, -1, dtype=torch.float32)
    feats = torch.stack([steps_to_go / T, torch.ones_like(steps_to_go)], dim=-1)
    critic = HABCCritic(2, num_layers=0, value_scale=float(T))
    opt = torch.optim.Adam(critic.parameters(), lr=1e-2)
    config = HABCConfig(efficiency_target="mc")
    for _ in range(300):
        loss = habc_step(critic, feats, batch, step=None, config=config).critic_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    v_e = critic(feats).v_e.detach()
    assert torch.allclose(v_e[batch.valid], -steps_to_go[batch.valid], atol=0.5)
    with pytest.raises(ValueError, match="efficiency_target"):
        HABCConfig(efficiency_target="bootstrap")
