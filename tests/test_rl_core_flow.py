"""Flow objectives: conventions, exact analytic checks, SDE log-probs, NFT/AWR/DMD identities."""

import math

import pytest
import torch

from diffusion_rl import distill, flow

torch.set_num_threads(1)


def test_interpolation_convention_t1_is_noise():
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(4, 3, 2, generator=g), torch.randn(4, 3, 2, generator=g)
    assert torch.equal(flow.interpolate(x0, eps, torch.ones(4)), eps)
    assert torch.equal(flow.interpolate(x0, eps, torch.zeros(4)), x0)
    t = torch.rand(4, generator=g)
    x_t = flow.interpolate(x0, eps, t)
    v = flow.velocity_target(x0, eps)
    torch.testing.assert_close(flow.x0_from_velocity(x_t, v, t), x0)
    torch.testing.assert_close(flow.velocity_from_x0(x_t, x0, t, eps=0.0), v, rtol=1e-4, atol=1e-4)


def test_weighted_flow_loss_with_unit_weights_equals_plain_loss():
    g = torch.Generator().manual_seed(1)
    pred, target = torch.randn(6, 5, 7, generator=g), torch.randn(6, 5, 7, generator=g)
    plain = flow.flow_matching_loss(pred, target)
    assert plain.shape == (6,)
    torch.testing.assert_close(plain, ((pred - target) ** 2).mean(dim=(1, 2)))
    assert torch.equal(flow.flow_matching_loss(pred, target, weights=torch.ones(6)), plain)
    w = torch.arange(6.0)
    torch.testing.assert_close(flow.flow_matching_loss(pred, target, weights=w), plain * w)


def test_flow_loss_mask_ignores_padding_even_if_nan():
    pred, target = torch.zeros(2, 4, 3), torch.ones(2, 4, 3)
    pred[0, 3] = float("nan")  # padded chunk step
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    loss = flow.flow_matching_loss(pred, target, mask=mask)
    torch.testing.assert_close(loss, torch.ones(2))


def test_flow_loss_rejects_bad_weight_shape():
    with pytest.raises(ValueError, match="weights must be per-sample"):
        flow.flow_matching_loss(torch.zeros(3, 2), torch.zeros(3, 2), weights=torch.ones(2))


def test_euler_on_constant_velocity_is_exact():
    c = torch.tensor([[0.5, -1.5, 2.0]])
    noise = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    x0 = flow.euler_sample(lambda x, t: c.expand_as(x), noise, num_steps=7)
    # dx/dt = c from t = 1 to 0: x_0 = x_1 − c.
    torch.testing.assert_close(x0, noise - c, rtol=0, atol=1e-6)
    sched = flow.time_schedule(5, shift=3.0)
    assert sched[0] == 1 and sched[-1] == 0 and bool((sched[1:] < sched[:-1]).all())
    torch.testing.assert_close(flow.euler_sample(lambda x, t: c.expand_as(x), noise, schedule=sched), noise - c)


def test_euler_recovers_data_for_the_exact_point_mass_velocity():
    # For data = a point mass at m, the marginal velocity is v(x, t) = (x − m)/t: Euler is exact on it.
    m = torch.tensor([[1.0, -2.0]])
    noise = torch.randn(3, 2, generator=torch.Generator().manual_seed(3))
    x0, traj = flow.euler_sample(lambda x, t: (x - m) / t[:, None], noise, num_steps=4, return_trajectory=True)
    torch.testing.assert_close(x0, m.expand(3, 2), rtol=0, atol=1e-5)
    assert len(traj) == 4 and torch.equal(traj[0][0], noise) and float(traj[0][1][0]) == 1.0


def test_sample_time_distributions():
    g = torch.Generator().manual_seed(4)
    for dist in ("uniform", "logit_normal", "beta"):
        t = flow.sample_time(20000, distribution=dist, generator=g)
        assert t.shape == (20000,) and float(t.min()) >= 0 and float(t.max()) <= 1
    # π0/openpi: t = 0.001 + 0.999·Beta(1.5, 1): mean 0.001 + 0.999·0.6, more mass near t = 1 (noise).
    t = flow.sample_time(50000, distribution="beta", generator=g)
    assert abs(float(t.mean()) - (0.001 + 0.999 * 0.6)) < 0.01
    # VideoAWR: a uniform draw among the high-noise half of a 20-step schedule.
    sched = torch.linspace(1, 0, 21)[:-1]
    t = flow.sample_time(1000, schedule=sched, low=0.5, generator=g)
    assert set(t.tolist()) <= set(sched[sched >= 0.5].tolist()) and len(set(t.tolist())) == 11
    # Decoupled: samples draw different times.
    assert flow.sample_time(8, generator=g).unique().numel() == 8
    with pytest.raises(ValueError, match="distribution"):
        flow.sample_time(3, distribution="cosine")


def _sde_params(v, x, t, t_next, a):
    """Independent restatement of the Flow-SDE step (drift of dx = [v + σ²/(2t)(x + (1−t)v)]dt + σ dw)."""
    dt = t_next - t
    sigma = a * math.sqrt(t / (1 - (t_next if t >= 1 else t)))
    mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
    return mean, sigma * math.sqrt(-dt)


@pytest.mark.parametrize("t, t_next", [(0.7, 0.6), (1.0, 0.9), (0.1, 0.0)])
def test_sde_logprob_is_the_gaussian_density(t, t_next):
    v, x = torch.tensor([[0.8]]), torch.tensor([[-0.3]])
    mean, std = _sde_params(0.8, -0.3, t, t_next, 0.7)
    grid = torch.linspace(mean - 10 * std, mean + 10 * std, 20001)
    lp = flow.sde_step_with_logprob(
        v.expand(grid.numel(), 1),
        x.expand(grid.numel(), 1),
        torch.full((grid.numel(),), t),
        torch.full((grid.numel(),), t_next),
        noise_level=0.7,
        prev_sample=grid[:, None],
        reduce="sum",
    ).log_prob
    dens, xs = lp.double().exp(), grid.double()
    # Numerically integrated: a normalised density with the analytic mean and variance.
    assert abs(float(torch.trapezoid(dens, xs)) - 1.0) < 1e-4
    m1 = float(torch.trapezoid(dens * xs, xs))
    m2 = float(torch.trapezoid(dens * (xs - m1) ** 2, xs))
    assert abs(m1 - mean) < 1e-4 and abs(math.sqrt(m2) - std) < 1e-4
    ref = torch.distributions.Normal(mean, std).log_prob(grid)
    torch.testing.assert_close(lp, ref, rtol=1e-4, atol=1e-4)


def test_sde_logprob_reductions_and_sampling():
    g = torch.Generator().manual_seed(5)
    v, x = torch.randn(3, 4, 5, generator=g), torch.randn(3, 4, 5, generator=g)
    t, tn = torch.full((3,), 0.5), torch.full((3,), 0.4)
    step = flow.sde_step_with_logprob(v, x, t, tn, reduce="none", generator=g)
    summed = flow.sde_step_with_logprob(v, x, t, tn, prev_sample=step.sample, reduce="sum").log_prob
    mean = flow.sde_step_with_logprob(v, x, t, tn, prev_sample=step.sample, reduce="mean").log_prob
    torch.testing.assert_close(summed, step.log_prob.sum(dim=(1, 2)))
    torch.testing.assert_close(mean, summed / 20)
    ref = torch.distributions.Normal(step.mean, step.std_dev_t * math.sqrt(0.1)).log_prob(step.sample).sum(dim=(1, 2))
    torch.testing.assert_close(summed, ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="t_next < t"):
        flow.sde_step_with_logprob(v, x, tn, t)


def test_ppo_ratio_is_exactly_one_before_the_first_update():
    torch.manual_seed(6)
    net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    vel = lambda x, t: net(torch.cat([x, t[:, None]], dim=-1))  # noqa: E731
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        _, states, nexts, old_lp = flow.sde_sample(vel, torch.randn(5, 2, generator=g), num_steps=6, generator=g)
    sched = flow.time_schedule(6)
    adv = torch.randn(5, generator=g)
    for k in range(6):
        t, tn = sched[k].expand(5), sched[k + 1].expand(5)
        lp = flow.sde_step_with_logprob(vel(states[k], t), states[k], t, tn, prev_sample=nexts[k]).log_prob
        assert torch.equal(lp, old_lp[k])
        loss, stats = flow.ppo_clip_loss(lp, old_lp[k], adv)
        assert float(stats.ratio_mean) == 1.0 and float(stats.clipfrac) == 0.0 and float(stats.approx_kl) == 0.0
        torch.testing.assert_close(loss, -adv.clamp(-5, 5))


def test_ppo_clip_stops_the_gradient_outside_the_trust_region():
    lp = torch.tensor([0.5, -0.5, 0.5, -0.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, stats = flow.ppo_clip_loss(lp, torch.zeros(4), adv, clip_range=0.2)
    loss.sum().backward()
    # Ratio e^0.5 > 1.2 with A > 0 and e^-0.5 < 0.8 with A < 0 are clipped: no gradient; the others are not.
    assert lp.grad[0] == 0 and lp.grad[3] == 0 and lp.grad[1] != 0 and lp.grad[2] != 0
    assert float(stats.clipfrac) == 1.0


def test_sde_kl_matches_flow_grpo_form_and_exact_kl():
    g = torch.Generator().manual_seed(8)
    m, mr = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    sd = torch.full((4, 1), 0.3)
    kl = flow.sde_kl_loss(m, mr, sd)
    torch.testing.assert_close(kl, ((m - mr) ** 2).mean(1) / (2 * 0.09))
    exact = flow.sde_kl_loss(m, mr, sd, dt=torch.full((4,), 0.1))
    p = torch.distributions.Normal(m, 0.3 * math.sqrt(0.1))
    q = torch.distributions.Normal(mr, 0.3 * math.sqrt(0.1))
    torch.testing.assert_close(exact, torch.distributions.kl_divergence(p, q).mean(1))


def test_nft_weight_mapping_and_velocity_form():
    a = torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 10.0])
    torch.testing.assert_close(flow.nft_weight(a, adv_clip_max=5.0), torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0]))
    g = torch.Generator().manual_seed(9)
    x0, eps, t = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g), torch.rand(5, generator=g) * 0.8 + 0.1
    x_t, v = flow.interpolate(x0, eps, t), flow.velocity_target(x0, eps)
    v_theta, v_old = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    # All-positive (r = 1) with β = 1 is plain flow matching on v_θ.
    loss = flow.nft_loss(v_theta, v_old, x_t=x_t, x0=x0, t=t, r=torch.ones(5), beta=1.0, space="velocity")
    torch.testing.assert_close(loss, flow.flow_matching_loss(v_theta, v), rtol=1e-4, atol=1e-5)
    # r = 0: the implicit negative 2·v_old − v_θ is regressed onto v.
    loss0 = flow.nft_loss(v_theta, v_old, x_t=x_t, x0=x0, t=t, r=torch.zeros(5), beta=1.0, space="velocity")
    torch.testing.assert_close(loss0, flow.flow_matching_loss(2 * v_old - v_theta, v), rtol=1e-4, atol=1e-5)


def test_nft_gradient_points_towards_positive_and_away_from_negative_samples():
    g = torch.Generator().manual_seed(10)
    x0, eps, t = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g), torch.full((2,), 0.5)
    x_t, v = flow.interpolate(x0, eps, t), flow.velocity_target(x0, eps)
    v_old = v + 0.3 * torch.randn(2, 3, generator=g)
    v_theta = v_old.clone().requires_grad_(True)
    loss = flow.nft_loss(v_theta, v_old, x_t=x_t, x0=x0, t=t, advantages=torch.tensor([5.0, -5.0]))
    loss.sum().backward()
    step = -v_theta.grad
    assert float((step[0] * (v[0] - v_old[0])).sum()) > 0  # positive sample: towards its velocity
    assert float((step[1] * (v[1] - v_old[1])).sum()) < 0  # negative sample: away from it


def test_awr_target_and_loss():
    g = torch.Generator().manual_seed(11)
    x0, eps, t = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g), torch.full((3,), 0.6)
    x_t = flow.interpolate(x0, eps, t)
    v_old = torch.randn(3, 4, generator=g)
    x0_old = flow.x0_from_velocity(x_t, v_old, t)
    tgt = flow.awr_target(x_t=x_t, t=t, v_old=v_old, x0=x0, energies=torch.tensor([1.0, 0.0, -1.0]))
    torch.testing.assert_close(tgt[0], x0[0])  # E = 1: the clean sample
    torch.testing.assert_close(tgt[1], x0_old[1])  # E = 0: the old model's own prediction
    torch.testing.assert_close(tgt[2], 2 * x0_old[2] - x0[2])  # E < 0: reflected away
    v_theta = v_old.clone().requires_grad_(True)
    loss = flow.awr_loss(v_theta, x_t=x_t, t=t, x0=x0, x0_star=tgt)
    assert loss.shape == (3,) and float(loss[1].detach()) == 0.0
    x0_th = flow.x0_from_velocity(x_t, v_theta.detach(), t)
    expect0 = ((x0_th[0] - tgt[0]) ** 2).mean() / (x0_th[0] - x0[0]).abs().mean()
    torch.testing.assert_close(loss[0], expect0)


def test_dmd_loss_gradient_is_g_and_stream_r1_weights():
    g_ = torch.Generator().manual_seed(12)
    x = torch.randn(2, 3, 4, generator=g_, requires_grad=True)
    f_real, f_fake = torch.randn(2, 3, 4, generator=g_), torch.randn(2, 3, 4, generator=g_)
    g = distill.dmd_gradient(x.detach(), f_fake, f_real)
    torch.testing.assert_close(g[0], (f_fake[0] - f_real[0]) / (x[0].detach() - f_real[0]).abs().mean())
    tilt = distill.reward_tilt_weights(torch.tensor([0.0, 1.0]))
    distill.dmd_loss(x, g, weights=tilt).sum().backward()
    torch.testing.assert_close(x.grad, g * tilt[:, None, None] / 12)
    # Saliency weights: mean 1 per sample, floors respected, a salient frame weighs more.
    sal = torch.rand(2, 5, 6, 6, generator=g_)
    sal[:, 2] += 3.0
    w = distill.saliency_weights(sal)
    torch.testing.assert_close(w.mean(dim=(1, 2, 3)), torch.ones(2))
    assert float(w[:, 2].mean()) > float(w[:, 0].mean())
    fused = distill.saliency_weights(torch.rand(2, 3, 5, 6, 6, generator=g_), torch.tensor([[0.1, 0.5, 0.9]] * 2))
    assert fused.shape == (2, 5, 6, 6)


def test_afd_discriminator_and_advantage_mapping():
    d_t, d_s = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 2.0])
    bt = distill.bt_discriminator_loss(d_t, d_s)
    torch.testing.assert_close(bt, -torch.nn.functional.logsigmoid(d_t - d_s))
    assert float(bt[0]) < float(bt[1])
    a = distill.afd_advantages(torch.tensor([1.0, 3.0, 5.0, 7.0]), torch.tensor([0, 0, 1, 1]))
    torch.testing.assert_close(a, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    torch.testing.assert_close(distill.afd_weights(a, adv_clip_max=2.0), torch.tensor([0.25, 0.75, 0.25, 0.75]))


def test_opsd_regresses_onto_teacher_velocity():
    v_s = torch.zeros(3, 2, requires_grad=True)
    v_t = torch.ones(3, 2)
    loss = distill.opsd_loss(v_s, v_t)
    torch.testing.assert_close(loss, torch.ones(3))
    loss.sum().backward()
    assert bool((v_s.grad < 0).all())  # descending moves the student towards the teacher


def test_dtypes_are_preserved_and_sde_math_runs_in_float32():
    x64 = torch.randn(3, 4, dtype=torch.float64)
    assert flow.flow_matching_loss(x64, torch.zeros_like(x64)).dtype == torch.float64
    assert flow.interpolate(x64, x64, torch.rand(3, dtype=torch.float64)).dtype == torch.float64
    xb = torch.randn(3, 4).bfloat16()
    step = flow.sde_step_with_logprob(xb, xb, torch.full((3,), 0.5), torch.full((3,), 0.4))
    assert step.sample.dtype == torch.bfloat16 and step.log_prob.dtype == torch.float32


def test_reference_anchor_velocity_and_x0_forms_agree_up_to_t_squared():
    from diffusion_rl.flow import reference_anchor

    g = torch.Generator().manual_seed(0)
    v, v_ref = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    t = torch.tensor([0.1, 0.5, 1.0])
    vel = reference_anchor(v, v_ref, weight=0.5)
    torch.testing.assert_close(vel, 0.5 * (v - v_ref).pow(2).mean((1, 2)))
    x0 = reference_anchor(v, v_ref, weight=0.5, t=t, space="x0")
    x_t = torch.randn(3, 2, 4, generator=g)
    direct = 0.5 * (flow.x0_from_velocity(x_t, v, t) - flow.x0_from_velocity(x_t, v_ref, t)).pow(2).mean((1, 2))
    torch.testing.assert_close(x0, direct)
    torch.testing.assert_close(x0, vel * t**2)
    v.requires_grad_(True)
    reference_anchor(v, v_ref.requires_grad_(True), weight=1.0).sum().backward()
    assert v_ref.grad is None and v.grad is not None  # the reference is a constant
    with pytest.raises(ValueError, match="space='x0' needs the flow time t"):
        reference_anchor(v, v_ref, weight=1.0, space="x0")


def test_flowawr_reference_decay_schedule():
    from diffusion_rl.flow import flowawr_ref_decay

    assert [flowawr_ref_decay(s) for s in (0, 74, 75)] == [0.0, 0.0, 0.0]
    assert flowawr_ref_decay(175) == pytest.approx(0.75)
    assert flowawr_ref_decay(10_000) == 0.999


def test_opsd_loss_x0_space_is_the_velocity_loss_weighted_by_t_squared():
    from diffusion_rl.distill import opsd_loss

    g = torch.Generator().manual_seed(1)
    v_s, v_t = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    t = torch.tensor([0.2, 0.4, 0.6, 1.0])
    torch.testing.assert_close(opsd_loss(v_s, v_t, t=t, space="x0"), opsd_loss(v_s, v_t) * t**2)
