"""Kinema's commands as child processes for the end-to-end robot tests: started through `python -m kinema.cli` with
the test session's loopback DDS settings (tests/conftest.py), their JSON stdout lines read back, every one stopped by
its PID in a `finally` (the `procs` fixture), whatever the test's outcome."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from robot.transport.loopback import loopback_environment

ROOT = Path(__file__).resolve().parent.parent


class Processes:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []
        self.env = {
            **os.environ, "PYTHONPATH": str(ROOT), "MUJOCO_GL": "egl", "LP_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def start(self, name: str, *args: str) -> subprocess.Popen:
        out = open(self.tmp / f"{name}.out", "w")
        err = open(self.tmp / f"{name}.err", "w")
        proc = subprocess.Popen([sys.executable, "-m", "kinema.cli", *args], cwd=ROOT, env=self.env, stdout=out, stderr=err)
        self.procs.append((name, proc, out, err))
        return proc

    def start_script(self, name: str, script: Path, *args: str) -> subprocess.Popen:
        """A plain Python script (a ROS 2 node of the robot's own, say), pinned to loopback like everything here; a
        line "stop" on its stdin ends it."""
        out = open(self.tmp / f"{name}.out", "w")
        err = open(self.tmp / f"{name}.err", "w")
        proc = subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=loopback_environment(self.env),
                                stdin=subprocess.PIPE, stdout=out, stderr=err, text=True)
        self.procs.append((name, proc, out, err))
        return proc

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process did not finish within {timeout} s:\n{self.logs()}") from None

    def records(self, name: str) -> list[dict]:
        lines = (self.tmp / f"{name}.out").read_text().splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def logs(self) -> str:
        return "\n".join(f"--- {n} stderr ---\n{(self.tmp / f'{n}.err').read_text()[-3000:]}" for n, *_ in self.procs)

    def stop_all(self) -> None:
        for _, proc, _, _ in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        for _, proc, out, err in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            out.close()
            err.close()
            if proc.stdin is not None:
                proc.stdin.close()


@pytest.fixture
def procs(tmp_path):
    p = Processes(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()
