"""What every kinema policy does alike: read camera frames from a batch (`camera_images`) and act one step at a time
from predicted chunks (`ChunkedActing`, LeRobot's `select_action` with an action queue)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def camera_images(batch: Mapping[str, Any], key: str, size: int, device: torch.device, cameras: Any) -> Tensor:
    """`batch[key]` as float (B, 3, size, size) in [0, 1]: uint8 HWC frames converted, other sizes resized."""
    if key not in batch:
        raise KeyError(f"batch lacks {key!r}; this policy reads cameras {list(cameras)}")
    img = torch.as_tensor(batch[key], device=device)
    if img.dtype == torch.uint8:
        img = img.permute(0, 3, 1, 2).float() / 255.0 if img.shape[-1] == 3 else img.float() / 255.0
    img = img.float()
    if img.shape[-1] != size or img.shape[-2] != size:
        img = F.interpolate(img, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return img


class ChunkedActing:
    """What every kinema policy is, to a trainer and to the commands that run it, written down once.

    Every policy type has: `config` (with `chunk_size`, `n_action_steps`, `action_dim`, `image_size`, `cameras`,
    `hidden_dim`), `predict_action_chunk(batch, *, noise=None) -> (B, chunk_size, action_dim)`, `features(batch)`,
    the RL core's `FlowPolicy` (`flow_loss`, `sde_log_prob`), `save_pretrained` / `from_pretrained`; and from this
    class `select_action`/`reset`: one env's next action, a new chunk every `n_action_steps` steps.

    What only some types can do is declared by the class attributes below (False here); a type that sets one
    implements what it names. Trainers and commands ask these, never `hasattr`.
    """

    # Its sampler starts from Gaussian noise that a runner may scale (`config.inference_noise_scale`, the scale the
    # policy draws at by itself): the VLA's flow. A policy that samples latents of its own (the video policy) does not.
    scales_initial_noise: bool = False
    # `plan(batch, *, candidates=None, noise=None) -> {"chunks", "values", "best", ...}`: sampled chunks with their
    # predicted values, so it can act best-of-N by its own value (`config.planning_candidates`).
    plans: bool = False
    # `predicted_future_images() -> {camera: (B, 3, H, W)}`: the frames its last chunk predicted.
    predicts_frames: bool = False
    # `experience_loss(batch, *, context=None) -> (B,)`: modes trained on every replay step (`config.experience_fraction`).
    learns_from_experience: bool = False

    _queue: deque[np.ndarray]

    def context_features(self, context: Any) -> Tensor:
        """The critics' features (`features(batch)`) of a context from `encode(batch)[0]`, what `predict_action_chunk`
        and `flow_loss` take as `context=`: a runner that needs both encodes once. The VLA's context is its features."""
        return context

    def reset(self) -> None:
        self._queue.clear()

    @torch.no_grad()
    def select_action(self, observation: Mapping[str, Any]) -> np.ndarray:
        """One env's next action (action_dim,)."""
        if not self._queue:
            batch = {k: (v[None] if isinstance(v, np.ndarray) else [v]) for k, v in observation.items()}
            was_training = self.training
            self.eval()
            chunk = self.predict_action_chunk(batch)[0].cpu().numpy()
            self.train(was_training)
            self._queue.extend(chunk[: self.config.n_action_steps])
        return self._queue.popleft()
