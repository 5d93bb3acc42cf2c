"""Episodes in memory as training samples: (observation at t, action chunk t..t+H-1, labels) for the policies
(and, for those that predict futures, where the chunk ends and how the episode ended).

Images stay uint8 and are converted per minibatch. Each step keeps which episode it came from, so per-step
weights from the credit machinery (HABC, AWR) line up with samples by a flat step index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from diffusion_rl.credit import segment_imitation_weights
from diffusion_rl.data import Episode

AUX_KEYS = ("privileged.objects", "privileged.target_pos", "privileged.goal_pos")
# What a grounded encoder's first keypoints are taught to point at, in this order (sim.env.privileged_with_pixels).
WHERE_ROLES = ("target", "goal")


def aux_targets(ep: Episode) -> np.ndarray | None:
    """Privileged positions flattened per step (T, aux_dim), or None if the episode has none (real robots)."""
    if not all(k in ep.privileged for k in AUX_KEYS):
        return None
    return np.concatenate([ep.privileged[k].reshape(len(ep), -1) for k in AUX_KEYS], axis=1).astype(np.float32)


def where_targets(ep: Episode, cameras: Sequence[str]) -> np.ndarray | None:
    """Where the named target and goal are in each camera's image, per step: (T, cameras, roles, 2) in [-1, 1], NaN
    where the episode has no such label (no goal, a real robot) or the point is out of that camera's view; None if
    the episode has no pixel label at all."""
    keys = [[f"privileged.{role}_pixels.{cam}" for role in WHERE_ROLES] for cam in cameras]
    if not any(k in ep.privileged for row in keys for k in row):
        return None
    out = np.full((len(ep), len(cameras), len(WHERE_ROLES), 2), np.nan, np.float32)
    for c, row in enumerate(keys):
        for r, key in enumerate(row):
            if key in ep.privileged:
                xy = ep.privileged[key].reshape(len(ep), 2)
                out[:, c, r] = np.where((np.abs(xy) <= 1).all(-1, keepdims=True), xy, np.nan)
    return out


@dataclass
class StepBuffer:
    """All steps of a list of episodes, flattened: arrays are (N_steps, ...); `episode_start[e]` indexes them."""

    images: dict[str, np.ndarray]
    state: np.ndarray
    action: np.ndarray
    aux: np.ndarray | None
    task: list[str]
    episode_of_step: np.ndarray
    step_in_episode: np.ndarray
    episode_start: np.ndarray
    episode_length: np.ndarray
    # Steps worth imitating (HELP): idle and failure-inducing steps, e.g. the policy's steps just before a human
    # took over in a recorded deployment, are excluded, never made negatives.
    imitable: np.ndarray | None = None
    outcome: np.ndarray | None = None  # per step: its episode's outcome (1 success, 0 failure)
    # per step: Recap's improvement indicator (diffusion_rl.recap), set by the method that labels the steps
    advantage: np.ndarray | None = None
    # per episode: the instructions its steps may be imitated under, one drawn by `rng` at each use (`with_instructions`)
    instruction_choices: list[tuple[str, ...]] | None = None
    rng: np.random.Generator | None = None
    where: np.ndarray | None = None  # per step: `where_targets`, for a locator's cell classification

    def with_instructions(self, choices: Sequence[Sequence[str]], rng: np.random.Generator) -> StepBuffer:
        """This buffer with each episode's steps imitated under one of `choices[episode]`, drawn at each use."""
        if len(choices) != len(self.episode_start) or not all(choices):
            raise ValueError(f"one non-empty list of instructions per episode is needed: {len(self.episode_start)} episodes, "
                             f"{len(choices)} lists ({sum(not c for c in choices)} empty)")  # fmt: skip
        return dataclasses.replace(self, instruction_choices=[tuple(c) for c in choices], rng=rng)

    def imitable_index(self) -> np.ndarray:
        return np.arange(len(self)) if self.imitable is None else np.flatnonzero(self.imitable)

    @classmethod
    def from_episodes(
        cls, episodes: Sequence[Episode], cameras: Sequence[str], image_size: int | None = None
    ) -> StepBuffer:
        """`image_size`: resize camera frames to this square size (a dataset recorded at another size than the env
        renders, e.g. robomimic's 84x84, must match the rollouts a method mixes it with)."""
        if not episodes:
            raise ValueError("no episodes to build a training buffer from")
        lengths = np.array([len(ep) for ep in episodes])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        images = {}
        for cam in cameras:
            key = f"observation.images.{cam}"
            missing = [i for i, ep in enumerate(episodes) if key not in ep.observations]
            if missing:
                raise ValueError(f"episodes {missing[:5]} lack camera {key!r} that the policy reads")
            images[cam] = np.concatenate([ep.observations[key] for ep in episodes])
            if image_size is not None and images[cam].shape[1:3] != (image_size, image_size):
                import cv2

                images[cam] = np.stack([cv2.resize(x, (image_size, image_size), interpolation=cv2.INTER_AREA)
                                        for x in images[cam]])
        aux_parts = [aux_targets(ep) for ep in episodes]
        aux = np.concatenate(aux_parts) if all(a is not None for a in aux_parts) else None
        where_parts = [where_targets(ep, cameras) for ep in episodes]
        where = None
        if any(w is not None for w in where_parts):  # an episode without labels (a recording) teaches no `where`
            blank = (len(cameras), len(WHERE_ROLES), 2)
            where = np.concatenate([np.full((len(ep), *blank), np.nan, np.float32) if w is None else w
                                    for ep, w in zip(episodes, where_parts)])  # fmt: skip
        return cls(
            images=images,
            state=np.concatenate([ep.observations["observation.state"] for ep in episodes]),
            action=np.concatenate([ep.action for ep in episodes]),
            aux=aux,
            task=[ep.task for ep in episodes for _ in range(len(ep))],
            episode_of_step=np.repeat(np.arange(len(episodes)), lengths),
            step_in_episode=np.concatenate([np.arange(n) for n in lengths]),
            episode_start=starts,
            episode_length=lengths,
            outcome=np.repeat(np.array([float(ep.outcome) for ep in episodes], np.float32), lengths),
            imitable=segment_imitation_weights(torch.from_numpy(np.concatenate([ep.segment for ep in episodes]))).numpy() > 0,
            where=where,
        )

    def __len__(self) -> int:
        return len(self.state)

    def batch(self, index: np.ndarray, chunk_size: int, device: torch.device | str = "cpu", *, future: bool = False) -> dict:
        """The samples at flat step indices `index`: observation at t and the chunk a[t : t + chunk_size].

        future: also the observation where the chunk ends, t + chunk_size clamped to the episode's last step
        (future.images.<camera>, future.state), the episode's outcome and the steps from there to the episode's end
        (steps_to_end): what a policy that predicts futures and values trains on (`reads_future`)."""
        ep = self.episode_of_step[index]
        t = self.step_in_episode[index]
        offsets = np.arange(chunk_size)
        steps = t[:, None] + offsets[None]
        is_pad = steps >= self.episode_length[ep][:, None]
        last = self.episode_length[ep][:, None] - 1
        flat = self.episode_start[ep][:, None] + np.minimum(steps, last)
        out = {
            f"observation.images.{cam}": torch.from_numpy(images[index]).to(device) for cam, images in self.images.items()
        }
        out["observation.state"] = torch.from_numpy(self.state[index]).to(device)
        if self.instruction_choices is not None:
            out["task"] = [self.instruction_choices[e][self.rng.integers(len(self.instruction_choices[e]))] for e in ep]
        else:
            out["task"] = [self.task[i] for i in index]
        out["action"] = torch.from_numpy(self.action[flat]).to(device)
        out["action_is_pad"] = torch.from_numpy(is_pad).to(device)
        if self.aux is not None:
            out["aux_target"] = torch.from_numpy(self.aux[index]).to(device)
        if self.where is not None:
            out["where_target"] = torch.from_numpy(self.where[index]).to(device)
        if self.advantage is not None:
            out["advantage_indicator"] = torch.from_numpy(self.advantage[index].astype(np.int64)).to(device)
        if future:
            end = np.minimum(t + chunk_size, last[:, 0])
            at = self.episode_start[ep] + end
            for cam, images in self.images.items():
                out[f"future.images.{cam}"] = torch.from_numpy(images[at]).to(device)
            out["future.state"] = torch.from_numpy(self.state[at]).to(device)
            out["steps_to_end"] = torch.from_numpy((last[:, 0] - end).astype(np.float32)).to(device)
            outcome = self.outcome[index] if self.outcome is not None else np.ones(len(index), np.float32)
            out["outcome"] = torch.from_numpy(outcome).to(device)
        return out

    def stats(self) -> dict[str, dict[str, np.ndarray]]:
        out = {"observation.state": {"mean": self.state.mean(0), "std": self.state.std(0)},
               "action": {"mean": self.action.mean(0), "std": self.action.std(0)}}  # fmt: skip
        if self.aux is not None:
            out["aux"] = {"mean": self.aux.mean(0), "std": self.aux.std(0)}
        if self.where is not None:  # each camera's pixel labels (roles, 2), over the steps where they are in view
            for c, cam in enumerate(self.images):
                labels = self.where[:, c]
                if np.isfinite(labels).all(-1).any(0).all():
                    out[f"where_target.{cam}"] = {"mean": np.nanmean(labels, 0), "std": np.nanstd(labels, 0)}
        return out
