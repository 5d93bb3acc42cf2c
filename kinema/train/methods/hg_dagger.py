"""`rl.method hg_dagger`: HG-DAgger (Kelly et al., 2019), the control of the human-in-the-loop arms.

The policy acts while the simulated human watches (`rl.interventions`, the same human the habc_hil arms get). Where
the human takes over, the steps the human executes label the states the policy led to. Every round's human segments
join one aggregate (DAgger aggregates: nothing leaves it when rounds leave the replay window). The policy imitates
the demonstrations plus that aggregate with the per-sample flow loss, every step at weight 1: no critic, no credit,
nothing of the policy's own steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from diffusion_rl.data import Episode, ExecutedBy
from diffusion_rl.data.lerobot_v3 import read_episodes
from kinema.train.buffer import StepBuffer
from kinema.train.methods.base import RLMethod, imitated_human_steps
from sim.env import CAMERAS

SAMPLING = ("uniform", "demo_fraction")


@dataclass
class HGDAggerOptions:
    # uniform: one pool of demonstrations and human steps, each drawn alike (the aggregate dataset HG-DAgger trains
    # on); demo_fraction (ours): rl.demo_fraction of every batch from the demonstrations, as the habc arms mix.
    sampling: str = "uniform"

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING:
            raise ValueError(f"rl.hg_dagger.sampling {self.sampling!r} is not known; valid: {', '.join(SAMPLING)}")


def imitation_mask(episode: Episode, human_steps: str = "all") -> np.ndarray:
    """The steps of a rollout HG-DAgger imitates: those the human executed, recovery and correction alike (with
    `rl.human_steps correction`, the corrections only)."""
    return (episode.executed_by == ExecutedBy.HUMAN) & imitated_human_steps(episode, human_steps)


def human_segments(episodes: Sequence[Episode], human_steps: str = "all") -> list[Episode]:
    """Each maximal run of `imitation_mask` as an episode of its own: a chunk target then ends where the human handed
    back (padded, so masked in the loss) instead of running on into the policy's actions."""
    out = []
    for ep in episodes:
        mask = np.concatenate([[False], imitation_mask(ep, human_steps), [False]])
        edges = np.flatnonzero(mask[1:] != mask[:-1])  # run starts and stops, alternating
        out += [ep.select(slice(int(start), int(stop))) for start, stop in zip(edges[::2], edges[1::2])]
    return out


class HGDAgger(RLMethod):
    name = "hg_dagger"
    policy_types = ("vla", "smolvla", "pi0")  # a separate action expert (SmolVLA's and pi0's: a transformer of its own)
    summary = "HG-DAgger, the human-in-the-loop control: imitate the demos plus every round's human takeovers, weight 1"
    options_key = "hg_dagger"
    options_class = HGDAggerOptions
    learns_from_recordings = True

    def __init__(self, learner) -> None:
        super().__init__(learner)
        self.aggregate: list[Episode] = []  # the human segments of every round so far, oldest first

    @classmethod
    def check_config(cls, cfg) -> None:
        if not cfg.rl.interventions:
            raise ValueError(
                "rl.method hg_dagger learns from a human's takeovers: it needs rl.interventions true (the simulated "
                "human); got rl.interventions false"
            )

    def prepare(self) -> None:
        """The aggregate of the rounds done before a resume, from the rollouts they wrote (interrupted rounds' rollouts
        were set aside and are not read)."""
        folder = self.learner.run.root / "rollouts"
        rounds = sorted(p for p in folder.glob("round-*") if p.name[6:].isdigit() and (p / "meta" / "info.json").exists())
        self.aggregate = [seg for path in rounds for seg in human_segments(read_episodes(path), self.cfg.rl.human_steps)]

    def update(self, rollouts, record, progress) -> None:
        new = human_segments(rollouts.new, self.cfg.rl.human_steps)
        self.aggregate.extend(new)
        record["hg_dagger/human_steps_new"] = sum(len(s) for s in new)
        record["hg_dagger/human_steps"] = sum(len(s) for s in self.aggregate)
        record["hg_dagger/segments"] = len(self.aggregate)
        human, weights = self.training_set()
        mixing = "pooled" if self.options.sampling == "uniform" else "fixed"
        self.imitate(rollouts, weights, record, progress, replay=human, mixing=mixing)

    def training_set(self) -> tuple[StepBuffer | None, np.ndarray | None]:
        """What the actor imitates besides the demonstrations: every aggregated human step, at weight 1."""
        if not self.aggregate:
            return None, None
        human = StepBuffer.from_episodes(self.aggregate, CAMERAS)
        return human, np.ones(len(human))
