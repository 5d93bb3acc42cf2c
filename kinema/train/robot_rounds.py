"""`kinema train --robot ROBOT`: each round's episodes come from a robot through the ROS 2 policy node.

    kinema sim-robot --task drawer --person                         # terminal 1: the robot, a simulated person beside it
    kinema train --robot sim_panda --rl.interventions true          # terminal 2: SFT, then rounds on the robot

A round: `rl.episodes_per_round` episodes on the robot (the policy node as `kinema deploy` runs it: safety layer, a
person's takeovers on the takeover topic, every episode recorded with its takeover segments to RUN_DIR/robot), then
the method's update on what was recorded, then the round's checkpoint swapped into the running node (no restart).
Every episode is on disk before an update reads it; a run killed at any moment loses at most the episode in progress
(committed as incomplete, and not trained on), and `--resume` continues the same round with the episodes it lacks.
An e-stop mid-episode ends that episode as a failure; the round waits for the operator to release it (Enter).
`robot.reset operator`: before each episode a person resets the scene and presses Enter. Success comes from the
robot's success topic, or, where it says nothing, from the operator's y/n.

Only methods that learn from what a robot records can train this way (`RLMethod.learns_from_recordings`): they need
no log-probabilities of the executed chunks and no actor of their own.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from diffusion_rl.data import Episode, ExecutedBy
from diffusion_rl.data.lerobot_v3 import LeRobotDatasetReader
from kinema.train.methods.base import RLMethod, Rollouts
from kinema.train.progress import RunProgress


class RobotRounds:
    """The policy node, its recorder and the transport, held across the rounds of one `kinema train` start."""

    def __init__(self, cfg: Any, run_root: Path, console: Console) -> None:
        from robot.config import load_robot_config

        self.cfg, self.options, self.console = cfg, cfg.robot, console
        self.robot = load_robot_config(self.options.config)
        self.folder = run_root / "robot"  # the recordings: LeRobotDataset v3 (robot/dataset) and MCAP (robot/mcap)
        self._stack = contextlib.ExitStack()
        self.session: Any = None

    @property
    def dataset(self) -> Path:
        return self.folder / "dataset"

    def start(self, checkpoint: Path) -> None:
        """Connect to the robot and put `checkpoint` on it, acting as `kinema eval` evaluates it."""
        from kinema.robot_policies import load_policy
        from robot.session import RobotSession
        from robot.transport import make_transport

        opts = self.options
        transport = self._stack.enter_context(make_transport(opts.backend, node_name="kinema_train", local=opts.local))
        policy = load_policy(str(checkpoint), control_hz=self.robot.rates.control_hz)
        self.session = self._stack.enter_context(RobotSession(
            transport, self.robot, policy, instruction=opts.instruction, record=str(self.folder), task_id=self.cfg.task,
            inference=opts.inference,
        ))  # fmt: skip
        self.session.wait_ready(opts.wait_robot)
        self.console.print(f"robot {self.robot.name}: acting with {checkpoint} ({policy.fingerprint}); recording to {self.folder}")

    def recorded(self, round_index: int) -> list[int]:
        """Dataset indices of the round's complete episodes, in the order they were recorded."""
        if not (self.dataset / "meta" / "info.json").exists():
            return []
        rows = LeRobotDatasetReader(self.dataset).meta.episodes
        version = f"round-{round_index}"
        return [i for i, row in enumerate(rows) if row.get("policy_version") == version and row.get("complete", True)]

    def roll_out(self, method: RLMethod, round_index: int, record: dict[str, Any], progress: RunProgress) -> Rollouts:
        """The round's episodes on the robot (those a killed start of this round recorded count), then the method's
        digest of them: written to the run's rollouts, joined to the replay, success model refit."""
        session, wanted = self.session, self.cfg.rl.episodes_per_round
        session.recorder.config.policy_version = f"round-{round_index}"
        record["robot/policy"] = session.node.policy.fingerprint  # the checkpoint that acts this round
        done = len(self.recorded(round_index))
        if done:
            self.console.print(f"round {round_index}: {done} episode(s) already recorded on the robot (resumed)")
        started, requests_before = time.monotonic(), session.node.stats.snapshot()
        with progress.phase(f"round {round_index}: robot episodes", wanted - min(done, wanted), kind="rollout"):
            while done < wanted:
                if session.quit.is_set():
                    raise KeyboardInterrupt
                if self.options.reset == "operator":
                    self.operator(f"round {round_index}, episode {done + 1} of {wanted}: reset the scene, then press Enter")
                result = session.run_episode(duration=self.options.episode_seconds, reset=True, index=done, judge=self.outcome)
                if result["estopped"]:  # the episode ended as a failure; nothing moves until a person releases it
                    self.operator("e-stop: the episode ended as a failure; release the robot's e-stop, then press Enter")
                    session.node.release_estop()
                session.recorder.flush(timeout=120)
                now = len(self.recorded(round_index))
                if now > done:  # an episode the recorder could not keep (no step sampled) is run again
                    progress.advance()
                done = now
        episodes = self._read(round_index)[:wanted]
        record["robot/seconds"] = round(time.monotonic() - started, 1)  # this start's (a resumed round: since the resume)
        record["robot/episodes_taken_over"] = sum(bool((ep.executed_by == ExecutedBy.HUMAN).any()) for ep in episodes)
        # How the node computed this round's chunks (robot.inference auto decides by the measured inference time).
        requests = {k: session.node.stats.snapshot().get(k, 0) - requests_before.get(k, 0) for k in ("requests", "sync_requests")}
        record["robot/sync_chunk_share"] = round(requests["sync_requests"] / max(1, requests["requests"]), 3)
        record["robot/inference_ms"] = session.node.status()["inference_ms"]
        return method.digest(round_index, episodes, record)

    def operator(self, prompt: str) -> None:
        """Wait for the person at the robot: a line on this process's standard input."""
        self.console.print(f"[bold]{prompt}[/bold]")
        if not sys.stdin.readline():
            raise RuntimeError(f"waiting for the operator ({prompt}), but standard input is closed: run kinema train in a "
                               "terminal, or use robot.reset topic")  # fmt: skip

    def outcome(self) -> bool:
        """The operator's mark of an episode the robot's success topic said nothing about."""
        while True:
            self.console.print("[bold]the robot did not say: did the episode succeed? [y/n][/bold]")
            answer = sys.stdin.readline()
            if not answer:
                raise RuntimeError("the robot has no success topic and standard input is closed: nobody can mark the "
                                   "episode (run kinema train in a terminal, or give the robot config a success topic)")  # fmt: skip
            if answer.strip().lower() in ("y", "n"):
                return answer.strip().lower() == "y"

    def _read(self, round_index: int) -> list[Episode]:
        reader = LeRobotDatasetReader(self.dataset)
        return [reader.episode(i) for i in self.recorded(round_index)]

    def swap(self, checkpoint: Path) -> str:
        """Put the round's checkpoint on the running node; its fingerprint."""
        from kinema.robot_policies import load_policy

        policy = load_policy(str(checkpoint), control_hz=self.robot.rates.control_hz)
        self.session.node.swap_policy(policy)
        return policy.fingerprint

    def close(self) -> None:
        self._stack.close()
