"""A simulated person at a ROS 2 robot: the in-simulation simulated human (`sim.monitor.SimulatedHuman`), acting only
through the topics a person's teleop device uses.

    person = SimulatedPerson(transport, robot_config)   # beside a SimRobotNode made with privileged_hz > 0

It reads the sim robot's privileged state (`topics.privileged`: the episode's seed and the MuJoCo state) into a copy
of the task, so it sees the scene as the in-sim monitor does; when the task's progress stalls or drops it publishes
takeover `True` (latched, as a person's switch), drives the arm with the scripted expert's end-effector actions as
`Joy` axes at the rate the state arrives (the policy node turns them into joint commands through its safety layer),
and publishes `False` once its correction has made its progress. Its recovery is the monitor's "drive" back to the
last good pose (a "teleport" rewind cannot be done through topics). It stands down when the episode succeeds, and
starts again on the next scene (a new seed, or "reset" on the episode topic).

Only `kinema sim-robot --person` and tests make one: a real robot has a real person.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np

import sim.tasks
from diffusion_rl.data import Segment
from robot import messages as msg
from robot.config import RobotConfig
from robot.counters import Counters
from robot.transport.base import QOS_DEFAULT, QOS_LATCHED, Transport
from sim.monitor import MonitorConfig, SimulatedHuman

log = logging.getLogger("kinema.sim_person")


class SimulatedPerson:
    def __init__(self, transport: Transport, robot: RobotConfig, *, monitor: MonitorConfig | None = None) -> None:
        self.robot = robot
        self.monitor = monitor or MonitorConfig()
        if self.monitor.rewind == "teleport":
            raise ValueError("a person at a robot cannot teleport its state: MonitorConfig.rewind must be 'drive' or 'none'")
        self.counters = Counters()  # takeovers, handbacks, commands, episodes
        self.in_control = False
        self._lock = threading.Lock()
        self._env: Any = None
        self._human: SimulatedHuman | None = None
        self._scene: tuple[str, str, int] | None = None  # (task, task_config JSON, seed) the copy is reset to
        self._made: tuple[str, str] | None = None  # (task, task_config JSON) the copy was made for
        self._done = False  # the episode succeeded: nothing to watch until the next scene
        t = robot.topics
        self._takeover_pub = transport.publisher(t.takeover, msg.Bool, QOS_LATCHED)
        self._joy_pub = transport.publisher(t.teleop_joy, msg.Joy)
        self._subs = [
            transport.subscribe(t.privileged, msg.String, self._on_privileged, QOS_DEFAULT),
            transport.subscribe(t.episode, msg.String, self._on_episode, QOS_DEFAULT),
        ]

    # ----- callbacks (transport threads) --------------------------------------------------------------------------------
    def _on_episode(self, m: msg.String) -> None:
        if m.data.strip().startswith("reset"):
            with self._lock:
                self._hand_back()  # the scene is about to change: whoever drives, the next episode starts with the policy
                self._scene = None

    def _on_privileged(self, m: msg.String) -> None:
        try:
            data = json.loads(m.data)
            with self._lock:
                self._step(data)
        except Exception:  # noqa: BLE001 - a bad message must not stop the person; it is logged and counted
            self.counters.add("errors")
            log.exception("simulated person: could not act on the privileged state")

    # ----- one look at the scene -------------------------------------------------------------------------------------------
    def _step(self, data: dict[str, Any]) -> None:
        scene = (data["task"], json.dumps(data.get("task_config") or {}, sort_keys=True), int(data["seed"]))
        if scene != self._scene:
            self._begin(scene)
        env, human = self._env, self._human
        env.set_state(np.asarray(data["state"], np.float64))
        if self._done:
            return
        if data.get("success"):
            self._done = True
            self._hand_back()
            return
        progress = float(env.progress())
        t = len(human.labels)
        if human.mode == "policy":
            human.labels.append(Segment.PROGRESS)
            if human.watch(progress, t):
                self.in_control = True
                self._takeover_pub.publish(msg.Bool(data=True))
                self.counters.add("takeovers")
            return
        action = human.recovery_action(env) if human.mode == "recovery" else human.expert()
        human.labels.append(Segment.RECOVERY if human.mode == "recovery" else Segment.HUMAN)
        human.human_steps += 1
        self._joy_pub.publish(msg.Joy(axes=np.clip(np.asarray(action, np.float32), -1.0, 1.0)))
        self.counters.add("commands")
        if human.advance_human(progress):
            self._hand_back()

    def _begin(self, scene: tuple[str, str, int]) -> None:
        task, task_config, seed = scene
        if self._made != scene[:2]:
            if self._env is not None:
                self._env.close()
            self._env = sim.tasks.make(task, json.loads(task_config) or None, cameras=())
            self._human = SimulatedHuman(self._env, self.monitor)
            self._made = scene[:2]
        self._human.reset(seed=seed)
        self._hand_back()
        self._scene, self._done = scene, False
        self.counters.add("episodes")

    def _hand_back(self) -> None:
        if self.in_control:
            self._takeover_pub.publish(msg.Bool(data=False))
            self.counters.add("handbacks")
        self.in_control = False

    def close(self) -> None:
        for sub in self._subs:
            sub.close()
        self._subs.clear()
        with self._lock:
            self._hand_back()
            if self._env is not None:
                self._env.close()
                self._env, self._made = None, None
