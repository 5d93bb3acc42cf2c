"""A policy node on a robot running episodes one after another, each recorded with its takeover segments: what
`kinema deploy` runs, and what `kinema train --robot` runs every round, swapping each round's checkpoint into the
same node.

    with RobotSession(transport, robot, policy, record="runs/deploy") as session:
        session.wait_ready(wait_robot=20.0)
        for i in range(3):
            print(session.run_episode(duration=60.0, reset=i > 0))

An episode: "reset" on the episode topic when asked (the sim robot resets its scene to the next seed; on a real arm
an operator or a reset routine does), the node restarts the policy from the current state, and the episode ends when
the success topic says so or after `duration` seconds (a failure if it said False, unlabelled if it said nothing), or
at once as a failure when the e-stop latches (the node holds until `node.release_estop()`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from robot import messages as msg
from robot.config import RobotConfig
from robot.policy_node import PolicyNode
from robot.transport.base import Transport

COMMAND_MATCH_SETTLE_S = 0.25
RESET_SETTLE_S = 0.5  # the robot resets and publishes its new state and instruction


def sleep_until(predicate: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


class RobotSession:
    def __init__(
        self, transport: Transport, robot: RobotConfig, policy: Any, *, instruction: str = "", record: str | None = None,
        marks_by_person: bool = False, task_id: str = "", policy_version: str = "deployment", inference: str = "auto",
    ) -> None:  # fmt: skip
        """`record`: a folder for the episodes (LeRobotDataset v3 + MCAP); `marks_by_person`: a person marks the
        recorded episodes (robot.recorder.KeyControl), not the session; `task_id`, `policy_version`: written with
        each recorded episode (a training round's episodes carry the round); `inference`: the node's (auto | sync | async)."""
        self.robot = robot
        self.node = PolicyNode(transport, robot, policy, instruction=instruction, inference=inference)
        self.recorder = (
            episode_recorder(transport, robot, self.node.mapper, record, instruction, task_id=task_id, policy_version=policy_version)
            if record else None
        )  # fmt: skip
        self._marks = self.recorder if self.recorder is not None and not marks_by_person else None
        self._episode_pub = transport.publisher(robot.topics.episode, msg.String)
        self.quit = threading.Event()  # set by a person (KeyControl's q) or a caller: no further episode starts

    def wait_ready(self, wait_robot: float) -> None:
        """Wait for the robot's valid joint states and for its controller to subscribe to the commands (each within
        `wait_robot` seconds, else a clear error), then start the node paused and the recorder."""
        node, robot = self.node, self.robot
        if not sleep_until(lambda: node.safety.has_state, wait_robot):
            raise ValueError(
                f"no valid {robot.topics.joint_states} within {wait_robot} s (joints {robot.command_joint_names}): "
                "is the robot (e.g. `kinema sim-robot`) running on the same backend and ROS_DOMAIN_ID?"
            )
        own = 0 if self.recorder is None else 1  # the recorder listens to the commands too; it is not the controller
        if not sleep_until(lambda: node.command_subscriptions() > own, wait_robot):
            raise ValueError(
                f"nothing subscribes to {node.command_topic} within {wait_robot} s: is the robot's "
                f"{robot.controller.type} controller loaded and configured?"
            )
        if not node.instruction:  # the robot side may name the task (the sim robot does, once a second)
            sleep_until(lambda: bool(node.instruction), 2.0)
        # Each side matches the other on its own: the robot's reader may match this writer a little later, and
        # drops what was sent before it did (benchmarks/RESULTS.md, "The first commands of an rclpy ...").
        time.sleep(COMMAND_MATCH_SETTLE_S)
        node.pause()
        node.start()
        if self.recorder is not None:
            self.recorder.start()

    def run_episode(
        self, *, duration: float, reset: bool, index: int = 0, judge: Callable[[], bool | None] | None = None,
    ) -> dict[str, Any]:  # fmt: skip
        """One episode, recorded; its result as `kinema deploy` prints it. `judge`: asked for the outcome when the
        success topic said nothing (a person's mark; None: unlabelled)."""
        node, recorder = self.node, self.recorder
        if reset:
            self._episode_pub.publish(msg.String(data="reset"))
            time.sleep(RESET_SETTLE_S)
        if recorder is not None and recorder.recording:
            # The recorder starts an episode on "reset" itself; that one began while the scene was being reset (its
            # steps pair the old command with the new state), so drop it and start afresh.
            recorder.mark("abort")
        node.start_episode()
        if self._marks is not None:
            self._marks.mark("start")
        start = time.monotonic()
        sleep_until(lambda: bool(node.success) or self.quit.is_set() or node.estopped, duration)
        node.pause()
        estopped = node.estopped
        success = False if estopped else node.success  # None: nobody said (no success topic on this robot)
        if success is None and judge is not None:
            success = judge()
        if self._marks is not None:
            self._marks.mark("stop" if success is None else ("success" if success else "failure"))
        return {
            "event": "episode", "episode": index, "success": success, "seconds": round(time.monotonic() - start, 2),
            "instruction": node.instruction, "taken_over": node.was_taken_over, "estopped": estopped,
        }  # fmt: skip

    def close(self) -> None:
        """The node stops commanding; the recorder commits what it has (an episode still open as incomplete)."""
        self.node.close()
        if self.recorder is not None:
            self.recorder.close()

    def __enter__(self) -> RobotSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def episode_recorder(transport, robot, mapper, out_dir: str, instruction: str, *, task_id: str = "", policy_version: str = "deployment"):
    """The recorder `kinema deploy --record` uses: the robot's topics and cameras, the policy's state and action."""
    from robot.recorder import EpisodeRecorder, RecorderConfig

    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValueError(f"record folder {out_dir} is a file; recordings go to a folder (LeRobotDataset v3 + MCAP)")
    # The robot's own view (per-camera sizes; a step per streamed command, so no aliasing against the control loop).
    # The recorded state and action are the policy's (EE pose; EE delta), so recordings train like sim data.
    config = RecorderConfig.from_robot(
        robot, instruction=instruction, state_names=list(mapper.STATE_NAMES), action_names=list(mapper.ACTION_NAMES),
        task_id=task_id, policy_version=policy_version,
    )  # fmt: skip
    return EpisodeRecorder(transport, config, out_dir, state_fn=mapper.state, action_fn=mapper.to_action)
