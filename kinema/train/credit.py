"""Per-step actor weights for each RL method, computed through the RL core (`diffusion_rl`).

Each function takes the replay episodes and their per-step policy features and returns one weight per step
(a list of (T,) arrays, aligned with the episodes) plus diagnostics. The actor then samples replay steps in
proportion to these weights (equivalent in expectation to the weighted flow loss, with less variance).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import copy

import numpy as np
import torch
from torch import Tensor, nn

from diffusion_rl.batching import collate_episodes
from diffusion_rl.data import Episode, ExecutedBy
from diffusion_rl.advantages import grpo_advantages
from diffusion_rl.flow import exp_advantage_weights, nft_weight
from diffusion_rl.habc import HABCConfig, HABCCritic, habc_step
from diffusion_rl.success_model import (
    SuccessHead,
    brier_score,
    expected_calibration_error,
    make_target,
    soft_update_,
    success_model_update,
)


def pad_features(features: Sequence[Tensor], t_max: int) -> Tensor:
    """List of (T_i, F) -> (N, t_max, F), zero-padded."""
    out = torch.zeros(len(features), t_max, features[0].shape[-1])
    for i, f in enumerate(features):
        out[i, : len(f)] = f
    return out


def seeded(seed: int, build):
    """`build()` with the torch generator seeded to `seed`, leaving the global generator as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


@dataclass
class CriticState:
    """Critics that persist across rounds (and checkpoints)."""

    feature_dim: int
    critic_lr: float = 3e-4
    value_scale: float = 1.0
    seed: int = 0
    habc: HABCCritic = field(init=False)
    value: nn.Module = field(init=False)
    success: SuccessHead = field(init=False)

    def __post_init__(self) -> None:
        # Each critic draws its initial weights from its own seed, not from the global stream: which critics a
        # method builds then does not change the policy's own random draws.
        # value_scale 1 for TD: a larger scale multiplies the TD step in value space and diverged in practice.
        self.habc = seeded(self.seed + 1, lambda: HABCCritic(self.feature_dim, hidden_dim=256, num_layers=2, value_scale=self.value_scale))
        self.habc_target = copy.deepcopy(self.habc).requires_grad_(False)
        self.value = seeded(self.seed + 2, lambda: nn.Sequential(nn.Linear(self.feature_dim, 256), nn.SiLU(), nn.Linear(256, 1)))
        self.success = seeded(self.seed + 3, lambda: SuccessHead(self.feature_dim, hidden_dim=256, num_layers=2))
        self.success_target = make_target(self.success)
        self.success_step = 0
        self.optimizers = {
            "habc": torch.optim.Adam(self.habc.parameters(), lr=self.critic_lr),
            "value": torch.optim.Adam(self.value.parameters(), lr=1e-3),
            "success": torch.optim.Adam(self.success.parameters(), lr=1e-3),
        }

    def state_dict(self) -> dict:
        return {
            "habc": self.habc.state_dict(),
            "habc_target": self.habc_target.state_dict(),
            "value": self.value.state_dict(),
            "success": self.success.state_dict(),
            "success_target": self.success_target.state_dict(),
            "success_step": self.success_step,
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.habc.load_state_dict(state["habc"])
        self.habc_target.load_state_dict(state["habc_target"])
        self.value.load_state_dict(state["value"])
        self.success.load_state_dict(state["success"])
        self.success_target.load_state_dict(state["success_target"])
        self.success_step = state["success_step"]
        for k, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][k])


def habc_step_weights(
    critics: CriticState,
    episodes: Sequence[Episode],
    features: Sequence[Tensor],
    *,
    config: HABCConfig,
    critic_steps: int,
    actor_step: int,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """Train HABC's viability and efficiency heads on the replay, then return its per-step actor weights."""
    batch = collate_episodes(episodes, intervention_aware=config.intervention_credit)
    feats = pad_features(features, batch.max_len)
    opt = critics.optimizers["habc"]
    for i in range(critic_steps):
        result = habc_step(critics.habc, feats, batch, step=actor_step, config=config, target=critics.habc_target)
        opt.zero_grad()
        result.critic_loss.backward()
        opt.step()
        soft_update_(critics.habc_target, critics.habc, tau=0.05)
    with torch.no_grad():
        result = habc_step(critics.habc, feats, batch, step=actor_step, config=config)
    weights = result.weights.clamp(min=0).numpy()
    diag = {f"habc/{k}": float(v) for k, v in result.diagnostics.items() if torch.as_tensor(v).numel() == 1}
    diag["habc/critic_loss"] = float(result.critic_loss)
    return [weights[i, : len(ep)] for i, ep in enumerate(episodes)], diag


def awr_step_weights(
    critics: CriticState,
    episodes: Sequence[Episode],
    features: Sequence[Tensor],
    *,
    temperature: float,
    critic_steps: int,
    gamma: float = 0.99,
) -> tuple[list[np.ndarray], dict[str, float]]:
    """Single-critic AWR: V(s) regressed on the discounted sparse return, w = exp((G − V) / τ), clipped."""
    returns = [
        (gamma ** np.arange(len(ep))[::-1] * float(ep.outcome)).astype(np.float32) for ep in episodes
    ]
    x = torch.cat(list(features))
    y = torch.from_numpy(np.concatenate(returns))
    opt = critics.optimizers["value"]
    for _ in range(critic_steps):
        loss = (critics.value(x).squeeze(-1) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        adv = y - critics.value(x).squeeze(-1)
        w = exp_advantage_weights(adv, temperature=temperature, normalize=True)
    out, start = [], 0
    for ep in episodes:
        out.append(w[start : start + len(ep)].numpy())
        start += len(ep)
    return out, {"awr/value_loss": float(loss.detach()), "awr/adv_std": float(adv.std())}


def nft_step_weights(episodes: Sequence[Episode], *, adv_clip_max: float) -> tuple[list[np.ndarray], list[np.ndarray], dict[str, float]]:
    """DiffusionNFT's credit for one round of rollouts: each episode's outcome advantage within the round (one GRPO
    group: the rollouts have distinct seeds), mapped to NFT's positive-branch weight r = clip(A / A_max)/2 + ½ for
    every step of the episode, and sampling weights 1 / length so that each episode weighs the same (failures run
    to the horizon, 2-5x longer than successes: drawn per step, most of the objective would be failures').

    Returns (r per step, sampling weight per step, diagnostics), both aligned with the episodes.
    """
    rewards = torch.tensor([float(ep.outcome) for ep in episodes])
    adv = grpo_advantages(rewards, torch.zeros(len(episodes), dtype=torch.long), degenerate="keep").advantages
    r = nft_weight(adv, adv_clip_max=adv_clip_max).numpy()
    per_step_r = [np.full(len(ep), r[i], dtype=np.float32) for i, ep in enumerate(episodes)]
    sampling = [np.full(len(ep), 1.0 / len(ep), dtype=np.float64) for ep in episodes]
    return per_step_r, sampling, {"nft/r_success": float(r[rewards > 0].mean()) if (rewards > 0).any() else float("nan"),
                                  "nft/r_failure": float(r[rewards == 0].mean()) if (rewards == 0).any() else float("nan")}


def refit_success_model(
    critics: CriticState, episodes: Sequence[Episode], features: Sequence[Tensor], *, steps: int = 200, target: str = "td"
) -> dict[str, float]:
    """RLER: score the new rollouts with the current model (calibration), then refit it on them (eVTA_0's TD
    targets, or with target="mc" each step's outcome: `rl.success_target`).

    `success_model/brier` beside `brier_base_rate` (the Brier score of always guessing the rollouts' own success rate)
    says whether the model knows more than the base rate. Measured on push and pick_place (2026-11-30): it did not
    (0.18–0.22 against 0.13–0.19): fitted for 200 steps on one round's 48 rollouts, the TD head memorised them
    (loss 0.001) while its bootstrapped targets had barely propagated from the terminal steps. HABC's weights do not
    use it; the video generator's success reward trains its own on far more labelled clips.
    """
    autonomous = [i for i, ep in enumerate(episodes) if not (ep.executed_by == ExecutedBy.HUMAN).any()]
    if not autonomous:
        return {}
    x = torch.cat([features[i] for i in autonomous])
    x_next = torch.cat([torch.cat([features[i][1:], features[i][-1:]]) for i in autonomous])
    terminal = torch.cat([torch.arange(len(episodes[i])) == len(episodes[i]) - 1 for i in autonomous])
    outcome = torch.cat([torch.full((len(episodes[i]),), float(episodes[i].outcome)) for i in autonomous])
    with torch.no_grad():
        p = torch.sigmoid(critics.success(x))
    y = outcome[terminal]
    base_rate_brier = float(y.mean() * (1 - y.mean()))  # the best constant guess, in hindsight
    metrics = {
        "success_model/brier": float(brier_score(p[terminal], y)),
        "success_model/brier_base_rate": base_rate_brier,
        "success_model/ece": float(expected_calibration_error(p, outcome)),
    }
    batch = {"x": x, "x_next": x_next, "outcome": outcome, "terminal": terminal}
    for _ in range(steps):
        stats = success_model_update(
            critics.success, critics.success_target, critics.optimizers["success"], batch, step=critics.success_step,
            target=target,
        )
        critics.success_step += 1
    metrics["success_model/loss"] = stats["loss"]
    return metrics
