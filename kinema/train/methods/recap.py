"""`rl.method recap`: Recap (π*0.6), RL with experience and corrections via advantage-conditioned policies
(`diffusion_rl.recap`). Every round: a distributional value of the steps left to success is fitted on all the data
(the demonstrations and the replay window's rollouts), every step gets its improvement indicator from the N-step
advantage (the top `positive_fraction` of the data; human corrections always), and the policy imitates all of it,
demonstrations and rollouts, successes and failures, with the indicator as an input. It acts, in rollouts,
evaluations and deployment, asking for improvements (`policy.advantage_condition`, with classifier-free guidance
`guidance` > 1).

Our choices at this scale (the paper trains a separate VLM value on all data and the policy on text tokens):
- the value reads the SFT policy's features, frozen for the run (the demonstrations' are computed once), through an
  MLP head over the 201 bins;
- the indicator is an embedding added to the action expert's context (zero at first: the SFT policy acts as before);
- demonstrations and rollouts are mixed by `rl.demo_fraction` as the other methods' (`rl.replay_mixing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from diffusion_rl.data import ExecutedBy, Segment
from diffusion_rl.recap import (
    POSITIVE,
    DistributionalValue,
    fit_value,
    improvement_indicator,
    improvement_threshold,
    normalised_returns,
    nstep_advantages,
)
from diffusion_rl.success_model import spearman_rank_correlation
from kinema.train.actor import policy_features, split_per_episode
from kinema.train.methods.base import RLMethod
from kinema.train.success import seeded
from policies import load_policy


RECAP_LABELS = ("advantage", "outcome")


@dataclass
class RecapOptions:
    positive_fraction: float = 0.3  # share of the data labelled an improvement (the paper's ε per task: about 30 %)
    lookahead: int = 20  # N of the advantage, env steps (1 s at kinema's 20 Hz)
    failure_cost: float = 1.0  # the extra cost at the end of a failure, in units of the task's horizon
    value_bins: int = 201  # atoms of the distributional value on [-1, 0]
    value_steps: int = 500  # value gradient steps per round
    value_lr: float = 3e-4
    value_batch_size: int = 256
    # The demos' share of the value's minibatches: 0 draws every step alike, as Recap (on push 82k demo steps, all
    # successes, against 6k of rollouts: the value ranked fresh rollouts backwards); in (0, 1): that share (ours)
    value_demo_share: float = 0.0
    indicator_dropout: float = 0.3  # share of training samples whose indicator is dropped (for guidance)
    # ours: the indicator's embedding, new after SFT, learns this many times faster than the policy (its scale in the
    # context); at 1 it barely moved in a drawer run (benchmarks/RESULTS.md, "Recap")
    indicator_scale: float = 100.0
    guidance: float = 1.0  # classifier-free guidance β when acting (1: plain conditioning on an improvement)
    # advantage: Recap's labels from the value | outcome (ours, no value): a step is an improvement iff its episode
    # succeeded (every demo step, the human's corrections too), so that guidance steers away from the failures
    labels: str = "advantage"

    def __post_init__(self) -> None:
        if not 0 < self.positive_fraction < 1:
            raise ValueError(f"rl.recap.positive_fraction must be in (0, 1); got {self.positive_fraction}")
        for name in ("lookahead", "value_bins", "value_batch_size"):
            if getattr(self, name) < (2 if name == "value_bins" else 1):
                raise ValueError(f"rl.recap.{name} must be >= {2 if name == 'value_bins' else 1}; got {getattr(self, name)}")
        if self.value_steps < 0 or self.failure_cost < 0 or self.value_lr <= 0:
            raise ValueError("rl.recap.value_steps and rl.recap.failure_cost must be >= 0 and rl.recap.value_lr > 0; got "
                             f"{self.value_steps}, {self.failure_cost}, {self.value_lr}")  # fmt: skip
        if not 0 <= self.indicator_dropout < 1:
            raise ValueError(f"rl.recap.indicator_dropout must be in [0, 1); got {self.indicator_dropout}")
        if self.indicator_scale <= 0:
            raise ValueError(f"rl.recap.indicator_scale must be > 0; got {self.indicator_scale}")
        if self.guidance < 1:
            raise ValueError(f"rl.recap.guidance must be >= 1 (1: plain conditioning); got {self.guidance}")
        if not 0 <= self.value_demo_share < 1:
            raise ValueError(f"rl.recap.value_demo_share must be in [0, 1) (0: every step alike); got {self.value_demo_share}")
        if self.labels not in RECAP_LABELS:
            raise ValueError(f"rl.recap.labels {self.labels!r} is not known; valid: {', '.join(RECAP_LABELS)}")
        if self.guidance > 1 and not self.indicator_dropout:
            raise ValueError("rl.recap.guidance > 1 guides away from the unconditioned policy, which only "
                             "rl.recap.indicator_dropout > 0 trains; set both")  # fmt: skip


class Recap(RLMethod):
    name = "recap"
    summary = "Recap (π*0.6): imitate everything, conditioned on whether each step was an improvement by a value of the steps left"
    options_key = "recap"
    options_class = RecapOptions
    learns_from_recordings = True

    def __init__(self, learner) -> None:
        super().__init__(learner)
        self.value = seeded(self.cfg.seed + 11, lambda: DistributionalValue(learner.policy.config.hidden_dim, bins=self.options.value_bins))
        self.value_optimizer = torch.optim.Adam(self.value.parameters(), lr=self.options.value_lr)
        self.generator = torch.Generator().manual_seed(self.cfg.seed + 13)
        self.encoder = None  # the SFT policy, frozen: what the value reads
        self.demo_features: torch.Tensor | None = None

    def prepare(self) -> None:
        learner, o = self.learner, self.options
        for policy in {id(learner.policy): learner.policy, id(learner.acting): learner.acting}.values():
            if not policy.config.advantage_input:  # a resumed run's keeps the scale it trained with
                policy.config.advantage_scale = o.indicator_scale
            policy.add_advantage_input()
            if policy is not learner.policy:  # the acting average is never trained itself
                policy.expert.advantage.requires_grad_(False)
            policy.config.advantage_dropout = o.indicator_dropout
            policy.config.advantage_guidance = o.guidance
        self._rebuild_optimizer()
        if o.labels != "advantage":
            return
        self.encoder = load_policy(learner.run.root / "checkpoints" / "sft").requires_grad_(False).eval()
        self.demo_features = policy_features(self.encoder, learner.demos)
        from sim.tasks import make

        env = make(self.cfg.task, self.cfg.task_config or None)
        self.horizon = int(env.config.horizon)
        env.close()
        demos = learner.demos
        self.demo_returns = normalised_returns(demos.episode_length.tolist(), [1.0] * len(demos.episode_length), horizon=self.horizon,
                                               failure_cost=o.failure_cost)  # fmt: skip

    def _rebuild_optimizer(self) -> None:
        """The optimiser over every policy weight, the indicator's embedding included, keeping the moments it has."""
        learner = self.learner
        old = learner.optimizer
        params = list(learner.policy.parameters())
        if len(params) == sum(len(g["params"]) for g in old.param_groups):
            return
        new = type(old)(params)
        new.param_groups[0].update({k: v for k, v in old.param_groups[0].items() if k != "params"})
        for p in params:
            if p in old.state:
                new.state[p] = old.state[p]
        learner.optimizer = new

    def update(self, rollouts, record, progress) -> None:
        demos, replay, episodes = self.learner.demos, rollouts.buffer, rollouts.episodes
        corrections = np.concatenate([(ep.executed_by == ExecutedBy.HUMAN) & (ep.segment != Segment.RECOVERY) for ep in episodes])
        success = np.repeat([bool(ep.outcome) for ep in episodes], replay.episode_length)
        if self.options.labels == "outcome":
            demos.advantage = np.full(len(demos), POSITIVE, np.int8)  # the run imitates successful demos only
            replay.advantage = improvement_indicator(success.astype(np.float32), 0.5, always_positive=corrections)
        else:
            demos.advantage, replay.advantage = self.advantage_labels(rollouts, corrections, record, progress)
        record.update({
            "recap/positive_demos": float((demos.advantage == POSITIVE).mean()),
            "recap/positive_rollout_successes": share(replay.advantage[success] == POSITIVE),
            "recap/positive_rollout_failures": share(replay.advantage[~success] == POSITIVE),
        })  # fmt: skip
        weights = np.ones(len(replay)) if replay.imitable is None else replay.imitable.astype(np.float64)
        self.imitate(rollouts, weights, record, progress)

    def advantage_labels(self, rollouts, corrections: np.ndarray, record, progress) -> tuple[np.ndarray, np.ndarray]:
        """Recap's labels: fit the value on the demos and the replay window, then each step's N-step advantage against
        the threshold that makes `positive_fraction` of them improvements. Returns (demos', replay's) indicators."""
        o, demos, replay, episodes = self.options, self.learner.demos, rollouts.buffer, rollouts.episodes
        replay_features = policy_features(self.encoder, replay)
        replay_returns = normalised_returns([len(ep) for ep in episodes], [float(ep.outcome) for ep in episodes],
                                            horizon=self.horizon, failure_cost=o.failure_cost)  # fmt: skip
        new_start = int(replay.episode_start[len(episodes) - len(rollouts.new)])
        record.update(self.calibration(replay_features[new_start:], np.concatenate(replay_returns[len(episodes) - len(rollouts.new) :])))
        features = torch.cat([self.demo_features, replay_features])
        returns = torch.from_numpy(np.concatenate([*self.demo_returns, *replay_returns]))
        sampling = None
        if o.value_demo_share:
            n_demo, n_replay = len(self.demo_features), len(replay_features)
            sampling = torch.cat([torch.full((n_demo,), o.value_demo_share / n_demo), torch.full((n_replay,), (1 - o.value_demo_share) / n_replay)])
        with progress.phase(f"round {rollouts.round}: value (steps)", o.value_steps, kind="update", units=0):
            record["value/loss"] = fit_value(self.value, self.value_optimizer, features, returns, steps=o.value_steps, sampling=sampling,
                                             batch_size=o.value_batch_size, generator=self.generator, on_step=progress.advance)  # fmt: skip
        with torch.no_grad():
            values = self.value(features).numpy()
        n_demo = len(demos)
        demo_adv = nstep_advantages(self.demo_returns, split_per_episode(values[:n_demo], demos), o.lookahead)
        replay_adv = nstep_advantages(replay_returns, split_per_episode(values[n_demo:], replay), o.lookahead)
        advantages = np.concatenate([*demo_adv, *replay_adv])
        threshold = improvement_threshold(advantages, o.positive_fraction)
        record["recap/threshold"] = threshold
        record["recap/positive_share"] = float((advantages > threshold).mean())  # before the corrections are added
        return improvement_indicator(advantages[:n_demo], threshold), improvement_indicator(advantages[n_demo:], threshold, always_positive=corrections)

    @torch.no_grad()
    def calibration(self, features: torch.Tensor, returns: np.ndarray) -> dict[str, float]:
        """The value scored on the fresh rollouts before it trains on them (held out): error against their realised
        normalised returns, beside the error of guessing their mean, and its rank correlation with them."""
        if not len(returns):
            return {}
        v, g = self.value(features), torch.from_numpy(returns)
        return {"value/mse": float((v - g).pow(2).mean()), "value/mse_base_rate": float(g.var(unbiased=False)),
                "value/spearman": float(spearman_rank_correlation(v, g))}  # fmt: skip

    def state_dict(self) -> dict:
        return {"value": self.value.state_dict(), "optimizer": self.value_optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.value.load_state_dict(state["value"])
        self.value_optimizer.load_state_dict(state["optimizer"])


def share(mask: np.ndarray) -> float:
    return float(mask.mean()) if len(mask) else float("nan")
