"""robosuite/Lift from robomimic demonstrations (tests/robomimic_lift.py) through `kinema dataset import robomimic`,
`kinema train` and `kinema eval` (robosuite extra: skipped where it is not installed). A file of its own so that
pytest-xdist runs it beside test_robosuite_robomimic.py's checks of the file format: it is the extra's slowest test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sim  # noqa: F401  (sets MUJOCO_GL=egl before robosuite imports mujoco; see test_robosuite_adapter.py)

pytest.importorskip("robosuite", reason="robosuite extra not installed: pip install -e '.[robosuite]'")
pytest.importorskip("h5py", reason="robomimic extra not installed: pip install -e '.[robomimic]'")

sys.path.insert(0, str(Path(__file__).parent))
import robomimic_lift


@pytest.mark.slow
@pytest.mark.timeout(1500)  # robosuite renders ~35 env steps/s on an idle 2-core machine, a third of that under load
def test_imported_lift_demos_through_train_and_eval(tmp_path):
    """robosuite/Lift from imported robomimic demos through `kinema dataset import robomimic`, `kinema train
    --dataset` (SFT, an RL round, evaluation with the splits robosuite has no notion of reported as not applicable)
    and `kinema eval` on its checkpoint."""
    demos = robomimic_lift.collect(4, seed=1, max_tries=8)
    robomimic_lift.write(tmp_path / "lift.hdf5", demos, image_size=32)
    env = {**os.environ, "MUJOCO_GL": "egl"}
    cli = [sys.executable, "-m", "kinema.cli"]
    imported = subprocess.run([*cli, "dataset", "import", "robomimic", str(tmp_path / "lift.hdf5"), "--out",
                               str(tmp_path / "demos")], check=False, capture_output=True, text=True, timeout=300,
                              env=env)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert "imported 4 robomimic demos" in imported.stdout
    config = json.dumps({"horizon": 50})  # the demos take ~37 steps; what it proves needs no success
    run = tmp_path / "run"
    trained = subprocess.run([
        *cli, "train", "--task", "robosuite/Lift", "--dataset", str(tmp_path / "demos"),
        "--task_config", config, "--sft.steps", "30", "--sft.batch_size", "8", "--rl.rounds", "1",
        "--rl.episodes_per_round", "2", "--rl.updates_per_round", "4", "--rl.batch_size", "8",
        "--rl.habc.critic_steps", "5", "--eval.episodes", "1", "--eval.round_episodes", "1", "--eval.videos", "1",
        "--workers", "0", "--num_envs", "2", "--policy.image_size", "32", "--out", str(run),
    ], check=False, capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "loaded 4 episodes" in trained.stdout + trained.stderr
    assert "held-out colours: not applicable" in trained.stderr
    report = (run / "report.md").read_text()
    assert "successful episodes of" in report and "RL 1 of 1 rounds" in report and "| training templates |" in report
    evaluated = subprocess.run([
        *cli, "eval", "--policy", str(run / "checkpoints" / "final"), "--task", "robosuite/Lift", "--task-config",
        config, "--episodes", "1", "--workers", "0", "--videos", "0", "--out", str(tmp_path / "eval"),
    ], check=False, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads((tmp_path / "eval" / "eval.json").read_text())["results"]
    assert set(results) == {"train", "heldout_instructions"}  # robosuite has held-out paraphrases, not colours
