"""Who acts: scripted demonstrations, and a simulated human who takes over from a policy before it fails.

Both are gymnasium wrappers, so they work unchanged inside vectorised envs and worker processes, around any
policy: the policy proposes an action; the wrapper decides what is executed and reports it in `info`:
- `info["action"]`: the action actually executed (the policy's, or the human's);
- `info["executed_by"]`: `ExecutedBy.POLICY` or `ExecutedBy.HUMAN`;
- `info["segment_labels"]` (last step only): the episode's per-step segment labels, as the Episode contract defines.

The simulated human follows RaC/HELP/ARMADA: a monitor with privileged state detects imminent failure (progress
stalls, or drops, e.g. a dropped object), takes over, first *recovers* (drives back toward an earlier in-distribution
pose, or rewinds the simulator state), then *corrects* (finishes the sub-task with the scripted expert) and hands
control back. The policy steps just before a takeover are labelled `failure_inducing`; steps where the policy did
not move are labelled `idle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from diffusion_rl.data import ExecutedBy, Segment, mark_failure_inducing
from sim.env import TabletopEnv
from sim.experts import ExpertConfig, make_expert


class DemoWrapper(gym.Wrapper):
    """Every step is the scripted expert's; whatever action is passed in is ignored. The recorded action is the
    expert's clean command (`ScriptedExpert.label`): the executed one unless `ExpertConfig.perturb` (DART) adds noise."""

    def __init__(self, env: TabletopEnv, expert: ExpertConfig | None = None, *, seed: int | None = None) -> None:
        super().__init__(env)
        self.expert = make_expert(env, expert, seed=seed)
        self.steps = 0

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        seed = kwargs.get("seed")
        if seed is not None:  # per-episode expert randomness follows the episode seed, for reproducibility
            self.expert.rng = np.random.default_rng([seed, 7])
        self.expert.reset()
        self.steps = 0
        return obs, info

    def step(self, action: Any):
        executed = self.expert()
        obs, reward, terminated, truncated, info = self.env.step(executed)
        self.steps += 1
        info["action"] = self.expert.label
        info["executed_by"] = ExecutedBy.HUMAN
        if terminated or truncated:
            info["segment_labels"] = np.full(self.steps, Segment.HUMAN, np.int8)
        return obs, reward, terminated, truncated, info


@dataclass
class MonitorConfig:
    stall_steps: int = 30  # policy steps without `min_gain` progress before the human takes over
    min_gain: float = 0.02
    drop: float = 0.15  # a fall of this much from the best progress so far means something went wrong
    failure_window: int = 8  # policy steps before a takeover labelled failure_inducing
    rewind: str = "drive"  # how the human recovers: "drive" back to an earlier pose, "teleport" the state, "none"
    correction_gain: float = 0.25  # progress the human adds before handing back
    max_correction_steps: int = 40
    max_takeovers: int = 3
    idle_motion: float = 0.002  # metres of end-effector motion below which a policy step counts as idle
    expert: ExpertConfig = field(default_factory=ExpertConfig)

    def __post_init__(self) -> None:
        if self.rewind not in ("drive", "teleport", "none"):
            raise ValueError(f"MonitorConfig.rewind must be 'drive', 'teleport' or 'none'; got {self.rewind!r}")
        if self.stall_steps < 1 or self.failure_window < 0 or self.max_takeovers < 0:
            raise ValueError("MonitorConfig: stall_steps >= 1, failure_window >= 0 and max_takeovers >= 0 are required")


class SimulatedHuman(gym.Wrapper):
    """A privileged monitor that takes over from the policy before it fails, recovers, corrects, and hands back."""

    def __init__(
        self,
        env: TabletopEnv,
        config: MonitorConfig | None = None,
        *,
        autopilot: ExpertConfig | None = None,
        seed: int | None = None,
    ) -> None:
        """`autopilot`: an imperfect scripted expert that stands in for the learned policy (incoming actions are then
        ignored), to produce intervention-structured data before any policy exists."""
        super().__init__(env)
        self.config = config or MonitorConfig()
        self.expert = make_expert(env, self.config.expert, seed=seed)
        self.autopilot = make_expert(env, autopilot, seed=seed) if autopilot is not None else None
        self._reset_state()

    def _reset_state(self) -> None:
        self.mode = "policy"  # policy | recovery | correction
        self.labels: list[int] = []
        self.takeovers = 0
        self.best_progress = 0.0
        self.best_pose: np.ndarray | None = None
        self.best_state: np.ndarray | None = None
        self.last_gain_step = 0
        self.human_steps = 0
        self.handback_progress = 0.0
        self.recovery_target: np.ndarray | None = None

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        seed = kwargs.get("seed")
        if seed is not None:
            self.expert.rng = np.random.default_rng([seed, 11])
        self.expert.reset()
        if self.autopilot is not None:
            if seed is not None:
                self.autopilot.rng = np.random.default_rng([seed, 13])
            self.autopilot.reset()
        self._reset_state()
        self.best_pose = self.env.unwrapped.ee_pos()
        self.best_state = self.env.unwrapped.get_state()
        info["executed_by"] = ExecutedBy.POLICY
        return obs, info

    @property
    def human_in_control(self) -> bool:
        return self.mode != "policy"

    def step(self, action: Any):
        env: TabletopEnv = self.env.unwrapped
        t = len(self.labels)
        handback = False
        if self.mode == "policy":
            before, opening_before, progress_before = env.ee_pos(), env.gripper_opening(), env.progress()
            executed = env.validate_action(self.autopilot() if self.autopilot is not None else action)
            obs, reward, terminated, truncated, info = self.env.step(executed)
            # Idle: the arm neither moved nor changed its grip, and nothing got better.
            idle = (
                np.linalg.norm(env.ee_pos() - before) < self.config.idle_motion
                and abs(env.gripper_opening() - opening_before) < 0.02
                and info["progress"] <= progress_before + 1e-3
            )
            self.labels.append(Segment.IDLE if idle else Segment.PROGRESS)
            executed_by = ExecutedBy.POLICY
            if self.watch(info["progress"], t) and not (terminated or truncated):
                if self.config.rewind == "teleport" and self.best_state is not None:
                    # The rewind happens now, so the next observation is the rewound state the human acts from.
                    env.set_state(self.best_state)
                    obs, info = env._observation(), env._info(env.is_success())
        else:
            executed_by = ExecutedBy.HUMAN
            if self.mode == "recovery":
                executed, label = self.recovery_action(env), Segment.RECOVERY
            else:
                executed, label = self.expert(), Segment.HUMAN
            obs, reward, terminated, truncated, info = self.env.step(executed)
            self.labels.append(label)
            self.human_steps += 1
            handback = self.advance_human(info["progress"])
        info["action"] = np.asarray(executed, np.float32)
        info["handback"] = handback
        info["executed_by"] = executed_by
        info["takeovers"] = self.takeovers
        if terminated or truncated:
            info["segment_labels"] = np.asarray(self.labels, np.int8)
        return obs, reward, terminated, truncated, info

    # ----- the monitor (public: the simulated person over ROS 2, robot/sim_person.py, drives the same one) -----------
    def watch(self, progress: float, t: int) -> bool:
        """Track the best progress so far; take over (and return True) when it stalls or drops."""
        cfg = self.config
        env: TabletopEnv = self.env.unwrapped
        if progress > self.best_progress + cfg.min_gain:
            self.best_progress, self.last_gain_step = progress, t
            self.best_pose, self.best_state = env.ee_pos(), env.get_state()
        stalled = t - self.last_gain_step >= cfg.stall_steps
        dropped = progress < self.best_progress - cfg.drop
        if (stalled or dropped) and self.takeovers < cfg.max_takeovers:
            self.take_over(t)
            return True
        return False

    def take_over(self, t: int) -> None:
        cfg = self.config
        env: TabletopEnv = self.env.unwrapped
        self.takeovers += 1
        # The policy's last steps led here: exclude them from imitation (HELP), never make them negatives.
        self.labels = [Segment(x) for x in mark_failure_inducing(np.asarray(self.labels, np.int8), t + 1, cfg.failure_window)]
        self.expert.reset()
        self.human_steps = 0
        if cfg.rewind == "teleport" and self.best_state is not None:
            self.mode = "correction"  # the state itself is restored by `step`, which then re-observes
        elif cfg.rewind == "drive" and self.best_pose is not None:
            # Back to where things last went well, a little higher so nothing is knocked on the way.
            self.recovery_target = self.best_pose + np.array([0.0, 0.0, 0.04])
            self.mode = "recovery"
        else:
            self.mode = "correction"
        # The last allowed takeover finishes the task (as HABC's operators did for failed rollouts).
        final = self.takeovers >= cfg.max_takeovers
        self.handback_progress = 1.01 if final else env.progress() + cfg.correction_gain

    def recovery_action(self, env: TabletopEnv) -> np.ndarray:
        holding = self.expert.holding()
        action = self.expert.move(self.recovery_target, env.ee_yaw(), 1.0 if holding else -1.0, speed=0.6)
        if np.linalg.norm(env.ee_pos() - self.recovery_target) < 0.02 or self.human_steps >= 15:
            self.mode = "correction"
        return action.astype(np.float32)

    def advance_human(self, progress: float) -> bool:
        """Hand control back once the correction has made its progress; True on the hand-back step."""
        cfg = self.config
        finishing = self.handback_progress > 1.0
        if self.mode == "correction" and (
            progress >= self.handback_progress or (not finishing and self.human_steps >= cfg.max_correction_steps + 15)
        ):
            self.mode = "policy"
            if self.autopilot is not None:
                self.autopilot.reset()
            self.best_progress = progress
            self.last_gain_step = len(self.labels)
            env: TabletopEnv = self.env.unwrapped
            self.best_pose, self.best_state = env.ee_pos(), env.get_state()
            return True
        return False
