"""A chunk-level Q critic (Q-chunking, Li et al. 2025): Q(φ(s_t), a_{t:t+h}) of an executed action chunk, trained by an
h-step backup over the chunk from a sparse outcome; and the critic-guided chunk choice of PA-RL / V-GPS.

Conventions (ours where the paper leaves a choice):
- reward 1 at the step that succeeds (the last step of a successful episode), 0 elsewhere; an episode's end is
  terminal (a time-out is a failure of the task, not a truncation to bootstrap through);
- discount γ **per env step**: a chunk of h executed actions earns Σ_{k<h} γ^k r_{t+k} and its successor is
  discounted by γ^h, so Q is the same quantity whatever the chunk length: Q(s_t, a) = E[γ^(steps to success − 1)]
  (0 on failure), in [0, 1];
- the target bootstraps on the chunk executed next in the data (an h-step SARSA backup of the behaviour that
  produced the replay: demonstrations, rollouts). Q-chunking's paper bootstraps on the current policy's own next
  chunk; evaluating a fresh policy sample at every replay state each critic step costs a flow sample per state;
- a target network, Polyak-averaged (τ), supplies the bootstrap.

Shapes: a batch of transitions is flat over every step t of every episode (M,). `chunk` is (M, h, A), zero-padded
past the episode's end with `chunk_mask` (M, h) false there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from diffusion_rl.success_model import soft_update_


class ChunkQ(nn.Module):
    """Q(φ, chunk) ∈ [0, 1]: an MLP on the features and the flattened executed chunk, sigmoid output."""

    def __init__(self, feature_dim: int, horizon: int, action_dim: int, *, hidden_dim: int = 256, num_layers: int = 2):
        super().__init__()
        if horizon < 1 or action_dim < 1:
            raise ValueError(f"ChunkQ needs horizon >= 1 and action_dim >= 1; got {horizon}, {action_dim}")
        self.horizon, self.action_dim = horizon, action_dim
        layers: list[nn.Module] = []
        width = feature_dim + horizon * action_dim
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden_dim), nn.LayerNorm(hidden_dim), nn.SiLU()]
            width = hidden_dim
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def logits(self, features: Tensor, chunk: Tensor) -> Tensor:
        if chunk.shape[-2:] != (self.horizon, self.action_dim):
            raise ValueError(f"chunk must be (..., {self.horizon}, {self.action_dim}); got {tuple(chunk.shape)}")
        return self.net(torch.cat([features, chunk.flatten(-2)], dim=-1)).squeeze(-1)

    def forward(self, features: Tensor, chunk: Tensor) -> Tensor:
        """(B,) values in [0, 1]."""
        return torch.sigmoid(self.logits(features, chunk))


def chunk_transitions(
    actions: Sequence[np.ndarray], rewards: Sequence[np.ndarray], *, horizon: int, gamma: float
) -> dict[str, Tensor]:
    """Every step of every episode as a chunk transition (flat over episodes, in order).

    actions[e]: (T_e, A) the executed actions; rewards[e]: (T_e,) per-step rewards. Returns
    chunk (M, h, A), chunk_mask (M, h), reward (M,) = Σ_{k<h, t+k<T} γ^k r_{t+k}, next_index (M,) the flat index of
    step t + h (−1 where the episode has ended by then: terminal), and discount (M,) = γ^h.
    """
    if horizon < 1 or not 0.0 < gamma <= 1.0:
        raise ValueError(f"need horizon >= 1 and 0 < gamma <= 1; got {horizon}, {gamma}")
    if len(actions) != len(rewards):
        raise ValueError(f"one reward array per episode: {len(actions)} action arrays, {len(rewards)} reward arrays")
    chunks, masks, rets, nexts = [], [], [], []
    powers = gamma ** np.arange(horizon)
    offset = 0
    for a, r in zip(actions, rewards):
        T = len(a)
        if len(r) != T:
            raise ValueError(f"an episode has {T} actions but {len(r)} rewards")
        a_pad = np.concatenate([np.asarray(a, np.float32), np.zeros((horizon, a.shape[1]), np.float32)])
        r_pad = np.concatenate([np.asarray(r, np.float64), np.zeros(horizon)])
        idx = np.arange(T)[:, None] + np.arange(horizon)[None]
        chunks.append(a_pad[idx])
        masks.append(idx < T)
        rets.append((r_pad[idx] * powers).sum(1))
        nxt = np.arange(T) + horizon
        nexts.append(np.where(nxt < T, nxt + offset, -1))
        offset += T
    return {
        "chunk": torch.from_numpy(np.concatenate(chunks)),
        "chunk_mask": torch.from_numpy(np.concatenate(masks)),
        "reward": torch.from_numpy(np.concatenate(rets).astype(np.float32)),
        "next_index": torch.from_numpy(np.concatenate(nexts)),
        "discount": torch.full((offset,), float(gamma**horizon)),
    }


def outcome_rewards(lengths: Sequence[int], outcomes: Sequence[float]) -> list[np.ndarray]:
    """The sparse reward: 1 at the last step of a successful episode, else 0."""
    out = []
    for T, o in zip(lengths, outcomes):
        r = np.zeros(T, np.float32)
        if T and o:
            r[-1] = 1.0
        out.append(r)
    return out


def chunk_backup(reward: Tensor, next_value: Tensor, next_index: Tensor, discount: Tensor) -> Tensor:
    """The h-step target y = R_chunk + γ^h · V(s_{t+h}), with V = 0 past a terminal (next_index < 0); (M,)."""
    return reward + discount * torch.where(next_index >= 0, next_value, torch.zeros_like(next_value))


def discounted_returns(lengths: Sequence[int], outcomes: Sequence[float], gamma: float) -> Tensor:
    """The realised return of every step, γ^(T−1−t)·outcome (flat): what a calibrated Q predicts on average."""
    return torch.from_numpy(np.concatenate([(gamma ** np.arange(T)[::-1] * float(o)).astype(np.float32) for T, o in zip(lengths, outcomes)]))


def chunk_q_update(
    q: ChunkQ,
    target: ChunkQ,
    optimizer: torch.optim.Optimizer,
    features: Tensor,
    transitions: dict[str, Tensor],
    index: Tensor,
    *,
    tau: float = 0.05,
) -> float:
    """One gradient step of Q on the transitions `index` (MSE to the h-step target from the target network), then
    the Polyak update of the target. `features` (M, F) are aligned with the transitions. Returns the loss."""
    nxt = transitions["next_index"][index]
    with torch.no_grad():
        safe = nxt.clamp_min(0)
        v_next = target(features[safe], transitions["chunk"][safe])
        y = chunk_backup(transitions["reward"][index], v_next, nxt, transitions["discount"][index])
    loss = (q(features[index], transitions["chunk"][index]) - y).pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    soft_update_(target, q, tau=tau)
    return float(loss.detach())


# ----------------------------------------------------------------------------------------------------------------
# Critic-guided choice among sampled chunks (PA-RL's "global" step, V-GPS at inference)
# ----------------------------------------------------------------------------------------------------------------


def refine_chunks(
    q: ChunkQ, features: Tensor, candidates: Tensor, *, steps: int, step_size: float, low: float = -1.0, high: float = 1.0
) -> Tensor:
    """PA-RL's "local" step: `steps` gradient-ascent steps on Q of each candidate's executed part, clipped to the
    action range. features (B, F), candidates (B, N, H, A) with H >= q.horizon; returns the refined (B, N, H, A)."""
    if steps <= 0:
        return candidates
    B, N = candidates.shape[:2]
    h = q.horizon
    x = candidates.clone()
    f = features[:, None].expand(B, N, features.shape[-1]).reshape(B * N, -1)
    for _ in range(steps):
        head = x[:, :, :h].reshape(B * N, h, -1).detach().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(q(f, head).sum(), head)
        x[:, :, :h] = (head + step_size * grad).clamp(low, high).reshape(B, N, h, -1).detach()
    return x


@torch.no_grad()
def select_chunks(q: ChunkQ, features: Tensor, candidates: Tensor, *, margin: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """The candidate with the highest Q per row: features (B, F), candidates (B, N, H, A) (Q reads the first
    q.horizon actions, the executed part). Returns (chosen (B, H, A), index (B,), values (B, N)).
    With `margin` > 0 (ours, not V-GPS's), candidate 0 is kept unless the best is valued more than `margin` above it:
    trust the policy's own chunk where the critic's preference is within its error."""
    if margin < 0:
        raise ValueError(f"margin must be >= 0; got {margin}")
    B, N = candidates.shape[:2]
    h = q.horizon
    if candidates.shape[2] < h:
        raise ValueError(f"candidates hold {candidates.shape[2]} actions; the critic scores the first {h}")
    f = features[:, None].expand(B, N, features.shape[-1]).reshape(B * N, -1)
    values = q(f, candidates[:, :, :h].reshape(B * N, h, -1)).reshape(B, N)
    best, index = values.max(1)
    if margin > 0:
        index = torch.where(best - values[:, 0] > margin, index, torch.zeros_like(index))
    return candidates[torch.arange(B), index], index, values
