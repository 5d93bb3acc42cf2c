"""Several rewards scored together and balanced into one advantage (GDPO, or a weighted sum for comparison)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from diffusion_rl.advantages import GroupAdvantages, gdpo_advantages, grpo_advantages
from policies.video.rewards.base import VideoReward, check_scores


def prompt_group_ids(prompts: Sequence[str]) -> Tensor:
    """(B,) int64 group ids: samples with the same prompt share a group (first appearance order)."""
    ids: dict[str, int] = {}
    return torch.tensor([ids.setdefault(p, len(ids)) for p in prompts], dtype=torch.long)


@dataclass
class RewardBatch:
    """What `RewardSet` returns for a batch of videos.

    scores: {name: (B,)} raw per-reward scores (detached). advantages, weights: (B,) the balanced advantage and
    the per-sample loss weight (0 for dropped degenerate groups). stats: flat floats for the metrics log:
    `reward/<name>/{mean,std,min,max,group_std}` and the balancing stats (`adv_mean`, `n_degenerate_groups`, ...).
    """

    scores: dict[str, Tensor]
    advantages: Tensor
    weights: Tensor
    stats: dict[str, float]


class RewardSet:
    """Several rewards scored together and balanced into one advantage.

    - `balance="gdpo"` (default): each reward is z-scored within its prompt group on its own, the z-scores are
      summed with `weights`, and the batch is whitened (diffusion_rl.advantages.gdpo_advantages). A reward's raw
      scale cannot drown the others, and a reward that is constant in a group contributes 0 there.
    - `balance="weighted_sum"`: Σ_k w_k·r_k on the raw scores, then GRPO within the group (grpo_advantages). Kept
      for comparison: the reward with the widest raw spread dominates the sum, and a harder reward whose spread
      is small stalls (the failure GDPO addresses).
    Groups in which every reward is equal carry no signal: dropped by default (`degenerate`), and counted.
    """

    def __init__(
        self,
        rewards: Sequence[VideoReward],
        *,
        weights: Mapping[str, float] | None = None,
        balance: Literal["gdpo", "weighted_sum"] = "gdpo",
        degenerate: Literal["drop", "downweight", "keep"] = "drop",
    ):
        if balance not in ("gdpo", "weighted_sum"):
            raise ValueError(f"balance must be 'gdpo' or 'weighted_sum'; got {balance!r}")
        self.rewards = list(rewards)
        names: list[str] = []
        for r in self.rewards:
            for n in r.names:
                if n in names:
                    raise ValueError(f"two rewards return the score {n!r}; each name may come from one reward only")
                names.append(n)
        if not names:
            raise ValueError("a RewardSet needs at least one reward")
        self.names = tuple(names)
        weights = dict(weights or {})
        unknown = sorted(set(weights) - set(names))
        if unknown:
            raise ValueError(f"weights name unknown rewards {unknown}; the rewards in this set: {list(names)}")
        self.weights = {n: float(weights.get(n, 1.0)) for n in names}
        self.balance, self.degenerate = balance, degenerate

    @property
    def differentiable(self) -> bool:
        return all(r.differentiable for r in self.rewards)

    def to(self, device: torch.device | str) -> RewardSet:
        for r in self.rewards:
            r.to(device)
        return self

    def score(self, videos: Tensor, prompts: Sequence[str], *, grad: bool = False) -> dict[str, Tensor]:
        """{name: (B,)} from every reward; with grad=False (default) under no_grad, for rollouts."""
        out: dict[str, Tensor] = {}
        with torch.set_grad_enabled(grad):
            for r in self.rewards:
                s = r(videos, prompts)
                check_scores(type(r).__name__, s, r.names, videos.shape[0])
                out.update(s)
        return out

    def advantages(self, scores: Mapping[str, Tensor], group_ids: Tensor) -> GroupAdvantages:
        missing = [n for n in self.names if n not in scores]
        if missing:
            raise ValueError(f"scores lack {missing}; this RewardSet has {list(self.names)}")
        r = torch.stack([scores[n].detach().float() for n in self.names], dim=1)  # (B, K)
        w = torch.tensor([self.weights[n] for n in self.names], device=r.device)
        group_ids = group_ids.to(r.device)
        if self.balance == "gdpo":
            return gdpo_advantages(r, group_ids, reward_weights=w, degenerate=self.degenerate)
        return grpo_advantages((r * w).sum(dim=1), group_ids, degenerate=self.degenerate)

    def __call__(self, videos: Tensor, prompts: Sequence[str], group_ids: Tensor | None = None) -> RewardBatch:
        """Score, balance and summarise a batch; groups default to one per distinct prompt."""
        scores = {k: v.detach() for k, v in self.score(videos, prompts).items()}
        group_ids = prompt_group_ids(prompts) if group_ids is None else group_ids
        adv = self.advantages(scores, group_ids)
        return RewardBatch(scores, adv.advantages, adv.weights, {**reward_stats(scores, group_ids), **adv.stats})


def reward_stats(scores: Mapping[str, Tensor], group_ids: Tensor) -> dict[str, float]:
    """Per-reward curves: `reward/<name>/{mean,std,min,max,group_std}` (group_std: mean within-group std)."""
    stats: dict[str, float] = {}
    _, inv = torch.unique(group_ids.cpu(), return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    for name, s in scores.items():
        s = s.detach().double().cpu()
        stats[f"reward/{name}/mean"] = float(s.mean())
        stats[f"reward/{name}/std"] = float(s.std(correction=0))
        stats[f"reward/{name}/min"] = float(s.min())
        stats[f"reward/{name}/max"] = float(s.max())
        stds = [float(s[inv == g].std(correction=0)) for g in range(n_groups)]
        stats[f"reward/{name}/group_std"] = float(np.mean(stds)) if stds else 0.0
    return stats
