"""Scripted experts: reactive controllers over privileged state, one per task, with tunable competence.

Each expert re-derives what to do from the current state every step (grasped? above the goal? drawer open?)
rather than replaying a fixed script. That makes it robust at zero noise, lets it recover from its own noisy
mistakes, and lets the simulated human (`sim.monitor`) hand control to it in the middle of any episode.

Competence knobs, for mixed-quality demonstrations:
- `noise`: Gaussian noise (std, in action units) added to every translation/rotation command;
- `hesitation`: per-step probability of starting a pause of a few idle steps;
- `wrong_grasp`: per-episode probability that the first grasp is aimed a few cm off the object.

`perturb` is not a competence knob but DART's (Laskey et al. 2017): slowly varying noise is added to the command the
arm *executes*, while the action recorded for imitation stays the expert's clean command at the state the noise led
to (`ScriptedExpert.label`). The demos then show how to return from the off-path states a learner's own errors reach.

`operator="teleop"` plays the plan the way a person at a teleoperation rig does (`TeleopConfig`): slower, with
pauses, hesitant back-offs and detours on the way; every decision stays the expert's, so it still succeeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mujoco
import numpy as np

from sim.env import POS_SCALE, ROT_SCALE, TabletopEnv
from sim.tasks.objects import HALF

OPEN, CLOSED = -1.0, 1.0


@dataclass
class TeleopConfig:
    """A simulated teleoperator's habits, over the expert's plan. Only the free hand (nothing held) is slowed,
    paused, turned back or sent round: with an object in hand the expert's own careful speed is kept."""

    speed: tuple[float, float] = (0.35, 0.55)  # per-episode speed of free-hand moves, a fraction of the expert's
    fine_speed: float = 0.6  # further factor within `fine_radius` of the sub-goal: careful final approach
    fine_radius: float = 0.06
    pause: float = 0.02  # per-step probability of stopping to look (free hand)
    pause_steps: tuple[int, int] = (4, 12)
    hesitation: float = 0.03  # per-step probability of a brief back-off on the way to a sub-goal
    detour: float = 0.7  # probability that a long move to a new sub-goal goes round a side waypoint
    detour_offset: tuple[float, float] = (0.04, 0.08)  # sideways, metres
    jitter: float = 0.15  # std of slowly varying (Ornstein-Uhlenbeck) noise on free-hand translation commands

    def __post_init__(self) -> None:
        for name in ("speed", "pause_steps", "detour_offset"):
            lo, hi = getattr(self, name)
            if not 0 <= lo <= hi:
                raise ValueError(f"TeleopConfig.{name} must be a range (low, high) with 0 <= low <= high; got {(lo, hi)}")
        if not 0 < self.speed[0] <= self.speed[1] <= 1 or not 0 < self.fine_speed <= 1:
            raise ValueError("TeleopConfig.speed and fine_speed are fractions of the expert's speed, in (0, 1]")
        for name in ("pause", "hesitation", "detour"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"TeleopConfig.{name} is a probability in [0, 1]; got {getattr(self, name)}")


OPERATORS = ("scripted", "teleop")
APPROACHES = ("gate", "funnel")


@dataclass
class ExpertConfig:
    noise: float = 0.0  # std of Gaussian action noise
    perturb: float = 0.0  # stationary std of Ornstein-Uhlenbeck noise on the executed command only (DART; the label stays clean)
    hesitation: float = 0.0  # per-step probability of a pause
    wrong_grasp: float = 0.0  # per-episode probability of a mis-aimed first grasp
    operator: str = "scripted"  # scripted | teleop: the plan played as a teleoperator would (`teleop`)
    # How a grasp comes down onto its object: gate (hold the height until within 8 mm and 0.1 rad, then descend) |
    # funnel (the height allowed grows with the distance in the plane, a cone over the object: every state's command
    # is a smooth function of it, and a gripper found low and off to one side is told to rise along the cone)
    approach: str = "gate"
    teleop: TeleopConfig = field(default_factory=TeleopConfig)

    def __post_init__(self) -> None:
        for name in ("noise", "perturb", "hesitation", "wrong_grasp"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"ExpertConfig.{name} must be a finite number >= 0; got {value}")
        if self.hesitation > 1 or self.wrong_grasp > 1:
            raise ValueError("ExpertConfig.hesitation and wrong_grasp are probabilities in [0, 1]")
        if self.approach not in APPROACHES:
            raise ValueError(f"ExpertConfig.approach must be one of {', '.join(APPROACHES)}; got {self.approach!r}")
        if self.operator not in OPERATORS:
            raise ValueError(f"ExpertConfig.operator must be one of {', '.join(OPERATORS)}; got {self.operator!r}")


def desired_rotation(yaw: float) -> np.ndarray:
    """Gripper pointing down, finger axis at `yaw` in the table plane."""
    y = np.array([np.cos(yaw), np.sin(yaw), 0.0])
    z = np.array([0.0, 0.0, -1.0])
    return np.stack([np.cross(y, z), y, z], axis=1)


def rotation_error(current: np.ndarray, desired: np.ndarray) -> np.ndarray:
    """World-frame axis-angle rotating `current` onto `desired`."""
    quat = np.zeros(4)
    mujoco.mju_mat2Quat(quat, (desired @ current.T).ravel())
    axis_angle = np.zeros(3)
    mujoco.mju_quat2Vel(axis_angle, quat, 1.0)
    return axis_angle


def nearest_equivalent_yaw(yaw: float, reference: float, period: float) -> float:
    """The yaw congruent to `yaw` modulo `period` that is closest to `reference`."""
    return reference + (yaw - reference + period / 2) % period - period / 2


class ScriptedExpert:
    """Base class: subclasses implement `plan()` returning (target EE position, finger yaw, gripper command)."""

    def __init__(self, env: TabletopEnv, config: ExpertConfig | None = None, *, seed: int | None = None) -> None:
        self.env = env
        self.config = config or ExpertConfig()
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self) -> None:
        self.pause = 0
        self.mis_aim = np.zeros(2)
        if self.rng.random() < self.config.wrong_grasp:
            angle = self.rng.uniform(0, 2 * np.pi)
            self.mis_aim = 0.035 * np.array([np.cos(angle), np.sin(angle)])
        # Drawn after the expert's own draws, so that a scripted expert's episodes are what they always were.
        self.operator = Teleoperator(self.config.teleop, self.rng) if self.config.operator == "teleop" else None
        self.perturbation = np.zeros(6)
        self.label: np.ndarray | None = None  # the clean command of the last call, what a demonstration records

    # Set by `plan()`: the move it returned is a transit through free space (no contact, no fine alignment), where a
    # teleoperator's detours, back-offs and jitter cannot spoil the task.
    transit = False

    def plan(self) -> tuple[np.ndarray, float, float]:
        raise NotImplementedError

    def holding(self) -> bool:
        return False

    carry_speed = 0.6  # max |action| while holding an object

    def __call__(self, obs: dict | None = None) -> np.ndarray:
        self.transit = False
        target, yaw, gripper = self.plan()
        if self.operator is not None and not self.holding():
            action = self.operator.act(self, target, yaw, gripper)
        else:
            action = self.move(target, yaw, gripper, speed=self.carry_speed if self.holding() else 1.0)
        if self.pause > 0:
            self.pause -= 1
            action[:6] = 0.0
        elif self.config.hesitation and self.rng.random() < self.config.hesitation:
            self.pause = int(self.rng.integers(3, 9))
        if self.config.noise:
            action[:6] += self.rng.normal(0.0, self.config.noise, 6)
        self.label = np.clip(action, -1.0, 1.0).astype(np.float32)
        if not self.config.perturb:
            return self.label.copy()
        # Correlation 0.8 per step (about 5 steps, a quarter of a second): the arm drifts off the path for a while, as
        # a learner's compounding error takes it, rather than jittering about it. Innovation std 0.6 sigma keeps the
        # process's stationary std at sigma.
        self.perturbation = 0.8 * self.perturbation + self.rng.normal(0.0, 0.6 * self.config.perturb, 6)
        executed = self.label.copy()
        executed[:6] = np.clip(executed[:6] + self.perturbation, -1.0, 1.0)
        return executed

    def move(self, target: np.ndarray, yaw: float, gripper: float, *, speed: float = 1.0) -> np.ndarray:
        # Proportional control that eases in near the target: abrupt stops with an object in hand make it slip.
        dpos = np.asarray(target) - self.env.ee_pos()
        dpos = dpos / POS_SCALE * min(1.0, 0.4 + np.linalg.norm(dpos) / 0.05)
        dpos *= min(1.0, speed / max(np.abs(dpos).max(), 1e-9))
        drot = rotation_error(self.env.arm.ee_mat(self.env.data), desired_rotation(yaw)) / ROT_SCALE
        return np.concatenate([np.clip(dpos, -1, 1), np.clip(drot, -1, 1), [gripper]])

    def home_yaw(self) -> float:
        return -np.pi / 2


class PickPlaceExpert(ScriptedExpert):
    """Approach, descend, grasp, lift, carry over the goal, lower, release, retreat. Used for pick_place and stack."""

    carry_height = 0.14

    def reset(self) -> None:
        super().reset()
        self.closing = 0
        self.reopen = 0
        self.released = False

    def holding(self) -> bool:
        return all(self.env.finger_contacts(self.env.target.body))

    def grasp_yaw(self, body: str, shape: str) -> float:
        if shape == "brick":  # close across the short side, i.e. finger axis along the brick's local x
            return nearest_equivalent_yaw(self.env.body_yaw(body), self.home_yaw(), np.pi)
        return nearest_equivalent_yaw(self.env.body_yaw(body) + np.pi / 2, self.home_yaw(), np.pi / 2)

    def plan(self) -> tuple[np.ndarray, float, float]:
        env = self.env
        slot = env.target
        ee, obj, goal = env.ee_pos(), env.body_pos(slot.body), env.goal_pos()
        place_z = env.place_height()
        grasped = all(env.finger_contacts(slot.body))
        yaw = self.grasp_yaw(slot.body, slot.shape)

        if self.released:
            on_goal = np.linalg.norm(obj[:2] - goal[:2]) < 0.03 and abs(obj[2] - place_z) < 0.015
            if on_goal:
                self.transit = True
                return np.array([ee[0], ee[1], max(ee[2], place_z) + 0.06]), env.ee_yaw(), OPEN
            self.released = False

        if grasped and self.reopen == 0:
            self.closing = 0
            offset = ee - obj
            dxy = np.linalg.norm(obj[:2] - goal[:2])
            if dxy > 0.01:
                if obj[2] < self.carry_height - 0.05 and dxy > 0.04:
                    return np.array([ee[0], ee[1], self.carry_height + offset[2]]), env.ee_yaw(), CLOSED
                return np.array([goal[0] + offset[0], goal[1] + offset[1], self.carry_height + offset[2]]), env.ee_yaw(), CLOSED
            if obj[2] - place_z > 0.006:
                return np.array([goal[0] + offset[0], goal[1] + offset[1], place_z + offset[2] - 0.01]), env.ee_yaw(), CLOSED
            self.released = True
            return ee, env.ee_yaw(), OPEN

        if self.reopen > 0:  # a grasp closed on nothing: open and back off before trying again
            self.reopen -= 1
            return np.array([ee[0], ee[1], obj[2] + 0.1]), yaw, OPEN
        if self.closing > 0:
            self.closing += 1
            if self.closing > 8:
                self.closing, self.reopen = 0, 6
                self.mis_aim = np.zeros(2)
            return ee, env.ee_yaw(), CLOSED

        aim = obj[:2] + self.mis_aim
        grasp_z = max(obj[2] - 0.005, 0.012)
        xy_err = np.linalg.norm(ee[:2] - aim)
        period = np.pi / 2 if slot.shape == "cube" else np.pi
        yaw_err = abs(env.ee_yaw() - yaw) % period
        yaw_err = min(yaw_err, period - yaw_err)
        hover_z = obj[2] + 0.09
        if self.config.approach == "funnel":
            return self.funnel(ee, aim, yaw, xy_err, yaw_err, grasp_z, hover_z)
        if xy_err > 0.008 or yaw_err > 0.1:
            self.transit = xy_err > 0.03
            if ee[2] < obj[2] + 0.05 and xy_err > 0.03:
                return np.array([ee[0], ee[1], hover_z]), yaw, OPEN
            return np.array([aim[0], aim[1], max(hover_z if xy_err > 0.03 else ee[2], grasp_z)]), yaw, OPEN
        if ee[2] > grasp_z + 0.01:
            return np.array([aim[0], aim[1], grasp_z]), yaw, OPEN
        self.closing = 1
        return np.array([aim[0], aim[1], grasp_z]), yaw, CLOSED

    def funnel(self, ee, aim, yaw, xy_err, yaw_err, grasp_z, hover_z) -> tuple[np.ndarray, float, float]:
        # Fingertips stay above the object's top (2.5 cm over grasp_z) until within 2 cm in the plane and 0.15 rad in yaw.
        cone_z = grasp_z + min(2.0 * max(xy_err - 0.008, 0.0) + min(0.03, 0.3 * max(yaw_err - 0.05, 0.0)), hover_z - grasp_z)
        self.transit = xy_err > 0.03
        if xy_err > 0.03 and ee[2] < cone_z - 0.02:  # low and off to one side: straight up first, not through the object
            return np.array([ee[0], ee[1], cone_z]), yaw, OPEN
        if xy_err <= 0.008 and yaw_err <= 0.1 and ee[2] <= grasp_z + 0.01:
            self.closing = 1
            return np.array([aim[0], aim[1], grasp_z]), yaw, CLOSED
        return np.array([aim[0], aim[1], cone_z]), yaw, OPEN


class PushExpert(ScriptedExpert):
    """Line up behind the object on the far side from the region, lower the closed gripper, push through."""

    carry_speed = 0.5  # pushing speed: faster pushes make the object tumble

    def holding(self) -> bool:
        return any(self.env.finger_contacts(self.env.target.body))

    def plan(self) -> tuple[np.ndarray, float, float]:
        env = self.env
        ee, obj, goal = env.ee_pos(), env.body_pos(env.target.body), env.goal_pos()
        d = goal[:2] - obj[:2]
        dist = np.linalg.norm(d)
        direction = d / max(dist, 1e-6)
        # Finger axis along the push: the front pad's broad face pushes (not the gap between the two pads).
        yaw = nearest_equivalent_yaw(np.arctan2(direction[1], direction[0]), self.home_yaw(), np.pi)
        push_z = 0.018
        behind = obj[:2] - direction * (HALF + 0.045) + self.mis_aim * 0.5
        rel = ee[:2] - obj[:2]
        along = rel @ direction
        lateral = abs(rel @ np.array([-direction[1], direction[0]]))
        in_line = along < -HALF and lateral < 0.015
        if ee[2] < 0.05 and in_line:
            self.mis_aim = np.zeros(2)
            through = obj[:2] + direction * min(dist, 0.06)
            return np.array([through[0], through[1], push_z]), yaw, CLOSED
        if np.linalg.norm(ee[:2] - behind) < 0.012:
            return np.array([behind[0], behind[1], push_z]), yaw, CLOSED
        self.transit = True
        if ee[2] < 0.07 and np.linalg.norm(ee[:2] - behind) > 0.02:
            return np.array([ee[0], ee[1], 0.1]), yaw, CLOSED
        return np.array([behind[0], behind[1], 0.1]), yaw, CLOSED


class DrawerExpert(ScriptedExpert):
    """Come in front of the vertical handle, slide the open fingers around it, close, pull straight back."""

    def reset(self) -> None:
        super().reset()
        self.closing = 0

    def plan(self) -> tuple[np.ndarray, float, float]:
        env = self.env
        ee, handle = env.ee_pos(), env.handle_pos()
        yaw = self.home_yaw()  # finger axis along y: the pads straddle the vertical bar
        grasp = handle + np.array([0.0, 0.0, -0.018])
        grasp[:2] += self.mis_aim * 0.5
        front = grasp + np.array([-0.09, 0.0, 0.0])
        touching = all(env.finger_contacts(f"drawer_{env.which}"))
        if touching and self.closing >= 5:
            return grasp + np.array([-0.12, 0.0, 0.0]), yaw, CLOSED
        if self.closing > 0:
            self.closing += 1
            if self.closing > 12:  # closed on nothing: back out to the front point and retry
                self.closing = 0
                self.mis_aim = np.zeros(2)
                return front, yaw, OPEN
            return grasp, yaw, CLOSED
        at_grasp = np.linalg.norm(ee - grasp) < 0.012
        if at_grasp:
            self.closing = 1
            return grasp, yaw, CLOSED
        in_corridor = abs(ee[1] - grasp[1]) < 0.015 and abs(ee[2] - grasp[2]) < 0.015 and ee[0] < grasp[0] + 0.01
        if in_corridor:
            return grasp, yaw, 0.0
        if np.linalg.norm(ee - front) < 0.015:
            return grasp, yaw, 0.0
        self.transit = True
        if ee[0] > front[0] + 0.03:  # too close to the cabinet: back away first
            return np.array([front[0], ee[1], max(ee[2], 0.05)]), yaw, 0.0
        return front, yaw, 0.0


class Teleoperator:
    """How a person plays an expert's free-hand moves (`TeleopConfig`): one per episode, drawing from the expert's
    generator, so an episode is the same for the same seed."""

    def __init__(self, config: TeleopConfig, rng: np.random.Generator) -> None:
        self.config, self.rng = config, rng
        self.speed = float(rng.uniform(*config.speed))
        self.subgoal: np.ndarray | None = None
        self.waypoint: np.ndarray | None = None
        self.stopped = 0  # steps left of a pause
        self.backing = 0  # steps left of a back-off
        self.drift = np.zeros(3)

    def act(self, expert: ScriptedExpert, target: np.ndarray, yaw: float, gripper: float) -> np.ndarray:
        cfg, rng = self.config, self.rng
        ee = expert.env.ee_pos()
        target = np.asarray(target, float)
        if not expert.transit:  # contact or fine alignment: only slower, and the odd pause
            self.subgoal = self.waypoint = None
            self.backing = 0
            if self.stopped == 0 and rng.random() < cfg.pause:
                self.stopped = int(rng.integers(cfg.pause_steps[0], cfg.pause_steps[1] + 1))
            action = expert.move(target, yaw, gripper, speed=cfg.fine_speed)
            if self.stopped:
                self.stopped -= 1
                action[:6] = 0.0
            return action
        if self.subgoal is None or np.linalg.norm(target - self.subgoal) > 0.03:  # a new sub-goal of the plan
            self.subgoal, self.waypoint = target.copy(), None
            if np.linalg.norm(target - ee) > 0.1 and rng.random() < cfg.detour:
                self.waypoint = self._side_waypoint(ee, target)
        if self.waypoint is not None and np.linalg.norm(self.waypoint - ee) < 0.02:
            self.waypoint = None
        goal = self.waypoint if self.waypoint is not None else target
        distance = np.linalg.norm(target - ee)
        speed = self.speed * (cfg.fine_speed if distance < cfg.fine_radius else 1.0)
        if self.stopped == 0 and self.backing == 0:
            if rng.random() < cfg.pause:
                self.stopped = int(rng.integers(cfg.pause_steps[0], cfg.pause_steps[1] + 1))
            elif distance > 0.05 and rng.random() < cfg.hesitation:
                self.backing = int(rng.integers(2, 6))
        if self.backing:  # second thoughts: ease back a little from the sub-goal, then go on
            self.backing -= 1
            goal, speed = ee - 0.5 * (goal - ee), 0.3 * self.speed
        action = expert.move(goal, yaw, gripper, speed=speed)
        if self.stopped:
            self.stopped -= 1
            action[:6] = 0.0
        elif cfg.jitter and distance > 0.03:
            self.drift = 0.8 * self.drift + rng.normal(0.0, cfg.jitter * 0.6, 3)
            action[:3] += self.drift
        return action

    def _side_waypoint(self, ee: np.ndarray, target: np.ndarray) -> np.ndarray:
        """Off to one side of the straight line, never lower than either end (nothing is knocked on the way)."""
        d = target[:2] - ee[:2]
        side = np.array([-d[1], d[0]]) / max(np.linalg.norm(d), 1e-6) if np.linalg.norm(d) > 0.02 else np.array([0.0, 1.0])
        mid = (ee + target) / 2
        mid[:2] += side * self.rng.choice([-1.0, 1.0]) * self.rng.uniform(*self.config.detour_offset)
        mid[2] = max(ee[2], target[2]) + self.rng.uniform(0.0, 0.04)
        return mid


EXPERTS: dict[str, type[ScriptedExpert]] = {
    "pick_place": PickPlaceExpert,
    "stack": PickPlaceExpert,
    "push": PushExpert,
    "drawer": DrawerExpert,
}


def make_expert(env: TabletopEnv, config: ExpertConfig | None = None, *, seed: int | None = None) -> ScriptedExpert:
    if env.name not in EXPERTS:
        raise ValueError(f"no scripted expert for task {env.name!r}; experts exist for {sorted(EXPERTS)}")
    return EXPERTS[env.name](env, config, seed=seed)
