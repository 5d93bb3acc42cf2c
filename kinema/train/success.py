"""RLER for `kinema train`: the success-probability model (eVTA_0) scored on each round's fresh rollouts, then refit on
them. Every method that rolls out keeps one; its calibration is logged, and no actor weight reads it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import Tensor

from diffusion_rl.data import Episode, ExecutedBy
from diffusion_rl.success_model import (
    SuccessHead,
    brier_score,
    expected_calibration_error,
    make_target,
    success_model_update,
)


def seeded(seed: int, build: Callable[[], Any]) -> Any:
    """`build()` with the torch generator seeded to `seed`, leaving the global generator as it was: which critics a
    method builds then does not change the policy's own random draws."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class RolloutSuccessModel:
    """P(success | policy features) with its TD target network, persisted across rounds and checkpoints."""

    def __init__(self, feature_dim: int, *, seed: int, lr: float = 1e-3) -> None:
        self.head = seeded(seed + 3, lambda: SuccessHead(feature_dim, hidden_dim=256, num_layers=2))
        self.target = make_target(self.head)
        self.step = 0
        self.optimizer = torch.optim.Adam(self.head.parameters(), lr=lr)

    def score_and_refit(
        self, episodes: Sequence[Episode], features: Sequence[Tensor], *, steps: int = 200, target: str = "td"
    ) -> dict[str, float]:
        """Score the new rollouts with the current model (calibration), then refit it on them (eVTA_0's TD targets,
        or with target="mc" each step's outcome: `rl.success_target`).

        `success_model/brier` beside `brier_base_rate` (the Brier score of always guessing the rollouts' own success
        rate) says whether the model knows more than the base rate."""
        autonomous = [i for i, ep in enumerate(episodes) if not (ep.executed_by == ExecutedBy.HUMAN).any()]
        if not autonomous:
            return {}
        x = torch.cat([features[i] for i in autonomous])
        x_next = torch.cat([torch.cat([features[i][1:], features[i][-1:]]) for i in autonomous])
        terminal = torch.cat([torch.arange(len(episodes[i])) == len(episodes[i]) - 1 for i in autonomous])
        outcome = torch.cat([torch.full((len(episodes[i]),), float(episodes[i].outcome)) for i in autonomous])
        with torch.no_grad():
            p = torch.sigmoid(self.head(x))
        y = outcome[terminal]
        metrics = {
            "success_model/brier": float(brier_score(p[terminal], y)),
            "success_model/brier_base_rate": float(y.mean() * (1 - y.mean())),  # the best constant guess, in hindsight
            "success_model/ece": float(expected_calibration_error(p, outcome)),
        }
        batch = {"x": x, "x_next": x_next, "outcome": outcome, "terminal": terminal}
        for _ in range(steps):
            stats = success_model_update(self.head, self.target, self.optimizer, batch, step=self.step, target=target)
            self.step += 1
        metrics["success_model/loss"] = stats["loss"]
        return metrics

    def state_dict(self) -> dict:
        return {"head": self.head.state_dict(), "target": self.target.state_dict(), "step": self.step,
                "optimizer": self.optimizer.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.head.load_state_dict(state["head"])
        self.target.load_state_dict(state["target"])
        self.step = state["step"]
        self.optimizer.load_state_dict(state["optimizer"])

    @staticmethod
    def from_legacy_critics(critics: dict) -> dict:
        """Its state as a checkpoint written before the methods split stored it (one `critics` dict for all)."""
        return {"head": critics["success"], "target": critics["success_target"], "step": critics["success_step"],
                "optimizer": critics["optimizers"]["success"]}  # fmt: skip
