"""`rl.method pa_rl`: policy-agnostic RL (PA-RL, Mark et al. 2024) with a chunk-level Q critic (Q-chunking).

A round: the rollouts act by sampling `num_samples` ODE chunks per decision from the flow policy, optionally moving
them `refine_steps` gradient steps up the critic (PA-RL's "local" step), and executing the one the critic values
most (its "global" step); then the critic trains off-policy on every replay rollout and on demonstrations (all
successes); then the selected chunks are distilled into the policy with the flow-matching loss, beside the
demonstrations (`rl.demo_fraction` of each batch). Evaluation: the distilled policy at N = 1 (the normal one, the
fair comparison), and, once at the end, value-guided selection at N = `eval_samples` with its batch-1 latency
(V-GPS): the `selection_eval` record. `kinema eval --select N` does the same from a checkpoint's `method.pt`.

Our choices (the paper leaves them open, or its setting differs):
- the critic is `diffusion_rl.chunk_q` (h = the executed `n_action_steps`, γ per env step, h-step SARSA target on
  the data's next chunk, Polyak target), on the acting policy's features, not PA-RL's Cal-QL/IQL critics;
- the chunks distilled are those the newest round's rollouts selected and executed (the whole chunk_size), not
  a fresh re-selection at every replay state (that costs N flow samples per state per round);
- demonstrations join the critic's data as `demo_episodes` randomly drawn episodes per round (their features cost
  one encoder pass per step), and the first round acts with the freshly initialised critic (a random choice
  among the N samples).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from diffusion_rl.chunk_q import ChunkQ, chunk_q_update, chunk_transitions, discounted_returns, outcome_rewards
from diffusion_rl.data import Episode, ExecutedBy
from diffusion_rl.success_model import brier_score, expected_calibration_error, spearman_rank_correlation
from kinema.train.actor import policy_features
from kinema.train.evaluate import Acting, SelectChunkPolicy, batch1_latency_ms, evaluate
from kinema.train.methods.base import RLMethod
from kinema.train.success import seeded


@dataclass
class PARLOptions:
    num_samples: int = 8  # N chunks sampled per decision in the rollouts; the critic's argmax is executed
    refine_steps: int = 0  # gradient-ascent steps on Q per sampled chunk before the choice (PA-RL's local step)
    refine_step_size: float = 0.05  # step of that ascent, in action units per unit gradient
    critic_steps: int = 400  # chunk-critic gradient steps per round
    critic_lr: float = 3e-4
    critic_batch_size: int = 256
    gamma: float = 0.99  # discount per env step
    tau: float = 0.05  # Polyak rate of the target critic
    demo_episodes: int = 48  # demonstration episodes drawn into the critic's data each round (0: rollouts only)
    eval_samples: int = 8  # N of the final value-guided selection evaluation (0: none)
    eval_margin: float = 0.0  # that selection keeps the policy's own chunk unless another is valued this much higher (0: V-GPS's argmax)

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"rl.pa_rl.num_samples must be >= 1; got {self.num_samples}")
        for name in ("refine_steps", "critic_steps", "demo_episodes", "eval_samples"):
            if getattr(self, name) < 0:
                raise ValueError(f"rl.pa_rl.{name} must be >= 0; got {getattr(self, name)}")
        if self.eval_margin < 0:
            raise ValueError(f"rl.pa_rl.eval_margin must be >= 0 (a value difference, Q in [0, 1]); got {self.eval_margin}")
        if not 0 < self.gamma <= 1 or not 0 < self.tau <= 1:
            raise ValueError(f"rl.pa_rl.gamma and rl.pa_rl.tau must be in (0, 1]; got {self.gamma}, {self.tau}")


def chunk_critic(feature_dim: int, horizon: int, action_dim: int, seed: int) -> ChunkQ:
    return seeded(seed + 5, lambda: ChunkQ(feature_dim, horizon, action_dim))


class PARL(RLMethod):
    name = "pa_rl"
    policy_types = ("vla", "smolvla", "pi0")  # a separate action expert (SmolVLA's and pi0's: a transformer of its own)
    summary = "policy-agnostic RL: N sampled chunks per decision, a chunk Q critic picks one, the picks are distilled"
    options_key = "pa_rl"
    options_class = PARLOptions

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.rl.replay_mixing != "fixed":
            raise ValueError(f"rl.method pa_rl mixes demos and selected chunks by rl.demo_fraction; rl.replay_mixing must be fixed, got {cfg.rl.replay_mixing!r}")

    def __init__(self, learner) -> None:
        super().__init__(learner)
        pc = learner.policy.config
        self.critic = chunk_critic(pc.hidden_dim, pc.n_action_steps, pc.action_dim, self.cfg.seed)
        self.target = copy.deepcopy(self.critic).requires_grad_(False)
        self.optimizer = torch.optim.Adam(self.critic.parameters(), lr=self.options.critic_lr)

    def rollout_plan(self, first_seed: int):
        o = self.options
        runner = SelectChunkPolicy(self.learner.acting, self.critic, num_samples=o.num_samples, refine_steps=o.refine_steps,
                                   step_size=o.refine_step_size, noise_scale=self.cfg.rl.rollout_noise_scale, record=True)  # fmt: skip
        return list(range(first_seed, first_seed + self.cfg.rl.episodes_per_round)), runner

    def update(self, rollouts, record, progress) -> None:
        o = self.options
        new = rollouts.episodes[-len(rollouts.new) :]
        record.update(self.calibration(new, rollouts.features[-len(new) :]))
        with progress.phase(f"round {rollouts.round}: chunk critic (steps)", o.critic_steps, kind="update", units=0):
            record.update(self.fit(rollouts.episodes, rollouts.features, on_step=progress.advance))
        weights, selected = self.selected_chunks(rollouts)
        record["pa_rl/selected_chunks"] = int((weights > 0).sum())
        self.imitate(rollouts, weights, record, progress, loss_fn=distil_loss(selected))

    # -- the critic --------------------------------------------------------------------------------------------------
    def _data(self, episodes: Sequence[Episode], features: Sequence[Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Features and chunk transitions of the replay episodes plus `demo_episodes` drawn demonstrations."""
        learner, o = self.learner, self.options
        actions = [ep.action for ep in episodes]
        lengths = [len(ep) for ep in episodes]
        outcomes = [float(ep.outcome) for ep in episodes]
        feats = list(features)
        demos = learner.demos
        if o.demo_episodes and len(demos.episode_start):
            chosen = learner.rng.choice(len(demos.episode_start), min(o.demo_episodes, len(demos.episode_start)), replace=False)
            index = np.concatenate([np.arange(demos.episode_start[e], demos.episode_start[e] + demos.episode_length[e]) for e in chosen])
            demo_feats = policy_features(learner.acting, demos, index=index)
            start = 0
            for e in chosen:
                n = int(demos.episode_length[e])
                actions.append(demos.action[demos.episode_start[e] : demos.episode_start[e] + n])
                feats.append(demo_feats[start : start + n])
                lengths.append(n)
                outcomes.append(1.0)  # the run imitates successful demonstrations only
                start += n
        tr = chunk_transitions(actions, outcome_rewards(lengths, outcomes), horizon=self.critic.horizon, gamma=o.gamma)
        return torch.cat(feats), tr

    def fit(self, episodes: Sequence[Episode], features: Sequence[Tensor], on_step=None) -> dict[str, float]:
        o = self.options
        x, tr = self._data(episodes, features)
        self.critic.train()
        losses = []
        for _ in range(o.critic_steps):
            index = torch.from_numpy(self.learner.rng.integers(0, len(x), o.critic_batch_size))
            losses.append(chunk_q_update(self.critic, self.target, self.optimizer, x, tr, index, tau=o.tau))
            if on_step is not None:
                on_step()
        return {"q/loss": float(np.mean(losses)) if losses else float("nan"), "q/transitions": len(x)}

    @torch.no_grad()
    def calibration(self, episodes: Sequence[Episode], features: Sequence[Tensor]) -> dict[str, float]:
        """The critic scored on fresh rollouts before it trains on them (held out, as the success model's
        calibration): Q of each executed chunk against the realised discounted return γ^(T−1−t)·outcome. `q/mse`
        beside `q/mse_base_rate` (always guessing the returns' mean, in hindsight) says whether Q knows more."""
        keep = [i for i, ep in enumerate(episodes) if not (ep.executed_by == ExecutedBy.HUMAN).any()]
        if not keep:
            return {}
        eps = [episodes[i] for i in keep]
        lengths, outcomes = [len(ep) for ep in eps], [float(ep.outcome) for ep in eps]
        tr = chunk_transitions([ep.action for ep in eps], outcome_rewards(lengths, outcomes), horizon=self.critic.horizon, gamma=self.options.gamma)
        self.critic.eval()
        q = self.critic(torch.cat([features[i] for i in keep]), tr["chunk"])
        g = discounted_returns(lengths, outcomes, self.options.gamma)
        return {
            "q/mse": float(brier_score(q, g)),
            "q/mse_base_rate": float(g.var(unbiased=False)),
            "q/ece": float(expected_calibration_error(q, g)),
            "q/spearman": float(spearman_rank_correlation(q, g)),
            "q/mean": float(q.mean()),
            "q/return_mean": float(g.mean()),
        }

    # -- the distillation --------------------------------------------------------------------------------------------
    def selected_chunks(self, rollouts) -> tuple[np.ndarray, Tensor]:
        """Per replay step: weight 1 at the steps where the newest round executed a selected chunk (0 elsewhere), and
        that chunk (replay steps, chunk_size, action_dim)."""
        buffer = rollouts.buffer
        pc = self.learner.policy.config
        weights = np.zeros(len(buffer))
        selected = torch.zeros(len(buffer), pc.chunk_size, pc.action_dim)
        first_new = len(rollouts.episodes) - len(rollouts.new)
        for (i, step), rec in rollouts.chunks.items():
            flat = int(buffer.episode_start[first_new + i]) + step
            weights[flat] = 1.0
            selected[flat] = rec["chunk"]
        return weights, selected

    # -- evaluation and checkpoints ----------------------------------------------------------------------------------
    @classmethod
    def selection(cls, policy: Any, state: dict[str, Any] | None, *, num_samples: int, noise_scale: float,
                  margin: float = 0.0) -> Acting | None:  # fmt: skip
        """Value-guided selection (V-GPS) with the chunk critic the checkpoint saved; `margin` keeps the policy's own
        chunk unless another is valued that much higher."""
        if state is None:
            return None
        critic = ChunkQ(policy.config.hidden_dim, state["shape"]["horizon"], state["shape"]["action_dim"])
        critic.load_state_dict(state["critic"])
        critic.eval()
        kept = f", the policy's own kept unless another is valued {margin:g} higher" if margin else ""
        return Acting(lambda: SelectChunkPolicy(policy, critic, num_samples=num_samples, noise_scale=noise_scale, margin=margin),
                      f"best of {num_samples} sampled chunks by the pa_rl checkpoint's chunk critic{kept}", num_samples)  # fmt: skip

    def final_evaluations(self, policy, progress) -> list[dict[str, Any]]:
        cfg, n = self.cfg, self.options.eval_samples
        if not n:
            return []
        def runner_at(samples: int) -> SelectChunkPolicy:  # its first candidate is the chunk the N = 1 evaluation executes
            return SelectChunkPolicy(policy, self.critic, num_samples=samples, refine_steps=self.options.refine_steps,
                                     step_size=self.options.refine_step_size, noise_scale=cfg.eval.noise_scale,
                                     margin=self.options.eval_margin)  # fmt: skip

        runner = runner_at(n)
        with progress.phase(f"value-guided selection at N={n} (episodes)", cfg.eval.episodes, kind="eval"):
            result, _ = evaluate(
                policy, cfg.task, episodes=cfg.eval.episodes, num_envs=cfg.num_envs, num_workers=cfg.workers,
                image_size=cfg.policy.image_size, task_config=cfg.task_config or None, seed=cfg.seed,
                on_episode=lambda ep: progress.advance(), runner=runner,
            )  # fmt: skip
        latency = batch1_latency_ms({n: runner, 1: runner_at(1)}, cfg.task, image_size=cfg.policy.image_size, task_config=cfg.task_config or None)
        return [{"kind": "selection_eval", "stage": "final", "num_samples": n, "margin": self.options.eval_margin, "latency_ms": round(latency[n], 2),
                 "latency_ms_n1": round(latency[1], 2), **result.as_dict(prefix="train/")}]  # fmt: skip

    def state_dict(self) -> dict:
        return {"critic": self.critic.state_dict(), "target": self.target.state_dict(), "optimizer": self.optimizer.state_dict(),
                "shape": {"horizon": self.critic.horizon, "action_dim": self.critic.action_dim}}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.critic.load_state_dict(state["critic"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])


def distil_loss(selected: Tensor):
    """The flow-matching loss with each replay sample's target chunk replaced by the chunk the rollout selected
    (the whole chunk, unpadded); demonstrations keep theirs."""

    def loss(policy, batch, context, replay_index):
        if len(replay_index):
            n_demo = len(batch["task"]) - len(replay_index)
            batch = dict(batch)
            action = batch["action"].clone()
            action[n_demo:] = selected[replay_index].to(action)
            pad = batch["action_is_pad"].clone()
            pad[n_demo:] = False
            batch["action"], batch["action_is_pad"] = action, pad
        return policy.flow_loss(batch, context=context)

    return loss
