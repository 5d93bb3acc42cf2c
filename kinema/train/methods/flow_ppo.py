"""`rl.method flow_ppo`: the Flow-SDE policy-gradient baseline (πRL / Flow-GRPO) on the VLA.

Rollouts sample every chunk with Flow-SDE steps and record each step's Gaussian log-prob; each executed chunk gets
an advantage (GRPO groups of rollouts sharing a seed, or GAE from a value critic), and every recorded denoising step
is a PPO sample. It trains the action expert only, at its own learning rate, inside a trust region (target KL and a
KL anchor to the starting policy), as πRL does; it acts with the very weights it updates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kinema.train.evaluate import ChunkPolicy
from kinema.train.methods.awr import value_critic
from kinema.train.methods.base import RLMethod
from kinema.train.ppo import flow_ppo_updates, gae_chunk_advantages, grpo_chunk_advantages, restrict_to_flow_grpo_settings
from policies import load_policy

ADVANTAGES = ("grpo", "gae")


@dataclass
class PPOOptions:
    advantage: str = "grpo"  # grpo (group-relative, rollouts in seed groups) | gae (PPO with a value critic)
    group_size: int = 4  # grpo: rollouts per seed
    gae_lambda: float = 0.95  # gae: λ per chunk (γ = 0.99 per env step, so 0.99^n per chunk)
    clip: float = 0.2  # clip range on the ratio of mean-reduced per-step log-probs
    noise_level: float = 0.3  # Flow-SDE noise level a (σ_t = a·sqrt(t / (1 − t)))
    epochs: int = 2
    target_kl: float = 0.01  # stop a round's updates once the approximate KL passes 1.5x this (0: off)
    kl_weight: float = 0.04  # Flow-GRPO's β: KL of the SDE steps to the starting (SFT) policy (0: off)
    lr: float = 3e-6  # the actor's learning rate (0: rl.lr)
    expert_only: bool = True  # train the action expert only, the encoders frozen (πRL's train_expert_only)
    critic_steps: int = 400  # gae: value-critic gradient steps per round
    critic_lr: float = 1e-3  # gae: value-critic learning rate

    def __post_init__(self) -> None:
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"rl.ppo.advantage must be one of {', '.join(ADVANTAGES)}; got {self.advantage!r}")
        if not 0.0 <= self.gae_lambda <= 1.0:
            raise ValueError(f"rl.ppo.gae_lambda must be in [0, 1]; got {self.gae_lambda}")
        for name in ("target_kl", "kl_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"rl.ppo.{name} must be >= 0 (0 turns it off); got {getattr(self, name)}")
        if self.lr < 0:
            raise ValueError(f"rl.ppo.lr must be >= 0 (0: use rl.lr); got {self.lr}")
        if self.group_size < 1 or self.critic_steps < 0:
            raise ValueError(f"rl.ppo.group_size must be >= 1 and rl.ppo.critic_steps >= 0; got {self.group_size}, {self.critic_steps}")


class FlowPPO(RLMethod):
    name = "flow_ppo"
    policy_types = ("vla", "smolvla", "pi0")  # a separate action expert (SmolVLA's and pi0's: a transformer of its own)
    summary = "Flow-SDE PPO (πRL / Flow-GRPO): GRPO groups, or GAE with a value critic (rl.ppo.advantage)"
    options_key = "ppo"
    options_class = PPOOptions
    acts_with_average = False

    def __init__(self, learner) -> None:
        super().__init__(learner)
        self.value = None
        if self.options.advantage == "gae":
            self.value = value_critic(learner.policy.config.hidden_dim, self.cfg.seed)
            self.value_optimizer = torch.optim.Adam(self.value.parameters(), lr=self.options.critic_lr)
        self.reference = None

    def prepare(self) -> None:
        # Flow-GRPO's KL anchor: the starting policy, as saved before the first round (also there after a resume).
        if self.options.kl_weight > 0:
            self.reference = load_policy(self.learner.run.root / "checkpoints" / "sft").requires_grad_(False).eval()
        restrict_to_flow_grpo_settings(
            self.learner.policy, self.learner.optimizer, lr=self.options.lr or self.cfg.rl.lr, expert_only=self.options.expert_only
        )

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.rl.rollout_noise_scale != 1.0:
            raise ValueError(f"rl.method flow_ppo's rollouts sample its Flow-SDE from sampled noise; rl.rollout_noise_scale must be 1, got {cfg.rl.rollout_noise_scale}")

    def rollout_plan(self, first_seed: int):
        per_seed = self.options.group_size if self.options.advantage == "grpo" else 1
        seeds = [first_seed + j // per_seed for j in range(self.cfg.rl.episodes_per_round)]
        return seeds, ChunkPolicy(self.learner.acting, sde_noise=self.options.noise_level)

    def update(self, rollouts, record, progress) -> None:
        o, learner, r = self.options, self.learner, rollouts.round
        if self.value is not None:
            with progress.phase(f"round {r}: critic (steps)", o.critic_steps, kind="update", units=0):
                advantages, diag = gae_chunk_advantages(
                    self.value, self.value_optimizer, rollouts.new, rollouts.features[-len(rollouts.new) :],
                    rollouts.chunks, chunk_steps=learner.acting.config.n_action_steps, lam=o.gae_lambda,
                    critic_steps=o.critic_steps,
                )  # fmt: skip
        else:
            advantages, diag = grpo_chunk_advantages(rollouts.new, rollouts.chunks)
        record.update(diag)
        samples = sum(rec["log_prob"].shape[0] for key, rec in rollouts.chunks.items() if advantages.get(key, 0.0))
        most = o.epochs * -(-samples // self.cfg.rl.batch_size)  # the trust region may stop the round earlier
        with progress.phase(f"round {r}: PPO (updates)", most, kind="update", units=self.cfg.rl.updates_per_round):
            record.update(flow_ppo_updates(
                learner.policy, learner.optimizer, rollouts.chunks, advantages, epochs=o.epochs,
                batch_size=self.cfg.rl.batch_size, clip_range=o.clip, noise_level=o.noise_level, rng=learner.rng,
                target_kl=o.target_kl, reference=self.reference, kl_weight=o.kl_weight, on_step=progress.advance,
            ))  # fmt: skip

    def state_dict(self) -> dict:
        if self.value is None:
            return {}
        return {"value": self.value.state_dict(), "optimizer": self.value_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.value is not None and state:
            self.value.load_state_dict(state["value"])
            self.value_optimizer.load_state_dict(state["optimizer"])

    @classmethod
    def from_legacy_critics(cls, critics: dict) -> dict:
        return {"value": critics["value"], "optimizer": critics["optimizers"]["value"]}
