"""`rl.method awr`: advantage-weighted regression with one critic. V(s) is regressed on the discounted sparse return;
each replay step is weighted by exp((G − V) / temperature), clipped and normalised."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from diffusion_rl.data import Episode
from diffusion_rl.flow import exp_advantage_weights
from kinema.train.methods.base import RLMethod
from kinema.train.success import seeded


@dataclass
class AWROptions:
    temperature: float = 1.0  # w = exp(A / temperature), clipped
    critic_steps: int = 400  # value-critic gradient steps per round
    critic_lr: float = 1e-3
    gamma: float = 0.99  # discount of the sparse return per env step

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"rl.awr.temperature must be > 0; got {self.temperature}")
        if self.critic_steps < 0:
            raise ValueError(f"rl.awr.critic_steps must be >= 0; got {self.critic_steps}")


def value_critic(feature_dim: int, seed: int) -> nn.Module:
    """V(s) on the policy's features (AWR's critic, and PPO's with GAE)."""
    return seeded(seed + 2, lambda: nn.Sequential(nn.Linear(feature_dim, 256), nn.SiLU(), nn.Linear(256, 1)))


class AWR(RLMethod):
    name = "awr"
    summary = "advantage-weighted regression: one value critic, rollout steps weighted by exp(A / temperature)"
    policy_types = ("vla", "video", "smolvla", "pi0")  # imitation-style: its flow loss covers the video policy's whole sequence
    options_key = "awr"
    options_class = AWROptions
    learns_from_recordings = True

    def __init__(self, learner) -> None:
        super().__init__(learner)
        self.value = value_critic(learner.policy.config.hidden_dim, self.cfg.seed)
        self.optimizer = torch.optim.Adam(self.value.parameters(), lr=self.options.critic_lr)

    def update(self, rollouts, record, progress) -> None:
        with progress.phase(f"round {rollouts.round}: critic (steps)", self.options.critic_steps, kind="update", units=0):
            per_step, diag = self.fit_and_weigh(rollouts.episodes, rollouts.features, on_step=progress.advance)
        record.update(diag)
        self.imitate(rollouts, np.concatenate(per_step), record, progress)

    def fit_and_weigh(
        self, episodes: Sequence[Episode], features: Sequence[Tensor], on_step=None
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        o = self.options
        returns = [(o.gamma ** np.arange(len(ep))[::-1] * float(ep.outcome)).astype(np.float32) for ep in episodes]
        x = torch.cat(list(features))
        y = torch.from_numpy(np.concatenate(returns))
        for _ in range(o.critic_steps):
            loss = (self.value(x).squeeze(-1) - y).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            if on_step is not None:
                on_step()
        with torch.no_grad():
            adv = y - self.value(x).squeeze(-1)
            w = exp_advantage_weights(adv, temperature=o.temperature, normalize=True)
            if not o.critic_steps:
                loss = (self.value(x).squeeze(-1) - y).pow(2).mean()
        out, start = [], 0
        for ep in episodes:
            out.append(w[start : start + len(ep)].numpy())
            start += len(ep)
        return out, {"awr/value_loss": float(loss.detach()), "awr/adv_std": float(adv.std())}

    def state_dict(self) -> dict:
        return {"value": self.value.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.value.load_state_dict(state["value"])
        self.optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def from_legacy_critics(cls, critics: dict) -> dict:
        return {"value": critics["value"], "optimizer": critics["optimizers"]["value"]}
