"""HABC: hierarchical advantage-weighted behaviour cloning (critic heads, one-step advantages, gate, actor weights).

As the HABC paper specifies it:

- Two critic heads on a shared feature φ(s) supplied by the policy (`HABCCritic`):
  **viability** z_v(s) (a logit, p_v = σ(z_v)), BCE against the episode outcome on outcome-labelled policy
  windows, no bootstrapping, no discount; **efficiency** V_e(s), the undiscounted negative steps-to-go, Huber
  (δ = 1) TD with target 0 at the terminal success and −1 + stopgrad(V_e(s')) elsewhere, on windows of
  successful episodes only (autonomous and intervention). The critic loss is their sum.
- One-step advantages, inputs detached: A_v = z_v(s') − z_v(s) (logit space: resolution near p_v ≈ 1),
  A_e = −1 + V_e(s') − V_e(s).
- Gate g = 1 + tanh((1 − p_v(s))·A_v + p_v(s)·A_e) ∈ (0, 2): no temperature, no threshold, no clip; g = 1 during
  the first 500 (actor) steps.
- Actor weights: successful autonomous steps g, failed 0, demonstrations 1, human steps 1 (g with intervention
  reweighting); the non-demo weights are divided by their mean.

Indexing. Step t is (s_t, a_t); its successor s_{t+1} is the next step's observation. At the step where the task
first succeeds the successor is the (unrecorded) success state, whose V_e is 0 — the paper's "0 at the terminal
success step" — so the TD target there is −1 and V_e(s_t) = −steps_to_go(t). Where there is no usable successor
(the last step of a failed episode, or a step right before a takeover), the advantages are 0 and no TD target is
formed.

Ablations, as named options: `gate="paper" | "fixed_mix" | "viability_only" | "efficiency_only" | "exp"`
(`exp` is an exponentiated-advantage variant of ours), intervention credit on/off (`credit.intervention_credit
(enabled=False)`), intervention reweighting on/off (`habc_actor_weights(intervention_reweighting=...)`), all
gathered in `HABCConfig`. `habc_step` does a whole training step's credit on a padded batch: critic loss and
actor weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffusion_rl._util import check_same_shape, check_shape, masked_mean
from diffusion_rl.batching import TransitionBatch, shift_next
from diffusion_rl.credit import Credit, SampleKind, intervention_credit

GateMode = Literal["paper", "fixed_mix", "viability_only", "efficiency_only", "exp"]
GATE_MODES: tuple[str, ...] = ("paper", "fixed_mix", "viability_only", "efficiency_only", "exp")


@dataclass
class HABCConfig:
    """HABC options (the paper's values are the defaults)."""

    gate: GateMode = "paper"  # the gate; others are ablations / our variant
    warmup_steps: int = 500  # g = 1 for the first actor steps
    fixed_mix: float = 0.5  # weight of A_e in the "fixed_mix" ablation (no state-adaptive balance)
    exp_temperature: float = 1.0  # "exp" variant: g = min(exp(mix/τ), exp_max_weight)
    exp_max_weight: float = 20.0
    intervention_credit: bool = True  # only the suffix after the last takeover takes the outcome
    intervention_reweighting: bool = False  # human steps get g instead of 1 (the paper's "IR")
    huber_delta: float = 1.0
    normalize: bool = True  # divide non-demo weights by their mean
    # "td" (the paper): V_e(s) regresses on -1 + sg(V_e(s')). "mc" (our variant): on the observed negative
    # steps-to-success of the successful episode, the TD fixed point on that data without the slow propagation
    # of -1 per step back through the horizon.
    efficiency_target: Literal["td", "mc"] = "td"

    def __post_init__(self) -> None:
        if self.gate not in GATE_MODES:
            raise ValueError(f"HABCConfig.gate must be one of {GATE_MODES}; got {self.gate!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"HABCConfig.warmup_steps must be >= 0; got {self.warmup_steps}")
        if not 0.0 <= self.fixed_mix <= 1.0:
            raise ValueError(f"HABCConfig.fixed_mix must be in [0, 1]; got {self.fixed_mix}")
        if self.efficiency_target not in ("td", "mc"):
            raise ValueError(f"HABCConfig.efficiency_target must be 'td' or 'mc'; got {self.efficiency_target!r}")


class CriticOutput(NamedTuple):
    z_v: Tensor  # (...,) viability logit
    v_e: Tensor  # (...,) efficiency value (negative steps-to-go)


class HABCCritic(nn.Module):
    """Two heads (viability logit, efficiency value) over a shared trunk on policy-supplied features.

    Args:
        feature_dim: size of φ(s), the feature a policy exposes via `FlowPolicy.features`.
        hidden_dim, num_layers: the shared MLP trunk (num_layers = 0: linear heads on φ directly).
        value_scale: V_e = value_scale · head output. Steps-to-go run into the hundreds; a scale near the typical
            episode length keeps the head's output O(1).
    """

    def __init__(self, feature_dim: int, *, hidden_dim: int = 256, num_layers: int = 2, value_scale: float = 1.0):
        super().__init__()
        if feature_dim < 1:
            raise ValueError(f"feature_dim must be >= 1; got {feature_dim}")
        layers: list[nn.Module] = []
        d = feature_dim
        for _ in range(num_layers):
            layers += [nn.Linear(d, hidden_dim), nn.SiLU()]
            d = hidden_dim
        self.feature_dim = feature_dim
        self.trunk = nn.Sequential(*layers)
        self.viability = nn.Linear(d, 1)
        self.efficiency = nn.Linear(d, 1)
        self.value_scale = float(value_scale)

    def forward(self, features: Tensor) -> CriticOutput:
        """features (..., feature_dim) -> CriticOutput(z_v (...), v_e (...))."""
        if features.shape[-1] != self.feature_dim:
            raise ValueError(f"features must end in feature_dim={self.feature_dim}; got {tuple(features.shape)}")
        h = self.trunk(features)
        return CriticOutput(self.viability(h).squeeze(-1), self.value_scale * self.efficiency(h).squeeze(-1))


# ----------------------------------------------------------------------------------------------------------------
# Critic losses
# ----------------------------------------------------------------------------------------------------------------


def efficiency_td_target(v_e_next: Tensor, *, terminal_success: Tensor) -> Tensor:
    """TD target for V_e: −1 at the step that reaches success (V_e(success state) = 0), else −1 + sg(V_e(s'))."""
    check_same_shape(v_e_next=v_e_next, terminal_success=terminal_success)
    nxt = torch.where(terminal_success.to(torch.bool), torch.zeros_like(v_e_next), v_e_next.detach())
    return nxt - 1.0


def habc_critic_loss(
    z_v: Tensor,
    v_e: Tensor,
    v_e_next: Tensor,
    *,
    outcome: Tensor,
    viability_mask: Tensor,
    efficiency_mask: Tensor,
    terminal_success: Tensor,
    bootstrap_ok: Tensor,
    huber_delta: float = 1.0,
    mc_targets: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """HABC critic loss = BCE(z_v, y) on viability_mask + Huber(V_e, TD target) on efficiency_mask; scalar.

    All tensors share one shape, (N, T) or flat (M,):
        z_v, v_e: the critic's outputs at s_t. v_e_next: V_e at s_{t+1} (any value where unused; detached here).
        outcome: the episode outcome per step (bool/float). viability_mask: outcome-labelled policy steps
        (`Credit.outcome_labelled`). efficiency_mask: `Credit.efficiency`. terminal_success: the first-success
        step. bootstrap_ok: s_{t+1} is usable (`Credit.bootstrap_ok`); efficiency steps that neither bootstrap
        nor terminate get no target.
    Returns (loss, {"viability_loss", "efficiency_loss", "n_viability", "n_efficiency"}).
    """
    check_same_shape(
        z_v=z_v,
        v_e=v_e,
        v_e_next=v_e_next,
        outcome=outcome,
        viability_mask=viability_mask,
        efficiency_mask=efficiency_mask,
        terminal_success=terminal_success,
        bootstrap_ok=bootstrap_ok,
    )
    y = outcome.to(z_v.dtype)
    bce = F.binary_cross_entropy_with_logits(z_v, y, reduction="none")
    vmask = viability_mask.to(torch.bool)
    term = terminal_success.to(torch.bool)
    if mc_targets is None:
        emask = efficiency_mask.to(torch.bool) & (term | bootstrap_ok.to(torch.bool))
        target = efficiency_td_target(v_e_next, terminal_success=term)
    else:  # `steps_to_success_targets(...)`: (targets, mask), the "mc" variant
        target, mc_mask = mc_targets
        emask = efficiency_mask.to(torch.bool) & mc_mask
    hub = F.huber_loss(v_e, target, reduction="none", delta=huber_delta)
    lv = masked_mean(bce, vmask)
    le = masked_mean(hub, emask)
    return lv + le, {
        "viability_loss": lv.detach(),
        "efficiency_loss": le.detach(),
        "n_viability": vmask.sum(),
        "n_efficiency": emask.sum(),
    }


# ----------------------------------------------------------------------------------------------------------------
# Advantages, gate, weights
# ----------------------------------------------------------------------------------------------------------------


def steps_to_success_targets(first_success: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Monte-Carlo efficiency targets: V_e(s_t) = -(t_success - t + 1) up to the first-success step.

    first_success, valid: (N, T) bool. Returns (targets (N, T) float, mask (N, T) bool: steps at or before a
    first success). Equals the TD target's fixed point on a successful trajectory.
    """
    check_same_shape(first_success=first_success, valid=valid)
    T = first_success.shape[-1]
    tidx = torch.arange(T, device=first_success.device).expand_as(first_success)
    has = first_success.any(dim=-1, keepdim=True)
    fs_idx = torch.where(first_success, tidx, torch.full_like(tidx, T)).min(dim=-1, keepdim=True).values
    mask = has & valid.to(torch.bool) & (tidx <= fs_idx)
    targets = torch.where(mask, -(fs_idx - tidx + 1).to(torch.float32), torch.zeros((), dtype=torch.float32))
    return targets, mask


class HABCAdvantages(NamedTuple):
    a_v: Tensor  # viability advantage, logit space
    a_e: Tensor  # efficiency advantage
    p_v: Tensor  # σ(z_v(s_t))


def habc_advantages(
    z_v: Tensor,
    z_v_next: Tensor,
    v_e: Tensor,
    v_e_next: Tensor,
    *,
    has_next: Tensor,
    terminal_success: Tensor,
) -> HABCAdvantages:
    """One-step advantages (detached), any common shape.

    A_v = z_v(s') − z_v(s) (0 where s' is not usable); A_e = −1 + V_e(s') − V_e(s) with V_e(s') = 0 at the
    first-success step (0 where neither). has_next: `Credit.bootstrap_ok`.
    """
    check_same_shape(z_v=z_v, z_v_next=z_v_next, v_e=v_e, v_e_next=v_e_next, has_next=has_next)
    check_same_shape(z_v=z_v, terminal_success=terminal_success)
    z_v, z_v_next, v_e, v_e_next = (x.detach() for x in (z_v, z_v_next, v_e, v_e_next))
    nxt = has_next.to(torch.bool)
    term = terminal_success.to(torch.bool)
    a_v = torch.where(nxt & ~term, z_v_next - z_v, torch.zeros_like(z_v))
    ve_next = torch.where(term, torch.zeros_like(v_e_next), v_e_next)
    a_e = torch.where(nxt | term, -1.0 + ve_next - v_e, torch.zeros_like(v_e))
    return HABCAdvantages(a_v, a_e, torch.sigmoid(z_v))


def habc_gate(
    a_v: Tensor,
    a_e: Tensor,
    p_v: Tensor,
    *,
    mode: GateMode = "paper",
    step: int | None = None,
    warmup_steps: int = 500,
    fixed_mix: float = 0.5,
    exp_temperature: float = 1.0,
    exp_max_weight: float = 20.0,
) -> Tensor:
    """The gate g, same shape as the advantages.

    paper:           1 + tanh((1 − p_v)·A_v + p_v·A_e)
    fixed_mix:       1 + tanh((1 − m)·A_v + m·A_e), m = fixed_mix (no state-adaptive balance)
    viability_only:  1 + tanh(A_v)
    efficiency_only: 1 + tanh(A_e)
    exp (ours):      min(exp(((1 − p_v)·A_v + p_v·A_e)/τ), exp_max_weight)
    With `step` < `warmup_steps`, g = 1 (the critic is not trusted yet).
    """
    check_same_shape(a_v=a_v, a_e=a_e, p_v=p_v)
    if step is not None and step < warmup_steps:
        return torch.ones_like(a_v)
    if mode == "paper":
        return 1.0 + torch.tanh((1.0 - p_v) * a_v + p_v * a_e)
    if mode == "fixed_mix":
        return 1.0 + torch.tanh((1.0 - fixed_mix) * a_v + fixed_mix * a_e)
    if mode == "viability_only":
        return 1.0 + torch.tanh(a_v)
    if mode == "efficiency_only":
        return 1.0 + torch.tanh(a_e)
    if mode == "exp":
        mix = (1.0 - p_v) * a_v + p_v * a_e
        return torch.exp((mix / exp_temperature).clamp(max=math.log(exp_max_weight)))
    raise ValueError(f"gate mode must be one of {GATE_MODES}; got {mode!r}")


def habc_actor_weights(
    gate: Tensor,
    *,
    kind: Tensor,
    outcome: Tensor,
    segment_weight: Tensor | None = None,
    intervention_reweighting: bool = False,
    normalize: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample actor weights for the flow-matching loss, same shape as `gate`.

    Before normalisation: DEMO 1; AUTONOMOUS g if the episode succeeded, else 0; UNLABELLED 0; HUMAN 1 (g with
    intervention reweighting); padding 0. `segment_weight` (HELP: idle/failure_inducing 0) multiplies the
    non-demo weights. With `normalize`, the non-demo weights are divided by their mean over the non-demo samples
    that were not dropped outright (failed, unlabelled, excluded segments, padding), guarded by eps, so that
    those kept average exactly 1 and a batch with many failures does not silently shrink the step size.
    """
    check_same_shape(gate=gate, kind=kind, outcome=outcome, segment_weight=segment_weight)
    g = gate.detach().float()
    succ = outcome.to(torch.bool)
    w = torch.zeros_like(g)
    demo = kind == SampleKind.DEMO
    auto = kind == SampleKind.AUTONOMOUS
    human = kind == SampleKind.HUMAN
    w = torch.where(demo, torch.ones_like(g), w)
    w = torch.where(auto & succ, g, w)
    w = torch.where(human, g if intervention_reweighting else torch.ones_like(g), w)
    kept = (auto & succ) | human
    if segment_weight is not None:
        sw = segment_weight.to(g.dtype)
        w = torch.where(demo, w, w * sw)
        kept = kept & (sw != 0)
    # The scale comes from the positive kept weights only: with the negative-credit segment variant a mean
    # over signed weights could be ~0 or negative. In the faithful path every kept weight is > 0 anyway.
    pos = kept & (w > 0)
    if normalize and bool(pos.any()):
        w = torch.where(kept, w / w[pos].mean().clamp_min(eps), w)
    return w


def habc_weights(
    critic_out: CriticOutput,
    critic_out_next: CriticOutput,
    *,
    kind: Tensor,
    outcome: Tensor,
    has_next: Tensor,
    terminal_success: Tensor,
    step: int | None,
    config: HABCConfig | None = None,
    segment_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantages -> gate -> actor weights in one call; returns (weights, diagnostics).

    critic_out / critic_out_next: the critic at s_t and s_{t+1} (same shape; e.g. (N, T) with the next one built
    by `batching.shift_next`). The other tensors as in `habc_advantages` / `habc_actor_weights`.
    Diagnostics: mean gate on successful autonomous steps (the paper reports 0.68–0.86), mean A_v, A_e, p_v.
    """
    config = config or HABCConfig()
    adv = habc_advantages(
        critic_out.z_v,
        critic_out_next.z_v,
        critic_out.v_e,
        critic_out_next.v_e,
        has_next=has_next,
        terminal_success=terminal_success,
    )
    g = habc_gate(
        adv.a_v,
        adv.a_e,
        adv.p_v,
        mode=config.gate,
        step=step,
        warmup_steps=config.warmup_steps,
        fixed_mix=config.fixed_mix,
        exp_temperature=config.exp_temperature,
        exp_max_weight=config.exp_max_weight,
    )
    w = habc_actor_weights(
        g,
        kind=kind,
        outcome=outcome,
        segment_weight=segment_weight,
        intervention_reweighting=config.intervention_reweighting,
        normalize=config.normalize,
    )
    auto_succ = (kind == SampleKind.AUTONOMOUS) & outcome.to(torch.bool)
    return w, {
        "gate_mean_successful_autonomous": masked_mean(g, auto_succ),
        "a_v_mean": masked_mean(adv.a_v, kind >= 0),
        "a_e_mean": masked_mean(adv.a_e, kind >= 0),
        "p_v_mean": masked_mean(adv.p_v, kind >= 0),
        "weight_mean_nondemo": masked_mean(w, (kind >= 0) & (kind != SampleKind.DEMO)),
    }


# ----------------------------------------------------------------------------------------------------------------
# One call per training step on a padded batch
# ----------------------------------------------------------------------------------------------------------------


class HABCStep(NamedTuple):
    critic_loss: Tensor  # scalar, to backpropagate into the critic (and the features, if they train)
    weights: Tensor  # (N, T) actor weights for the per-sample flow-matching loss (0 on padding)
    credit: Credit  # the credit masks used (intervention-aware or not, per the config)
    diagnostics: dict[str, Tensor]


def habc_step(
    critic: HABCCritic,
    features: Tensor,
    batch: TransitionBatch,
    *,
    step: int | None,
    config: HABCConfig | None = None,
    segment_weight: Tensor | None = None,
    target: HABCCritic | None = None,
) -> HABCStep:
    """Critic loss and actor weights for a padded batch, honouring every `HABCConfig` switch.

    Args:
        critic: the two-head critic. features: (N, T, F) φ(s_t) per step from the policy (`FlowPolicy.features`).
        batch: from `batching.collate_episodes`. The credit is recomputed here so that
            `config.intervention_credit=False` gives the naive-credit ablation on the same batch.
        step: the actor's training step (for the warm-up). segment_weight: (N, T) HELP weights, optional.
    The successor values come from the same forward pass, shifted one step and detached (the critic is
    evaluated once per state), or, with `target`, from a slowly updated copy of the critic: semi-gradient TD on
    high-dimensional policy features can diverge without one (measured on the drawer task: the efficiency loss
    grew to 2e5 within 400 full-batch steps at lr 1e-3).
    """
    config = config or HABCConfig()
    check_shape("features", features, (*batch.valid.shape, None))
    credit = intervention_credit(
        batch.executed_by,
        batch.valid,
        batch.outcome,
        first_success=batch.first_success,
        is_demo=batch.is_demo,
        enabled=config.intervention_credit,
    )
    out = critic(features)
    mc = steps_to_success_targets(batch.first_success, batch.valid) if config.efficiency_target == "mc" else None
    if target is None or mc is not None:  # Monte-Carlo targets need no slowly updated copy
        nxt = CriticOutput(shift_next(out.z_v.detach()), shift_next(out.v_e.detach()))
    else:
        with torch.no_grad():
            tgt = target(features)
        nxt = CriticOutput(shift_next(out.z_v.detach()), shift_next(tgt.v_e))
    outcome = batch.outcome[:, None].expand_as(batch.valid)
    loss, parts = habc_critic_loss(
        out.z_v,
        out.v_e,
        nxt.v_e,
        outcome=outcome,
        viability_mask=credit.outcome_labelled,
        efficiency_mask=credit.efficiency,
        terminal_success=batch.first_success,
        bootstrap_ok=credit.bootstrap_ok,
        huber_delta=config.huber_delta,
        mc_targets=mc,
    )
    w, diag = habc_weights(
        CriticOutput(out.z_v.detach(), out.v_e.detach()),
        nxt,
        kind=credit.kind,
        outcome=outcome,
        has_next=credit.bootstrap_ok,
        terminal_success=batch.first_success,
        step=step,
        config=config,
        segment_weight=segment_weight,
    )
    return HABCStep(loss, w, credit, {**parts, **diag})
