"""The Episode: the one data contract for every robot trajectory in kinema.

Sim rollouts, scripted demonstrations and deployment episodes recorded on a real arm are all Episodes.
No package defines a parallel type. This module needs numpy only (no torch), so `sim/` and `robot/`
can emit Episodes without loading torch.

Step convention: an Episode of length T holds T (observation, action) pairs. `observations[k][t]` is what the
controller saw when it chose `action[t]`; `reward[t]` and `success[t]` are what the environment reported after
executing `action[t]`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FORMAT_VERSION = 1

IMAGE_PREFIX = "observation.images."
STATE_KEY = "observation.state"
PRIVILEGED_PREFIX = "privileged."


class ExecutedBy(enum.IntEnum):
    """Who produced the action at a step (the intervention flag)."""

    POLICY = 0
    HUMAN = 1


class Segment(enum.IntEnum):
    """Per-step segment labels (HELP's four kinds, plus human control).

    `IDLE` and `FAILURE_INDUCING` steps are excluded from imitation (weight 0), never turned into negatives.
    """

    PROGRESS = 0
    IDLE = 1
    FAILURE_INDUCING = 2
    RECOVERY = 3
    HUMAN = 4


SEGMENT_NAMES: tuple[str, ...] = tuple(s.name.lower() for s in Segment)


def mark_failure_inducing(segment: np.ndarray, takeover: int, window: int) -> np.ndarray:
    """HELP's labelling at a takeover: the `window` policy steps before it led there.

    `takeover` is the index of the first human step. Steps in [takeover - window, takeover) become FAILURE_INDUCING
    (excluded from imitation, never made negatives), except HUMAN and RECOVERY steps, which keep their labels.
    The one rule for the simulated human (sim/monitor.py) and for recorded deployments (robot/recorder.py).
    """
    out = np.array(segment, dtype=np.int8)
    span = slice(max(0, takeover - window), max(0, takeover))
    keep = np.isin(out[span], (Segment.HUMAN, Segment.RECOVERY))
    out[span] = np.where(keep, out[span], np.int8(Segment.FAILURE_INDUCING))
    return out


@dataclass
class Episode:
    """One trajectory, with the labels the RL core needs.

    Attributes:
        observations: `observation.images.<camera>` -> uint8 (T, H, W, 3); `observation.state` -> float32 (T, D).
        action: float32 (T, A).
        task: the language instruction.
        executed_by: int8 (T,), values of `ExecutedBy`.
        segment: int8 (T,), values of `Segment`.
        timestamp: float32 (T,), seconds from the episode start.
        reward: float32 (T,), the environment's (sparse) reward after each step.
        success: bool (T,), whether the task counted as solved after each step.
        outcome: the episode's outcome (success or failure). For recorded episodes it may come from a human
            label rather than from `success`.
        task_id: the task family name (e.g. `pick_place`).
        seed: the reset seed, so that episodes sharing task and seed form a group.
        policy_version: which policy produced the autonomous steps (`expert`, `sft`, `round-3`, ...).
        fps: control rate in Hz.
        complete: False when the recording stopped before the episode ended (crash, kill).
        privileged: `privileged.<name>` -> float32 (T, ...): simulator state kept out of the policy's input
            (object poses, contacts), offered as targets for auxiliary losses. Empty for real-robot episodes.
        wrong_target: whether the episode reached, at some step, a target its instruction did not name (the other
            drawer open, another object on the plate), which fails it; None where unknown (a task that defines no
            wrong target, a recording). Evaluation reports it; datasets do not store it.
    """

    observations: dict[str, np.ndarray]
    action: np.ndarray
    task: str
    executed_by: np.ndarray | None = None
    segment: np.ndarray | None = None
    timestamp: np.ndarray | None = None
    reward: np.ndarray | None = None
    success: np.ndarray | None = None
    outcome: bool | None = None
    task_id: str = ""
    seed: int | None = None
    policy_version: str = ""
    fps: float = 20.0
    complete: bool = True
    privileged: dict[str, np.ndarray] = field(default_factory=dict)
    wrong_target: bool | None = None

    def __post_init__(self) -> None:
        # Own copies of the dicts: normalising dtypes must not change the caller's objects.
        self.observations = dict(self.observations)
        self.privileged = dict(self.privileged)
        self.action = np.asarray(self.action, dtype=np.float32)
        if self.action.ndim != 2:
            raise ValueError(f"Episode.action must be (T, action_dim); got shape {self.action.shape}")
        T = len(self.action)
        if STATE_KEY not in self.observations:
            raise ValueError(f"Episode.observations needs {STATE_KEY!r}; got keys {sorted(self.observations)}")
        for key, value in list(self.observations.items()):
            if not key.startswith("observation."):
                raise ValueError(f"observation key {key!r} must start with 'observation.' (LeRobot naming)")
            value = np.asarray(value)
            if key.startswith(IMAGE_PREFIX):
                if value.dtype != np.uint8 or value.ndim != 4 or value.shape[-1] != 3:
                    raise ValueError(f"{key} must be uint8 (T, H, W, 3); got {value.dtype} {value.shape}")
            else:
                value = value.astype(np.float32, copy=False)
                if value.ndim != 2:
                    raise ValueError(f"{key} must be (T, dim); got shape {value.shape}")
            self.observations[key] = value
        for key, value in list(self.privileged.items()):
            if not key.startswith(PRIVILEGED_PREFIX):
                raise ValueError(f"privileged key {key!r} must start with {PRIVILEGED_PREFIX!r}")
            self.privileged[key] = np.asarray(value, dtype=np.float32)
        if self.executed_by is None:
            self.executed_by = np.zeros(T, np.int8)
        if self.segment is None:
            self.segment = np.where(np.asarray(self.executed_by) == ExecutedBy.HUMAN, Segment.HUMAN, Segment.PROGRESS)
        if self.timestamp is None:
            self.timestamp = np.arange(T, dtype=np.float32) / np.float32(self.fps)
        if self.reward is None:
            self.reward = np.zeros(T, np.float32)
        if self.success is None:
            self.success = np.zeros(T, bool)
            if self.outcome and T:
                self.success[-1] = True
        self.executed_by = np.asarray(self.executed_by, dtype=np.int8)
        self.segment = np.asarray(self.segment, dtype=np.int8)
        self.timestamp = np.asarray(self.timestamp, dtype=np.float32)
        self.reward = np.asarray(self.reward, dtype=np.float32)
        self.success = np.asarray(self.success, dtype=bool)
        if self.outcome is None:
            self.outcome = bool(self.success.any())
        self.outcome = bool(self.outcome)
        per_step = {
            **self.observations,
            **self.privileged,
            "executed_by": self.executed_by,
            "segment": self.segment,
            "timestamp": self.timestamp,
            "reward": self.reward,
            "success": self.success,
        }
        for key, value in per_step.items():
            if len(value) != T:
                raise ValueError(f"Episode field {key!r} has {len(value)} steps; action has {T}")
        if self.executed_by.size and not np.isin(self.executed_by, [e.value for e in ExecutedBy]).all():
            raise ValueError(f"executed_by values must be in {[e.value for e in ExecutedBy]} (policy, human)")
        if self.segment.size and not np.isin(self.segment, [s.value for s in Segment]).all():
            raise ValueError(f"segment values must be in {[s.value for s in Segment]} ({', '.join(SEGMENT_NAMES)})")

    def __len__(self) -> int:
        return len(self.action)

    @property
    def camera_keys(self) -> list[str]:
        return sorted(k for k in self.observations if k.startswith(IMAGE_PREFIX))

    @property
    def steps_to_success(self) -> int | None:
        """Number of steps until the task first counted as solved, or None if it never did."""
        hits = np.flatnonzero(self.success)
        return int(hits[0]) + 1 if hits.size else None

    @property
    def intervened(self) -> bool:
        return bool((self.executed_by == ExecutedBy.HUMAN).any())

    def select(self, steps: slice | np.ndarray) -> Episode:
        """The episode of the chosen steps (a slice, or a boolean mask or indices over T), every per-step field
        taken alike; the episode-level fields (outcome, seed, task, ...) kept."""
        return dataclasses.replace(
            self, observations={k: v[steps] for k, v in self.observations.items()}, action=self.action[steps],
            executed_by=self.executed_by[steps], segment=self.segment[steps], timestamp=self.timestamp[steps],
            reward=self.reward[steps], success=self.success[steps], privileged={k: v[steps] for k, v in self.privileged.items()},
        )  # fmt: skip

    def segments(self) -> list[tuple[int, int, ExecutedBy]]:
        """Maximal runs of steps under one controller, as (start, stop, executed_by) with stop exclusive."""
        runs: list[tuple[int, int, ExecutedBy]] = []
        start = 0
        for t in range(1, len(self) + 1):
            if t == len(self) or self.executed_by[t] != self.executed_by[start]:
                runs.append((start, t, ExecutedBy(int(self.executed_by[start]))))
                start = t
        return runs

    def meta(self) -> dict[str, Any]:
        """Per-episode metadata, JSON-serialisable."""
        return {
            "task": self.task,
            "task_id": self.task_id,
            "seed": self.seed,
            "policy_version": self.policy_version,
            "outcome": self.outcome,
            "steps_to_success": self.steps_to_success,
            "complete": self.complete,
            "length": len(self),
            "intervened": self.intervened,
        }
