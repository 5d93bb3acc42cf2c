"""Motion magnitude and temporal consistency from OpenCV Farnebäck optical flow (not differentiable)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import cv2
import numpy as np
import torch
from torch import Tensor

from policies.video.rewards.base import VideoReward


def _standardised_grey(frame: np.ndarray) -> np.ndarray:
    """(H, W) luma in [0, 1] -> uint8 with its mean and contrast fixed, so global brightness/tint changes vanish."""
    sd = float(frame.std())
    if sd < 1e-3:  # a uniform frame has no structure to track
        return np.full(frame.shape, 128, np.uint8)
    return np.clip((frame - frame.mean()) / sd * 40.0 + 128.0, 0, 255).astype(np.uint8)


class OpticalFlowReward(VideoReward):
    """Motion magnitude and temporal consistency from Farnebäck optical flow between consecutive frames.

    - `motion`: mean flow magnitude in pixels per frame. `region="moving"` averages over pixels whose flow
      exceeds `min_flow` (a translating object scores its speed, whatever its size; a static video scores 0);
      `region="all"` averages over every pixel (then a small object moving fast scores low).
    - `temporal_consistency`: −mean |frame_t − frame_{t+1} warped back by the flow| over RGB and in-bounds pixels
      (values in [−1, 0]; 0 is perfectly consistent). Flicker, popping and noise raise the warping error.

    The flow is estimated on per-frame standardised grey levels (a tint or a flicker moves nothing), while the
    warping error is measured on the raw RGB frames (so flicker is caught). Not differentiable: scores are
    computed on detached CPU copies with OpenCV. `outputs` selects which scores to return.
    """

    differentiable = False
    min_frames = 2
    OUTPUTS = ("motion", "temporal_consistency")

    def __init__(
        self,
        outputs: Sequence[str] = OUTPUTS,
        *,
        region: Literal["moving", "all"] = "moving",
        min_flow: float = 0.25,
        pyr_scale: float = 0.5,
        levels: int = 3,
        winsize: int = 9,
        iterations: int = 3,
        poly_n: int = 5,
        poly_sigma: float = 1.1,
    ):
        outputs = tuple(outputs)
        bad = [o for o in outputs if o not in self.OUTPUTS]
        if bad or not outputs:
            raise ValueError(f"optical-flow reward outputs must be a non-empty subset of {list(self.OUTPUTS)}; got {list(outputs)}")
        if region not in ("moving", "all"):
            raise ValueError(f"motion region must be 'moving' or 'all'; got {region!r}")
        if min_flow < 0:
            raise ValueError(f"min_flow must be >= 0 (pixels per frame); got {min_flow}")
        self.names = outputs
        self.region, self.min_flow = region, min_flow
        self.farneback = (pyr_scale, levels, winsize, iterations, poly_n, poly_sigma, 0)

    def flow(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """Flow (H, W, 2) such that prev(y, x) ≈ next(y + fy, x + fx), from luma frames (H, W) in [0, 1]."""
        return cv2.calcOpticalFlowFarneback(_standardised_grey(prev), _standardised_grey(nxt), None, *self.farneback)

    def video_scores(self, video: np.ndarray) -> tuple[float, float]:
        """(motion, warping error) of one video (F, 3, H, W) float32 in [0, 1]."""
        frames = np.ascontiguousarray(video.transpose(0, 2, 3, 1))  # (F, H, W, 3)
        luma = frames @ np.array([0.299, 0.587, 0.114], np.float32)
        H, W = luma.shape[1:]
        gy, gx = np.mgrid[0:H, 0:W].astype(np.float32)
        motion, error = [], []
        for t in range(len(frames) - 1):
            flow = self.flow(luma[t], luma[t + 1])
            mag = np.linalg.norm(flow, axis=-1)
            if self.region == "all":
                motion.append(float(mag.mean()))
            else:
                moving = mag > self.min_flow
                motion.append(float(mag[moving].mean()) if moving.any() else 0.0)
            mx, my = gx + flow[..., 0], gy + flow[..., 1]
            warped = cv2.remap(frames[t + 1], mx, my, cv2.INTER_LINEAR, borderMode=cv2.BORDER_REPLICATE)
            inside = (mx >= 0) & (mx <= W - 1) & (my >= 0) & (my <= H - 1)  # pixels that left the frame have no match
            diff = np.abs(warped - frames[t]).mean(axis=-1)
            error.append(float(diff[inside].mean()) if inside.any() else 0.0)
        return float(np.mean(motion)), float(np.mean(error))

    def score(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        arr = videos.detach().float().cpu().numpy()
        per_video = np.array([self.video_scores(v) for v in arr], np.float32).reshape(-1, 2)
        out = {"motion": per_video[:, 0], "temporal_consistency": -per_video[:, 1]}
        return {k: torch.as_tensor(out[k], device=videos.device) for k in self.names}
