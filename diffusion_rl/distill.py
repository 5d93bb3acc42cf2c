"""Distillation targets as per-sample flow objectives: DMD, Stream-R1, AFD and OPSD.

Same conventions as `diffusion_rl.flow` (t = 1 is noise, per-sample (B,) losses). Shapes: samples x are
(B, ...); videos for the saliency weights are (B, F, H, W) maps (frames, height, width).

- DMD: g = (f_fake − f_real) / mean|x − f_real|, loss ½·mean((x − sg(x − g))²), whose gradient w.r.t. x is g.
  f_real / f_fake are the real (teacher) and fake (student-score) models' x̂_0 predictions at a noised x.
- Stream-R1: the DMD loss reweighted per rollout by exp(β·r) and per element by reward-saliency weights W.
- AFD: a prompt-paired Bradley–Terry discriminator between teacher and student videos; its centred score on the
  student's samples is an advantage, mapped to NFT's w ∈ [0, 1] and trained with `flow.nft_loss`.
- OPSD: the teacher's velocity at the states the student's own rollout visits is the regression target
  (collect the states with `flow.euler_sample(..., return_trajectory=True)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from diffusion_rl._util import check_same_shape, check_shape, expand_to, per_sample_mean
from diffusion_rl.flow import flow_matching_loss, nft_weight

# ----------------------------------------------------------------------------------------------------------------
# DMD and Stream-R1
# ----------------------------------------------------------------------------------------------------------------


def dmd_gradient(x: Tensor, f_fake: Tensor, f_real: Tensor, *, eps: float = 1e-8) -> Tensor:
    """DMD's normalised gradient g = (f_fake − f_real) / mean|x − f_real| (per-sample mean), (B, ...), detached."""
    check_same_shape(x=x, f_fake=f_fake, f_real=f_real)
    with torch.no_grad():
        scale = per_sample_mean((x - f_real).abs()).clamp_min(eps)
        return (f_fake - f_real) / expand_to(scale, x)


def dmd_loss(
    x: Tensor,
    g: Tensor,
    *,
    weights: Tensor | None = None,
    element_weights: Tensor | None = None,
) -> Tensor:
    """½·mean(W ⊙ (x − sg(x − g))²) per sample (B,), times `weights` (B,). Its gradient w.r.t. x is W ⊙ g / numel.

    x: (B, ...) the student's generated sample (with grad). g: `dmd_gradient`. element_weights W: broadcastable
    to x (Stream-R1's saliency weights, mean 1). weights: per-rollout (Stream-R1's exp(β·r)).
    """
    check_same_shape(x=x, g=g)
    target = (x - g).detach()
    sq = (x - target).pow(2)
    if element_weights is not None:
        sq = sq * element_weights
    loss = 0.5 * per_sample_mean(sq)
    if weights is not None:
        check_shape("weights", weights, (x.shape[0],))
        loss = loss * weights.to(loss.dtype)
    return loss


def stream_r1_reward(axis_scores: Tensor, axis_improvements: Tensor | None = None, *, balance: float = 0.5) -> Tensor:
    """Stream-R1's balanced reward r = mean_k(score_k) − balance·std_k(improvement_k), (B,).

    axis_scores: (B, K) normalised per-axis scores (visual, motion, text alignment). axis_improvements: (B, K)
    the per-axis improvements (default: the scores themselves); their spread is penalised so that no single
    axis dominates.
    """
    check_shape("axis_scores", axis_scores, (None, None))
    imp = axis_scores if axis_improvements is None else axis_improvements
    check_same_shape(axis_scores=axis_scores, axis_improvements=imp)
    return axis_scores.mean(-1) - balance * imp.std(dim=-1, correction=0)


def reward_tilt_weights(rewards: Tensor, *, beta: float = 1.0) -> Tensor:
    """Stream-R1's per-rollout tilt exp(β·r), (B,) (β = 1 in the paper). Not normalised (the authors' form)."""
    check_shape("rewards", rewards, (None,))
    return torch.exp(beta * rewards)


def _minmax(x: Tensor, dims: tuple[int, ...], eps: float = 1e-8) -> Tensor:
    lo = x.amin(dim=dims, keepdim=True)
    hi = x.amax(dim=dims, keepdim=True)
    return (x - lo) / (hi - lo).clamp_min(eps)


def saliency_weights(
    saliency: Tensor,
    axis_rewards: Tensor | None = None,
    *,
    temporal_floor: float = 0.2,
    spatial_floor: float = 0.15,
) -> Tensor:
    """Stream-R1's element weights W (B, F, H, W) from reward-gradient saliency, mean 1 per sample.

    Args:
        saliency: (B, K, F, H, W) per-axis |∂reward_k/∂pixels| maps (K reward axes), or (B, F, H, W) if fused.
        axis_rewards: (B, K) per-axis rewards; the axes are fused with softmax(−r) so that weaker axes weigh
            more. Needed when saliency has an axis dim.
    Steps: temporal weight = per-frame mean saliency, min-max normalised over frames, floored at 0.2,
    mean-normalised; spatial weight = per frame min-max normalised over pixels, floored at 0.15,
    mean-normalised; W = temporal × spatial, renormalised to mean 1.
    """
    if saliency.ndim == 5:
        if axis_rewards is None:
            raise ValueError("axis_rewards (B, K) is required to fuse per-axis saliency (B, K, F, H, W)")
        check_shape("axis_rewards", axis_rewards, saliency.shape[:2])
        mix = torch.softmax(-axis_rewards, dim=-1)
        saliency = (saliency * mix[:, :, None, None, None]).sum(1)
    check_shape("saliency", saliency, (None, None, None, None))
    s = saliency.abs().float()
    # 1. Temporal: which frames matter.
    frame = s.mean(dim=(2, 3))  # (B, F)
    tw = _minmax(frame, (1,)).clamp_min(temporal_floor)
    tw = tw / tw.mean(dim=1, keepdim=True)
    # 2. Spatial: which pixels within each frame.
    sw = _minmax(s, (2, 3)).clamp_min(spatial_floor)
    sw = sw / sw.mean(dim=(2, 3), keepdim=True)
    w = tw[:, :, None, None] * sw
    return w / w.mean(dim=(1, 2, 3), keepdim=True)


# ----------------------------------------------------------------------------------------------------------------
# AFD
# ----------------------------------------------------------------------------------------------------------------


def bt_discriminator_loss(d_teacher: Tensor, d_student: Tensor) -> Tensor:
    """Prompt-paired Bradley–Terry loss −log σ(D(x_teacher) − D(x_student)) per pair, (B,)."""
    check_same_shape(d_teacher=d_teacher, d_student=d_student)
    return F.softplus(d_student - d_teacher)


def afd_advantages(d_student: Tensor, group_ids: Tensor | None = None, *, whiten: bool = False, eps: float = 1e-6) -> Tensor:
    """AFD's advantage: the discriminator score on student samples minus its batch (or group) mean, detached.

    whiten: also divide by the batch std of the centred scores, so that the NFT mapping clip(A/A_max) sees unit
    scale whatever the discriminator's logit scale (which drifts as it trains)."""
    check_shape("d_student", d_student, (None,))
    d = d_student.detach().float()
    if group_ids is None:
        adv = d - d.mean()
    else:
        check_shape("group_ids", group_ids, d.shape)
        _, inv = torch.unique(group_ids, return_inverse=True)
        cnt = torch.bincount(inv).float()
        mean = torch.zeros_like(cnt).index_add_(0, inv, d) / cnt
        adv = d - mean[inv]
    return adv / (adv.std() + eps) if whiten and adv.numel() > 1 else adv


def afd_weights(advantages: Tensor, *, adv_clip_max: float = 1.0) -> Tensor:
    """Map AFD advantages to the NFT branch weight w ∈ [0, 1] (NFT's clip(A/A_max)/2 + ½); pass as `r=`."""
    return nft_weight(advantages, adv_clip_max=adv_clip_max)


# ----------------------------------------------------------------------------------------------------------------
# OPSD
# ----------------------------------------------------------------------------------------------------------------


def opsd_loss(
    v_student: Tensor,
    v_teacher: Tensor,
    *,
    weights: Tensor | None = None,
    mask: Tensor | None = None,
    t: Tensor | None = None,
    space: str = "velocity",
) -> Tensor:
    """On-policy self-distillation: regress the student's velocity onto the teacher's at student-visited states.

    v_student: (B, ...) at (x_t, t) from the student's own rollout; v_teacher: the teacher's velocity at the
    same (x_t, t) (with its cleaner context), detached here. Returns (B,).

    space: "velocity" (the method's form) or "x0" (our variant: the same regression compared as x̂_0 = x_t − t·v,
    i.e. weighted by t², which needs `t`; same minimiser, but bounded for models that predict x̂_0 and derive v
    with a 1/t near t = 0).
    """
    if space == "x0":
        if t is None:
            raise ValueError("opsd_loss(space='x0') needs the flow time t")
        tt = expand_to(torch.as_tensor(t, dtype=v_student.dtype, device=v_student.device), v_student)
        return flow_matching_loss(tt * v_student, (tt * v_teacher).detach(), weights=weights, mask=mask)
    if space != "velocity":
        raise ValueError(f"space must be 'velocity' or 'x0'; got {space!r}")
    return flow_matching_loss(v_student, v_teacher.detach(), weights=weights, mask=mask)
