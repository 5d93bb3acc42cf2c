"""A round's samples: prompts drawn in groups, rolled out the method's way, decoded, scored and balanced into one
advantage per sample (`Rollout`, `collect_rollout`); the pipeline's ODE that rollouts and evaluation samples integrate; the
within-prompt diversity of a batch of videos.

Latents are (B, C, F, H, W), videos (B, F, C, H, W) in [0, 1]; B = prompts × group_size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from diffusion_rl.flow import euler_sample
from kinema.train.distributed import gather_rows, own_rows, world
from policies.video.rewards.balance import RewardBatch, reward_stats

if TYPE_CHECKING:
    from kinema.video.methods import Method
    from policies.video.generator import VideoGenerator
    from policies.video.rewards import RewardSet


@dataclass
class Rollout:
    """One round's samples. B = prompts × group_size."""

    prompts: list[str]
    group_ids: Tensor  # (B,)
    embeds: Tensor  # (B, L, D)
    latents: Tensor  # (B, C, F, H, W) the clean samples x_0
    videos: Tensor  # (B, F, C, H, W) in [0, 1]
    scores: dict[str, Tensor] = field(default_factory=dict)  # per reward, (B,)
    advantages: Tensor | None = None  # (B,) the balanced advantage
    weights: Tensor | None = None  # (B,) 0 for samples of degenerate groups
    extra: dict[str, Any] = field(default_factory=dict)  # what one method needs (SDE records, trajectories, ...)


def diversity(videos: Tensor, group_ids: Tensor) -> float:
    """Mean pairwise RMS distance between the videos of one prompt, averaged over prompts. (B, F, C, H, W)."""
    values = []
    for g in torch.unique(group_ids):
        x = videos[group_ids == g].flatten(1).float()
        if len(x) < 2:
            continue
        d = torch.cdist(x, x) / math.sqrt(x.shape[1])
        n = len(x)
        values.append(float(d.sum() / (n * (n - 1))))
    return float(np.mean(values)) if values else 0.0


def velocity_fn(generator: VideoGenerator, emb: Tensor, adapter: str | None, *,
                guidance: float = 1.0) -> Callable[[Tensor, Tensor], Tensor]:
    """v(x, t) of one adapter (a LoRA name, BASE, or None: the generator as it stands), for diffusion_rl's samplers.

    `guidance` > 1 is CFG against the generator's negative prompt."""
    return lambda x, t: generator.velocity(x, t, emb, adapter=adapter, guidance_scale=guidance)


@torch.no_grad()
def ode_sample(generator: VideoGenerator, emb: Tensor, adapter: str | None, noise: Tensor, *, num_steps: int,
               guidance: float = 1.0, trajectory: bool = False):
    """The pipeline's ODE (Euler on its sigmas) from `noise`: latents (B, C, F', h, w) [, visited states].

    The generator's own schedule, so that rollouts, evaluation samples and `generate()` integrate the same ODE."""
    return euler_sample(velocity_fn(generator, emb, adapter, guidance=guidance), noise,
                        schedule=generator.sigmas(num_steps), return_trajectory=trajectory)


def draw_prompts(pool: Sequence[str], k: int, group_size: int, rng: np.random.Generator,
                 device: torch.device) -> tuple[list[str], Tensor]:
    """k prompts of the pool (repeats only when the pool holds fewer), each `group_size` times, and their group ids."""
    pick = rng.choice(len(pool), size=k, replace=k > len(pool))
    prompts = [pool[i] for i in pick for _ in range(group_size)]
    return prompts, torch.arange(k, device=device).repeat_interleave(group_size)


def collect_rollout(generator: VideoGenerator, method: Method, rewards: RewardSet, prompts: list[str],
            group_ids: Tensor) -> Rollout:
    """The method's rollouts of `prompts`, decoded and scored: every reward, the balanced advantage, and the weights
    (0 for the samples of reward-degenerate groups where the method is reward-gated, all 1 otherwise)."""
    embeds = generator.encode_prompts(prompts)
    with torch.no_grad():
        latents, extra = method.rollout(prompts, embeds)
        videos = generator.decode_latents(latents)
    ro = Rollout(prompts, group_ids, embeds, latents.detach(), videos, extra=extra)
    scored = score_over_ranks(rewards, videos, prompts, group_ids)
    dev = generator.device  # rewards may score elsewhere (a CPU success model): the losses live here
    ro.scores = {k: v.to(dev) for k, v in scored.scores.items()}
    ro.advantages, ro.weights = scored.advantages.to(dev), scored.weights.to(dev)
    if not method.reward_gated:
        ro.weights = torch.ones_like(ro.weights)
    ro.extra["reward_stats"] = scored.stats
    return ro


def score_over_ranks(rewards: RewardSet, videos: Tensor, prompts: list[str], group_ids: Tensor) -> RewardBatch:
    """`rewards(videos, prompts, group_ids)`, with the advantages balanced over every rank's samples under torchrun.

    Each rank scores its own samples (whole groups); the scores of the round are gathered, so that GDPO's batch
    whitening and the reward stats see the round one process would have, and each rank keeps its own rows."""
    if world()[1] == 1:
        return rewards(videos, prompts, group_ids)
    scores = {k: v.detach() for k, v in rewards.score(videos, prompts).items()}
    round_scores = {k: gather_rows(v) for k, v in scores.items()}
    round_groups = gather_rows(group_ids)  # the round's group ids: each rank keeps its groups' own
    adv = rewards.advantages(round_scores, round_groups)
    mine = own_rows(len(prompts))
    return RewardBatch(scores, adv.advantages[mine], adv.weights[mine], {**reward_stats(round_scores, round_groups), **adv.stats})
