"""The one flow-matching module of kinema: time sampling, interpolation, per-sample losses, samplers.

Every trainable model in kinema (the VLA's action expert, the video-diffusion policy, the video generator) is a
flow-matching model, and every RL objective is expressed here as a per-sample loss that the credit machinery
weights or re-targets.

Time convention (diffusers' `FlowMatchEulerDiscreteScheduler`, and openpi): **t = 1 is pure noise, t = 0 is data.**

    x_t = (1 − t)·x_0 + t·ε          (interpolate)
    v   = dx_t/dt = ε − x_0           (velocity_target)
    x̂_0 = x_t − t·v                   (x0_from_velocity)

Sampling integrates from t = 1 down to t = 0: x_{t'} = x_t + (t' − t)·v(x_t, t) with t' < t (Euler).
The π0 paper writes time the other way round (τ = 1 is data); openpi, like us, uses t = 1 for noise.

Tensor shapes: a batch is (B, ...) with any trailing shape: (B, horizon, action_dim) for action chunks,
(B, C, F, H, W) for video latents. Per-sample quantities (t, weights, advantages) are (B,). Every loss here
returns a (B,) tensor of per-sample losses: the caller reduces (usually `.mean()`), so that weights, masks and
group structure stay visible.

Distillation targets (DMD, Stream-R1, AFD, OPSD) live in `diffusion_rl.distill`; group-relative advantages and
the VideoAWR energies in `diffusion_rl.advantages`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from diffusion_rl._util import check_same_shape, expand_to, per_sample_mean

VelocityFn = Callable[[Tensor, Tensor], Tensor]
"""A velocity field: (x_t (B, ...), t (B,)) -> v (B, ...)."""

TimeDistribution = Literal["uniform", "logit_normal", "beta"]


# ----------------------------------------------------------------------------------------------------------------
# Time sampling (decoupled: every sample draws its own t)
# ----------------------------------------------------------------------------------------------------------------


def sample_time(
    batch_size: int,
    *,
    distribution: TimeDistribution = "uniform",
    low: float = 0.0,
    high: float = 1.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    beta_a: float = 1.5,
    beta_b: float = 1.0,
    beta_offset: float = 0.001,
    schedule: Tensor | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Draw one flow time per sample, (batch_size,), in [low, high] (t = 1 is noise).

    Args:
        distribution: `uniform`; `logit_normal` (t = sigmoid(N(logit_mean, logit_std)), as in SD3);
            `beta`: π0/openpi's schedule t = beta_offset + (1 − beta_offset)·Beta(beta_a, beta_b), which with
            (1.5, 1) puts more mass near t = 1 (noisier). The draw u ∈ [0, 1] is mapped to low + (high − low)·u.
        schedule: optional discrete timesteps (S,). If given, each sample picks uniformly one entry of `schedule`
            that lies in [low, high] (VideoAWR: a uniform step from the high-noise half of a 20-step schedule),
            and `distribution` is ignored.
        generator: makes the draw reproducible. Beta with both parameters ≠ 1 falls back to
            `torch.distributions.Beta`, which ignores the generator.
    """
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0; got {batch_size}")
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"need 0 <= low <= high <= 1; got low={low}, high={high}")
    if schedule is not None:
        allowed = schedule[(schedule >= low) & (schedule <= high)]
        if allowed.numel() == 0:
            raise ValueError(f"no schedule entry lies in [{low}, {high}]; schedule={schedule.tolist()}")
        idx = torch.randint(0, allowed.numel(), (batch_size,), generator=generator, device=allowed.device)
        return allowed[idx].to(device=device or allowed.device, dtype=dtype)
    u = torch.rand(batch_size, generator=generator, device=device, dtype=dtype)
    if distribution == "uniform":
        base = u
    elif distribution == "logit_normal":
        n = torch.randn(batch_size, generator=generator, device=device, dtype=dtype)
        base = torch.sigmoid(logit_mean + logit_std * n)
    elif distribution == "beta":
        # Inverse CDF where it is closed-form, so the generator is honoured for π0's Beta(1.5, 1).
        if beta_b == 1.0:
            draw = u.pow(1.0 / beta_a)
        elif beta_a == 1.0:
            draw = 1.0 - u.pow(1.0 / beta_b)
        else:
            draw = torch.distributions.Beta(beta_a, beta_b).sample((batch_size,)).to(device=device, dtype=dtype)
        base = beta_offset + (1.0 - beta_offset) * draw
    else:
        raise ValueError(f"distribution must be 'uniform', 'logit_normal' or 'beta'; got {distribution!r}")
    return low + (high - low) * base


def time_schedule(num_steps: int, *, shift: float = 1.0, device=None, dtype=torch.float32) -> Tensor:
    """Decreasing sampling times (num_steps + 1,) from 1 to 0, with diffusers' shift σ' = sσ / (1 + (s − 1)σ)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    sigma = torch.linspace(1.0, 0.0, num_steps + 1, device=device, dtype=dtype)
    if shift != 1.0:
        sigma = shift * sigma / (1.0 + (shift - 1.0) * sigma)
    return sigma


# ----------------------------------------------------------------------------------------------------------------
# The interpolant
# ----------------------------------------------------------------------------------------------------------------


def interpolate(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """x_t = (1 − t)·x_0 + t·ε. x0, noise: (B, ...); t: (B,) or scalar."""
    check_same_shape(x0=x0, noise=noise)
    tt = expand_to(torch.as_tensor(t, dtype=x0.dtype, device=x0.device), x0)
    return (1.0 - tt) * x0 + tt * noise


def velocity_target(x0: Tensor, noise: Tensor) -> Tensor:
    """The conditional velocity v = ε − x_0, (B, ...)."""
    check_same_shape(x0=x0, noise=noise)
    return noise - x0


def x0_from_velocity(x_t: Tensor, v: Tensor, t: Tensor) -> Tensor:
    """x̂_0 = x_t − t·v, (B, ...)."""
    check_same_shape(x_t=x_t, v=v)
    return x_t - expand_to(torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device), x_t) * v


def velocity_from_x0(x_t: Tensor, x0_hat: Tensor, t: Tensor, *, eps: float = 1e-3) -> Tensor:
    """v = (x_t − x̂_0) / max(t, eps), for models that predict the clean sample (trains better for wide patches)."""
    check_same_shape(x_t=x_t, x0_hat=x0_hat)
    tt = expand_to(torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device), x_t)
    return (x_t - x0_hat) / tt.clamp_min(eps)


def cfg_velocity(v_cond: Tensor, v_uncond: Tensor, scale: float) -> Tensor:
    """Classifier-free guidance: v_uncond + scale·(v_cond − v_uncond). scale = 1 is unguided."""
    check_same_shape(v_cond=v_cond, v_uncond=v_uncond)
    return v_uncond + scale * (v_cond - v_uncond)


# ----------------------------------------------------------------------------------------------------------------
# Conditional flow matching, plain and advantage-weighted
# ----------------------------------------------------------------------------------------------------------------


def flow_matching_loss(
    pred: Tensor,
    target: Tensor,
    *,
    weights: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """Per-sample conditional flow-matching loss, (B,).

    loss_i = w_i · mean over unmasked elements of (pred_i − target_i)².

    Args:
        pred, target: (B, ...), usually v_θ(x_t, t) and ε − x_0 (or x̂_0 and x_0, or an AWR/OPSD target).
        weights: (B,) per-sample weights from the credit machinery (HABC g, AWR exp(A/τ), ...). Not normalised
            here: normalisation is a credit decision (`habc_actor_weights` does it).
        mask: broadcastable to pred from the left, e.g. (B,) or (B, horizon) for padded chunks, or (B, ...).
    """
    check_same_shape(pred=pred, target=target)
    loss = per_sample_mean((pred - target).pow(2), mask)
    if weights is not None:
        if weights.shape != loss.shape:
            raise ValueError(f"weights must be per-sample ({loss.shape[0]},); got {tuple(weights.shape)}")
        loss = loss * weights.to(loss.dtype)
    return loss


def exp_advantage_weights(
    advantages: Tensor,
    *,
    temperature: float = 1.0,
    max_weight: float = 20.0,
    normalize: bool = False,
) -> Tensor:
    """AWR / AWM weights w = min(exp(A/τ), max_weight), (B,). With normalize, divided by their mean."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    w = torch.exp((advantages / temperature).clamp(max=math.log(max_weight)))
    if normalize:
        w = w / w.mean().clamp_min(1e-8)
    return w


# ----------------------------------------------------------------------------------------------------------------
# DiffusionNFT
# ----------------------------------------------------------------------------------------------------------------


def nft_weight(advantages: Tensor, *, adv_clip_max: float = 5.0) -> Tensor:
    """NFT's mapping from advantage to the positive-branch weight: r = clip(A/A_max, −1, 1)/2 + ½ ∈ [0, 1]."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0; got {adv_clip_max}")
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2.0 + 0.5).clamp(0.0, 1.0)


def _adaptive_x0_mse(x0_pred: Tensor, x0: Tensor, mask: Tensor | None) -> Tensor:
    # The official NFT/AWR codes divide the x0-space MSE by a detached per-sample mean |x̂_0 − x_0| (clamped at
    # 1e-5): a per-sample step-size normaliser that makes the loss scale-free across t and samples.
    with torch.no_grad():
        scale = per_sample_mean((x0_pred.double() - x0.double()).abs(), mask).clamp_min(1e-5).to(x0_pred.dtype)
    return per_sample_mean((x0_pred - x0).pow(2), mask) / scale


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    *,
    x_t: Tensor,
    x0: Tensor,
    t: Tensor,
    advantages: Tensor | None = None,
    r: Tensor | None = None,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    v_ref: Tensor | None = None,
    ref_weight: float = 0.0,
    space: Literal["x0_adaptive", "velocity"] = "x0_adaptive",
    mask: Tensor | None = None,
) -> Tensor:
    """DiffusionNFT loss on the student's own noised clean samples, per sample (B,).

    v⁺ = β·v_θ + (1 − β)·v_old,  v⁻ = (1 + β)·v_old − β·v_θ  (v_old detached: the sampling policy's prediction),
    loss = r·ℓ(v⁺) + (1 − r)·ℓ(v⁻) + λ·mean(v_θ − v_ref)²,  r = clip(A/A_max)/2 + ½.

    `space="x0_adaptive"` (default) follows the official code: ℓ is the x̂_0-space MSE divided by a detached
    mean|x̂_0 − x_0|, the two branches are divided by β and the policy term is multiplied by A_max.
    `space="velocity"` is the textbook form ℓ(v±) = mean(v± − (ε − x_0))², with no extra scaling.

    Note: the loss as DiffusionNFT writes it has stopgrad(v_θ) in place of v_old. The two coincide only on the first
    step after the old policy was synced; the official code uses the old (sampling) model, as we do here. Pass
    `v_old = v_theta.detach()` for the other reading.

    Args:
        v_theta: (B, ...) current prediction (with grad). v_old: (B, ...) the old policy's prediction.
        x_t, x0: (B, ...); t: (B,). advantages (B,) or r (B,) directly (e.g. AFD's discriminator mapping).
        v_ref: (B, ...) reference-model prediction for the anchor, weighted by `ref_weight` (λ).
    """
    check_same_shape(v_theta=v_theta, v_old=v_old, x_t=x_t, x0=x0, v_ref=v_ref)
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta}")
    if (advantages is None) == (r is None):
        raise ValueError("pass exactly one of `advantages` (mapped by nft_weight) or `r` (already in [0, 1])")
    if r is None:
        r = nft_weight(advantages, adv_clip_max=adv_clip_max)
    r = r.to(v_theta.dtype)
    v_old = v_old.detach()
    v_pos = beta * v_theta + (1.0 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v_theta
    if space == "x0_adaptive":
        tt = expand_to(torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device), x_t)
        pos = _adaptive_x0_mse(x_t - tt * v_pos, x0, mask)
        neg = _adaptive_x0_mse(x_t - tt * v_neg, x0, mask)
        loss = (r * pos / beta + (1.0 - r) * neg / beta) * adv_clip_max
    elif space == "velocity":
        tt = expand_to(torch.as_tensor(t, dtype=x_t.dtype, device=x_t.device), x_t)
        v_target = (x_t - x0) / tt.clamp_min(1e-6)  # = ε − x_0 exactly when x_t was built by `interpolate`
        loss = r * flow_matching_loss(v_pos, v_target, mask=mask) + (1.0 - r) * flow_matching_loss(
            v_neg, v_target, mask=mask
        )
    else:
        raise ValueError(f"space must be 'x0_adaptive' or 'velocity'; got {space!r}")
    if v_ref is not None and ref_weight > 0:
        loss = loss + reference_anchor(v_theta, v_ref, weight=ref_weight, mask=mask)
    return loss


# ----------------------------------------------------------------------------------------------------------------
# The reference anchor, and FlowAWR's reference schedule
# ----------------------------------------------------------------------------------------------------------------


def reference_anchor(
    v_theta: Tensor,
    v_ref: Tensor,
    *,
    weight: float,
    t: Tensor | None = None,
    space: Literal["velocity", "x0"] = "velocity",
    mask: Tensor | None = None,
) -> Tensor:
    """The anchor to a reference model, per sample (B,): λ·mean(v_θ − v_ref)² (`space="velocity"`, the form of
    FlowAWR) or λ·mean(x̂_0,θ − x̂_0,ref)² = λ·mean(t²·(v_θ − v_ref)²) (`space="x0"`, needs t).

    At the same x_t the two differ only by the factor t²: the x̂_0 form keeps a model that predicts x̂_0 and
    derives v = (x_t − x̂_0)/t from an anchor that grows as 1/t² near t = 0. v_ref is detached.
    """
    check_same_shape(v_theta=v_theta, v_ref=v_ref)
    if weight < 0:
        raise ValueError(f"weight must be >= 0; got {weight}")
    diff = v_theta - v_ref.detach()
    if space == "x0":
        if t is None:
            raise ValueError("space='x0' needs the flow time t (x̂_0 − x̂_0,ref = −t·(v_θ − v_ref))")
        diff = expand_to(torch.as_tensor(t, dtype=diff.dtype, device=diff.device), diff) * diff
    elif space != "velocity":
        raise ValueError(f"space must be 'velocity' or 'x0'; got {space!r}")
    return weight * per_sample_mean(diff.pow(2), mask)


def flowawr_ref_decay(step: int, *, start: int = 75, rate: float = 0.0075, max_decay: float = 0.999) -> float:
    """FlowAWR's EMA-reference decay at update `step`: 0 (the reference is the current policy) until `start`,
    then min(rate·(step − start), max_decay), so the reference slows down as training settles."""
    if step < start:
        return 0.0
    return min(rate * (step - start), max_decay)


# ----------------------------------------------------------------------------------------------------------------
# FlowAWR / VideoAWR target regression
# ----------------------------------------------------------------------------------------------------------------


def awr_target(*, x_t: Tensor, t: Tensor, v_old: Tensor, x0: Tensor, energies: Tensor) -> Tensor:
    """VideoAWR's rectified target x_0* = x̂_0,old + E·(x_0 − x̂_0,old), (B, ...).

    v_old must be the old reference's **unguided** conditional prediction (the rollouts may use CFG, the anchor
    may not: that is VideoAWR's decoupling). energies: (B,) from `advantages.awr_energies`.
    """
    check_same_shape(x_t=x_t, v_old=v_old, x0=x0)
    x0_old = x0_from_velocity(x_t, v_old.detach(), t)
    return x0_old + expand_to(energies.to(x0.dtype), x0) * (x0 - x0_old)


def awr_loss(
    v_theta: Tensor,
    *,
    x_t: Tensor,
    t: Tensor,
    x0: Tensor,
    x0_star: Tensor,
    v_base: Tensor | None = None,
    base_weight: float = 1e-4,
    mask: Tensor | None = None,
) -> Tensor:
    """VideoAWR loss per sample (B,): mean(x̂_0,θ − x_0*)² / stopgrad(mean|x̂_0,θ − x_0|) + λ·mean(v_θ − v_base)².

    The normaliser uses the distance to the clean sample x_0 (not to the target), clamped at 1e-5, as in the
    official `train_wan2_1_awr.py`. `v_base` is the frozen base model's prediction (λ = 1e-4 by default).
    """
    check_same_shape(v_theta=v_theta, x_t=x_t, x0=x0, x0_star=x0_star, v_base=v_base)
    x0_theta = x0_from_velocity(x_t, v_theta, t)
    with torch.no_grad():
        scale = per_sample_mean((x0_theta.double() - x0.double()).abs(), mask).clamp_min(1e-5).to(x0.dtype)
    loss = per_sample_mean((x0_theta - x0_star.detach()).pow(2), mask) / scale
    if v_base is not None and base_weight > 0:
        loss = loss + reference_anchor(v_theta, v_base, weight=base_weight, mask=mask)
    return loss


# ----------------------------------------------------------------------------------------------------------------
# Samplers
# ----------------------------------------------------------------------------------------------------------------


def euler_sample(
    velocity_fn: VelocityFn,
    noise: Tensor,
    *,
    num_steps: int = 10,
    schedule: Tensor | None = None,
    return_trajectory: bool = False,
) -> Tensor | tuple[Tensor, list[tuple[Tensor, Tensor]]]:
    """Integrate dx/dt = v from t = 1 (noise) to t = 0 with Euler steps: x_{t'} = x_t + (t' − t)·v(x_t, t).

    Args:
        velocity_fn: (x (B, ...), t (B,)) -> v (B, ...).
        noise: (B, ...) the starting point at t = 1.
        schedule: decreasing times (S + 1,) from 1 to 0; defaults to `time_schedule(num_steps)`.
        return_trajectory: also return the visited (x_t, t) pairs, the states on which on-policy distillation
            (OPSD) queries its teacher.
    Returns: x_0 (B, ...), and optionally the list of (x_t (B, ...), t (B,)) before each step.
    """
    sched = schedule if schedule is not None else time_schedule(num_steps, device=noise.device, dtype=noise.dtype)
    if sched.ndim != 1 or sched.numel() < 2:
        raise ValueError(f"schedule must be 1-D with >= 2 entries; got shape {tuple(sched.shape)}")
    x = noise
    traj: list[tuple[Tensor, Tensor]] = []
    for i in range(sched.numel() - 1):
        t = sched[i].expand(x.shape[0])
        if return_trajectory:
            traj.append((x, t))
        x = x + (sched[i + 1] - sched[i]) * velocity_fn(x, t)
    return (x, traj) if return_trajectory else x


class SDEStep(NamedTuple):
    """One Flow-SDE step: the next sample, its log-prob (reduced as asked), the Gaussian's mean and σ_t."""

    sample: Tensor  # (B, ...) x_{t_next}
    log_prob: Tensor  # (B,) or (B, ...) when reduce="none"
    mean: Tensor  # (B, ...)
    std_dev_t: Tensor  # (B, 1, ..., 1): σ_t (the step's standard deviation is σ_t·sqrt(t − t_next))


def sde_step_with_logprob(
    v: Tensor,
    x_t: Tensor,
    t: Tensor,
    t_next: Tensor,
    *,
    noise_level: float = 0.7,
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
    reduce: Literal["mean", "sum", "none"] = "mean",
) -> SDEStep:
    """One step of Flow-GRPO's reverse SDE, with the Gaussian log-prob of the step (for PPO/GRPO baselines).

    Matched against Flow-GRPO's `sde_step_with_logprob` (yifan123/flow_grpo,
    flow_grpo/diffusers_patch/sd3_sde_with_logprob.py, sde_type="sde"), written afresh:

        σ_t  = a·sqrt(t / (1 − t))     (a = noise_level; at t = 1 the denominator uses t_next, as Flow-GRPO
                                         substitutes sigmas[1] for the first step)
        dt   = t_next − t  (< 0)
        mean = x_t·(1 + σ_t²/(2t)·dt) + v·(1 + σ_t²(1 − t)/(2t))·dt
        x'   = mean + σ_t·sqrt(−dt)·z,   z ~ N(0, I)
        log p(x') = −(x' − mean)²/(2σ_t²|dt|) − log(σ_t sqrt|dt|) − ½ log 2π      (per element, x' detached)

    Flow-GRPO then takes the **mean** over non-batch dims (`reduce="mean"`, the default here, so clip ranges
    like 1e-4 transfer); `reduce="sum"` gives the exact log-density of the step.

    Args:
        v: (B, ...) the model's velocity at (x_t, t). x_t: (B, ...). t, t_next: (B,) or scalars, t > t_next.
        prev_sample: evaluate the log-prob of a given x' instead of sampling one (PPO's re-evaluation).
    """
    check_same_shape(v=v, x_t=x_t, prev_sample=prev_sample)
    # Float32 math: bf16 overflows in the mean (Flow-GRPO casts for the same reason).
    v32, x32 = v.float(), x_t.float()
    tt = expand_to(torch.as_tensor(t, device=x_t.device, dtype=torch.float32), x32)
    tn = expand_to(torch.as_tensor(t_next, device=x_t.device, dtype=torch.float32), x32)
    if bool((tn >= tt).any()):
        raise ValueError("sde_step_with_logprob needs t_next < t (sampling runs from t = 1 towards 0)")
    dt = tn - tt
    denom_t = torch.where(tt >= 1.0, tn, tt)
    std_dev_t = torch.sqrt(tt / (1.0 - denom_t)) * noise_level
    mean = (
        x32 * (1.0 + std_dev_t.pow(2) / (2.0 * tt) * dt) + v32 * (1.0 + std_dev_t.pow(2) * (1.0 - tt) / (2.0 * tt)) * dt
    )
    scale = std_dev_t * torch.sqrt(-dt)
    if prev_sample is None:
        # Drawn where the generator lives (a CPU generator for a CUDA model is fine), then moved to the state.
        z = torch.randn(x32.shape, generator=generator, device=generator.device if generator is not None else x32.device,
                        dtype=x32.dtype).to(x32.device)
        sample = mean + scale * z
    else:
        sample = prev_sample.float()
    lp = -((sample.detach() - mean) ** 2) / (2.0 * scale.pow(2)) - torch.log(scale) - 0.5 * math.log(2.0 * math.pi)
    if reduce == "mean":
        lp = lp.mean(dim=tuple(range(1, lp.ndim)))
    elif reduce == "sum":
        lp = lp.sum(dim=tuple(range(1, lp.ndim)))
    elif reduce != "none":
        raise ValueError(f"reduce must be 'mean', 'sum' or 'none'; got {reduce!r}")
    return SDEStep(sample.to(x_t.dtype), lp, mean, std_dev_t)


def sde_sample(
    velocity_fn: VelocityFn,
    noise: Tensor,
    *,
    num_steps: int = 10,
    schedule: Tensor | None = None,
    noise_level: float = 0.7,
    generator: torch.Generator | None = None,
    reduce: Literal["mean", "sum"] = "mean",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Roll out the Flow-SDE from t = 1 to 0, recording what PPO needs to re-evaluate each step.

    Every step is stochastic, the last one (to t = 0) included, as in Flow-GRPO: σ_t·sqrt(t − t_next) stays > 0.
    Returns: (x_0 (B, ...), states (S, B, ...) = x_t before each step, next_states (S, B, ...),
    log_probs (S, B)), S = number of steps; the schedule is `time_schedule(num_steps)` unless given.
    """
    sched = schedule if schedule is not None else time_schedule(num_steps, device=noise.device, dtype=noise.dtype)
    x = noise
    states, nexts, lps = [], [], []
    for i in range(sched.numel() - 1):
        t = sched[i].expand(x.shape[0])
        t_next = sched[i + 1].expand(x.shape[0])
        step = sde_step_with_logprob(
            velocity_fn(x, t), x, t, t_next, noise_level=noise_level, generator=generator, reduce=reduce
        )
        states.append(x)
        nexts.append(step.sample)
        lps.append(step.log_prob)
        x = step.sample
    return x, torch.stack(states), torch.stack(nexts), torch.stack(lps)


# ----------------------------------------------------------------------------------------------------------------
# Policy-gradient baselines on the SDE (Flow-GRPO / πRL)
# ----------------------------------------------------------------------------------------------------------------


class PPOStats(NamedTuple):
    approx_kl: Tensor  # scalar: ½·mean((log π − log π_old)²), as Flow-GRPO logs it
    clipfrac: Tensor  # scalar: fraction of samples with |ratio − 1| > clip_range
    ratio_mean: Tensor  # scalar


def ppo_clip_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
) -> tuple[Tensor, PPOStats]:
    """Clipped-ratio policy loss per sample (B,): max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)), ρ = exp(log π − log π_old).

    Defaults are Flow-GRPO's (clip_range 1e-4 on mean-reduced log-probs, advantages clipped to ±5).
    Before the first update log π equals log π_old bit for bit, so ρ = 1 exactly.
    """
    check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    diff = log_prob - old_log_prob.detach()
    ratio = torch.exp(diff)
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))
    with torch.no_grad():
        stats = PPOStats(
            approx_kl=0.5 * diff.pow(2).mean(),
            clipfrac=((ratio - 1.0).abs() > clip_range).float().mean(),
            ratio_mean=ratio.mean(),
        )
    return loss, stats


def sde_kl_loss(mean: Tensor, ref_mean: Tensor, std_dev_t: Tensor, *, dt: Tensor | None = None) -> Tensor:
    """KL of the policy's SDE step to the reference's, per sample (B,).

    Flow-GRPO's form (dt=None): mean over elements of (μ − μ_ref)² / (2σ_t²). That is the exact per-element
    Gaussian KL times |dt| (both steps share the variance σ_t²|dt|). Pass dt (B,) for the exact per-element KL.
    """
    check_same_shape(mean=mean, ref_mean=ref_mean)
    var = std_dev_t.pow(2)
    if dt is not None:
        var = var * expand_to(torch.as_tensor(dt, dtype=var.dtype, device=var.device).abs(), mean)
    return per_sample_mean((mean - ref_mean.detach()).pow(2) / (2.0 * var))
