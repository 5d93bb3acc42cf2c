"""`--tensorboard true`: a run's metrics records as TensorBoard scalars, read back with TensorBoard's own reader."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rich.console import Console

from kinema.board import record_scalars
from kinema.common import Run


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar point in the run's event files, as a reader that honours no purge marker sees them (TensorBoard's
    Rust data server does not)."""
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        for event in loader.EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                point = value.tensor.float_val[0] if value.HasField("tensor") else value.simple_value
                out.setdefault(value.tag, []).append((event.step, pytest.approx(point)))
    return out


def test_records_become_scalars_at_their_env_step(tmp_path: Path):
    run = Run(tmp_path, Console(file=None), tensorboard=True)
    run.log({"kind": "sft", "steps": 100, "actor/loss": 0.5})
    run.log({"kind": "eval", "stage": "sft", "round": 0, "env_steps": 0, "train/success": 0.4, "train/episodes": 10})
    run.log({"kind": "round", "round": 1, "method": "habc", "env_steps": 480, "actor/loss": 0.3, "gate/on": True})
    run.log({"kind": "eval", "stage": "round", "round": 1, "env_steps": 480, "train/success": 0.6, "train/steps_to_success": None})
    run.close()
    got = scalars(tmp_path)
    assert got["sft/actor/loss"] == [(0, 0.5)]  # no step of its own: the last step seen
    assert got["eval/sft/train/success"] == [(0, pytest.approx(0.4))]
    assert got["round/actor/loss"] == [(480, pytest.approx(0.3))]
    assert got["eval/round/train/success"] == [(480, pytest.approx(0.6))]
    # strings, booleans, None, the time and the step itself are not scalars
    assert not any(t.endswith(("/method", "/gate/on", "/steps_to_success", "/time", "/env_steps", "/round")) for t in got)


def test_a_resumed_run_hides_the_points_its_checkpoint_does_not_cover(tmp_path: Path):
    first = Run(tmp_path, Console(file=None), tensorboard=True)
    first.log({"kind": "round", "round": 1, "env_steps": 100, "actor/loss": 1.0})
    first.save_state({"round": 1})
    first.log({"kind": "round", "round": 2, "env_steps": 200, "actor/loss": 2.0})  # killed before round 2's checkpoint
    first.close()
    assert scalars(tmp_path)["round/actor/loss"] == [(100, 1.0), (200, 2.0)]

    resumed = Run(tmp_path, Console(file=None), tensorboard=True)
    resumed.resume()
    resumed.log({"kind": "round", "round": 2, "env_steps": 230, "actor/loss": 0.5})  # round 2 again, other episodes
    resumed.close()
    assert scalars(tmp_path)["round/actor/loss"] == [(100, 1.0), (230, 0.5)]


def test_tensorboard_turned_on_at_a_resume_shows_the_whole_history(tmp_path: Path):
    first = Run(tmp_path, Console(file=None))
    first.log({"kind": "round", "round": 1, "env_steps": 100, "actor/loss": 1.0})
    first.save_state({"round": 1})
    resumed = Run(tmp_path, Console(file=None), tensorboard=True)
    resumed.resume()
    resumed.log({"kind": "round", "round": 2, "env_steps": 200, "actor/loss": 0.5})
    resumed.close()
    assert scalars(tmp_path)["round/actor/loss"] == [(100, 1.0), (200, 0.5)]


def test_the_video_workflow_steps_by_round():
    assert record_scalars({"kind": "eval", "stage": "round", "round": 3, "eval/reward": -0.2}, "round") == {
        "eval/round/eval/reward": -0.2
    }


def test_a_missing_tensorboard_package_is_named_before_any_work(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'kinema\[tensorboard\]'"):
        Run(tmp_path / "run", Console(file=None), tensorboard=True)
    assert not (tmp_path / "run").exists()
