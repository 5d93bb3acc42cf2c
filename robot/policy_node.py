"""The policy node: a policy drives a ROS 2 arm, behind the safety layer, and a human can take over at any moment.

    node = PolicyNode(transport, robot_config, policy, instruction="open the drawer")
    node.start()            # control loop + inference worker threads
    ...
    node.stop()

Inputs (topics from the robot config): `/joint_states` (joints matched by name), the cameras (raw `Image` or
`CompressedImage`, decoded with OpenCV), the instruction (`String`), takeover (`Bool`), teleop joint targets
(`Float64MultiArray`) or `Joy`, e-stop (`Bool`, latching). Outputs: `Float64MultiArray` on the forward-position
controller's `/…/commands`, or `JointTrajectory` chunks for a JointTrajectoryController; a JSON status once a second.

The control loop runs at `rates.control_hz` (or, with `trigger="state"`, on every fresh joint state, on the
transport's thread, with a watchdog tick when states stop). With `inference="sync"` a tick that has no action left
computes the chunk itself and runs it from index 0, as the simulator's evaluation does (the tick waits for the
policy). With `inference="async"` a worker thread computes the next chunk from the observation of tick s while the
current chunk executes, and the loop never waits on it: a chunk planned at tick s is a plan for ticks s, s+1, ...;
it is used from the first tick after it arrives, at the matching index (actions whose tick has passed are skipped),
and the next request goes out while `prefetch` actions remain, `prefetch` following the measured inference latency.
The default, `inference="auto"`, is sync while the measured inference takes at most half a tick (the first chunk is
computed in its tick, to measure it), else async.

The policy interface is the VLA's: `reset()`, `predict_action_chunk(batch) -> (B, H, A)` (torch or numpy), with
batch keys `observation.images.<cam>` (1, H, W, 3) uint8, `observation.state` (1, 8) float32 (EE pose from FK and the
gripper opening, as in sim), `task` [str], and `timestamp` (1,) seconds since the episode began (LeRobot's key; from
the joint states' header stamps when the robot stamps them, else from the control ticks).
A policy's optional `action_space` attribute is "ee_delta" (default, (7,) actions) or "joint" ((n_arm + 1,)
absolute arm joint targets plus the gripper action).

Malformed input (wrong lengths, missing joints, NaN, wrong image size, over-long joint lists, oversized compressed
frames) is rejected by the checks in robot/inputs.py, counted per reason in `node.rejected` and logged (the first, then
every 100th); the node keeps running. Samples over the DDS size cap (the loopback config's MaxSampleSize) are
dropped by CycloneDDS before they reach Python.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from robot import messages as msg
from robot.config import RobotConfig
from robot.counters import Counters, RejectionLog
from robot.inputs import InputRejected, decode_image, joint_positions
from robot.kinematics import ActionMapper, Kinematics
from robot.safety import SafetyDecision, SafetyLayer, SafetyLimits
from robot.transport.base import QOS_DEFAULT, QOS_SENSOR, Transport

log = logging.getLogger("kinema.robot")

MAX_INSTRUCTION_CHARS = 1000
TELEOP_TIMEOUT_S = 0.5  # a teleop command older than this is not executed (the arm holds)
# async: the next chunk is computed in the background while the current one runs, and runs from index 1 (the loop
# never waits); sync: at a tick with no action left the chunk is computed there and runs from index 0, as kinema eval
# acts. Sync spends the inference time inside the tick; async cost a drawer SFT 12 points in simulation (each action
# runs a tick later than the policy was trained to expect; benchmarks/RESULTS.md). auto: sync while the measured
# inference fits AUTO_SYNC_SHARE of a tick (the first chunk is computed synchronously to measure it), else async.
INFERENCE_MODES = ("auto", "sync", "async")
AUTO_SYNC_SHARE = 0.5


def check_inference(mode: str, name: str = "inference") -> str:
    """`mode` if it is one of INFERENCE_MODES, else a ValueError naming the option (`name`) and the valid modes."""
    if mode not in INFERENCE_MODES:
        raise ValueError(f"{name} {mode!r} is not known; valid: {', '.join(INFERENCE_MODES)}")
    return mode


# ----- simple policies (no simulator needed) ---------------------------------------------------------------------------
class ConstantPolicy:
    """Emits the same action every step: zeros are the zero-cost policy of the latency benchmark; NaN tests safety."""

    def __init__(self, action: np.ndarray | float = 0.0, *, chunk_size: int = 8, action_dim: int = 7, action_space: str = "ee_delta") -> None:
        self.chunk = np.broadcast_to(np.asarray(action, np.float32), (chunk_size, action_dim)).copy()
        self.action_space = action_space
        self.n_action_steps = chunk_size
        self.calls = 0

    def reset(self) -> None:
        pass

    def predict_action_chunk(self, batch: dict[str, Any]) -> np.ndarray:
        self.calls += 1
        return np.repeat(self.chunk[None], len(batch["task"]), axis=0)


HOLD_STILL = np.array([0, 0, 0, 0, 0, 0, -1.0])  # EE delta 0, gripper open: the zero-cost policy's action


# ----- the inference worker ------------------------------------------------------------------------------------------
@dataclass
class _Result:
    chunk: np.ndarray | None  # (H, A)
    tick: int  # the tick whose observation it was computed from
    generation: int
    seconds: float
    error: str = ""


class InferenceWorker:
    """One background thread running `policy.predict_action_chunk`; `submit` never blocks, `poll` never waits."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self._cv = threading.Condition()
        self._job: tuple[dict[str, Any], int, int] | None = None
        self._result: _Result | None = None
        self._busy = False
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kinema-inference", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._cv:
            return self._busy or self._job is not None

    def submit(self, batch: dict[str, Any], tick: int, generation: int) -> bool:
        with self._cv:
            if self._busy or self._job is not None:
                return False
            self._job = (batch, tick, generation)
            self._cv.notify_all()
            return True

    def while_idle(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run `fn` on the caller's thread once no prediction is running, with none starting until it returns; a
        queued job is dropped (it was planned before whatever `fn` changes)."""
        with self._cv:
            if not self._cv.wait_for(lambda: not self._busy, timeout):
                raise RuntimeError(f"the policy's predict_action_chunk did not finish within {timeout} s")
            self._job = None
            return fn()

    def poll(self) -> _Result | None:
        with self._cv:
            result, self._result = self._result, None
            return result

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._job is None and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                batch, tick, generation = self._job  # type: ignore[misc]
                self._job, self._busy = None, True
            result = self._predict(batch, tick, generation)
            with self._cv:
                self._result, self._busy = result, False
                self._cv.notify_all()  # while_idle() waits for this

    def predict_now(self, batch: dict[str, Any], tick: int, generation: int) -> _Result:
        """The chunk for `batch` computed on the caller's thread (the node's synchronous inference)."""
        return self.while_idle(lambda: self._predict(batch, tick, generation))

    def _predict(self, batch: dict[str, Any], tick: int, generation: int) -> _Result:
        start = time.perf_counter()
        try:
            out = self.policy.predict_action_chunk(batch)
            if hasattr(out, "detach"):
                out = out.detach().float().cpu().numpy()
            out = np.asarray(out, np.float64)
            if out.ndim != 3 or out.shape[0] != 1:
                raise ValueError(f"predict_action_chunk returned shape {out.shape}; expected (1, horizon, action_dim)")
            return _Result(out[0], tick, generation, time.perf_counter() - start)
        except Exception as err:  # a failing policy must not take the control loop down: the arm holds
            return _Result(None, tick, generation, time.perf_counter() - start, f"{type(err).__name__}: {err}")

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=5.0)


# ----- the node ----------------------------------------------------------------------------------------------------------
class PolicyNode:
    def __init__(
        self,
        transport: Transport,
        robot: RobotConfig,
        policy: Any,
        instruction: str = "",
        *,
        action_space: str | None = None,
        n_action_steps: int | None = None,
        trigger: str = "timer",
        kinematics: Kinematics | None = None,
        clock: Callable[[], float] = time.monotonic,
        status_period_s: float = 1.0,
        inference: str = "auto",
    ) -> None:
        if trigger not in ("timer", "state"):
            raise ValueError(f"trigger must be 'timer' (control_hz) or 'state' (every fresh joint state); got {trigger!r}")
        self.inference = check_inference(inference)
        self.transport, self.robot, self.policy = transport, robot, policy
        self.action_space = action_space or getattr(policy, "action_space", "ee_delta")
        if self.action_space not in ("ee_delta", "joint"):
            raise ValueError(f"action_space must be 'ee_delta' or 'joint'; got {self.action_space!r}")
        config = getattr(policy, "config", None)
        have = [c.name for c in robot.cameras]
        missing = [c for c in getattr(config, "cameras", ()) if c not in have]
        if missing:
            raise ValueError(
                f"the policy reads cameras {list(config.cameras)} but robot config {robot.name!r} has {have}; "
                "add them to its `cameras` (name = the policy's camera name)"
            )
        if self.action_space == "ee_delta" and getattr(config, "state_dim", 8) != 8:
            raise ValueError(f"the policy expects a {config.state_dim}-dim state; the bridge provides the (8,) EE state of sim")
        self.n_action_steps = int(n_action_steps or getattr(policy, "n_action_steps", 0) or getattr(config, "n_action_steps", 0) or 1)
        self.trigger = trigger
        self.clock = clock
        self.period = 1.0 / robot.rates.control_hz
        self.status_period_s = status_period_s
        self.joint_names = robot.command_joint_names
        self.n_arm = len(robot.joints)
        needs_fk = self.action_space == "ee_delta" or robot.kinematics.mjcf
        self.mapper = ActionMapper(robot, kinematics if kinematics is not None else (Kinematics.from_config(robot) if needs_fk else None))
        self.safety = SafetyLayer(
            SafetyLimits.from_robot(robot),
            ee_position=self.mapper.ee_position if robot.kinematics.mjcf else None,
            cameras=tuple(c.name for c in robot.cameras),
        )

        # Shared with the transport callbacks: guarded by self._lock.
        self._lock = threading.Lock()
        self._q: np.ndarray | None = None
        self._q_time: float | None = None
        self._q_stamp: float | None = None  # header stamp of the latest state (robot time), None when unstamped
        self._episode_stamp: float | None = None  # stamp of the first state of the episode
        self._images: dict[str, np.ndarray] = {}
        self._instruction = instruction
        self._instruction_changed = False
        self._takeover = False
        self._handback = False
        self._teleop: tuple[str, np.ndarray, float] | None = None  # ("joint" | "joy", values, receive time)
        self.rejected = RejectionLog(log)  # per reason; thread-safe, logs the first and every 100th
        self.success: bool | None = None

        # Owned by the control loop.
        self.tick_count = 0
        self._episode_tick = 0
        self._generation = 0
        self._queue: deque[tuple[int, np.ndarray]] = deque()  # (tick it is planned for, action)
        self._latency_ema: float | None = None
        self._last_status_pub = -math.inf
        self._published_trajectory_for = -1
        self._chunk_serial = 0
        self.stats = Counters()  # updated by the tick (any thread) and read by status(): thread-safe
        self.last_decision: SafetyDecision | None = None
        self.was_taken_over = False
        self.paused = False
        self.worker = InferenceWorker(policy)
        self._state_event = threading.Event()
        self._tick_lock = threading.RLock()
        self._running = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

        # 1. Outputs.
        r, t = robot, robot.topics
        if r.controller.type == "forward_position":
            self._cmd_pub = transport.publisher(r.controller.commands_topic, msg.Float64MultiArray)
        else:
            self._cmd_pub = transport.publisher(r.controller.trajectory_topic, msg.JointTrajectory)
        self._status_pub = transport.publisher(t.status, msg.String)
        # 2. Inputs. All volatile: a transient-local subscription does not match a volatile publisher (DDS durability
        # is request-offered), and an e-stop from `ros2 topic pub` (volatile by default) must always get through.
        self._subs = [
            transport.subscribe(t.joint_states, msg.JointState, self._on_joint_state, QOS_DEFAULT),
            transport.subscribe(t.instruction, msg.String, self._on_instruction, QOS_DEFAULT),
            transport.subscribe(t.takeover, msg.Bool, self._on_takeover, QOS_DEFAULT),
            transport.subscribe(t.teleop, msg.Float64MultiArray, self._on_teleop, QOS_DEFAULT),
            transport.subscribe(t.teleop_joy, msg.Joy, self._on_joy, QOS_DEFAULT),
            transport.subscribe(t.estop, msg.Bool, self._on_estop, QOS_DEFAULT),
            transport.subscribe(t.success, msg.Bool, self._on_success, QOS_DEFAULT),
        ]
        for cam in robot.cameras:
            kind = msg.Image if cam.format == "raw" else msg.CompressedImage
            self._subs.append(transport.subscribe(cam.topic, kind, self._image_callback(cam), QOS_SENSOR))

    # ----- input callbacks (transport threads) -----------------------------------------------------------------------
    def _reject(self, reason: str, detail: str) -> None:
        self.rejected.reject(reason, detail)

    def _on_joint_state(self, m: msg.JointState) -> None:
        try:
            q = joint_positions(m.name, m.position, self.joint_names)
        except InputRejected as err:
            return self._reject(f"joint_state_{err.reason}", f"{self.robot.topics.joint_states}: {err.detail}")
        now = self.clock()
        stamp = m.header.stamp.to_sec()
        with self._lock:
            self._q, self._q_time = q, now
            self._q_stamp = stamp if stamp > 0 else None
            if self._episode_stamp is None:
                self._episode_stamp = self._q_stamp
            self.safety.observe_state(q, now)
        if self.trigger == "state" and self._running:
            # Tick right here, on the transport's thread: a hand-off to the control thread would cost a wake-up
            # (and, on a loaded CPU, a scheduling delay) per state.
            self._state_event.set()
            self._guarded_tick()

    def _image_callback(self, cam) -> Callable[[Any], None]:
        def on_image(m: msg.Image | msg.CompressedImage) -> None:
            try:
                rgb = decode_image(m, (cam.height, cam.width))
            except InputRejected as err:
                return self._reject(f"image_{err.reason}", f"camera {cam.name!r} ({cam.topic}): {err.detail}")
            now = self.clock()
            with self._lock:
                self._images[cam.name] = rgb
                self.safety.observe_image(cam.name, now)

        return on_image

    def _on_instruction(self, m: msg.String) -> None:
        text = m.data.strip()
        if not text or len(text) > MAX_INSTRUCTION_CHARS:
            return self._reject(
                "instruction_length",
                f"{self.robot.topics.instruction}: {len(text)} characters (expected 1..{MAX_INSTRUCTION_CHARS})",
            )
        with self._lock:
            if text != self._instruction:
                self._instruction, self._instruction_changed = text, True

    def _on_takeover(self, m: msg.Bool) -> None:
        with self._lock:
            if m.data and not self._takeover:
                self._takeover, self._teleop = True, None
                log.info("human takeover")
            elif not m.data and self._takeover:
                self._takeover, self._handback = False, True
                self.stats.add("handbacks")  # counted as it arrives: an e-stop may pause the ticks right after
                log.info("hand-back to the policy")

    def _on_teleop(self, m: msg.Float64MultiArray) -> None:
        if m.data.shape != (len(self.joint_names),):
            return self._reject(
                "teleop_length",
                f"{self.robot.topics.teleop}: {m.data.size} values; expected {len(self.joint_names)} ({self.joint_names})",
            )
        if not np.isfinite(m.data).all():
            return self._reject("teleop_nonfinite", f"values {m.data.tolist()}")
        with self._lock:
            self._teleop = ("joint", m.data.copy(), self.clock())

    def _on_joy(self, m: msg.Joy) -> None:
        if m.axes.size < 7 or m.axes.size > 64:
            return self._reject(
                "joy_axes", f"{self.robot.topics.teleop_joy}: {m.axes.size} axes; expected 7..64 (0-5 EE delta, 6 gripper)"
            )
        axes = m.axes[:7].astype(np.float64)
        if not np.isfinite(axes).all():
            return self._reject("joy_nonfinite", f"axes {axes.tolist()}")
        with self._lock:
            self._teleop = ("joy", np.clip(axes, -1, 1), self.clock())

    def _on_estop(self, m: msg.Bool) -> None:
        if m.data:
            with self._lock:
                self.safety.estop(True, f"{self.robot.topics.estop} = true")
            log.error("e-stop engaged: holding until reset")

    @property
    def estopped(self) -> bool:
        with self._lock:
            return self.safety.estopped

    def release_estop(self) -> None:
        """Release the latched e-stop: a person has released the robot's own and said so (never from a topic)."""
        with self._lock:
            self.safety.reset_estop()
        log.warning("e-stop released by the operator")

    def _on_success(self, m: msg.Bool) -> None:
        with self._lock:
            self.success = bool(m.data)

    # ----- observation --------------------------------------------------------------------------------------------------
    @property
    def command_topic(self) -> str:
        return self._cmd_pub.topic

    def command_subscriptions(self) -> int:
        """Subscriptions matched with the command publisher: the robot's controller, and any listener (this
        process's included)."""
        return self._cmd_pub.subscription_count()

    @property
    def instruction(self) -> str:
        with self._lock:
            return self._instruction

    @property
    def taken_over(self) -> bool:
        with self._lock:
            return self._takeover

    def observation(self) -> dict[str, Any] | None:
        """The policy's batch from the latest inputs, or None while a joint state or a camera frame is missing."""
        with self._lock:
            q, images, task = self._q, dict(self._images), self._instruction
            stamp, start = self._q_stamp, self._episode_stamp
        if q is None or any(c.name not in images for c in self.robot.cameras):
            return None
        batch: dict[str, Any] = {c.key: images[c.name][None] for c in self.robot.cameras}
        batch["observation.state"] = self.mapper.state(q)[None].astype(np.float32)
        batch["task"] = [task]
        # Episode time of the observation: from the robot's state stamps when it stamps them (a simulator that falls
        # behind the wall clock stamps its own time), else from the control ticks.
        if stamp is not None and start is not None and stamp >= start:
            elapsed = stamp - start
        else:
            elapsed = (self.tick_count - self._episode_tick) * self.period
        batch["timestamp"] = np.array([elapsed], np.float32)
        return batch

    # ----- the control tick ------------------------------------------------------------------------------------------------
    def start_episode(self) -> None:
        """A new episode: the policy restarts (reset, fresh chunk from the current state), time restarts at 0.

        Under the tick lock (no tick can refill the queue from a chunk planned before), and the policy is reset only
        while the inference worker is idle (never during its predict_action_chunk)."""
        with self._tick_lock:
            self._restart_chunk()
            self.worker.while_idle(self.policy.reset)
            self._episode_tick = self.tick_count
            self.paused = False
            self.was_taken_over = False
            with self._lock:
                self.success = None
                self._episode_stamp = self._q_stamp
                self.safety.forget_command()  # the robot may have been reset: step bounds start from the measured state

    def swap_policy(self, policy: Any) -> None:
        """Act with `policy` from now on, without stopping the node (a training round's new checkpoint). It must act
        as the old one did (action space, chunk steps, cameras, state). Once this returns, no chunk of the old policy
        is executed: the inference worker is idle while the policy changes, and every queued or in-flight chunk is
        dropped (the next is planned by the new one from the current state)."""
        config, old = getattr(policy, "config", None), getattr(self.policy, "config", None)
        mismatched = [
            name for name, new, was in (
                ("action_space", getattr(policy, "action_space", "ee_delta"), self.action_space),
                ("cameras", list(getattr(config, "cameras", ())), list(getattr(old, "cameras", ()))),
                ("state_dim", getattr(config, "state_dim", None), getattr(old, "state_dim", None)),
            ) if new != was
        ]  # fmt: skip
        if mismatched:
            raise ValueError(f"the new policy does not act as the running one: its {', '.join(mismatched)} differ(s)")

        def replace() -> None:
            self.worker.policy = self.policy = policy

        with self._tick_lock:
            self.worker.while_idle(replace)
            self._restart_chunk()
            self.stats.add("policy_swaps")

    def _restart_chunk(self) -> None:
        """Drop the queued and in-flight chunks: the next one is planned from the current state."""
        self._generation += 1
        self._queue.clear()

    def pause(self) -> None:
        """Stop commanding (between episodes): ticks publish nothing until `resume()` or `start_episode()`. A tick
        in progress finishes first; none publishes after this returns."""
        with self._tick_lock:
            self.paused = True

    def resume(self) -> None:
        with self._tick_lock:
            self.paused = False

    def tick(self, now: float | None = None) -> SafetyDecision | None:
        """One control step: choose a command (policy or human), pass it through safety, publish. Never blocks.
        Returns the safety decision (None while paused)."""
        with self._tick_lock:  # with trigger="state", ticks come from the transport thread and the watchdog
            return self._tick(now)

    def _guarded_tick(self) -> None:
        try:
            self.tick()
        except Exception:  # noqa: BLE001 - log and keep controlling; the safety layer holds on missing commands
            self.stats.add("tick_errors")
            log.exception("control tick failed")

    def _tick(self, now: float | None) -> SafetyDecision | None:
        now = self.clock() if now is None else now
        if self.paused:
            return None
        tick = self.tick_count
        with self._lock:
            takeover, handback, changed = self._takeover, self._handback, self._instruction_changed
            self._handback = self._instruction_changed = False
            teleop, q = self._teleop, self._q
        if handback or changed:
            self._restart_chunk()  # hand-back: the policy's next chunk starts from the state the human left
        if changed:
            self.stats.add("instruction_changes")

        # 1. Take a finished chunk: actions planned for ticks that have passed are skipped.
        result = self.worker.poll()
        if result is not None:
            self._take(result, tick)

        # 2. The command: the human's while taken over, else the policy's next action.
        synchronous = self._synchronous()
        command: np.ndarray | None = None
        popped = 0
        if takeover:
            self.was_taken_over = True
            self._queue.clear()
            if teleop is not None and q is not None and now - teleop[2] <= TELEOP_TIMEOUT_S:
                kind, values, _ = teleop
                command = values if kind == "joint" else self.mapper.to_command(values, q[: self.n_arm], "ee_delta")
        else:
            while self._queue and self._queue[0][0] < tick:
                self._queue.popleft()
            if synchronous and not self._queue and q is not None and (batch := self.observation()) is not None:
                self._take(self.worker.predict_now(batch, tick, self._generation), tick, first=0)
                self.stats.add("requests")
                self.stats.add("sync_requests")
            if self._queue and q is not None:
                _, action = self._queue.popleft()
                popped = 1
                try:
                    command = self.mapper.to_command(action, q[: self.n_arm], self.action_space)
                except ValueError as err:
                    self.stats.add("bad_actions")
                    log.warning("policy action rejected: %s", err)
            elif q is not None:
                self.stats.add("starved_ticks")

        # 3. Safety, then the wire.
        with self._lock:
            decision = self.safety.filter(command, now)
        self._publish(decision, tick, takeover)
        # 4. The next chunk's request, after the command is out: building the observation is off the latency path.
        if not takeover and not synchronous:
            self._maybe_request(tick, popped)
        self.last_decision = decision
        self.stats.add(f"source_{'human' if takeover else 'policy'}")
        self.tick_count += 1
        if now - self._last_status_pub >= self.status_period_s:
            self._last_status_pub = now
            self._status_pub.publish(msg.String(data=json.dumps(self.status())))
        return decision

    def _synchronous(self) -> bool:
        """Whether this tick computes the chunk it needs itself: always with "sync", never with "async"; with "auto"
        while the measured inference takes at most AUTO_SYNC_SHARE of a tick (unmeasured: yes) and no asynchronous
        request is in flight."""
        if self.inference != "auto":
            return self.inference == "sync"
        fits = self._latency_ema is None or self._latency_ema <= AUTO_SYNC_SHARE * self.period
        return fits and not self.worker.busy

    def _take(self, result: _Result, tick: int, first: int = 1) -> None:
        if result.error:
            n = self.stats.add("policy_errors")
            if n == 1 or n % 100 == 0:
                log.error("policy inference failed (%d times so far; the arm holds): %s", n, result.error)
            return
        if result.generation != self._generation:
            self.stats.add("discarded_chunks")  # planned before a hand-back or a new instruction
            return
        self._latency_ema = result.seconds if self._latency_ema is None else 0.8 * self._latency_ema + 0.2 * result.seconds
        dim = self.mapper.action_dim(self.action_space)
        if result.chunk.shape[1] != dim:
            self.stats.add("bad_actions")
            log.error("policy chunk has action dim %d; the %s action space needs %d", result.chunk.shape[1], self.action_space, dim)
            return
        # Planned for ticks result.tick, result.tick + 1, ...; asynchronously, action 0 is always in the past by now,
        # so a chunk runs n_action_steps actions from index 1 (the next request goes out while the last ones execute);
        # synchronously (`first` 0) it runs from index 0 at the tick it was planned at, as in simulation.
        plan = [(result.tick + i, result.chunk[i]) for i in range(first, min(len(result.chunk), first + self.n_action_steps))]
        plan = [(t, a) for t, a in plan if t >= tick]
        if not plan:
            self.stats.add("late_chunks")
            return
        self._queue = deque(plan)
        self._chunk_serial += 1
        self.stats.add("chunks")

    def _maybe_request(self, tick: int, popped: int) -> None:
        # Ask for the next chunk while `prefetch` actions remain (counting the one this tick executed), so that it
        # lands before the queue runs dry.
        prefetch = 1 if self._latency_ema is None else 1 + int(self._latency_ema / self.period)
        if len(self._queue) + popped > prefetch or self.worker.busy:
            return
        batch = self.observation()
        if batch is None:
            return
        if self.worker.submit(batch, tick, self._generation):
            self.stats.add("requests")

    def _publish(self, decision: SafetyDecision, tick: int, takeover: bool) -> None:
        if decision.command is None:
            return
        if self.robot.controller.type == "forward_position":
            self._cmd_pub.publish(msg.Float64MultiArray(data=decision.command))
            self.stats.add("commands_published")
            return
        # joint_trajectory: a JointTrajectoryController runs a chunk by itself. Publish the rest of the chunk when it
        # starts (or after a hold); an empty trajectory on a hold stops it where it is (ros2_controllers semantics).
        if decision.holding:
            self._cmd_pub.publish(msg.JointTrajectory(joint_names=list(self.joint_names)))
            self._published_trajectory_for = -1
            self.stats.add("trajectories_published")
            return
        if not takeover and self._published_trajectory_for == self._chunk_serial:
            return  # this chunk's trajectory is running
        points = [decision.command]
        with self._lock:
            q = self._q
        if not takeover and q is not None:
            arm = decision.command[: self.n_arm]
            for _, action in list(self._queue):
                nxt = self.safety.preview(points[-1], self.mapper.to_command(action, arm, self.action_space))
                if nxt is None:
                    break
                points.append(nxt)
                arm = nxt[: self.n_arm]
        traj = msg.JointTrajectory(
            joint_names=list(self.joint_names),
            points=[
                msg.JointTrajectoryPoint(positions=p, time_from_start=msg.Duration.from_sec((i + 1) * self.period))
                for i, p in enumerate(points)
            ],
        )
        self._cmd_pub.publish(traj)
        self._published_trajectory_for = -1 if takeover else self._chunk_serial
        self.stats.add("trajectories_published")

    # ----- threads ------------------------------------------------------------------------------------------------------
    def start(self) -> PolicyNode:
        self._stop.clear()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="kinema-control", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            if self.trigger == "state":
                # States tick the node themselves (_on_joint_state); without one for longer than the state timeout,
                # tick here anyway: the watchdog then holds the arm and says why.
                fresh = self._state_event.wait(max(self.period, self.safety.limits.state_timeout_s))
                self._state_event.clear()
                if fresh:
                    continue
            else:
                next_t += self.period
                delay = next_t - time.monotonic()
                if delay > 0:
                    self._stop.wait(delay)
                else:  # late: tick now and re-anchor, never burst (bursts would hit the bounded command rate)
                    self.stats.add("late_ticks")
                    next_t = time.monotonic()
            if self._stop.is_set():
                break
            self._guarded_tick()

    def stop(self) -> None:
        self._running = False
        self._stop.set()
        self._state_event.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self.worker.close()
        for sub in self._subs:
            sub.close()
        self._subs.clear()

    def __enter__(self) -> PolicyNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def status(self) -> dict[str, Any]:
        d = self.last_decision
        with self._lock:
            safety = self.safety.summary()
            rejected = self.rejected.snapshot()
            takeover = self._takeover
        return {
            "tick": self.tick_count,
            "status": d.status.value if d else None,
            "reason": d.reason if d else "",
            "takeover": takeover,
            "policy": getattr(self.policy, "fingerprint", ""),
            "inference": self.inference,
            "inference_ms": None if self._latency_ema is None else round(self._latency_ema * 1e3, 2),
            "stats": self.stats.snapshot(),
            "rejected": rejected,
            "safety": safety,
        }

