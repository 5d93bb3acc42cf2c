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
    """`select_action`/`reset` for a policy with `predict_action_chunk` and `config.n_action_steps`: one env's next
    action, a new chunk planned every `n_action_steps` steps and the rest of the old one dropped."""

    _queue: deque[np.ndarray]

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
