"""`rl.method residual`: residual RL on a frozen VLA (ResiP, Ankile et al. 2024; Policy Decorator, Yuan et al. 2024):
a small Gaussian actor adds a bounded correction to the executed steps of the VLA's chunk, trained by SAC.

The VLA proposes its chunk (from the initial noise the evaluations use, `eval.noise_scale`; at 0 its deterministic
chunk); the actor reads the VLA's
features and the chunk's executed steps and outputs z ∈ [−1, 1] per executed step and action dimension; the arm
executes base + `scale` · z, clipped to the action range. Unlike `dsrl`, whose actor can only choose among the chunks
the sampler can produce, the correction leaves the demonstrations' support: it can move faster than the demonstrator,
or correct a systematic miss. Each executed chunk is one transition (the sparse outcome reward, discounted within the
chunk, as `dsrl`'s), kept for the whole run; each round runs `sac_steps` SAC updates. The VLA's weights never change;
evaluations and `kinema eval` act with the actor's mean correction (saved in the checkpoint's `method.pt`).

Our choices: the correction's bound `scale` (ResiP bounds the residual by scaling its output; Policy Decorator by a
bound α on the residual, 0.1–0.3 of the action range in its tasks); SAC as in `dsrl` (entropy out of the critics'
target, target entropy −dim z); the actor reads the VLA's fused features, not an encoder of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from diffusion_rl.dsrl import LOG_STD_RANGE
from kinema.train.evaluate import Acting, ResidualChunkPolicy
from kinema.train.methods.dsrl import DSRL, SACOptions, saved_actor


@dataclass
class ResidualOptions(SACOptions):
    key: ClassVar[str] = "residual"
    scale: float = 0.1  # the correction's bound per action dimension, in action units (actions lie in [−1, 1])
    # the VLA's initial noise under the correction, in rollouts and evaluations (None: eval.noise_scale's, so that
    # the arm is evaluated as the others are; 0: the VLA's deterministic chunk)
    base_noise_scale: float | None = None
    init_std: float = 1.0  # the actor's Gaussian std before tanh at the start (ours below 1: rollouts stay nearer the VLA)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.scale <= 2:
            raise ValueError(f"rl.residual.scale is the correction's bound in action units, in (0, 2]; got {self.scale}")
        low, high = (math.exp(x) for x in LOG_STD_RANGE)
        if not low < self.init_std < high:
            raise ValueError(f"rl.residual.init_std must lie in the actor's std range ({low:.4f}, {high:.2f}); got {self.init_std}")
        if self.base_noise_scale is not None and self.base_noise_scale < 0:
            raise ValueError(f"rl.residual.base_noise_scale must be >= 0; got {self.base_noise_scale}")


class Residual(DSRL):
    name = "residual"
    policy_types = ("vla", "smolvla", "pi0")  # a separate action expert (SmolVLA's and pi0's: a transformer of its own)
    summary = "residual RL: SAC on a bounded correction to the frozen VLA's executed steps (ResiP, Policy Decorator)"
    options_key = "residual"
    options_class = ResidualOptions
    rollout_noise = " acts on the VLA's chunk from rl.residual.base_noise_scale's noise"

    def __init__(self, learner) -> None:
        super().__init__(learner)
        with torch.no_grad():  # the correction starts at mean 0 and std init_std: the VLA's actions, plus exploration
            last = self.agent.actor.net[-1]
            last.weight.zero_()
            last.bias[: self.noise_dim].zero_()
            last.bias[self.noise_dim :].fill_(math.log(self.options.init_std))

    @property
    def bound(self) -> float:
        return 1.0  # z ∈ [−1, 1]; the runner scales it by `scale`

    @property
    def base_noise_scale(self) -> float:
        o = self.options
        return self.cfg.eval.noise_scale if o.base_noise_scale is None else o.base_noise_scale

    def action_space(self, pc) -> tuple[int, int]:
        """(z's size: the executed steps × action_dim; the input: the features and the base's executed steps). z is
        what DSRL's code calls the noise: the actor's output, stored in the transitions as `noise`."""
        executed = pc.n_action_steps * pc.action_dim
        return executed, pc.hidden_dim + executed

    def decision_input(self, features: torch.Tensor, record: dict | None) -> torch.Tensor:
        base = record["base"] if record is not None else torch.zeros(self.noise_dim)
        return torch.cat([features, base.to(features)])

    def _runner(self, policy: Any, *, deterministic: bool, record: bool = False) -> ResidualChunkPolicy:
        o = self.options
        return ResidualChunkPolicy(policy, self.agent.actor, scale=o.scale, base_noise_scale=self.base_noise_scale,
                                   deterministic=deterministic, record=record)  # fmt: skip

    def rollout_plan(self, first_seed: int):
        return list(range(first_seed, first_seed + self.cfg.rl.episodes_per_round)), self._runner(self.learner.acting, deterministic=False, record=True)

    def eval_runner(self, policy: Any) -> ResidualChunkPolicy:
        return self._runner(policy, deterministic=True)

    def _shape(self) -> dict:
        return {**super()._shape(), "scale": self.options.scale, "base_noise_scale": self.base_noise_scale}

    @classmethod
    def checkpoint_noise_scale(cls, policy: Any, state: dict[str, Any] | None) -> float:
        return state["shape"]["base_noise_scale"]  # the base's noise the correction was trained on

    @classmethod
    def acting(cls, policy: Any, state: dict[str, Any] | None, *, noise_scale: float) -> Acting:
        """The VLA's chunk from initial noise scaled by `noise_scale` plus the mean correction of the actor the
        checkpoint saved."""
        if state is None:
            raise ValueError("a residual checkpoint acts with the correction actor in its method.pt, which this checkpoint lacks")
        actor, bound = saved_actor(state, input_dim=state["shape"]["input_dim"]), state["shape"]["scale"]
        return Acting(lambda: ResidualChunkPolicy(policy, actor, scale=bound, base_noise_scale=noise_scale),
                      f"the VLA's chunk (initial noise scaled by {noise_scale:g}) plus the checkpoint's residual correction (bound ±{bound:g})")  # fmt: skip
