"""The sim-robot node: a `sim` MuJoCo task exposed as a ros2_control-like ROS 2 robot, for hardware-free deployment.

    node = SimRobotNode(transport, robot_config, task="drawer", seed=0)
    node.start()   # physics in real time; publishes until stop()

It publishes `/joint_states` (the robot config's arm and finger joints, by name) and each configured camera at its
rate, accepts forward-position commands (`Float64MultiArray`, the controller's joint order) and `JointTrajectory`
(joints matched by name, linearly interpolated between points; an empty trajectory holds the current position, as
ros2_controllers' JointTrajectoryController does), writes them to the sim's joint position actuators directly (what
`sim.arm.ArmController.apply` does after IK), reports success on a `Bool` topic, publishes the task's instruction
(latched, and again once a second), and resets on the episode topic (`String`: "reset", or "reset seed=N").

Messages are stamped with the simulation clock (seconds since the node started, continuing across resets), as a
ROS 2 simulator does for nodes with `use_sim_time`: on a loaded machine physics may fall behind the wall clock, and
the stamps say when, in the robot's time, each state was true.

This and `robot/sim_person.py` (the simulated person beside it) are the only `robot/` modules that import `sim/`:
the bridge itself runs on a real arm without the simulator.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import cv2
import mujoco
import numpy as np

import sim.tasks
from robot import messages as msg
from robot.config import RobotConfig
from robot.counters import Counters, RejectionLog
from robot.transport.base import QOS_DEFAULT, QOS_LATCHED, QOS_SENSOR, Transport

log = logging.getLogger("kinema.sim_robot")


class SimRobotNode:
    def __init__(
        self,
        transport: Transport,
        robot: RobotConfig,
        task: str,
        *,
        seed: int = 0,
        state_hz: float = 100.0,
        camera_hz: float = 30.0,
        task_config: dict[str, Any] | None = None,
        privileged_hz: float = 0.0,
    ) -> None:
        """`privileged_hz` > 0: also publish the simulator's privileged state on `topics.privileged` at that rate,
        for a simulated person (robot/sim_person.py), as a real robot's operator sees the scene."""
        cams = robot.cameras
        sizes = {(c.height, c.width) for c in cams}
        if len(sizes) > 1:
            raise ValueError(f"the sim robot renders every camera at one size; the robot config asks for {sorted(sizes)}")
        self.transport, self.robot, self.task_name = transport, robot, task
        # The env renders nothing itself (cameras=()): frames come from this node's renderer, made on the physics thread.
        self.env = sim.tasks.make(task, task_config, cameras=())
        self.model, self.data = self.env.model, self.env.data
        self.image_hw = next(iter(sizes)) if sizes else (64, 64)
        bad = [c.name for c in cams if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, c.name) < 0]
        if bad:
            raise ValueError(f"task {task!r} has no cameras {bad}; the sim's cameras are agentview, wrist, overview")
        self.joint_names = robot.command_joint_names
        self._qpos_idx, self._dof_idx, self._act_idx = [], [], []
        for name in self.joint_names:
            jid = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_JOINT, name)
            if jid < 0:
                raise ValueError(f"task {task!r} has no joint {name!r} (robot config {robot.name!r})")
            acts = np.flatnonzero((self.model.actuator_trntype == mujoco.mjtTrn.mjTRN_JOINT) & (self.model.actuator_trnid[:, 0] == jid))
            if acts.size != 1:
                raise ValueError(f"joint {name!r} of task {task!r} needs exactly one position actuator; found {acts.size}")
            self._qpos_idx.append(self.model.jnt_qposadr[jid])
            self._dof_idx.append(self.model.jnt_dofadr[jid])
            self._act_idx.append(int(acts[0]))
        self._qpos_idx, self._dof_idx, self._act_idx = map(np.array, (self._qpos_idx, self._dof_idx, self._act_idx))
        self._ctrl_lo, self._ctrl_hi = self.model.actuator_ctrlrange[self._act_idx].T
        self.dt = self.model.opt.timestep
        self.substeps = max(1, int(round(1.0 / (state_hz * self.dt))))
        self.camera_every = max(1, int(round(1.0 / (camera_hz * self.substeps * self.dt))))
        self.privileged_every = max(1, int(round(1.0 / (privileged_hz * self.substeps * self.dt)))) if privileged_hz > 0 else 0
        self.task_config = dict(task_config or {})
        self.seed = seed
        # Updated by the physics thread and the transport's: thread-safe. Rejections count as rejected_<reason>.
        self.counters = Counters()
        self._rejections = RejectionLog(log, "rejected command")
        self.success = False
        self.instruction = ""

        self._lock = threading.Lock()
        self._pending_ctrl: np.ndarray | None = None
        self._hold_request = False  # an empty trajectory: hold where the arm is (read on the physics thread)
        self._trajectory: tuple[float, np.ndarray, list[tuple[float, np.ndarray]], np.ndarray] | None = None
        self._reset_request: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renderer: mujoco.Renderer | None = None
        self.sim_time = 0.0

        t = robot.topics
        self._state_pub = transport.publisher(t.joint_states, msg.JointState)
        self._success_pub = transport.publisher(t.success, msg.Bool)
        self._instruction_pub = transport.publisher(t.instruction, msg.String, QOS_LATCHED)
        self._privileged_pub = transport.publisher(t.privileged, msg.String) if self.privileged_every else None
        self._cam_pubs = [
            (c, transport.publisher(c.topic, msg.Image if c.format == "raw" else msg.CompressedImage, QOS_SENSOR)) for c in cams
        ]
        self._subs = [
            transport.subscribe(robot.controller.commands_topic, msg.Float64MultiArray, self._on_command, QOS_DEFAULT),
            transport.subscribe(robot.controller.trajectory_topic, msg.JointTrajectory, self._on_trajectory, QOS_DEFAULT),
            transport.subscribe(t.episode, msg.String, self._on_episode, QOS_DEFAULT),
        ]
        self.reset(seed)

    # ----- episode ------------------------------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> None:
        self.seed = self.seed + 1 if seed is None else seed
        self.env.reset(seed=self.seed)
        self.instruction = self.env.task
        with self._lock:
            self._pending_ctrl, self._trajectory, self._hold_request = None, None, False
        self.success = False
        self.counters.add("resets")
        self._instruction_pub.publish(msg.String(data=self.instruction))
        log.info("episode: task %s seed %d: %s", self.task_name, self.seed, self.instruction)

    # ----- command callbacks (transport threads) -------------------------------------------------------------------------
    def _reject(self, reason: str, detail: str) -> None:
        self._rejections.reject(reason, detail)
        self.counters.add(f"rejected_{reason}")

    def _on_command(self, m: msg.Float64MultiArray) -> None:
        if m.data.shape != (len(self.joint_names),) or not np.isfinite(m.data).all():
            return self._reject("command", f"{m.data.size} values (expected {len(self.joint_names)} finite: {self.joint_names})")
        with self._lock:
            self._pending_ctrl, self._trajectory, self._hold_request = m.data.copy(), None, False
        self.counters.add("commands")

    def _on_trajectory(self, m: msg.JointTrajectory) -> None:
        unknown = [n for n in m.joint_names if n not in self.joint_names]
        if unknown or len(set(m.joint_names)) != len(m.joint_names):
            return self._reject("trajectory_joints", f"joint_names {m.joint_names}; known: {self.joint_names}")
        cols = [self.joint_names.index(n) for n in m.joint_names]
        points: list[tuple[float, np.ndarray]] = []
        for p in m.points:
            if p.positions.shape != (len(cols),) or not np.isfinite(p.positions).all():
                return self._reject("trajectory_point", f"a point has {p.positions.size} positions for {len(cols)} joints")
            points.append((p.time_from_start.to_sec(), p.positions))
        if any(b[0] <= a[0] for a, b in zip(points, points[1:])):
            return self._reject("trajectory_time", "time_from_start must increase")
        with self._lock:
            if not points:  # empty trajectory: stop where the arm is (qpos is read by the physics thread, not here)
                self._pending_ctrl, self._trajectory, self._hold_request = None, None, True
            else:
                self._trajectory = (None, np.array(cols), points, np.zeros(0))  # started by the physics thread
                self._hold_request = False
        self.counters.add("trajectories")

    def _on_episode(self, m: msg.String) -> None:
        words = m.data.strip().split()
        if not words or words[0] != "reset":
            return self._reject("episode", f"{m.data!r}; expected 'reset' or 'reset seed=N'")
        seed = -1
        for w in words[1:]:
            if w.startswith("seed=") and w[5:].lstrip("-").isdigit():
                seed = int(w[5:])
        with self._lock:
            self._reset_request = seed

    # ----- physics --------------------------------------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        with self._lock:
            pending, traj, hold = self._pending_ctrl, self._trajectory, self._hold_request
            self._pending_ctrl, self._hold_request = None, False
            if traj is not None and traj[0] is None:  # a new trajectory starts from the current targets
                traj = (self.sim_time, traj[1], traj[2], self.data.ctrl[self._act_idx[traj[1]]].copy())
                self._trajectory = traj
        if hold:  # read here, on the physics thread, never while mj_step runs
            pending = self.data.qpos[self._qpos_idx].copy()
        if pending is not None:
            self.data.ctrl[self._act_idx] = np.clip(pending, self._ctrl_lo, self._ctrl_hi)
        if traj is not None:
            start, cols, points, start_ctrl = traj
            t = self.sim_time - start
            times = np.array([0.0] + [p[0] for p in points])
            values = np.stack([start_ctrl] + [p[1] for p in points])
            target = np.array([np.interp(t, times, values[:, j]) for j in range(len(cols))])
            self.data.ctrl[self._act_idx[cols]] = np.clip(target, self._ctrl_lo[cols], self._ctrl_hi[cols])
            if t >= times[-1]:
                with self._lock:
                    if self._trajectory is traj:
                        self._trajectory = None

    def step(self) -> None:
        """Advance one state period (`substeps` physics steps) and publish what is due."""
        with self._lock:
            reset, self._reset_request = self._reset_request, None
        if reset is not None:
            self.reset(None if reset < 0 else reset)
        self._apply_commands()
        mujoco.mj_step(self.model, self.data, nstep=self.substeps)
        self.sim_time += self.substeps * self.dt
        n = self.counters.add("state_ticks") - 1
        self.publish_state()
        success = bool(self.env.is_success())
        if success != self.success or n % 10 == 0:
            self._success_pub.publish(msg.Bool(data=success))
        if n % 100 == 0:  # also once a second: volatile subscribers that joined late get the instruction too
            self._instruction_pub.publish(msg.String(data=self.instruction))
        if success and not self.success:
            log.info("success (seed %d) after %.2f s of sim time", self.seed, self.sim_time)
        self.success = success
        if n % self.camera_every == 0:
            self.publish_images()
        if self._privileged_pub is not None and n % self.privileged_every == 0:
            self.publish_privileged()

    def publish_state(self) -> None:
        header = msg.Header(stamp=msg.Time.from_sec(self.sim_time), frame_id="")
        self._state_pub.publish(
            msg.JointState(
                header=header, name=list(self.joint_names), position=self.data.qpos[self._qpos_idx],
                velocity=self.data.qvel[self._dof_idx], effort=self.data.actuator_force[self._act_idx],
            )
        )

    def publish_privileged(self) -> None:
        """The whole physics state and the episode's seed: a copy of the task made at that seed and set to it is
        this scene (what a simulated person reads progress and plans corrections from)."""
        state = self.env.get_state()
        self._privileged_pub.publish(msg.String(data=json.dumps({
            "task": self.task_name, "task_config": self.task_config, "seed": self.seed, "sim_time": round(self.sim_time, 4),
            "success": self.success, "state": state.tolist(),
        })))  # fmt: skip

    def render(self, camera: str) -> np.ndarray:
        if self._renderer is None:
            h, w = self.image_hw
            self._renderer = mujoco.Renderer(self.model, h, w)
        self._renderer.update_scene(self.data, camera=camera)
        return self._renderer.render()

    def publish_images(self) -> None:
        header = msg.Header(stamp=msg.Time.from_sec(self.sim_time), frame_id="")
        for cam, pub in self._cam_pubs:
            rgb = self.render(cam.name)
            if cam.format == "raw":
                pub.publish(msg.Image.from_array(rgb, header))
            else:
                ok, jpg = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
                pub.publish(msg.CompressedImage(header=header, format="jpeg", data=jpg.tobytes()))
        self.counters.add("frames")

    # ----- threads ---------------------------------------------------------------------------------------------------------
    def start(self) -> SimRobotNode:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kinema-sim-robot", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        period = self.substeps * self.dt
        t0 = time.monotonic()
        k = 0
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # noqa: BLE001 - keep the robot alive; a bad step is logged and counted
                self.counters.add("step_errors")
                log.exception("sim step failed")
            k += 1
            delay = t0 + k * period - time.monotonic()
            if delay > 0:
                self._stop.wait(delay)
            elif delay < -0.2:  # more than 200 ms behind real time (a loaded machine): resynchronise, and count it
                self.counters.add("realtime_resyncs")
                t0, k = time.monotonic(), 0
        self._close_renderer()  # a GL context is released on the thread that made it current

    def _close_renderer(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def close(self) -> None:
        self.stop()
        for sub in self._subs:
            sub.close()
        self._subs.clear()
        self._close_renderer()
        self.env.close()

    def __enter__(self) -> SimRobotNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
