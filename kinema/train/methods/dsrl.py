"""`rl.method dsrl`: diffusion steering (DSRL, Wagenmaker et al. 2025): SAC in the flow sampler's initial-noise space,
the VLA frozen.

A small Gaussian actor (`diffusion_rl.dsrl`) maps the observation's features to the noise the VLA's ODE sampler
starts from; rollouts act with it (sampled, its ε the per-episode noise), and every executed chunk becomes a
transition (features, noise, the chunk's discounted sparse reward, features at the next decision) kept for the whole
run (off-policy). Each round: `sac_steps` SAC updates of the twin critics, the actor and the temperature. The
VLA's weights do not change (unless `distill`); evaluations and `kinema eval` act with the actor's mean noise (the
actor is saved in the checkpoint's `method.pt`).

Our choices: the critics and the actor read the frozen VLA's fused features (DSRL may train its own encoder);
noise is tanh-squashed to ±`noise_bound`; discount γ per env step (γ^h per chunk of h executed steps); with
`distill`, the successful steered rollouts are imitated by the flow loss beside the demonstrations (DSRL's
optional distillation; the actor then steers a moving base).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from diffusion_rl.dsrl import DSRLAgent
from kinema.train.evaluate import Acting, SteeredChunkPolicy
from kinema.train.methods.base import RLMethod
from kinema.train.success import seeded


@dataclass
class SACOptions:
    """SAC on the executed chunks, shared by `dsrl` (in the sampler's noise space) and `residual` (in action space)."""

    key: ClassVar[str] = ""  # the options' group, rl.<key>, for the error messages
    sac_steps: int = 400  # SAC updates per round
    batch_size: int = 256
    lr: float = 3e-4
    gamma: float = 0.99  # discount per env step
    tau: float = 0.005  # Polyak rate of the target critics
    init_alpha: float = 0.1  # SAC temperature at the start (tuned to the target entropy −dim of the actor's output)
    hidden_dim: int = 256  # of the actor and the critics
    critic_layer_norm: bool = False  # LayerNorm in the critics (RLPD's; ours here): bounds Q's extrapolation
    clip_targets: bool = False  # ours: the critics' TD targets clamped to [0, 1], the discounted success reward's range
    bc_weight: float = 0.0  # ours (TD3+BC's term): the actor's mean pulled toward the stored actions by this weight

    def __post_init__(self) -> None:
        key = f"rl.{self.key}"
        for name in ("sac_steps", "batch_size"):
            if getattr(self, name) < 0 or (name == "batch_size" and self.batch_size < 1):
                raise ValueError(f"{key}.{name} must be >= {1 if name == 'batch_size' else 0}; got {getattr(self, name)}")
        if self.bc_weight < 0:
            raise ValueError(f"{key}.bc_weight must be >= 0; got {self.bc_weight}")
        if self.lr <= 0 or self.init_alpha <= 0:
            raise ValueError(f"{key}.lr and {key}.init_alpha must be > 0; got {self.lr}, {self.init_alpha}")
        if not 0 < self.gamma <= 1 or not 0 < self.tau <= 1:
            raise ValueError(f"{key}.gamma and {key}.tau must be in (0, 1]; got {self.gamma}, {self.tau}")


@dataclass
class DSRLOptions(SACOptions):
    key: ClassVar[str] = "dsrl"
    noise_bound: float = 1.5  # the actor's noise is tanh-squashed to ±bound
    distill: bool = False  # also imitate the successful steered rollouts with the VLA (the base then moves)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.noise_bound <= 0:
            raise ValueError(f"rl.dsrl.noise_bound must be > 0; got {self.noise_bound}")


class DSRL(RLMethod):
    name = "dsrl"
    policy_types = ("vla", "smolvla", "pi0")  # a separate action expert (SmolVLA's and pi0's: a transformer of its own)
    summary = "diffusion steering: SAC on the flow sampler's initial noise, the VLA frozen (optionally distilled)"
    options_key = "dsrl"
    options_class = DSRLOptions
    rollout_noise = "'s actor chooses the rollouts' initial noise"  # why rl.rollout_noise_scale does not apply

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.rl.interventions:
            raise ValueError(f"rl.method {cls.name} learns from autonomous rollouts only; set rl.interventions false (or use habc)")
        if cfg.rl.rollout_noise_scale != 1.0:
            raise ValueError(f"rl.method {cls.name}{cls.rollout_noise}; rl.rollout_noise_scale must be 1, got {cfg.rl.rollout_noise_scale}")

    def __init__(self, learner) -> None:
        super().__init__(learner)
        o, pc = self.options, learner.policy.config
        self.noise_dim, self.input_dim = self.action_space(pc)
        self.agent = seeded(self.cfg.seed + 6, lambda: DSRLAgent(
            self.input_dim, self.noise_dim, hidden_dim=o.hidden_dim, bound=self.bound, lr=o.lr, tau=o.tau, init_alpha=o.init_alpha,
            critic_layer_norm=o.critic_layer_norm, target_range=(0.0, 1.0) if o.clip_targets else None,
            bc_weight=o.bc_weight))  # fmt: skip
        self.transitions: dict[str, torch.Tensor] = {}

    @property
    def bound(self) -> float:
        return self.options.noise_bound

    def action_space(self, pc) -> tuple[int, int]:
        """(the actor's output size, its input size): the whole chunk's initial noise, from the VLA's features."""
        return pc.chunk_size * pc.action_dim, pc.hidden_dim

    def decision_input(self, features: torch.Tensor, record: dict | None) -> torch.Tensor:
        """What the actor and critics read at a decision (record: the runner's record of the chunk taken there,
        None past the episode's end): the VLA's features."""
        return features

    def rollout_plan(self, first_seed: int):
        runner = SteeredChunkPolicy(self.learner.acting, self.agent.actor, deterministic=False, record=True)
        return list(range(first_seed, first_seed + self.cfg.rl.episodes_per_round)), runner

    def eval_runner(self, policy: Any) -> SteeredChunkPolicy:
        return SteeredChunkPolicy(policy, self.agent.actor, deterministic=True)

    @classmethod
    def checkpoint_noise_scale(cls, policy: Any, state: dict[str, Any] | None) -> float:
        return 1.0  # its actor picks the noise

    @classmethod
    def acting(cls, policy: Any, state: dict[str, Any] | None, *, noise_scale: float) -> Acting:
        """The VLA steered by the noise actor the checkpoint saved (its mean noise)."""
        if state is None:
            raise ValueError("a dsrl checkpoint acts through the noise actor in its method.pt, which this checkpoint lacks")
        if noise_scale != 1.0:
            raise ValueError("--noise-scale scales the VLA's own initial flow noise; a dsrl checkpoint acts with the noise its DSRL actor chooses (use 1)")
        actor = saved_actor(state, input_dim=policy.config.hidden_dim)
        return Acting(lambda: SteeredChunkPolicy(policy, actor, deterministic=True), "the VLA steered by the checkpoint's DSRL noise actor")

    def update(self, rollouts, record, progress) -> None:
        o = self.options
        new = self.chunk_transitions(rollouts)
        self.transitions = {k: torch.cat([self.transitions[k], v]) if self.transitions else v for k, v in new.items()}
        n = len(self.transitions["x"])
        record.update({f"{self.name}/transitions": n, f"{self.name}/new_transitions": len(new["x"])})
        stats: list[dict[str, float]] = []
        self.agent.train()
        with progress.phase(f"round {rollouts.round}: SAC (steps)", o.sac_steps, kind="update", units=0):
            for _ in range(o.sac_steps if n else 0):
                index = torch.from_numpy(self.learner.rng.integers(0, n, o.batch_size))
                stats.append(self.agent.update({k: v[index] for k, v in self.transitions.items()}))
                progress.advance()
        for key in stats[0] if stats else ():
            record[f"{self.name}/{key}"] = float(np.mean([s[key] for s in stats]))
        if isinstance(o, DSRLOptions) and o.distill:
            weights = np.concatenate([np.full(len(ep), float(bool(ep.outcome))) for ep in rollouts.episodes])
            self.imitate(rollouts, weights, record, progress)

    def chunk_transitions(self, rollouts) -> dict[str, torch.Tensor]:
        """One transition per executed chunk of the newest round: the actor's input (`decision_input`) at its decision
        step, the actor's output there (`noise`), γ^(T−1−t) when the episode succeeds at T−1 within the chunk (else 0),
        the input at the next decision, done when the episode ended within the chunk, and the discount γ^(steps to
        that decision)."""
        gamma = self.options.gamma
        first_new = len(rollouts.episodes) - len(rollouts.new)
        steps: dict[int, list[int]] = {}
        for i, step in rollouts.chunks:
            steps.setdefault(i, []).append(step)
        rows: dict[str, list] = {k: [] for k in ("x", "noise", "reward", "x_next", "done", "discount")}
        for i, decisions in steps.items():
            ep, feats = rollouts.new[i], rollouts.features[first_new + i]
            T = len(ep)
            decisions = sorted(decisions)
            for k, t in enumerate(decisions):
                t_next = decisions[k + 1] if k + 1 < len(decisions) else T
                success_here = bool(ep.outcome) and t <= T - 1 < t_next
                rows["x"].append(self.decision_input(feats[t], rollouts.chunks[i, t]))
                rows["noise"].append(rollouts.chunks[i, t]["noise"])
                rows["reward"].append(gamma ** (T - 1 - t) if success_here else 0.0)
                rows["x_next"].append(self.decision_input(feats[min(t_next, T - 1)], rollouts.chunks.get((i, t_next))))
                rows["done"].append(float(t_next >= T))
                rows["discount"].append(gamma ** (t_next - t))
        if not rows["x"]:
            return {"x": torch.zeros(0, self.input_dim), "noise": torch.zeros(0, self.noise_dim),
                    **{k: torch.zeros(0) for k in ("reward", "done", "discount")}, "x_next": torch.zeros(0, self.input_dim)}  # fmt: skip
        return {k: torch.stack(v).float() if torch.is_tensor(v[0]) else torch.tensor(v, dtype=torch.float32) for k, v in rows.items()}

    def _shape(self) -> dict:
        return {"noise_dim": self.noise_dim, "input_dim": self.input_dim, "hidden_dim": self.options.hidden_dim, "bound": self.bound,
                "critic_layer_norm": self.options.critic_layer_norm}  # fmt: skip

    def state_dict(self) -> dict:
        return {"agent": self.agent.state_dict(), "optimizers": self.agent.optim_state(), "transitions": self.transitions, "shape": self._shape()}

    def export_state(self) -> dict:
        """The agent and its shape, without the transitions and optimisers only a resume needs."""
        return {"agent": self.agent.state_dict(), "shape": self._shape()}

    def load_state_dict(self, state: dict) -> None:
        # The stored transitions' actions mean what the saved shape says (a residual's scale, the base's noise)
        if (saved := state.get("shape")) is not None and (changed := {k: (v, saved.get(k)) for k, v in self._shape().items() if saved.get(k, v) != v}):
            raise ValueError(f"--resume: rl.{self.options_key} differs from the run's: " + ", ".join(
                f"{k} {now} (the run's {was})" for k, (now, was) in changed.items()) + "; resume with the run's options or start a new run")  # fmt: skip
        self.agent.load_state_dict(state["agent"])
        self.agent.load_optim_state(state["optimizers"])
        self.transitions = state["transitions"]


def saved_actor(state: dict, *, input_dim: int) -> torch.nn.Module:
    """The actor a dsrl or residual checkpoint saved in its method.pt, in eval mode (`input_dim`: for checkpoints
    from before the shape kept it, the VLA's feature size)."""
    shape = state["shape"]
    agent = DSRLAgent(shape.get("input_dim", input_dim), shape["noise_dim"], hidden_dim=shape["hidden_dim"], bound=shape["bound"],
                      critic_layer_norm=shape.get("critic_layer_norm", False))  # fmt: skip
    agent.load_state_dict(state["agent"])
    return agent.actor.eval()
