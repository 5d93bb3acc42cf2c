"""Intervention-aware credit (HABC, RaC, HELP, ARMADA) over padded episodes (N, T).

Who may learn what from an episode with takeovers:

- **Only the suffix takes the outcome.** The policy steps after the *last* takeover take the episode's outcome;
  in an episode without takeovers, every policy step does. Earlier policy segments stay unlabelled: they train
  no critic, and the actor does not imitate them (weight 0).
- **Human steps are imitation data** (weight 1), never scored as the policy's success, and efficiency targets
  when the episode succeeded.
- **A takeover boundary is a cut.** No TD target at a policy step bootstraps from the human state that follows
  it, so nothing a human did flows back into the policy's values. At a *handback* (human → policy) we do let the
  efficiency (steps-to-go) chain continue by default: steps-to-go is a physical count towards the success, and
  without it a human segment followed by a policy suffix would have no anchored efficiency target at all.
  `cut_at_handback=True` cuts there as well. (This is our reading of "nothing crosses a takeover boundary",
  which the papers state for outcome labels.)
- **Segment labels (HELP):** progress, idle, failure_inducing, recovery (and human). Idle and failure-inducing
  steps are excluded from imitation (weight 0), not turned into negatives; `variant="negative"` is our own
  variant and must be benchmarked as one. `segment_labels_from_progress` labels episodes that arrive without
  labels, from a per-step progress signal (privileged state in sim, or the success model's p).

All functions are pure torch over (N, T) tensors with a `valid` padding mask; see `diffusion_rl.batching`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from diffusion_rl._util import check_shape
from diffusion_rl.data.episode import ExecutedBy, Segment
from diffusion_rl.flow import exp_advantage_weights


class SampleKind(enum.IntEnum):
    """What a step is for the actor and the critics (per step, (N, T))."""

    PAD = -1
    DEMO = 0  # SFT demonstration: weight 1, no critic
    AUTONOMOUS = 1  # outcome-labelled policy step (the suffix after the last takeover, or a takeover-free episode)
    UNLABELLED = 2  # policy step before a later takeover: no label, no critic, weight 0
    HUMAN = 3  # intervention step: weight 1 (or g with intervention reweighting), efficiency target on success


@dataclass
class Credit:
    """Per-step credit masks, each (N, T) (bool unless noted)."""

    kind: Tensor  # long, SampleKind values
    outcome_labelled: Tensor  # AUTONOMOUS: trains the viability head / success model, actor weight g (success) or 0
    unlabelled_policy: Tensor  # UNLABELLED
    human: Tensor  # HUMAN
    demo: Tensor  # DEMO
    efficiency: Tensor  # may train the efficiency head: (AUTONOMOUS or HUMAN) in a successful episode, up to success
    bootstrap_ok: Tensor  # the TD target at t may use the value at t + 1 (same episode, not across a takeover)
    takeover: Tensor  # True at the first human step of each takeover (policy at t − 1, human at t)
    handback: Tensor  # True at the first policy step after a human segment


def _check_nt(name: str, x: Tensor, n: int, t: int) -> None:
    check_shape(name, x, (n, t))


def controller_segment_ids(executed_by: Tensor, valid: Tensor) -> Tensor:
    """Index of the maximal same-controller run each step belongs to, (N, T) long; −1 on padding."""
    check_shape("executed_by", executed_by, (None, None))
    _check_nt("valid", valid, *executed_by.shape)
    change = torch.zeros_like(valid)
    change[:, 1:] = (executed_by[:, 1:] != executed_by[:, :-1]) & valid[:, 1:] & valid[:, :-1]
    seg = torch.cumsum(change.long(), dim=1)
    return torch.where(valid, seg, torch.full_like(seg, -1))


def intervention_credit(
    executed_by: Tensor,
    valid: Tensor,
    outcome: Tensor,
    *,
    first_success: Tensor | None = None,
    is_demo: Tensor | None = None,
    enabled: bool = True,
    cut_at_handback: bool = False,
) -> Credit:
    """Intervention-aware credit masks for a padded batch of episodes.

    Args:
        executed_by: (N, T) ExecutedBy values (0 policy, 1 human); padding may hold anything.
        valid: (N, T) bool padding mask.
        outcome: (N,) bool episode outcome.
        first_success: (N, T) bool, True at the step where the task first counted as solved. Efficiency targets
            stop there (later steps have no steps-to-go). Default: the last valid step of successful episodes.
        is_demo: (N,) bool, SFT demonstrations (every step DEMO, no critic).
        enabled: False is the "no intervention-aware credit" ablation: every policy step takes the outcome,
            as naive credit would do; human steps stay human.
        cut_at_handback: also cut the efficiency bootstrap at human → policy handbacks (see module doc).
    """
    check_shape("executed_by", executed_by, (None, None))
    n, t_len = executed_by.shape
    _check_nt("valid", valid, n, t_len)
    check_shape("outcome", outcome, (n,))
    valid = valid.to(torch.bool)
    outcome = outcome.to(torch.bool)
    dev = executed_by.device
    human = valid & (executed_by == ExecutedBy.HUMAN)
    policy = valid & (executed_by == ExecutedBy.POLICY)
    demo_ep = torch.zeros(n, dtype=torch.bool, device=dev) if is_demo is None else is_demo.to(torch.bool)
    check_shape("is_demo", demo_ep, (n,))
    demo = valid & demo_ep[:, None]
    human = human & ~demo
    policy = policy & ~demo

    # 1. The suffix: policy steps after the last human step of the episode.
    tidx = torch.arange(t_len, device=dev).expand(n, t_len)
    last_human = torch.where(human, tidx, torch.full_like(tidx, -1)).amax(dim=1)  # (N,), −1 when no takeover
    if enabled:
        labelled = policy & (tidx > last_human[:, None])
    else:
        labelled = policy
    unlabelled = policy & ~labelled

    # 2. Boundaries and the bootstrap mask.
    nxt_valid = torch.zeros_like(valid)
    nxt_valid[:, :-1] = valid[:, 1:]
    nxt_exec = torch.full_like(executed_by, -1)
    nxt_exec[:, :-1] = executed_by[:, 1:]
    to_human = (executed_by == ExecutedBy.POLICY) & (nxt_exec == ExecutedBy.HUMAN)
    to_policy = (executed_by == ExecutedBy.HUMAN) & (nxt_exec == ExecutedBy.POLICY)
    bootstrap_ok = valid & nxt_valid & ~to_human
    if cut_at_handback:
        bootstrap_ok = bootstrap_ok & ~to_policy
    takeover = torch.zeros_like(valid)
    takeover[:, 1:] = to_human[:, :-1] & valid[:, 1:]
    handback = torch.zeros_like(valid)
    handback[:, 1:] = to_policy[:, :-1] & valid[:, 1:]

    # 3. Efficiency: labelled-policy and human steps of successful episodes, up to the first success.
    if first_success is None:
        last_valid = valid.long().sum(1) - 1
        first_success = torch.zeros_like(valid)
        rows = torch.nonzero(outcome & (last_valid >= 0)).squeeze(-1)
        first_success[rows, last_valid[rows]] = True
    _check_nt("first_success", first_success, n, t_len)
    fs_idx = torch.where(first_success, tidx, torch.full_like(tidx, t_len)).amin(dim=1)
    efficiency = (labelled | human) & outcome[:, None] & (tidx <= fs_idx[:, None])

    kind = torch.full((n, t_len), int(SampleKind.PAD), dtype=torch.long, device=dev)
    kind[demo] = SampleKind.DEMO
    kind[labelled] = SampleKind.AUTONOMOUS
    kind[unlabelled] = SampleKind.UNLABELLED
    kind[human] = SampleKind.HUMAN
    return Credit(
        kind=kind,
        outcome_labelled=labelled,
        unlabelled_policy=unlabelled,
        human=human,
        demo=demo,
        efficiency=efficiency,
        bootstrap_ok=bootstrap_ok,
        takeover=takeover,
        handback=handback,
    )


# ----------------------------------------------------------------------------------------------------------------
# HELP-style segment labels and imitation weights
# ----------------------------------------------------------------------------------------------------------------


def segment_labels_from_progress(
    progress: Tensor,
    valid: Tensor,
    *,
    executed_by: Tensor | None = None,
    first_success: Tensor | None = None,
    horizon: int = 1,
    idle_threshold: float = 0.01,
    failure_threshold: float = 0.05,
    recovery_margin: float = 0.05,
) -> Tensor:
    """Label each step progress / idle / failure_inducing / recovery / human from a progress signal, (N, T) long.

    HELP cuts rollouts with a learned signed-progress critic; here any per-step progress estimate works
    (privileged task progress in sim, or the success model's p). With Δ_t = progress[t + h] − progress[t]
    (h = horizon, clipped at the episode's last valid step):

    - Δ < −failure_threshold: FAILURE_INDUCING (the step loses ground);
    - Δ ≤ idle_threshold otherwise: IDLE (no progress);
    - Δ > idle_threshold: RECOVERY when progress[t] is more than `recovery_margin` below the best progress seen
      so far in the episode (regaining lost ground), else PROGRESS;
    - the first-success step is PROGRESS; human steps are HUMAN.

    Args:
        progress: (N, T) float. valid: (N, T) bool. executed_by: (N, T) optional. first_success: (N, T) optional.
    """
    check_shape("progress", progress, (None, None))
    n, t_len = progress.shape
    _check_nt("valid", valid, n, t_len)
    if horizon < 1:
        raise ValueError(f"horizon must be >= 1; got {horizon}")
    if not 0 <= idle_threshold <= failure_threshold:
        raise ValueError(f"need 0 <= idle_threshold <= failure_threshold; got {idle_threshold}, {failure_threshold}")
    valid = valid.to(torch.bool)
    dev = progress.device
    last = (valid.long().sum(1) - 1).clamp_min(0)  # (N,)
    tidx = torch.arange(t_len, device=dev).expand(n, t_len)
    ahead = torch.minimum(tidx + horizon, last[:, None])
    delta = progress.gather(1, ahead) - progress
    # Best progress so far (padding can't raise it: it sits after the last valid step).
    best = torch.cummax(torch.where(valid, progress, torch.full_like(progress, -torch.inf)), dim=1).values

    label = torch.full((n, t_len), int(Segment.IDLE), dtype=torch.long, device=dev)
    gaining = delta > idle_threshold
    below_best = progress < best - recovery_margin
    label[gaining & ~below_best] = Segment.PROGRESS
    label[gaining & below_best] = Segment.RECOVERY
    label[delta < -failure_threshold] = Segment.FAILURE_INDUCING
    if first_success is not None:
        _check_nt("first_success", first_success, n, t_len)
        label[first_success.to(torch.bool)] = Segment.PROGRESS
    if executed_by is not None:
        _check_nt("executed_by", executed_by, n, t_len)
        label[executed_by == ExecutedBy.HUMAN] = Segment.HUMAN
    return torch.where(valid, label, torch.full_like(label, -1))


def idle_steps(
    position: Tensor, quaternion: Tensor, opening: Tensor, *, motion: float = 0.002, turn: float = 0.02, grip: float = 0.02
) -> Tensor:
    """HELP's idle label on a recorded trajectory, from what the robot did: step t is idle when, from t to t + 1,
    the end effector moved less than `motion` (metres) and turned less than `turn` (radians), and the gripper
    opening changed less than `grip`. The last step, whose effect is not recorded, is never idle. (The simulated
    human's monitor uses the same motion and grip thresholds online, and also asks that progress did not rise.)

    Args:
        position: (T, 3) end-effector positions. quaternion: (T, 4) its orientations (unit, either sign).
        opening: (T,) gripper openings in [0, 1]. Returns (T,) bool.
    """
    check_shape("position", position, (None, 3))
    check_shape("quaternion", quaternion, (position.shape[0], 4))
    check_shape("opening", opening, (position.shape[0],))
    if motion < 0 or turn < 0 or grip < 0:
        raise ValueError(f"motion, turn and grip are thresholds >= 0; got {motion}, {turn}, {grip}")
    idle = torch.zeros(position.shape[0], dtype=torch.bool, device=position.device)
    moved = torch.linalg.vector_norm(position[1:] - position[:-1], dim=-1)
    cos_half = (quaternion[1:] * quaternion[:-1]).sum(-1).abs().clamp(max=1.0)  # q and -q: the same rotation
    turned = 2 * torch.arccos(cos_half)
    idle[:-1] = (moved < motion) & (turned < turn) & ((opening[1:] - opening[:-1]).abs() < grip)
    return idle


def segment_imitation_weights(
    segment: Tensor,
    *,
    variant: Literal["exclude", "negative"] = "exclude",
    negative_weight: float = -1.0,
) -> Tensor:
    """Per-step imitation weights from segment labels, same shape as `segment`, float.

    `exclude` (HELP, the faithful default): progress, recovery and human 1; idle and failure_inducing 0.
    `negative` (our variant, not in any paper): failure_inducing gets `negative_weight` (< 0), idle 0. A negative
    weight on a flow-matching loss pushes the velocity away from the action, without bound: use with a clip or
    an anchor. Padding (−1) gets 0.
    """
    if variant not in ("exclude", "negative"):
        raise ValueError(f"variant must be 'exclude' or 'negative'; got {variant!r}")
    w = torch.zeros(segment.shape, dtype=torch.float32, device=segment.device)
    keep = (segment == Segment.PROGRESS) | (segment == Segment.RECOVERY) | (segment == Segment.HUMAN)
    w[keep] = 1.0
    if variant == "negative":
        if negative_weight >= 0:
            raise ValueError(f"negative_weight must be < 0 for the negative variant; got {negative_weight}")
        w[segment == Segment.FAILURE_INDUCING] = negative_weight
    return w


def return_weights(steps_to_success: Tensor, *, temperature: float) -> Tensor:
    """Reward-weighted regression over successful episodes (ours, for demonstrations of uneven speed): episode e
    with return R_e = −T_e (its steps to success) gets w_e = exp((R_e − max R)/τ), scaled to mean 1 over episodes.

    `steps_to_success` (E,) > 0; `temperature` τ in steps: an episode k·τ steps slower than the fastest weighs
    e^−k of it. Every step of an episode takes its episode's weight, so each episode's share of a per-step draw
    is w_e·T_e (RWR's Σ_e w_e Σ_t log π(a_t | s_t)).
    """
    check_shape("steps_to_success", steps_to_success, (None,))
    if steps_to_success.numel() == 0:
        raise ValueError("return_weights needs at least one episode")
    if bool((steps_to_success <= 0).any()):
        raise ValueError("steps_to_success must be > 0 for every episode (only successful episodes are weighted)")
    t = steps_to_success.double()
    # the advantage over the fastest episode is <= 0, so AWR's weight cap never binds
    return exp_advantage_weights(-(t - t.min()), temperature=temperature, normalize=True).float()
