"""The video-reward interface: input checks, the `VideoReward` base class, output checks."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def check_videos(videos: Tensor, prompts: Sequence[str], *, min_frames: int = 1) -> None:
    """Raise a ValueError naming what is wrong unless videos is (B, F, 3, H, W) float in [0, 1] with B prompts."""
    if not isinstance(videos, Tensor):
        raise TypeError(f"videos must be a torch.Tensor (B, F, C, H, W); got {type(videos).__name__}")
    if videos.ndim != 5 or videos.shape[2] != 3:
        raise ValueError(f"videos must have shape (B, F, 3, H, W); got {tuple(videos.shape)}")
    if not videos.is_floating_point():
        raise ValueError(f"videos must be float in [0, 1]; got dtype {videos.dtype} (divide uint8 frames by 255)")
    if videos.shape[1] < min_frames:
        raise ValueError(f"this reward needs at least {min_frames} frames per video; got {videos.shape[1]}")
    if videos.numel():
        lo, hi = float(videos.detach().amin()), float(videos.detach().amax())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError("videos contain NaN or inf")
        if lo < -1e-3 or hi > 1 + 1e-3:
            raise ValueError(
                f"videos must be in [0, 1]; got values in [{lo:.3f}, {hi:.3f}] "
                "(a VAE decodes to [-1, 1]: pass (x + 1) / 2)"
            )
    if isinstance(prompts, str) or len(prompts) != videos.shape[0]:
        got = "a single string" if isinstance(prompts, str) else f"{len(prompts)} prompts"
        raise ValueError(f"prompts must be a list of {videos.shape[0]} strings, one per video; got {got}")


class VideoReward:
    """Base class of video rewards: `reward(videos, prompts) -> {name: scores (B,)}`, higher is better.

    Subclasses set `names` (the keys they return) and `differentiable`, and implement `score`. `__call__`
    validates the inputs and the outputs, so a user reward that returns the wrong shape fails with its name.
    """

    names: tuple[str, ...] = ()
    differentiable: bool = False
    min_frames: int = 1

    def score(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        raise NotImplementedError

    def __call__(self, videos: Tensor, prompts: Sequence[str]) -> dict[str, Tensor]:
        check_videos(videos, prompts, min_frames=self.min_frames)
        out = self.score(videos, list(prompts))
        check_scores(type(self).__name__, out, self.names, videos.shape[0])
        return out

    def to(self, device: torch.device | str) -> VideoReward:
        """Move any model the reward holds (no-op for model-free rewards)."""
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}(names={self.names}, differentiable={self.differentiable})"


def check_scores(owner: str, scores: Any, names: Sequence[str], batch: int) -> None:
    if not isinstance(scores, Mapping):
        raise TypeError(f"reward {owner} must return dict[str, Tensor]; got {type(scores).__name__}")
    if set(scores) != set(names):
        raise ValueError(f"reward {owner} declares names {list(names)} but returned {sorted(scores)}")
    for name, value in scores.items():
        if not isinstance(value, Tensor) or value.shape != (batch,):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"reward {owner}: score {name!r} must be a tensor of shape ({batch},); got {shape}")


def luminance(videos: Tensor) -> Tensor:
    """Rec. 601 luma of (..., 3, H, W) RGB in [0, 1] -> (..., H, W)."""
    r, g, b = videos.unbind(-3)
    return 0.299 * r + 0.587 * g + 0.114 * b
