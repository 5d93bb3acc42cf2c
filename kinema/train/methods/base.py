"""The interface every RL method of `kinema train` implements, and the state its rounds work on.

A round of `kinema train` is: `roll_out` (episodes of the acting policy, written to the run folder, scored by the
success model), then `update` (the method's critics, credit and actor update). A method is one class; its options are
one dataclass at `rl.<options_key>`. `kinema.train.methods.METHODS` registers them by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from diffusion_rl.data import Episode, ExecutedBy, Segment
from diffusion_rl.data.lerobot_v3 import write_episodes
from kinema.common import Run, learning_threads
from kinema.train.distributed import broadcast_object, is_main, world
from kinema.train.actor import ActorLoss, actor_updates, ema_update, policy_features, split_per_episode
from kinema.train.buffer import StepBuffer
from kinema.train.evaluate import Acting, ChunkPolicy, PlanAheadChunkPolicy, SelectChunkPolicy, summarize
from kinema.train.progress import RunProgress
from kinema.train.success import RolloutSuccessModel
from sim.env import CAMERAS
from sim.monitor import MonitorConfig
from sim.rollout import collect, make_vector

if TYPE_CHECKING:
    from kinema.train.config import TrainConfig

ROLLOUT_SEED_OFFSET = 100_000  # rollout seeds: disjoint from demo seeds (0..) and evaluation seeds (1e6..)


@dataclass
class Learner:
    """What a method's rounds work on: the policy being trained, the policy that acts (an average of its weights,
    or the policy itself), the optimiser, the demonstrations, the replay of recent rounds and the run's counters."""

    cfg: TrainConfig
    run: Run
    policy: Any
    acting: Any
    optimizer: torch.optim.Optimizer
    demos: StepBuffer
    rng: np.random.Generator
    decay: float  # of the acting average; 0: the acting policy is the trained one
    success_model: RolloutSuccessModel
    replay: list[list[Episode]] = field(default_factory=list)  # rollouts of the rounds kept, oldest first
    demo_weights: np.ndarray | None = None  # how SFT and the rounds draw demonstration steps (demos.weighting); None: uniform
    env_steps: int = 0
    actor_step: int = 0

    def average(self) -> None:
        if self.decay:
            ema_update(self.acting, self.policy, self.decay)


@dataclass
class Rollouts:
    """One round's rollouts, with the replay window they joined and the acting policy's features of it."""

    round: int
    new: list[Episode]
    episodes: list[Episode]  # the replay window, oldest round first; `new` are its last ones
    buffer: StepBuffer  # every step of `episodes`
    features: list[torch.Tensor]  # per episode of `episodes`: (T_i, hidden_dim)
    # Flow-SDE runners only: each executed chunk's observation and denoising log-probs, keyed by (index in `new`,
    # env step), in the order the chunks were taken.
    chunks: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)


# Which of the human's steps are imitation data (rl.human_steps): all of them (RaC and HG-DAgger imitate recovery and
# correction alike), or the corrections only (ours: the recovery drive back aims at a pose the observation does not show).
HUMAN_STEPS = ("all", "correction")


def imitated_human_steps(episode: Episode, human_steps: str) -> np.ndarray:
    """Per step of `episode`, False where `rl.human_steps` leaves a human step out of imitation (`correction`: the
    human's recovery steps), else True."""
    if human_steps not in HUMAN_STEPS:
        raise ValueError(f"rl.human_steps {human_steps!r} is not known; valid: {', '.join(HUMAN_STEPS)}")
    if human_steps == "all":
        return np.ones(len(episode), bool)
    return ~((episode.executed_by == ExecutedBy.HUMAN) & (episode.segment == Segment.RECOVERY))


class RLMethod:
    """One RL method. Subclasses set the class attributes and implement `update`; the rest has defaults."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line, for --help
    options_key: ClassVar[str] = ""  # its options live at rl.<options_key> (none when empty)
    options_class: ClassVar[type | None] = None
    has_rounds: ClassVar[bool] = True  # False: SFT only
    rolls_out: ClassVar[bool] = True  # False: its rounds train on the demonstrations alone
    acts_with_average: ClassVar[bool] = True  # False: acts with the very weights it updates (on-policy gradients)
    on_policy: ClassVar[bool] = False  # True: learns from the newest round only
    # True: its update needs only what a robot records of an episode (observations, actions, who acted, success), so
    # `kinema train --robot` can run its rounds on a robot; False: it needs its runner's chunk records or an actor of its own.
    learns_from_recordings: ClassVar[bool] = False
    # The policy types (policies.POLICY_TYPES) it can train: the video policy has no separate action expert, which
    # PPO's, NFT's and the critic-guided methods' updates act on.
    policy_types: ClassVar[tuple[str, ...]] = ("vla",)

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        self.cfg = learner.cfg
        self.options = getattr(self.cfg.rl, self.options_key) if self.options_key else None

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        """Refuse settings this method cannot honour, naming the key (called when the config loads)."""

    def replay_rounds(self) -> int:
        return 1 if self.on_policy else self.cfg.rl.replay_rounds

    def prepare(self) -> None:
        """Before the first round of this start (fresh or resumed): what the method sets on the policy or optimiser."""

    # -- a round -------------------------------------------------------------------------------------------------------
    def rollout_plan(self, first_seed: int) -> tuple[list[int], ChunkPolicy]:
        """The round's seeds and the runner that acts: distinct seeds, the acting policy's ODE chunks (from initial
        noise scaled by `rl.rollout_noise_scale`)."""
        runner = (PlanAheadChunkPolicy if self.cfg.rl.rollout_plan_ahead else ChunkPolicy)(
            self.learner.acting, noise_scale=self.cfg.rl.rollout_noise_scale)  # fmt: skip
        return list(range(first_seed, first_seed + self.cfg.rl.episodes_per_round)), runner

    def roll_out(self, round_index: int, record: dict[str, Any], progress: RunProgress) -> Rollouts | None:
        cfg = self.cfg
        seeds, runner = self.rollout_plan(ROLLOUT_SEED_OFFSET + round_index * 1000)
        with progress.phase(f"round {round_index}: rollouts (episodes)", len(seeds), kind="rollout"):
            new = roll_out_policy(runner, cfg, seeds, round_index, on_episode=lambda ep: progress.advance(), record=record,
                                  log=progress.bar.console.print)  # fmt: skip
            rollouts = self.digest(round_index, new, record)
        rollouts.chunks = runner.chunk_records()
        return rollouts

    def digest(self, round_index: int, new: list[Episode], record: dict[str, Any]) -> Rollouts:
        """Write a round's rollouts to the run folder, add them to the replay, take the acting policy's features of
        the replay and refit the success model on the new ones (RLER)."""
        learner, cfg = self.learner, self.cfg
        if is_main():  # under torchrun, rank 0 alone writes the run folder
            write_episodes(learner.run.root / "rollouts" / f"round-{round_index:03d}", new)
        learner.env_steps += sum(len(ep) for ep in new)
        stats = summarize(new)
        record.update({"rollout/success": stats.success, "rollout/episodes": stats.episodes,
                       "rollout/takeover_rate": stats.takeover_rate, "env_steps": learner.env_steps})  # fmt: skip
        learner.replay = (learner.replay + [new])[-self.replay_rounds() :]
        episodes = [ep for round_eps in learner.replay for ep in round_eps]
        record["replay/episodes"] = len(episodes)
        buffer = StepBuffer.from_episodes(episodes, CAMERAS, image_size=learner.policy.config.image_size)  # robot cameras may differ
        with learning_threads(cfg):
            features = split_per_episode(policy_features(learner.acting, buffer), buffer)
            if cfg.rl.success_model:  # RLER: calibration on the fresh rollouts, then a refit
                record.update(learner.success_model.score_and_refit(new, features[-len(new) :], target=cfg.rl.success_target))
        return Rollouts(round_index, new, episodes, buffer, features)

    def update(self, rollouts: Rollouts | None, record: dict[str, Any], progress: RunProgress) -> None:
        """Critics, credit and `cfg.rl.updates_per_round` actor updates; diagnostics go into `record`."""
        raise NotImplementedError

    def imitate(
        self, rollouts: Rollouts | None, weights: np.ndarray | None, record: dict[str, Any], progress: RunProgress, *,
        loss_fn: ActorLoss | None = None, train_mode: bool = True, replay: StepBuffer | None = None,
        mixing: str | None = None,
    ) -> None:  # fmt: skip
        """The actor update of the imitation-style methods: flow matching on demonstrations and replay steps drawn ∝
        `weights` (one per replay step; None: demonstrations only), the acting average following every step.
        `replay`: the steps `weights` index, when not the rollouts' replay window (whose human steps that
        `rl.human_steps` leaves out get weight 0); `mixing`: instead of rl.replay_mixing."""
        learner, rl = self.learner, self.cfg.rl
        if replay is None and rollouts is not None:
            replay = rollouts.buffer
            if weights is not None and rl.human_steps != "all":
                kept = np.concatenate([imitated_human_steps(ep, rl.human_steps) for ep in rollouts.episodes])
                record["weights/human_steps_left_out"] = int((~kept).sum())
                weights = weights * kept
        if weights is not None:
            record["weights/nonzero_share"] = float((weights > 0).mean())

        def step() -> None:
            learner.average()
            progress.advance()

        with progress.phase(f"round {record['round']}: actor (updates)", rl.updates_per_round, kind="update"):
            record.update(actor_updates(
                learner.policy, learner.optimizer, steps=rl.updates_per_round, batch_size=rl.batch_size,
                demos=learner.demos, replay=replay, replay_weights=weights,
                demo_fraction=rl.demo_fraction, aux_weight=0.0, rng=learner.rng, mixing=mixing or rl.replay_mixing,
                loss_fn=loss_fn, train_mode=train_mode, on_step=step, demo_weights=learner.demo_weights,
            ))  # fmt: skip

    # -- how its policy is evaluated -------------------------------------------------------------------------------------
    def eval_runner(self, policy: Any) -> ChunkPolicy:
        """What acts in the round and final evaluations: the policy's own ODE chunks (DSRL: steered by its actor)."""
        return ChunkPolicy(policy, noise_scale=self.cfg.eval.noise_scale)

    # -- how a checkpoint it saved acts (kinema eval, sim, deploy: `kinema.train.acting.load_acting`) --------------------
    @classmethod
    def checkpoint_noise_scale(cls, policy: Any, state: dict[str, Any] | None) -> float:
        """The initial-noise scale the checkpoint's run evaluated with: the policy's `inference_noise_scale`."""
        return getattr(policy.config, "inference_noise_scale", 1.0)

    @classmethod
    def acting(cls, policy: Any, state: dict[str, Any] | None, *, noise_scale: float) -> Acting:
        """How a checkpoint this method saved (`state`: its method.pt's, None for a checkpoint without one) acts alone:
        the policy's own chunks from its initial noise scaled by `noise_scale` (a policy that plans: its first
        candidate alone). Methods whose checkpoints act through an actor of their own (dsrl, residual) override it."""
        if policy.plans:  # its chunks alone, whatever planning_candidates the checkpoint keeps
            if noise_scale != 1.0:
                raise ValueError(f"a noise scale scales a flow sampler's initial noise; {type(policy).__name__} samples latents of its own (use 1)")
            return Acting(lambda: SelectChunkPolicy(policy, None, num_samples=1), "policy")
        acting = Acting(lambda: ChunkPolicy(policy, noise_scale=noise_scale),
                        "policy" if noise_scale == 1.0 else f"policy, initial noise scaled by {noise_scale:g}")  # fmt: skip
        if getattr(policy.config, "advantage_input", False):  # a recap checkpoint acts asking for its indicator
            asked = {0: "unconditioned", 1: "asking for improvements", 2: "asking for non-improvements"}[policy.config.advantage_condition]
            beta = policy.config.advantage_guidance
            acting.description += f", {asked} (Recap's indicator{f', guidance {beta:g}' if beta != 1 else ''})"
        return acting

    @classmethod
    def selection(cls, policy: Any, state: dict[str, Any] | None, *, num_samples: int, noise_scale: float,
                  margin: float = 0.0) -> Acting | None:  # fmt: skip
        """Best-of-N chunks by the value this method's checkpoint keeps (pa_rl: its chunk critic); None: it keeps
        none (a policy that predicts its own values, the video policy, then plans by them)."""
        return None

    def final_evaluations(self, policy: Any, progress: RunProgress) -> list[dict[str, Any]]:
        """Evaluation records beside the final one (PA-RL: value-guided selection at N samples, with its latency)."""
        return []

    # -- what a checkpoint keeps of the method (its critics) -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def export_state(self) -> dict[str, Any]:
        """What `kinema eval` needs of the method (saved as a checkpoint's `method.pt`): by default its state."""
        return self.state_dict()

    @classmethod
    def from_legacy_critics(cls, critics: dict[str, Any]) -> dict[str, Any]:
        """Its `state_dict` from a checkpoint written before the methods split (one `critics` dict for all)."""
        return {}


def roll_out_policy(
    runner: ChunkPolicy, cfg: TrainConfig, seeds: Sequence[int], round_index: int, *,
    on_episode: Callable[[Episode], None] | None = None, record: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[Episode]:  # fmt: skip
    """One episode per seed with `runner` acting (with the simulated human when `rl.interventions`), on this
    machine's env workers or on Ray actors (`rollout.backend`); the Ray backend's re-runs and weight broadcast go
    into `record`. Under torchrun rank 0 rolls out and every rank gets its episodes (and the runner's records)."""
    if world()[1] > 1:
        episodes = _roll_out(runner, cfg, seeds, round_index, on_episode, record, log) if is_main() else None
        episodes, runner.finished, runner.records, extra = broadcast_object(
            (episodes, runner.finished, runner.records, {k: v for k, v in (record or {}).items() if k.startswith("rollout/")})
        )  # fmt: skip
        if record is not None:
            record.update(extra)
        return episodes
    return _roll_out(runner, cfg, seeds, round_index, on_episode, record, log)


def _roll_out(
    runner: ChunkPolicy, cfg: TrainConfig, seeds: Sequence[int], round_index: int,
    on_episode: Callable[[Episode], None] | None, record: dict[str, Any] | None, log: Callable[[str], None] | None,
) -> list[Episode]:  # fmt: skip
    kwargs: dict[str, Any] = dict(image_size=cfg.policy.image_size, config=cfg.task_config or None)
    if cfg.rl.interventions:
        kwargs.update(actor="monitored", monitor=MonitorConfig())
    if cfg.rollout.backend == "ray":
        from kinema.train.ray_rollout import roll_out_on_ray

        episodes, reran, broadcast = roll_out_on_ray(runner, cfg, seeds, round_index, kwargs, on_episode=on_episode)
        if record is not None:
            record.update({"rollout/reran": reran, "rollout/broadcast_ms": broadcast["ms"], "rollout/broadcast_bytes": broadcast["bytes"]})
        if reran and log is not None:
            log(f"[yellow]round {round_index}: a Ray rollout actor died; {reran} episode(s) re-ran on a new one with the same seeds")
        return episodes
    num_envs = max(1, min(cfg.num_envs, len(seeds)))
    vector = make_vector(cfg.task, num_envs, num_workers=min(cfg.workers, num_envs), **kwargs)
    try:
        return collect(vector, runner, seeds, task_id=cfg.task, policy_version=f"round-{round_index}", on_episode=on_episode)
    finally:
        vector.close()
