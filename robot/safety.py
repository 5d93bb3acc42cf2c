"""The safety layer: every command to the arm, from the policy or from a human, passes here. Pure numpy.

Rules, checked in this order each control tick (`SafetyLayer.filter`):
1. bounded rate: a command closer than 1/max_rate_hz to the last published one is dropped (nothing published);
2. e-stop: once latched, hold until `reset_estop()` (a new e-stop `False` message does not release it);
3. no motion before the first valid joint state (nothing published);
4. stale state: no fresh joint state within `state_timeout_s`: hold;
5. stale image: some camera sent no fresh frame within `image_timeout_s`: hold;
6. NaN/inf (or a wrong-length command): hold the last safe command and raise the fault flag;
7. joint position limits: clip;
8. max joint step per tick, relative to the last published command (the measured position before the first): clip;
9. EE workspace box (FK of the command): hold if the command leaves the box, unless it brings an arm that is
   already outside closer to it;
10. joint position limits again, last: nothing outside [lower, upper] is ever published. When the step reference
   (a measured position) lies outside the limits, the limits win over the step bound.

"Hold" publishes the last safe command again (the measured position, clipped to the limits, if none was sent yet),
so a position controller stays where it is; the decision carries the status and a reason a person can read.
Counters count every status.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class SafetyStatus(enum.Enum):
    OK = "ok"
    CLIPPED = "clipped"  # published, after clipping to the joint limits and/or the step bound
    HOLD_ESTOP = "hold_estop"
    HOLD_STALE_STATE = "hold_stale_state"
    HOLD_STALE_IMAGE = "hold_stale_image"
    HOLD_NONFINITE = "hold_nonfinite"
    HOLD_WORKSPACE = "hold_workspace"
    HOLD_NO_COMMAND = "hold_no_command"  # the caller had nothing to send (policy not ready, no teleop yet)
    BLOCKED_NO_STATE = "blocked_no_state"  # nothing published: no valid joint state yet
    BLOCKED_RATE = "blocked_rate"  # nothing published: too soon after the last command

    @property
    def holding(self) -> bool:
        return self.value.startswith("hold")

    @property
    def publishes(self) -> bool:
        return not self.value.startswith("blocked")


@dataclass
class SafetyLimits:
    """Limits over the command vector (arm joints, then fingers). Build with `SafetyLimits.from_robot`."""

    lower: np.ndarray
    upper: np.ndarray
    max_step: np.ndarray
    workspace_min: np.ndarray = field(default_factory=lambda: np.full(3, -np.inf))
    workspace_max: np.ndarray = field(default_factory=lambda: np.full(3, np.inf))
    state_timeout_s: float = 0.1
    image_timeout_s: float = 0.1
    max_rate_hz: float = 40.0

    def __post_init__(self) -> None:
        self.lower, self.upper = np.asarray(self.lower, np.float64), np.asarray(self.upper, np.float64)
        self.max_step = np.broadcast_to(np.asarray(self.max_step, np.float64), self.lower.shape).copy()
        self.workspace_min = np.asarray(self.workspace_min, np.float64)
        self.workspace_max = np.asarray(self.workspace_max, np.float64)
        if self.lower.shape != self.upper.shape or not (self.lower < self.upper).all():
            raise ValueError(f"SafetyLimits: expected lower < upper elementwise; got lower={self.lower}, upper={self.upper}")
        if not (self.max_step > 0).all():
            raise ValueError(f"SafetyLimits.max_step must be positive; got {self.max_step}")

    @classmethod
    def from_robot(cls, robot) -> SafetyLimits:  # robot: robot.config.RobotConfig (kept untyped: no import cycle)
        r = robot.rates
        return cls(
            lower=robot.lower, upper=robot.upper, max_step=robot.max_step,
            workspace_min=np.asarray(robot.workspace.min), workspace_max=np.asarray(robot.workspace.max),
            state_timeout_s=r.state_timeout_ms / 1e3, image_timeout_s=r.image_timeout_ms / 1e3, max_rate_hz=r.max_command_hz,
        )


@dataclass
class SafetyDecision:
    command: np.ndarray | None  # what to publish; None: publish nothing
    status: SafetyStatus
    reason: str = ""

    @property
    def holding(self) -> bool:
        return self.status.holding


class SafetyLayer:
    """Stateful filter between command sources and the wire. `ee_position(command) -> (3,)` is the FK used for the
    workspace box (None disables the box). Times are seconds on one monotonic clock, passed in by the caller."""

    def __init__(
        self,
        limits: SafetyLimits,
        *,
        ee_position: Callable[[np.ndarray], np.ndarray] | None = None,
        cameras: tuple[str, ...] = (),
    ) -> None:
        self.limits = limits
        self.ee_position = ee_position
        self.cameras = tuple(cameras)
        self.counters: Counter[str] = Counter()
        self.fault = False  # raised by a non-finite command; cleared only by clear_fault()
        self.fault_reason = ""
        self.estopped = False
        self.estop_reason = ""
        self._state: np.ndarray | None = None
        self._state_time: float | None = None
        self._image_times: dict[str, float] = {}
        self._last_command: np.ndarray | None = None
        self._last_publish: float | None = None

    # ----- inputs ----------------------------------------------------------------------------------------------------
    def observe_state(self, positions: np.ndarray, now: float) -> bool:
        """A measured joint state (command-joint order). Non-finite or wrong-length states are not valid."""
        q = np.asarray(positions, np.float64)
        if q.shape != self.limits.lower.shape or not np.isfinite(q).all():
            self.counters["invalid_state"] += 1
            return False
        self._state, self._state_time = q.copy(), now
        return True

    def observe_image(self, camera: str, now: float) -> None:
        self._image_times[camera] = now

    def estop(self, engaged: bool, reason: str = "e-stop topic") -> None:
        """Engage the latching e-stop (False is ignored: only `reset_estop()` releases it)."""
        if engaged and not self.estopped:
            self.estopped, self.estop_reason = True, reason
            self.counters["estop_engaged"] += 1

    def reset_estop(self) -> None:
        self.estopped, self.estop_reason = False, ""

    def forget_command(self) -> None:
        """Forget the last command (after the robot was reset): holds and step bounds use the measured state again."""
        self._last_command = None

    def clear_fault(self) -> None:
        self.fault, self.fault_reason = False, ""

    @property
    def has_state(self) -> bool:
        return self._state is not None

    @property
    def last_command(self) -> np.ndarray | None:
        return None if self._last_command is None else self._last_command.copy()

    def hold_target(self) -> np.ndarray | None:
        """What a hold publishes: the last command, else the measured position; always inside the joint limits (an
        arm measured just past a limit is held at the limit, never commanded further out)."""
        target = self._last_command if self._last_command is not None else self._state
        return None if target is None else np.clip(target, self.limits.lower, self.limits.upper)

    # ----- the filter ------------------------------------------------------------------------------------------------
    def filter(self, command: np.ndarray | None, now: float) -> SafetyDecision:
        """Decide what to publish for `command` (None: the source has nothing this tick) at time `now`."""
        decision = self._decide(command, now)
        self.counters[decision.status.value] += 1
        if decision.command is not None:
            self._last_command = decision.command.copy()
            self._last_publish = now
        return decision

    def _hold(self, status: SafetyStatus, reason: str) -> SafetyDecision:
        return SafetyDecision(self.hold_target(), status, reason)

    def _decide(self, command: np.ndarray | None, now: float) -> SafetyDecision:
        lim = self.limits
        # 1. Bounded rate.
        if self._last_publish is not None and now - self._last_publish < 1.0 / lim.max_rate_hz - 1e-9:
            return SafetyDecision(None, SafetyStatus.BLOCKED_RATE, f"{(now - self._last_publish) * 1e3:.1f} ms since the last command")
        # 2. Latched e-stop.
        if self.estopped:
            return self._hold(SafetyStatus.HOLD_ESTOP, f"e-stop latched ({self.estop_reason})")
        # 3. No motion before the first valid state.
        if self._state is None or self._state_time is None:
            return SafetyDecision(None, SafetyStatus.BLOCKED_NO_STATE, "no valid joint state received yet")
        # 4-5. Watchdogs.
        age = now - self._state_time
        if age > lim.state_timeout_s:
            return self._hold(SafetyStatus.HOLD_STALE_STATE, f"joint state is {age * 1e3:.0f} ms old (limit {lim.state_timeout_s * 1e3:.0f} ms)")
        for cam in self.cameras:
            seen = self._image_times.get(cam)
            if seen is None:
                return self._hold(SafetyStatus.HOLD_STALE_IMAGE, f"no frame from camera {cam!r} yet")
            if now - seen > lim.image_timeout_s:
                return self._hold(
                    SafetyStatus.HOLD_STALE_IMAGE,
                    f"camera {cam!r} frame is {(now - seen) * 1e3:.0f} ms old (limit {lim.image_timeout_s * 1e3:.0f} ms)",
                )
        if command is None:
            return self._hold(SafetyStatus.HOLD_NO_COMMAND, "no command this tick")
        # 6. NaN/inf, wrong length.
        cmd = np.asarray(command, np.float64).reshape(-1)
        if cmd.shape != lim.lower.shape:
            self.fault, self.fault_reason = True, f"command has {cmd.size} values; expected {lim.lower.size}"
            return self._hold(SafetyStatus.HOLD_NONFINITE, self.fault_reason)
        if not np.isfinite(cmd).all():
            bad = np.flatnonzero(~np.isfinite(cmd)).tolist()
            self.fault, self.fault_reason = True, f"non-finite command at joints {bad}"
            return self._hold(SafetyStatus.HOLD_NONFINITE, self.fault_reason)
        # 7. Joint limits.
        clipped = np.clip(cmd, lim.lower, lim.upper)
        reasons = []
        if (clipped != cmd).any():
            reasons.append(f"joint limits at {np.flatnonzero(clipped != cmd).tolist()}")
        # 8. Step bound, from the last command (or the measured position), then 10. the limits as the final word.
        reference = self._last_command if self._last_command is not None else self._state
        stepped = np.clip(np.clip(clipped, reference - lim.max_step, reference + lim.max_step), lim.lower, lim.upper)
        if (stepped != clipped).any():
            reasons.append(f"step bound at {np.flatnonzero(stepped != clipped).tolist()}")
        # 9. Workspace box.
        if self.ee_position is not None:
            out = self.outside_distance(self.ee_position(stepped))
            if out > 0 and out >= self.outside_distance(self.ee_position(reference)) - 1e-9:
                return self._hold(SafetyStatus.HOLD_WORKSPACE, f"command takes the end effector {out * 100:.1f} cm outside the workspace box")
        if reasons:
            return SafetyDecision(stepped, SafetyStatus.CLIPPED, "; ".join(reasons))
        return SafetyDecision(stepped, SafetyStatus.OK)

    def preview(self, previous: np.ndarray, command: np.ndarray) -> np.ndarray | None:
        """Rules 6-10 on a planned point after `previous` (a trajectory's next point), changing no state: the point
        clipped to the limits and the step bound, or None where the plan must stop (non-finite, wrong length, or
        outside the workspace box)."""
        lim = self.limits
        cmd = np.asarray(command, np.float64).reshape(-1)
        if cmd.shape != lim.lower.shape or not np.isfinite(cmd).all():
            return None
        prev = np.asarray(previous, np.float64)
        point = np.clip(np.clip(np.clip(cmd, lim.lower, lim.upper), prev - lim.max_step, prev + lim.max_step),
                        lim.lower, lim.upper)
        if self.ee_position is not None and self.outside_distance(self.ee_position(point)) > 0:
            return None
        return point

    def outside_distance(self, ee: np.ndarray) -> float:
        """Distance (m) from `ee` to the workspace box; 0 inside, inf for a non-finite position."""
        ee = np.asarray(ee, np.float64)
        if not np.isfinite(ee).all():
            return float("inf")
        gap = np.maximum(self.limits.workspace_min - ee, 0) + np.maximum(ee - self.limits.workspace_max, 0)
        return float(np.linalg.norm(gap))

    def summary(self) -> dict[str, object]:
        return {
            "counters": dict(self.counters), "fault": self.fault, "fault_reason": self.fault_reason,
            "estopped": self.estopped, "estop_reason": self.estop_reason,
        }
