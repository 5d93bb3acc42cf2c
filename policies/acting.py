"""How a chunk-predicting policy acts one step at a time (LeRobot's `select_action` with an action queue)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


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
