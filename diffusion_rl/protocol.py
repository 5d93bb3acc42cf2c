"""What a model must expose so that the RL core can train it.

The VLA's action expert, the video-diffusion policy and the video generator all implement `FlowPolicy`.
The core never reaches into a model: it asks for per-sample flow losses (to weight or re-target), per-step
SDE log-probs (for the policy-gradient baselines) and features (for the critics and the success model).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from diffusion_rl.flow import SDEStep


@runtime_checkable
class FlowPolicy(Protocol):
    """A flow-matching model seen from the RL core. `batch` is the model's own mapping of inputs."""

    def flow_loss(
        self,
        batch: Mapping[str, Any],
        *,
        weights: Tensor | None = None,
        targets: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        """Per-sample flow-matching loss, (B,), never reduced.

        weights: (B,) from the credit machinery (HABC, AWR, ...). targets: replacement regression targets, e.g.
        {"x0": AWR's x_0*} or {"velocity": a teacher's velocity (OPSD)}; absent keys keep the plain
        conditional-flow-matching target ε − x_0. The model samples t and ε itself (decoupled, per sample)
        unless the batch carries them ("t", "noise").
        """
        ...

    def sde_log_prob(self, batch: Mapping[str, Any], *, noise_level: float = 0.7) -> SDEStep:
        """One Flow-SDE step's log-prob at the recorded transition.

        batch: "x_t" (B, ...), "t" (B,), "t_next" (B,), "x_next" (B, ...) plus conditioning. Returns
        `flow.sde_step_with_logprob(v_θ(x_t, t), x_t, t, t_next, prev_sample=x_next)`: log_prob (B,), mean and
        σ_t for the KL to a reference.
        """
        ...

    def features(self, batch: Mapping[str, Any]) -> Tensor:
        """A (B, F) feature of the observation (window) for the HABC critic and the success model."""
        ...
