"""`rl.method nft`: DiffusionNFT on the VLA's action expert (our application of it to the VLA; the loss as the
official code). Every rollout of the round trains: a success towards its chunks, a failure away from them, by
r = clip(A / A_max)/2 + ½ of its outcome advantage within the round. On-policy: the newest round only.

`rl.nft.demo_loss flow` (ours) gives the demonstration rows of each batch the control's own loss, plain flow matching
with SFT's augmentation, and the rollout rows NFT's loss in its textbook velocity form (at β = 1 a positive's is that
same flow loss, so the two terms share one scale): the arm is continued SFT plus the rollouts' pull and push. As
written, the demonstrations are NFT positives (r = 1) in the same unaugmented pass as the rollouts.

`rl.nft.reward discounted` (ours) rewards a success by γ^(steps − 1) instead of 1, so that within a round a faster
success counts more than a slower one: the only signal the episode outcome gives for speed."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_rl.advantages import grpo_advantages
from diffusion_rl.data import Episode
from diffusion_rl.flow import nft_weight
from kinema.train.actor import ActorLoss, take_rows
from kinema.train.methods.base import RLMethod


NFT_REWARDS = ("outcome", "discounted")
NFT_DEMO_LOSSES = ("nft", "flow")


@dataclass
class NFTOptions:
    beta: float = 1.0  # DiffusionNFT's β: how far the implicit positive and negative policies sit from the old one
    adv_clip_max: float = 5.0  # A_max: advantages are clipped to ±A_max before r = clip(A / A_max)/2 + ½
    reward: str = "outcome"  # outcome: 1 success, 0 failure (as DiffusionNFT) | discounted: gamma^(steps-1) per success (ours)
    gamma: float = 0.98  # per env step, for reward discounted
    demo_loss: str = "nft"  # nft: demos are NFT positives, as written | flow: the control's augmented flow loss on demos, NFT's velocity form on rollouts (ours)

    def __post_init__(self) -> None:
        for name in ("beta", "adv_clip_max"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rl.nft.{name} must be > 0; got {getattr(self, name)}")
        if self.reward not in NFT_REWARDS:
            raise ValueError(f"rl.nft.reward {self.reward!r} is not known; valid: {', '.join(NFT_REWARDS)}")
        if self.demo_loss not in NFT_DEMO_LOSSES:
            raise ValueError(f"rl.nft.demo_loss {self.demo_loss!r} is not known; valid: {', '.join(NFT_DEMO_LOSSES)}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"rl.nft.gamma must be in (0, 1]; got {self.gamma}")


class NFT(RLMethod):
    name = "nft"
    policy_types = ("vla", "smolvla", "pi0")  # a separate action expert (SmolVLA's and pi0's: a transformer of its own)
    summary = "DiffusionNFT: successes pull the action expert towards their chunks, failures push it away"
    options_key = "nft"
    options_class = NFTOptions
    on_policy = True  # r and v_old belong to the policy that sampled the newest round only

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.rl.interventions:
            raise ValueError("rl.method nft learns from autonomous rollouts only; set rl.interventions false (or use habc)")
        if cfg.rl.replay_mixing != "fixed":
            raise ValueError(f"rl.method nft mixes demos and rollouts by rl.demo_fraction; rl.replay_mixing must be fixed, got {cfg.rl.replay_mixing!r}")

    def update(self, rollouts, record, progress) -> None:
        o = self.options
        r_per_step, sampling, diag = nft_step_weights(rollouts.episodes, adv_clip_max=o.adv_clip_max,
                                                   gamma=o.gamma if o.reward == "discounted" else 1.0)
        old = copy.deepcopy(self.learner.acting).requires_grad_(False).eval()
        loss = nft_actor_loss(old, np.concatenate(r_per_step), beta=o.beta, adv_clip_max=o.adv_clip_max,
                              demo_loss=o.demo_loss)
        record.update(diag)
        # Eval mode: policy and old policy must see the very same inputs (no augmentation), so that v_θ − v_old is
        # the update alone.
        self.imitate(rollouts, np.concatenate(sampling), record, progress, loss_fn=loss, train_mode=False)


def nft_actor_loss(
    old, r_replay: np.ndarray, *, beta: float, adv_clip_max: float, demo_loss: str = "nft"
) -> ActorLoss:  # fmt: skip
    """DiffusionNFT's per-sample loss for `actor_updates`: `old` is the policy that sampled the round (frozen),
    `r_replay` each replay step's positive-branch weight; demonstrations count as positives (r = 1).
    demo_loss "flow": the demonstration rows take SFT's flow loss in train mode (augmented) instead, and the
    rollout rows NFT's velocity-form loss (the batch runs in eval mode, so `context` is unaugmented)."""

    def loss(policy, batch, context, replay_index):
        n_demo = len(batch["task"]) - len(replay_index)
        if demo_loss == "nft":
            r = torch.from_numpy(np.concatenate([np.ones(n_demo, np.float32), r_replay[replay_index]]))
            return policy.nft_loss(batch, old=old, r=r, beta=beta, adv_clip_max=adv_clip_max, context=context)
        parts = []
        if n_demo:
            policy.train(True)
            parts.append(policy.flow_loss(take_rows(batch, slice(0, n_demo))))
            policy.train(False)
        if len(replay_index):
            r = torch.from_numpy(np.asarray(r_replay[replay_index], np.float32))
            parts.append(policy.nft_loss(take_rows(batch, slice(n_demo, None)), old=old, r=r, beta=beta,
                                         adv_clip_max=adv_clip_max, context=context[n_demo:], space="velocity"))
        return torch.cat(parts)

    return loss


def nft_step_weights(
    episodes: Sequence[Episode], *, adv_clip_max: float, gamma: float = 1.0
) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """DiffusionNFT's credit for one round of rollouts: each episode's reward advantage within the round (one GRPO
    group: the rollouts have distinct seeds), the reward γ^(T − 1) for a success in T steps (1 at γ = 1) and 0 for
    a failure, mapped to NFT's positive-branch weight r = clip(A / A_max)/2 + ½ for
    every step of the episode, and sampling weights 1 / length so that each episode weighs the same (failures run
    to the horizon, 2-5x longer than successes: drawn per step, most of the objective would be failures').

    Returns (r per step, sampling weight per step, diagnostics), both aligned with the episodes.
    """
    rewards = torch.tensor([gamma ** ((ep.steps_to_success or len(ep)) - 1) if ep.outcome else 0.0 for ep in episodes])
    adv = grpo_advantages(rewards, torch.zeros(len(episodes), dtype=torch.long), degenerate="keep").advantages
    r = nft_weight(adv, adv_clip_max=adv_clip_max).numpy()
    per_step_r = [np.full(len(ep), r[i], dtype=np.float32) for i, ep in enumerate(episodes)]
    sampling = [np.full(len(ep), 1.0 / len(ep), dtype=np.float64) for ep in episodes]
    return per_step_r, sampling, {"nft/r_success": float(r[rewards > 0].mean()) if (rewards > 0).any() else float("nan"),
                                  "nft/r_failure": float(r[rewards == 0].mean()) if (rewards == 0).any() else float("nan")}
