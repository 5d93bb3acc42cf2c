"""`rl.method habc`: hierarchical advantage-weighted behaviour cloning.

Viability and efficiency critics on the policy's features, trained on the replay every round; their gated one-step
advantages weight each rollout step's flow-matching loss (successful autonomous steps by the gate, failed ones 0,
human steps 1 or the gate with intervention reweighting), beside the demonstrations at weight 1.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from diffusion_rl.batching import collate_episodes
from diffusion_rl.data import Episode
from diffusion_rl.habc import HABCConfig, HABCCritic, habc_step
from diffusion_rl.success_model import soft_update_
from kinema.train.methods.base import RLMethod
from kinema.train.success import seeded

GATES = ("paper", "fixed_mix", "viability_only", "efficiency_only", "exp")


@dataclass
class HABCOptions:
    gate: str = "paper"  # paper | fixed_mix | viability_only | efficiency_only | exp
    intervention_credit: bool = True  # False: the "no intervention-aware credit" ablation
    intervention_reweighting: bool = False  # human steps weighted by g instead of 1 (the paper's "IR")
    intervention_reweighting_after: int = 0  # rounds without IR before it starts (the paper runs 3 rounds without)
    warmup_rounds: int = 0  # rounds with g = 1 (the critics still train)
    critic_steps: int = 400  # critic gradient steps per round
    critic_lr: float = 3e-4  # critic learning rate (a soft-updated target critic serves the TD head)
    efficiency_target: str = "td"  # td (the paper) | mc: observed steps-to-success as V_e's target (ours)
    value_scale: float = 1.0  # V_e = scale * head output; > 1 (e.g. the horizon) only with efficiency_target mc

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"rl.habc.gate {self.gate!r} is not known; valid: {', '.join(GATES)}")
        if self.efficiency_target not in ("td", "mc"):
            raise ValueError(f"rl.habc.efficiency_target {self.efficiency_target!r} is not known; valid: td, mc")
        for name in ("critic_steps", "intervention_reweighting_after", "warmup_rounds"):
            if getattr(self, name) < 0:
                raise ValueError(f"rl.habc.{name} must be >= 0; got {getattr(self, name)}")


class HABC(RLMethod):
    name = "habc"
    summary = "hierarchical advantage-weighted BC: viability and efficiency critics gate each rollout step's weight"
    policy_types = ("vla", "video", "smolvla", "pi0")  # imitation-style: its flow loss covers the video policy's whole sequence
    options_key = "habc"
    options_class = HABCOptions
    learns_from_recordings = True

    def __init__(self, learner) -> None:
        super().__init__(learner)
        o, feature_dim = self.options, learner.policy.config.hidden_dim
        # value_scale 1 for TD: a larger scale multiplies the TD step in value space and diverged in practice.
        self.critic = seeded(self.cfg.seed + 1, lambda: HABCCritic(feature_dim, hidden_dim=256, num_layers=2, value_scale=o.value_scale))
        self.target = copy.deepcopy(self.critic).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.critic.parameters(), lr=o.critic_lr)

    def update(self, rollouts, record, progress) -> None:
        o = self.options
        reweighting = o.intervention_reweighting and rollouts.round > o.intervention_reweighting_after
        config = HABCConfig(
            gate=o.gate, warmup_steps=o.warmup_rounds * self.cfg.rl.updates_per_round,
            intervention_credit=o.intervention_credit, intervention_reweighting=reweighting,
            efficiency_target=o.efficiency_target,
        )  # fmt: skip
        record["habc/intervention_reweighting"] = reweighting
        with progress.phase(f"round {rollouts.round}: critics (steps)", self.options.critic_steps, kind="update", units=0):
            per_step, diag = self.fit_and_weigh(rollouts.episodes, rollouts.features, config, on_step=progress.advance)
        record.update(diag)
        self.imitate(rollouts, np.concatenate(per_step), record, progress)

    def fit_and_weigh(
        self, episodes: Sequence[Episode], features: Sequence[Tensor], config: HABCConfig, on_step=None
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Train the viability and efficiency heads on the replay, then return the per-step actor weights (one array
        per episode) and diagnostics."""
        batch = collate_episodes(episodes, intervention_aware=config.intervention_credit)
        feats = pad_features(features, batch.max_len)
        step = self.learner.actor_step
        for _ in range(self.options.critic_steps):
            result = habc_step(self.critic, feats, batch, step=step, config=config, target=self.target)
            self.optimizer.zero_grad()
            result.critic_loss.backward()
            self.optimizer.step()
            soft_update_(self.target, self.critic, tau=0.05)
            if on_step is not None:
                on_step()
        with torch.no_grad():
            result = habc_step(self.critic, feats, batch, step=step, config=config)
        weights = result.weights.clamp(min=0).numpy()
        diag = {f"habc/{k}": float(v) for k, v in result.diagnostics.items() if torch.as_tensor(v).numel() == 1}
        diag["habc/critic_loss"] = float(result.critic_loss)
        return [weights[i, : len(ep)] for i, ep in enumerate(episodes)], diag

    def state_dict(self) -> dict:
        return {"critic": self.critic.state_dict(), "target": self.target.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def from_legacy_critics(cls, critics: dict) -> dict:
        return {"critic": critics["habc"], "target": critics["habc_target"], "optimizer": critics["optimizers"]["habc"]}


def pad_features(features: Sequence[Tensor], t_max: int) -> Tensor:
    """List of (T_i, F) -> (N, t_max, F), zero-padded."""
    out = torch.zeros(len(features), t_max, features[0].shape[-1])
    for i, f in enumerate(features):
        out[i, : len(f)] = f
    return out
