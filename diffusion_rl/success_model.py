"""Success-probability reward model (eVTA_0 / RLER): head, TD targets, target network, dense rewards, calibration.

eVTA_0 learns P_φ(success | recent frames, task) from mixed-quality rollouts, with no demonstrations and no
annotations, by undiscounted TD-style bootstrapping (as the eVTA_0 code does it):

    y = d·z + (1 − d)·p̂_target(x⁺),   loss = (p_φ(x) − y)²

with d = 1 only at the terminal frame, z the outcome there (1 for success; 0 or a soft value for failure),
and x⁺ the same window extended by one frame. A target network tracks the online one with τ = 0.1 every 16
optimiser steps. The fixed point is the success probability under the data's policy: p(s) = E[p(s')].

The model here is a small head over features from any encoder a policy supplies (`SuccessHead`), or any module
`model(x) -> logits` / `model(x, task) -> logits` (the `success_model_update` routine only needs that).

Dense reward (`chunk_rewards`): r = p − 1 per action chunk (the authors' form), the chunk containing the first
success gets the terminal outcome, later chunks 0; `form="potential"` is our potential-based option
γ·P(o') − P(o) on top of the sparse outcome.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Literal

import torch
from torch import Tensor, nn

from diffusion_rl._util import check_same_shape, check_shape, masked_mean

# ----------------------------------------------------------------------------------------------------------------
# The head and its target network
# ----------------------------------------------------------------------------------------------------------------


class SuccessHead(nn.Module):
    """P(success | window features, task features) as a logit, over features from any encoder.

    Args:
        window_dim: size of the frame-window feature (e.g. a policy's `features` of the last frames).
        task_dim: size of a task/instruction feature (0: none).
        hidden_dim, num_layers: MLP; num_layers = 0 is the authors' linear head on a learned token's state.
    """

    def __init__(self, window_dim: int, *, task_dim: int = 0, hidden_dim: int = 256, num_layers: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        d = window_dim + task_dim
        for _ in range(num_layers):
            layers += [nn.Linear(d, hidden_dim), nn.SiLU()]
            d = hidden_dim
        layers.append(nn.Linear(d, 1))
        self.net = nn.Sequential(*layers)
        self.window_dim, self.task_dim = window_dim, task_dim

    def forward(self, window: Tensor, task: Tensor | None = None) -> Tensor:
        """window (B, window_dim), task (B, task_dim) -> logits (B,)."""
        if window.shape[-1] != self.window_dim:
            raise ValueError(f"window features must end in {self.window_dim}; got {tuple(window.shape)}")
        if self.task_dim:
            if task is None or task.shape[-1] != self.task_dim:
                got = None if task is None else tuple(task.shape)
                raise ValueError(f"task features of size {self.task_dim} are required; got {got}")
            window = torch.cat([window, task], dim=-1)
        return self.net(window).squeeze(-1)


def make_target(model: nn.Module) -> nn.Module:
    """A frozen deep copy of `model` to serve as the target network."""
    target = copy.deepcopy(model)
    for p in target.parameters():
        p.requires_grad_(False)
    return target.eval()


@torch.no_grad()
def soft_update_(target: nn.Module, online: nn.Module, *, tau: float) -> None:
    """θ_target ← (1 − τ)·θ_target + τ·θ_online, in place (buffers copied)."""
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"tau must be in (0, 1]; got {tau}")
    for pt, po in zip(target.parameters(), online.parameters(), strict=True):
        pt.lerp_(po.detach(), tau)
    for bt, bo in zip(target.buffers(), online.buffers(), strict=True):
        bt.copy_(bo)


# ----------------------------------------------------------------------------------------------------------------
# Targets and loss
# ----------------------------------------------------------------------------------------------------------------


def soft_failure_value(d_norm: Tensor) -> Tensor:
    """eVTA_0's soft failure value 0.6·σ(10·(0.5 − d_norm)), d_norm the normalised distance to success clusters."""
    return 0.6 * torch.sigmoid(10.0 * (0.5 - d_norm))


def success_td_targets(
    p_next_target: Tensor,
    *,
    outcome: Tensor,
    terminal: Tensor,
    has_next: Tensor,
    failure_value: float | Tensor = 0.0,
) -> tuple[Tensor, Tensor]:
    """y = d·z + (1 − d)·p̂_target(x⁺), and the mask of samples that have a target; both (B,).

    Args:
        p_next_target: (B,) the target network's probability on the one-frame-longer window (any value where
            unused). outcome: (B,) episode outcome. terminal: (B,) d, the last frame of a complete episode.
        has_next: (B,) x⁺ exists (same episode, same controller segment). Non-terminal samples without one get
            no target (mask False).
        failure_value: z for failures: 0 (the simple version) or a (B,) soft value (`soft_failure_value`).
    """
    check_same_shape(p_next_target=p_next_target, outcome=outcome, terminal=terminal, has_next=has_next)
    d = terminal.to(torch.bool)
    fv = torch.as_tensor(failure_value, dtype=p_next_target.dtype, device=p_next_target.device).expand_as(p_next_target)
    z = torch.where(outcome.to(torch.bool), torch.ones_like(p_next_target), fv)
    y = torch.where(d, z, p_next_target.detach())
    return y, d | has_next.to(torch.bool)


def success_loss(p: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
    """MSE between the predicted probability and the TD target (the authors' loss), scalar."""
    check_same_shape(p=p, y=y)
    return masked_mean((p - y.detach()).pow(2), mask)


def _call(model: nn.Module, batch: Mapping[str, Tensor], key: str) -> Tensor:
    task = batch.get("task")
    return model(batch[key]) if task is None else model(batch[key], task)


def success_model_update(
    model: nn.Module,
    target_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Mapping[str, Tensor],
    *,
    step: int,
    tau: float = 0.1,
    target_every: int = 16,
    failure_value: float | Tensor = 0.0,
    max_grad_norm: float | None = None,
    target: Literal["td", "mc"] = "td",
) -> dict[str, float]:
    """One optimiser step of the TD success model, then the target update every `target_every` steps.

    The closed loop (RLER) calls this on fresh rollouts of the evolving policy; `refit_success_model` runs a
    round of it.

    Args:
        model: `model(x) -> logits (B,)` or `model(x, task) -> logits` when the batch holds "task".
        target_model: from `make_target(model)`.
        batch: "x" (inputs of the window at t), "x_next" (the one-frame-longer window), "outcome" (B,),
            "terminal" (B,); optional "has_next" (B,) (default: all True), "task", "failure_value" (B,),
            "mask" (B,) (samples to train on, e.g. `Credit.outcome_labelled` flattened).
        step: the optimiser step counter (0-based) of this update.
        target: "td" (eVTA_0: bootstrap from the target network) or "mc" (ours: every step's target is its
            episode's outcome z, the same undiscounted fixed point without bootstrapping; a round of a few hundred
            steps propagates the terminal value only a few dozen frames back through TD, so long episodes stay
            near the initial guess).
    Returns: {"loss", "p_mean", "target_mean", "n"} as floats.
    """
    if target not in ("td", "mc"):
        raise ValueError(f"target must be 'td' or 'mc'; got {target!r}")
    if target_every < 1:
        raise ValueError(f"target_every must be >= 1; got {target_every}")
    for key in ("x", "x_next", "outcome", "terminal"):
        if key not in batch:
            raise KeyError(f"success_model_update needs batch[{key!r}]; got keys {sorted(batch)}")
    outcome = batch["outcome"]
    check_shape("outcome", outcome, (None,))
    has_next = batch.get("has_next", torch.ones_like(outcome, dtype=torch.bool))
    with torch.no_grad():
        p_next = torch.sigmoid(_call(target_model, batch, "x_next"))
    terminal = batch["terminal"]
    if target == "mc":  # every step takes its outcome as if terminal (has_next is then irrelevant)
        terminal = torch.ones_like(terminal, dtype=torch.bool)
    y, mask = success_td_targets(
        p_next,
        outcome=outcome,
        terminal=terminal,
        has_next=has_next,
        failure_value=batch.get("failure_value", failure_value),
    )
    if "mask" in batch:
        mask = mask & batch["mask"].to(torch.bool)
    model.train()
    p = torch.sigmoid(_call(model, batch, "x"))
    loss = success_loss(p, y, mask)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_grad_norm is not None:
        nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    if (step + 1) % target_every == 0:
        soft_update_(target_model, model, tau=tau)
    return {
        "loss": float(loss.detach()),
        "p_mean": float(masked_mean(p.detach(), mask)),
        "target_mean": float(masked_mean(y, mask)),
        "n": float(mask.sum()),
    }


def refit_success_model(
    model: nn.Module,
    target_model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Mapping[str, Tensor]],
    *,
    start_step: int = 0,
    **update_kwargs,
) -> tuple[int, list[dict[str, float]]]:
    """One RLER refit round: `success_model_update` over `batches`; returns (next step counter, per-step stats)."""
    step = start_step
    history = []
    for batch in batches:
        history.append(success_model_update(model, target_model, optimizer, batch, step=step, **update_kwargs))
        step += 1
    return step, history


# ----------------------------------------------------------------------------------------------------------------
# Dense rewards per action chunk
# ----------------------------------------------------------------------------------------------------------------


def chunk_rewards(
    p: Tensor,
    *,
    valid: Tensor,
    success: Tensor,
    chunk_len: int,
    complete: Tensor | None = None,
    form: Literal["authors", "potential"] = "authors",
    gamma: float = 1.0,
    failure_terminal_reward: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Dense success-probability rewards per action chunk; returns (rewards (N, C), chunk_valid (N, C)).

    Chunk c covers steps [c·H, (c + 1)·H). Its boundary probability is p at the observation after the chunk
    (the next chunk's first step), or at the episode's last frame for the final chunk.

    - `authors` (eVTA_0): r_c = p_boundary − 1; the chunk containing the first success gets the terminal outcome
      (1); later chunks 0. A failed episode keeps p − 1 on its last chunk unless `failure_terminal_reward` is set.
    - `potential` (ours): r_c = outcome_c + γ·Φ(end of c) − Φ(start of c), Φ = p, with Φ = 0 once the episode
      has ended (success, or the last chunk of a complete episode), so that the shaping leaves the optimal
      policy unchanged.

    Args:
        p: (N, T) success probability at each step's observation. valid, success: (N, T) bool.
        complete: (N,) bool, the episode ended (vs recording cut). Default all True.
    """
    check_shape("p", p, (None, None))
    n, t_len = p.shape
    check_shape("valid", valid, (n, t_len))
    check_shape("success", success, (n, t_len))
    if chunk_len < 1:
        raise ValueError(f"chunk_len must be >= 1; got {chunk_len}")
    valid = valid.to(torch.bool)
    complete = torch.ones(n, dtype=torch.bool, device=p.device) if complete is None else complete.to(torch.bool)
    c_len = (t_len + chunk_len - 1) // chunk_len
    dev = p.device
    length = valid.long().sum(1)
    last = (length - 1).clamp_min(0)
    starts = torch.arange(c_len, device=dev) * chunk_len  # (C,)
    chunk_valid = starts[None, :] < length[:, None]  # (N, C)
    end_idx = torch.minimum((starts + chunk_len)[None, :].expand(n, -1), last[:, None])  # (N, C)
    p_end = p.gather(1, end_idx)
    p_start = p.gather(1, torch.minimum(starts[None, :].expand(n, -1), last[:, None]))
    tidx = torch.arange(t_len, device=dev).expand(n, -1)
    succ = success.to(torch.bool) & valid
    first = torch.where(succ, tidx, torch.full_like(tidx, t_len)).amin(1)  # (N,), t_len if never
    first_chunk = torch.where(first < t_len, first // chunk_len, torch.full_like(first, c_len))
    cidx = torch.arange(c_len, device=dev).expand(n, -1)
    is_succ_chunk = cidx == first_chunk[:, None]
    after = cidx > first_chunk[:, None]
    is_last_chunk = cidx == (last // chunk_len)[:, None]
    if form == "authors":
        r = p_end - 1.0
        if failure_terminal_reward is not None:
            fail_end = is_last_chunk & (first_chunk == c_len)[:, None] & complete[:, None]
            r = torch.where(fail_end, torch.full_like(r, failure_terminal_reward), r)
        r = torch.where(is_succ_chunk, torch.ones_like(r), r)
        r = torch.where(after, torch.zeros_like(r), r)
    elif form == "potential":
        ended = is_succ_chunk | (is_last_chunk & complete[:, None])
        phi_end = torch.where(ended, torch.zeros_like(p_end), p_end)
        r = gamma * phi_end - p_start + is_succ_chunk.to(p.dtype)
        r = torch.where(after, torch.zeros_like(r), r)
    else:
        raise ValueError(f"form must be 'authors' or 'potential'; got {form!r}")
    return r * chunk_valid.to(r.dtype), chunk_valid


# ----------------------------------------------------------------------------------------------------------------
# Calibration and ranking metrics
# ----------------------------------------------------------------------------------------------------------------


def brier_score(p: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
    """mean((p − y)²) over `mask`; scalar. 0 is perfect, 0.25 is a constant 0.5 on balanced labels."""
    check_same_shape(p=p, y=y)
    return masked_mean((p.float() - y.float()).pow(2), mask)


def expected_calibration_error(p: Tensor, y: Tensor, *, n_bins: int = 10, mask: Tensor | None = None) -> Tensor:
    """ECE with equal-width bins on [0, 1]: Σ_b (n_b/n)·|mean p_b − mean y_b|; scalar."""
    check_same_shape(p=p, y=y)
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1; got {n_bins}")
    p, y = p.float().flatten(), y.float().flatten()
    if mask is not None:
        keep = mask.flatten().to(torch.bool)
        p, y = p[keep], y[keep]
    if p.numel() == 0:
        return torch.zeros((), device=p.device)
    b = (p.clamp(0, 1) * n_bins).long().clamp_max(n_bins - 1)
    sp = torch.zeros(n_bins, device=p.device).index_add_(0, b, p)
    sy = torch.zeros(n_bins, device=p.device).index_add_(0, b, y)
    gap = (sp - sy).abs()  # = n_b·|mean p_b − mean y_b|
    return gap.sum() / p.numel()


def _average_ranks(x: Tensor) -> Tensor:
    order = torch.argsort(x, stable=True)
    xs = x[order]
    ranks_sorted = torch.arange(x.numel(), dtype=torch.float64, device=x.device)
    # Ties share the mean of their ranks.
    _, inv, counts = torch.unique_consecutive(xs, return_inverse=True, return_counts=True)
    start = torch.cumsum(counts, 0) - counts
    mean_rank = start.double() + (counts.double() - 1.0) / 2.0
    ranks_sorted = mean_rank[inv]
    out = torch.empty_like(ranks_sorted)
    out[order] = ranks_sorted
    return out


def spearman_rank_correlation(x: Tensor, y: Tensor, mask: Tensor | None = None) -> Tensor:
    """Spearman's ρ between x and y (flattened, ties averaged); scalar, 0 when either is constant."""
    check_same_shape(x=x, y=y)
    x, y = x.flatten(), y.flatten()
    if mask is not None:
        keep = mask.flatten().to(torch.bool)
        x, y = x[keep], y[keep]
    if x.numel() < 2:
        return torch.zeros((), dtype=torch.float64, device=x.device)
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = (rx.pow(2).sum() * ry.pow(2).sum()).sqrt()
    return (rx * ry).sum() / den if den > 0 else torch.zeros((), dtype=torch.float64, device=x.device)


def value_order_correlation(p: Tensor, valid: Tensor) -> Tensor:
    """VOC: mean over episodes of Spearman(p_t, t) within the episode, (N, T) -> scalar.

    On demonstrations a good success model rises with time (VOC → 1); on reversed demos it should fall (VROC).
    """
    check_shape("p", p, (None, None))
    check_shape("valid", valid, tuple(p.shape))
    tidx = torch.arange(p.shape[1], device=p.device, dtype=p.dtype)
    vals = [spearman_rank_correlation(p[i], tidx, valid[i]) for i in range(p.shape[0]) if int(valid[i].sum()) > 1]
    return torch.stack(vals).mean() if vals else torch.zeros((), dtype=torch.float64, device=p.device)
