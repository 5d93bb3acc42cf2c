"""Group-relative advantages (GRPO, MC-GRPO, GDPO, DARA), VideoAWR energies, and GAE for a PPO baseline.

A *group* is the set of rollouts that share a task and seed (robot episodes) or a prompt (video samples);
`group_ids` is a (B,) integer tensor naming each sample's group (any integers; they need not be contiguous or
sorted). Groups in which every reward is equal carry no signal: they are dropped (weight 0) or down-weighted
explicitly, and counted in the returned stats. So are groups of one sample.

Every group function returns a `GroupAdvantages(advantages (B,), weights (B,), stats)`. `weights` is the
per-sample loss weight the trainer should multiply by: 0 for dropped samples (degenerate groups, MC-GRPO's
median pivot), `degenerate_weight` for down-weighted ones, 1 otherwise.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from diffusion_rl._util import check_shape

Degenerate = Literal["drop", "downweight", "keep"]


class GroupAdvantages(NamedTuple):
    advantages: Tensor  # (B,)
    weights: Tensor  # (B,) per-sample loss weight (0 = dropped)
    stats: dict[str, float]


# ----------------------------------------------------------------------------------------------------------------
# Vectorised per-group reductions (no Python loop over groups: 10^6 samples take milliseconds)
# ----------------------------------------------------------------------------------------------------------------


def _groups(group_ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    check_shape("group_ids", group_ids, (n,))
    _, inv = torch.unique(group_ids, return_inverse=True)
    count = torch.bincount(inv)
    return inv, count


def _group_sum(x: Tensor, inv: Tensor, n_groups: int) -> Tensor:
    out = torch.zeros((n_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out.index_add_(0, inv, x)


def _group_mean_std(x: Tensor, inv: Tensor, count: Tensor, *, correction: int) -> tuple[Tensor, Tensor]:
    """Per-group mean and std of x (B,) or (B, K) -> (G,) or (G, K). correction=0: population, 1: sample."""
    g = count.numel()
    c = count.to(x.dtype).reshape(-1, *([1] * (x.ndim - 1)))
    mean = _group_sum(x, inv, g) / c
    sq = _group_sum((x - mean[inv]).pow(2), inv, g)
    var = sq / (c - correction).clamp_min(1.0)
    return mean, var.sqrt()


def _group_range(x: Tensor, inv: Tensor, n_groups: int) -> Tensor:
    shape = (n_groups, *x.shape[1:])
    idx = inv.reshape(-1, *([1] * (x.ndim - 1))).expand_as(x)
    hi = torch.full(shape, -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(0, idx, x, "amax")
    lo = torch.full(shape, torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(0, idx, x, "amin")
    return hi - lo


def _group_lower_median(x: Tensor, inv: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    """Lower median per group of x (B,) (torch.median's convention) and the index of one sample holding it."""
    order = torch.argsort(x, stable=True)
    order = order[torch.argsort(inv[order], stable=True)]  # sorted by group, then by value
    start = torch.cumsum(count, 0) - count
    pos = start + (count - 1) // 2
    pivot = order[pos]
    return x[pivot], pivot


def _degeneracy(
    rewards: Tensor, inv: Tensor, count: Tensor, *, degenerate: Degenerate, degenerate_weight: float, atol: float
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Per-sample weights and a per-group degenerate flag: all rewards equal (within atol), or a single sample."""
    if degenerate not in ("drop", "downweight", "keep"):
        raise ValueError(f"degenerate must be 'drop', 'downweight' or 'keep'; got {degenerate!r}")
    spread = _group_range(rewards, inv, count.numel())
    if spread.ndim > 1:
        spread = spread.amax(dim=tuple(range(1, spread.ndim)))
    deg_group = (spread <= atol) | (count < 2)
    deg = deg_group[inv]
    w = torch.ones(rewards.shape[0], dtype=torch.float32, device=rewards.device)
    if degenerate == "drop":
        w = torch.where(deg, torch.zeros_like(w), w)
    elif degenerate == "downweight":
        w = torch.where(deg, torch.full_like(w, degenerate_weight), w)
    stats = {
        "n_groups": float(count.numel()),
        "n_degenerate_groups": float(deg_group.sum()),
        "degenerate_group_fraction": float(deg_group.float().mean()) if count.numel() else 0.0,
        "n_samples_in_degenerate_groups": float(deg.sum()),
    }
    return w, deg, stats


def _finish_stats(stats: dict[str, float], adv: Tensor, w: Tensor) -> dict[str, float]:
    kept = w > 0
    stats["n_samples"] = float(adv.numel())
    stats["n_samples_dropped"] = float((~kept).sum())
    stats["adv_mean"] = float(adv[kept].mean()) if kept.any() else 0.0
    stats["adv_std"] = float(adv[kept].std(correction=0)) if kept.any() else 0.0
    stats["adv_abs_max"] = float(adv.abs().max()) if adv.numel() else 0.0
    return stats


# ----------------------------------------------------------------------------------------------------------------
# GRPO and MC-GRPO
# ----------------------------------------------------------------------------------------------------------------


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-4,
    std: Literal["population", "sample"] = "population",
    scale: bool = True,
    degenerate: Degenerate = "drop",
    degenerate_weight: float = 0.1,
    atol: float = 1e-8,
) -> GroupAdvantages:
    """GRPO: A = (r − mean_group) / (std_group + eps), (B,).

    Defaults follow Flow-GRPO's per-prompt stat tracker (population std, eps 1e-4). `scale=False` gives the
    Dr. GRPO variant (centre only). Equal-reward groups get A = 0 and are dropped/down-weighted (`degenerate`).
    """
    check_shape("rewards", rewards, (None,))
    inv, count = _groups(group_ids, rewards.shape[0])
    r = rewards.float()
    mean, sd = _group_mean_std(r, inv, count, correction=0 if std == "population" else 1)
    adv = r - mean[inv]
    if scale:
        adv = adv / (sd[inv] + eps)
    w, deg, stats = _degeneracy(r, inv, count, degenerate=degenerate, degenerate_weight=degenerate_weight, atol=atol)
    adv = torch.where(deg, torch.zeros_like(adv), adv)  # exactly zero, not eps-noise
    return GroupAdvantages(adv, w, _finish_stats(stats, adv, w))


def mc_grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    eps: float = 1e-3,
    scale: Literal["mad", "none"] = "mad",
    exclude_pivot: bool = True,
    degenerate: Degenerate = "drop",
    degenerate_weight: float = 0.1,
    atol: float = 1e-8,
) -> GroupAdvantages:
    """MC-GRPO: median-centred advantages A = (r − median) / (MAD + eps), (B,).

    As in the official code (lotusroot-kim/MC-GRPO): the (lower) median of each group is the baseline, the
    median absolute deviation is the scale (eps 1e-3), and with `exclude_pivot` the one rollout that *is* the
    median gets weight 0 (sample G + 1 rollouts to train on G). One outlier moves the mean baseline, and with it
    the sign of the other rollouts' advantages; it does not move the median.
    """
    check_shape("rewards", rewards, (None,))
    inv, count = _groups(group_ids, rewards.shape[0])
    r = rewards.float()
    med, pivot = _group_lower_median(r, inv, count)
    adv = r - med[inv]
    if scale == "mad":
        mad, _ = _group_lower_median(adv.abs(), inv, count)
        adv = adv / (mad[inv] + eps)
    elif scale != "none":
        raise ValueError(f"scale must be 'mad' or 'none'; got {scale!r}")
    w, deg, stats = _degeneracy(r, inv, count, degenerate=degenerate, degenerate_weight=degenerate_weight, atol=atol)
    adv = torch.where(deg, torch.zeros_like(adv), adv)
    if exclude_pivot:
        w = w.clone()
        w[pivot] = 0.0
        stats["n_pivots_excluded"] = float(pivot.numel())
    return GroupAdvantages(adv, w, _finish_stats(stats, adv, w))


# ----------------------------------------------------------------------------------------------------------------
# Multi-reward: GDPO and DARA
# ----------------------------------------------------------------------------------------------------------------


def _channel_zscores(rewards: Tensor, inv: Tensor, count: Tensor, eps: float) -> Tensor:
    mean, sd = _group_mean_std(rewards, inv, count, correction=1)
    return (rewards - mean[inv]) / (sd[inv] + eps)


def _batch_whiten(x: Tensor, keep: Tensor, eps: float) -> Tensor:
    out = torch.zeros_like(x)
    if int(keep.sum()) > 1:
        v = x[keep]
        sd = v.std(correction=1)
        # Advantages that cancel to float noise (rewards in exact opposition) must stay ~0, not be scaled up to unit size.
        out[keep] = (v - v.mean()) / (sd + eps) if sd > 1e-4 else v - v.mean()
    return out


def gdpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    reward_weights: Tensor | None = None,
    eps: float = 1e-6,
    batch_normalize: bool = True,
    degenerate: Degenerate = "drop",
    degenerate_weight: float = 0.1,
    atol: float = 1e-8,
) -> GroupAdvantages:
    """GDPO: normalise each reward within its group on its own, then sum (weighted), then whiten the batch.

    rewards: (B, K), one column per reward. Summing raw rewards first (GRPO) can map different reward profiles
    to the same advantage; GDPO keeps them apart. Group z-scores use the sample std + eps, as in the DARA
    repository's GDPO reference. A group is degenerate when every channel is constant in it.
    """
    check_shape("rewards", rewards, (None, None))
    inv, count = _groups(group_ids, rewards.shape[0])
    r = rewards.float()
    z = _channel_zscores(r, inv, count, eps)
    k = r.shape[1]
    wts = torch.ones(k, device=r.device) if reward_weights is None else reward_weights.to(r)
    check_shape("reward_weights", wts, (k,))
    w, deg, stats = _degeneracy(r, inv, count, degenerate=degenerate, degenerate_weight=degenerate_weight, atol=atol)
    adv = (z * wts).sum(-1)
    if batch_normalize:
        adv = _batch_whiten(adv, ~deg, eps)
    adv = torch.where(deg, torch.zeros_like(adv), adv)
    return GroupAdvantages(adv, w, _finish_stats(stats, adv, w))


def dara_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    w_max: float = 5.0,
    calibration: Literal["symmetric", "positive"] = "symmetric",
    eps: float = 1e-6,
    tau: float = 1e-8,
    batch_normalize: bool = True,
    degenerate: Degenerate = "drop",
    degenerate_weight: float = 0.1,
    atol: float = 1e-8,
) -> GroupAdvantages:
    """DARA: density-aware reward aggregation on top of GDPO's per-reward group normalisation.

    Our reading of the abstract (papers/README.md), checked against the authors' repository
    (zhaihaotian/DARA, `math/rdgdpo/advantages.py` and `docs/ALGORITHMS.md`):
    - Z_k: reward k's group z-score (as GDPO).
    - π_k, the *active-group density*: the fraction of groups in which reward k gives a nonzero relative
      advantage (Σ|Z_k| over the group > tau). Under GDPO a reward's advantage energy is ∝ π_k, so rarely
      active (sparse) rewards are drowned out.
    - The inverse-square-root correction w_k = min(w_max, sqrt(max_j π_j / π_k)) equalises the energies
      (w² ∝ 1/π); a reward active in no group keeps w = 1 (its Z is zero anyway).
    - A = Σ_k w_k Z_k, then batch whitening. `calibration="symmetric"` (DARA) scales both signs; `"positive"`
      scales only positive Z (the authors' earlier RD-GDPO variant).
    rewards: (B, K). stats carry `density_k` and `weight_k` per reward column.
    """
    check_shape("rewards", rewards, (None, None))
    inv, count = _groups(group_ids, rewards.shape[0])
    r = rewards.float()
    z = _channel_zscores(r, inv, count, eps)
    active = _group_sum(z.abs(), inv, count.numel()) > tau  # (G, K)
    density = active.float().mean(0)
    weights = torch.ones_like(density)
    live = density > 0
    if bool(live.any()):
        weights[live] = torch.sqrt(density[live].max() / density[live]).clamp(max=w_max)
    if calibration == "symmetric":
        cal = weights * z
    elif calibration == "positive":
        cal = weights * z.clamp(min=0) + z.clamp(max=0)
    else:
        raise ValueError(f"calibration must be 'symmetric' or 'positive'; got {calibration!r}")
    w, deg, stats = _degeneracy(r, inv, count, degenerate=degenerate, degenerate_weight=degenerate_weight, atol=atol)
    adv = cal.sum(-1)
    if batch_normalize:
        adv = _batch_whiten(adv, ~deg, eps)
    adv = torch.where(deg, torch.zeros_like(adv), adv)
    for j in range(r.shape[1]):
        stats[f"density_{j}"] = float(density[j])
        stats[f"weight_{j}"] = float(weights[j])
    return GroupAdvantages(adv, w, _finish_stats(stats, adv, w))


# ----------------------------------------------------------------------------------------------------------------
# VideoAWR energies
# ----------------------------------------------------------------------------------------------------------------


def awr_energies(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    temperature: float = 1.0,
    energy_clip: float = 3.0,
    adv_clip_max: float | None = None,
    eps: float = 1e-4,
    degenerate: Degenerate = "drop",
    degenerate_weight: float = 0.1,
    atol: float = 1e-8,
) -> GroupAdvantages:
    """VideoAWR energies E_i = clip(k·(softmax_group(A/τ)_i − 1/k), ±energy_clip), returned as `advantages`.

    A = (r − mean)/(std + 1e-4) per group (population std, as FlowAWR's stat tracker), optionally clipped to
    ±adv_clip_max before the softmax. k is the group size. The energy sums to zero within a group; E = 1 would
    regress onto the clean sample, E = 0 onto the old model's own prediction, E < 0 away from the sample.
    Use with `flow.awr_target`. stats["grpo_adv_mean_abs"] reports the underlying group advantages.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    base = grpo_advantages(rewards, group_ids, eps=eps, degenerate="keep", atol=atol)
    a = base.advantages
    if adv_clip_max is not None:
        a = a.clamp(-adv_clip_max, adv_clip_max)
    inv, count = _groups(group_ids, rewards.shape[0])
    logits = a / temperature
    gmax = torch.full((count.numel(),), -torch.inf, device=a.device, dtype=a.dtype).scatter_reduce(
        0, inv, logits, "amax"
    )
    e = torch.exp(logits - gmax[inv])
    p = e / _group_sum(e, inv, count.numel())[inv]
    k = count[inv].to(a.dtype)
    energy = (k * (p - 1.0 / k)).clamp(-energy_clip, energy_clip)
    w, deg, stats = _degeneracy(
        rewards.float(), inv, count, degenerate=degenerate, degenerate_weight=degenerate_weight, atol=atol
    )
    energy = torch.where(deg, torch.zeros_like(energy), energy)
    stats = _finish_stats(stats, energy, w)
    stats["grpo_adv_mean_abs"] = float(base.advantages.abs().mean()) if base.advantages.numel() else 0.0
    stats["energy_clip_rate"] = float((energy.abs() >= energy_clip - 1e-6).float().mean()) if energy.numel() else 0.0
    return GroupAdvantages(energy, w, stats)


# ----------------------------------------------------------------------------------------------------------------
# GAE (PPO baseline): terminated and truncated kept apart
# ----------------------------------------------------------------------------------------------------------------


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    *,
    terminated: Tensor,
    truncated: Tensor,
    valid: Tensor | None = None,
    gamma: float = 0.99,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over padded episodes; returns (advantage, value_target), both (N, T).

    δ_t = r_t + γ·(1 − terminated_t)·V(s_{t+1}) − V(s_t),   A_t = δ_t + γλ·(1 − done_t)·A_{t+1},
    with done = terminated ∨ truncated. A truncated step (time limit, recording stopped) still bootstraps from
    V(s_{t+1}) — `next_values` must hold it — but the recursion stops there; a terminated step does not
    bootstrap at all. Conflating the two is CleanRL #457's bug.

    Args:
        rewards, values, next_values: (N, T). next_values[n, t] = V(s_{t+1}); for the last step of an episode it
            is the value of the final observation (ignored when terminated).
        terminated, truncated: (N, T) bool. valid: (N, T) bool padding mask; the recursion also stops where the
            next step is padding, and padded steps get 0.
    """
    check_shape("rewards", rewards, (None, None))
    n, t_len = rewards.shape
    for name, x in (
        ("values", values),
        ("next_values", next_values),
        ("terminated", terminated),
        ("truncated", truncated),
    ):
        check_shape(name, x, (n, t_len))
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    check_shape("valid", valid, (n, t_len))
    term = terminated.to(torch.bool)
    done = term | truncated.to(torch.bool)
    nxt_valid = torch.zeros_like(valid)
    nxt_valid[:, :-1] = valid[:, 1:]
    cut = done | ~nxt_valid  # never carry the recursion into padding
    r, v, nv = rewards.float(), values.float(), next_values.float()
    delta = r + gamma * (~term).float() * nv - v
    adv = torch.zeros_like(r)
    running = torch.zeros(n, dtype=r.dtype, device=r.device)
    keep = (~cut).float()
    for i in range(t_len - 1, -1, -1):
        running = delta[:, i] + gamma * lam * keep[:, i] * running
        adv[:, i] = running
    adv = adv * valid.float()
    return adv, (adv + v) * valid.float()
