"""A scripted "teleop" node: takes over from the policy in given time windows and drives the arm, like a person would.

    teleop = ScriptedTeleop(transport, robot_config, windows=[(1.0, 2.0), (3.0, 3.5)], motion="lift").start()

At each window's start it publishes takeover `True` (latched, as a person's switch would be), then, at the control
rate, a teleop command; at the window's end, takeover `False` (hand-back). Motions:
- `hold`: joint targets (`Float64MultiArray`) = the joint positions at the takeover: the arm stops where it was;
- `lift`: `Joy` axes moving the end effector up at half speed with the gripper unchanged (exercises the Joy path).

Every toggle is logged in `events` as (seconds since start, True/False), for tests and demos to compare against.
Run it alone with `python -m robot.teleop --windows 1-2,3-3.5 --motion lift --backend dds`.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from robot import messages as msg
from robot.config import RobotConfig, load_robot_config
from robot.inputs import InputRejected, joint_positions
from robot.transport.base import QOS_LATCHED, Transport

MOTIONS = ("hold", "lift")


class ScriptedTeleop:
    def __init__(
        self,
        transport: Transport,
        robot: RobotConfig,
        windows: list[tuple[float, float]],
        *,
        motion: str = "hold",
        rate_hz: float | None = None,
    ) -> None:
        if motion not in MOTIONS:
            raise ValueError(f"motion {motion!r} is not known; valid: {', '.join(MOTIONS)}")
        for a, b in windows:
            if not 0 <= a < b:
                raise ValueError(f"takeover window ({a}, {b}): expected 0 <= start < end (seconds)")
        if any(w2[0] < w1[1] for w1, w2 in zip(windows, windows[1:])):
            raise ValueError(f"takeover windows must be ordered and not overlap; got {windows}")
        self.robot, self.windows, self.motion = robot, list(windows), motion
        self.period = 1.0 / (rate_hz or robot.rates.control_hz)
        self.joint_names = robot.command_joint_names
        self.events: list[tuple[float, bool]] = []
        self._q: np.ndarray | None = None
        self._hold: np.ndarray | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._takeover_pub = transport.publisher(robot.topics.takeover, msg.Bool, QOS_LATCHED)
        self._joint_pub = transport.publisher(robot.topics.teleop, msg.Float64MultiArray)
        self._joy_pub = transport.publisher(robot.topics.teleop_joy, msg.Joy)
        self._sub = transport.subscribe(robot.topics.joint_states, msg.JointState, self._on_state)

    def _on_state(self, m: msg.JointState) -> None:
        try:
            q = joint_positions(m.name, m.position, self.joint_names)
        except InputRejected:
            return  # the node counts and logs bad states; a scripted person just waits for a good one
        with self._lock:
            self._q = q

    def set_takeover(self, active: bool, t: float) -> None:
        self._takeover_pub.publish(msg.Bool(data=active))
        self.events.append((t, active))

    def send(self) -> None:
        """One teleop command for the current motion."""
        if self.motion == "lift":
            self._joy_pub.publish(msg.Joy(axes=np.array([0, 0, 0.5, 0, 0, 0, 0], np.float32)))
            return
        with self._lock:
            if self._hold is None:
                self._hold = None if self._q is None else self._q.copy()
            hold = self._hold
        if hold is not None:
            self._joint_pub.publish(msg.Float64MultiArray(data=hold))

    def start(self) -> ScriptedTeleop:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="kinema-teleop", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        t0 = time.monotonic()
        active = False
        while not self._stop.is_set():
            t = time.monotonic() - t0
            inside = any(a <= t < b for a, b in self.windows)
            if inside != active:
                active = inside
                with self._lock:
                    self._hold = None
                self.set_takeover(active, t)
            if active:
                self.send()
            if t >= (self.windows[-1][1] if self.windows else 0) and not active:
                break
            self._stop.wait(self.period)

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def close(self) -> None:
        self.stop()
        self._sub.close()


def parse_windows(text: str) -> list[tuple[float, float]]:
    """'1-2,3-3.5' -> [(1.0, 2.0), (3.0, 3.5)]."""
    windows = []
    for part in filter(None, text.split(",")):
        a, sep, b = part.partition("-")
        if not sep:
            raise ValueError(f"takeover window {part!r}: expected START-END in seconds, e.g. 1-2.5")
        windows.append((float(a), float(b)))
    return windows


def main(argv: list[str] | None = None) -> int:
    from robot.transport import BACKENDS, make_transport

    parser = argparse.ArgumentParser(prog="python -m robot.teleop", description=__doc__.split("\n")[0])
    parser.add_argument("--windows", required=True, help="takeover windows in seconds from start, e.g. 1-2,3-3.5")
    parser.add_argument("--motion", choices=MOTIONS, default="hold")
    parser.add_argument("--robot", default="sim_panda", help="robot config YAML, or a shipped name")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    args = parser.parse_args(argv)
    robot = load_robot_config(args.robot)
    with make_transport(args.backend, node_name="kinema_teleop") as transport:
        teleop = ScriptedTeleop(transport, robot, parse_windows(args.windows), motion=args.motion).start()
        try:
            while not teleop.done:
                time.sleep(0.05)
        except KeyboardInterrupt:
            pass
        finally:
            if teleop.events and teleop.events[-1][1]:
                teleop.set_takeover(False, -1.0)  # never leave the policy locked out
            teleop.close()
    print(teleop.events)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
