"""Exposure and sharpness: per-frame image statistics in torch, so their gradients reach the pixels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from policies.video.rewards.base import VideoReward, luminance


class ExposureReward(VideoReward):
    """−mean_f |mean luminance of frame f − target| − clip_weight · (fraction of clipped pixels).

    The distance is taken per frame, so alternating dark and bright frames cannot average out to the target.
    The clipped fraction is a sigmoid-soft count of pixels below `clip_low` or above `clip_high` (temperature
    `softness`), so it has a gradient. Scores lie in [−1 − clip_weight, 0]; 0 is a well exposed video.
    """

    names = ("exposure",)
    differentiable = True

    def __init__(self, target: float = 0.5, *, clip_low: float = 0.02, clip_high: float = 0.98, clip_weight: float = 1.0, softness: float = 0.01):
        if not 0.0 < target < 1.0:
            raise ValueError(f"exposure target must be in (0, 1); got {target}")
        if not 0.0 <= clip_low < clip_high <= 1.0:
            raise ValueError(f"exposure needs 0 <= clip_low < clip_high <= 1; got clip_low={clip_low}, clip_high={clip_high}")
        if clip_weight < 0 or softness <= 0:
            raise ValueError(f"exposure needs clip_weight >= 0 and softness > 0; got {clip_weight}, {softness}")
        self.target, self.clip_low, self.clip_high = target, clip_low, clip_high
        self.clip_weight, self.softness = clip_weight, softness

    def score(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        y = luminance(videos)  # (B, F, H, W)
        level = (y.mean(dim=(-2, -1)) - self.target).abs().mean(dim=1)
        clipped = torch.sigmoid((y - self.clip_high) / self.softness) + torch.sigmoid((self.clip_low - y) / self.softness)
        return {"exposure": -level - self.clip_weight * clipped.mean(dim=(1, 2, 3))}


class SharpnessReward(VideoReward):
    """Variance of the 3×3 Laplacian of the luminance, per frame, averaged over frames (luma in [0, 1] units).

    Alone it invites noise (noise has the largest Laplacian variance): balance it with `temporal_consistency`.
    `scale` multiplies the variance (the default brings natural frames to order 1).
    """

    names = ("sharpness",)
    differentiable = True

    def __init__(self, *, scale: float = 100.0):
        if scale <= 0:
            raise ValueError(f"sharpness scale must be > 0; got {scale}")
        self.scale = scale

    def score(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        B, Fr, _, H, W = videos.shape
        if H < 3 or W < 3:
            raise ValueError(f"sharpness needs frames of at least 3x3 pixels; got {H}x{W}")
        y = luminance(videos).reshape(B * Fr, 1, H, W)
        kernel = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]], dtype=y.dtype, device=y.device)
        lap = F.conv2d(y, kernel[None, None])  # valid: no border artefacts from padding
        var = lap.flatten(1).var(dim=1, correction=0).reshape(B, Fr).mean(dim=1)
        return {"sharpness": self.scale * var}
