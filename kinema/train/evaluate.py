"""Evaluate a policy in simulation: success rate with its standard error, steps-to-success, takeover rate."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from diffusion_rl.data import Episode, ExecutedBy
from sim.rollout import collect, make_vector

EVAL_SEED_OFFSET = 1_000_000  # evaluation seeds never overlap training/demo seeds


class ChunkPolicy:
    """Adapts a VLA (or anything with `predict_action_chunk`) to sim.rollout's batched policy interface.

    With `sde_noise`, chunks are sampled with Flow-SDE steps and every chunk an env executes is recorded with its
    observation and per-step log-probs: `chunk_records()`, what the Flow-SDE PPO/GRPO baseline needs.
    """

    def __init__(self, policy: Any, *, n_action_steps: int | None = None, sde_noise: float | None = None) -> None:
        self.policy = policy
        self.n_action_steps = n_action_steps or policy.config.n_action_steps
        self.sde_noise = sde_noise
        self.records: dict[tuple[int, int], dict[str, Any]] = {}  # by (episode start-order number, step)
        self.finished: list[int] = []  # start-order numbers, in the order `collect` returns the episodes
        self._last: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None

    @torch.no_grad()
    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        was_training = self.policy.training
        self.policy.eval()
        batch = {k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for k, v in obs.items()}
        if self.sde_noise is None:
            chunk = self.policy.predict_action_chunk(batch)
        else:
            chunk, record = self.policy.sample_chunk_sde(batch, noise_level=self.sde_noise)
            self._last = ({k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in batch.items()}, record)
        self.policy.train(was_training)
        return chunk[:, : self.n_action_steps].cpu().numpy()

    def episode_finished(self, episode: int) -> None:
        self.finished.append(episode)

    def chunk_records(self) -> dict[tuple[int, int], dict[str, Any]]:
        """The executed chunks' records keyed by (index of the episode in the list `collect` returned, env step at
        which the chunk was computed), in the order the chunks were taken; empty without `sde_noise`."""
        index = {serial: i for i, serial in enumerate(self.finished)}
        return {(index[serial], step): rec for (serial, step), rec in self.records.items() if serial in index}

    def chunk_taken(self, env_index: int, episode: int, step: int) -> None:
        if self._last is None:
            return
        batch, record = self._last
        obs = {k: v[env_index] for k, v in batch.items()}
        self.records[(episode, step)] = {"obs": obs, **{k: (v[env_index] if v.ndim > 1 else v) for k, v in record.items()}}


@dataclass
class EvalResult:
    split: str
    episodes: int
    success: float
    success_se: float
    steps_to_success: float | None
    takeover_rate: float | None

    def as_dict(self, prefix: str = "") -> dict[str, float | None]:
        return {
            f"{prefix}success": self.success,
            f"{prefix}success_se": self.success_se,
            f"{prefix}steps_to_success": self.steps_to_success,
            f"{prefix}takeover_rate": self.takeover_rate,
            f"{prefix}episodes": self.episodes,
        }


def summarize(episodes: Sequence[Episode], split: str = "train") -> EvalResult:
    n = len(episodes)
    outcomes = np.array([ep.outcome for ep in episodes], float)
    p = float(outcomes.mean()) if n else 0.0
    steps = [ep.steps_to_success for ep in episodes if ep.outcome and ep.steps_to_success]
    takeovers = [sum(1 for _, _, who in ep.segments() if who == ExecutedBy.HUMAN) for ep in episodes]
    any_policy = any((ep.executed_by == ExecutedBy.POLICY).any() for ep in episodes)
    return EvalResult(
        split=split,
        episodes=n,
        success=p,
        success_se=math.sqrt(p * (1 - p) / n) if n else float("nan"),
        steps_to_success=float(np.mean(steps)) if steps else None,
        takeover_rate=float(np.mean(takeovers)) if any_policy and any(takeovers) else (0.0 if any_policy else None),
    )


# Evaluation splits: which instruction templates and object combinations the held-out seeds use.
SPLITS = {
    "train": dict(instructions="train", objects="train"),
    "heldout_instructions": dict(instructions="heldout", objects="train"),
    "heldout_objects": dict(instructions="train", objects="heldout"),
}


def evaluate(
    policy: Any,
    task: str,
    *,
    episodes: int,
    split: str = "train",
    num_envs: int = 8,
    num_workers: int = 0,
    image_size: int = 64,
    task_config: dict | None = None,
    seed: int = 0,
    on_episode: Callable[[Episode], None] | None = None,
) -> tuple[EvalResult, list[Episode]]:
    """Roll the policy out on held-out seeds. `split`: "train" (training templates and objects),
    "heldout_instructions" (paraphrases) or "heldout_objects" (held-out object/colour combinations)."""
    if split not in SPLITS:
        raise ValueError(f"unknown evaluation split {split!r}; valid: {sorted(SPLITS)}")
    num_envs = max(1, min(num_envs, episodes))
    vector = make_vector(
        task, num_envs, num_workers=min(num_workers, num_envs), image_size=image_size, config=task_config, **SPLITS[split]
    )
    try:
        seeds = range(EVAL_SEED_OFFSET + seed, EVAL_SEED_OFFSET + seed + episodes)
        eps = collect(vector, ChunkPolicy(policy), seeds, task_id=task, policy_version="eval", record_privileged=False, on_episode=on_episode)
    finally:
        vector.close()
    return summarize(eps, split), eps
