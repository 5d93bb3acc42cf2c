"""`kinema sim ...` end to end, as a user runs it: real subprocesses, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from cli_in_process import kinema_in_process

from diffusion_rl.data import ExecutedBy, Segment
from diffusion_rl.data.lerobot_v3 import read_episodes
from kinema.media import read_mp4


def kinema(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kinema.cli", *args], capture_output=True, text=True, timeout=300)


def test_sim_list_shows_every_task_and_template():
    out = kinema("sim", "list")
    assert out.returncode == 0, out.stderr
    for name in ("pick_place", "stack", "push", "drawer"):
        assert name in out.stdout
    assert "could you get the" in out.stdout  # a held-out drawer paraphrase


def test_collect_writes_a_readable_dataset_and_preview(tmp_path: Path):
    out_dir, video = tmp_path / "demos", tmp_path / "preview.mp4"
    result = kinema(
        "sim", "collect", "--task", "push", "--episodes", "3", "--out", str(out_dir), "--image-size", "48",
        "--video", str(video),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    info = json.loads((out_dir / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 3 and info["codebase_version"] == "v3.0"
    episodes = read_episodes(out_dir)
    assert sorted(ep.seed for ep in episodes) == [0, 1, 2]  # stored in completion order
    assert all(ep.outcome and ep.policy_version == "expert" for ep in episodes)
    assert episodes[0].observations["observation.images.agentview"].shape[1:] == (48, 48, 3)
    frames = read_mp4(video)
    assert len(frames) == sum(len(ep) for ep in episodes) and frames.shape[1:] == (48, 48, 3)


def test_collect_teleoperator_quality_demos(tmp_path: Path):
    """--demo-source teleop: the simulated teleoperator demonstrates, slower than the scripted expert on the same seeds."""
    lengths = {}
    for source in ("scripted", "teleop"):
        out_dir = tmp_path / source
        result = kinema("sim", "collect", "--task", "drawer", "--episodes", "3", "--out", str(out_dir), "--image-size", "32",
                        "--demo-source", source)  # fmt: skip
        assert result.returncode == 0, result.stderr
        episodes = sorted(read_episodes(out_dir), key=lambda ep: ep.seed)
        assert all(ep.policy_version == ("expert" if source == "scripted" else "teleop") for ep in episodes)
        lengths[source] = [ep.steps_to_success or len(ep) for ep in episodes]
    assert sum(lengths["teleop"]) > 1.4 * sum(lengths["scripted"]), lengths


def test_collect_with_interventions_records_segments(tmp_path: Path):
    out_dir = tmp_path / "hil"
    result = kinema(
        "sim", "collect", "--task", "pick_place", "--episodes", "4", "--out", str(out_dir), "--interventions",
        "--image-size", "32", "--seed", "10",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    episodes = read_episodes(out_dir)
    assert sorted(ep.seed for ep in episodes) == [10, 11, 12, 13]
    everything = np.concatenate([ep.executed_by for ep in episodes])
    assert (everything == ExecutedBy.POLICY).any() and (everything == ExecutedBy.HUMAN).any()
    for ep in episodes:
        human = ep.executed_by == ExecutedBy.HUMAN
        assert np.isin(ep.segment[human], [Segment.RECOVERY, Segment.HUMAN]).all()
        assert ep.policy_version == "autopilot"


def test_collect_refuses_a_foreign_folder(tmp_path: Path):
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "chapter1.tex").write_text("do not touch")
    result = kinema_in_process("sim", "collect", "--task", "stack", "--episodes", "1", "--out", str(precious))
    assert result.returncode == 2
    assert "thesis" in result.stderr and "Traceback" not in result.stderr
    assert [p.name for p in precious.iterdir()] == ["chapter1.tex"]
    assert (precious / "chapter1.tex").read_text() == "do not touch"


def test_unknown_task_is_a_clear_error(tmp_path: Path):
    result = kinema_in_process("sim", "collect", "--task", "stak", "--episodes", "1", "--out", str(tmp_path / "x"))
    assert result.returncode == 2
    assert "unknown task 'stak'" in result.stderr and "Did you mean 'stack'" in result.stderr
    assert not (tmp_path / "x").exists()


def test_render_writes_a_video(tmp_path: Path):
    video = tmp_path / "drawer.mp4"
    result = kinema("sim", "render", "--task", "drawer", "--out", str(video), "--cameras")
    assert result.returncode == 0, result.stderr
    frames = read_mp4(video)
    assert frames.shape[1:] == (240, 440, 3)
    assert 10 < len(frames) <= 120
    assert frames[-1].astype(float).std() > 10


def test_collect_extends_an_existing_dataset_with_new_seeds(tmp_path: Path):
    out_dir = tmp_path / "demos"
    args = ("sim", "collect", "--task", "drawer", "--episodes", "2", "--out", str(out_dir), "--image-size", "32")
    assert kinema(*args).returncode == 0
    assert kinema(*args).returncode == 0
    assert sorted(ep.seed for ep in read_episodes(out_dir)) == [0, 1, 2, 3]
    replaced = kinema(*args, "--overwrite")
    assert replaced.returncode == 0, replaced.stderr
    assert sorted(ep.seed for ep in read_episodes(out_dir)) == [0, 1]


def test_bad_collect_flags_name_the_flag(tmp_path: Path):
    result = kinema_in_process("sim", "collect", "--task", "push", "--episodes", "1", "--out", str(tmp_path / "x"), "--image-size", "33")
    assert result.returncode == 2 and "--image-size" in result.stderr
    result = kinema_in_process("sim", "collect", "--task", "push", "--episodes", "1", "--out", str(tmp_path / "x"), "--expert-noise", "-1")
    assert result.returncode == 2 and "--expert-noise" in result.stderr
    for flag, value in (("--video", "preview.avi"), ("--seed", "-5")):
        result = kinema_in_process("sim", "collect", "--task", "push", "--episodes", "1", "--out", str(tmp_path / "x"), flag, value)
        assert result.returncode == 2 and flag in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "x").exists()


def test_ctrl_c_between_episodes_keeps_the_finished_ones(tmp_path: Path, monkeypatch, capsys):
    """Ctrl-C once lost every episode of the run (the writer aborted on any exception). Between episodes they are
    whole, so they are committed; an existing dataset keeps its episodes too. The interrupt is raised where Ctrl-C
    lands between episodes: in the loop, after an episode was written."""
    import kinema.sim_commands as sim_commands
    from kinema.cli import main

    out_dir = tmp_path / "demos"
    args = ["sim", "collect", "--task", "drawer", "--out", str(out_dir), "--image-size", "32", "--num-envs", "1"]
    assert main([*args, "--episodes", "1"]) == 0
    real = sim_commands.collect_episodes

    def interrupted_after_two(vector, policy, seeds, *, on_episode, **kwargs):
        written = []

        def on_episode_then_ctrl_c(ep):
            on_episode(ep)
            written.append(ep.seed)
            if len(written) == 2:
                raise KeyboardInterrupt

        return real(vector, policy, seeds, on_episode=on_episode_then_ctrl_c, **kwargs)

    monkeypatch.setattr(sim_commands, "collect_episodes", interrupted_after_two)
    assert main([*args, "--episodes", "6"]) == 130
    err = " ".join(capsys.readouterr().err.split())
    assert "kept the 2 finished episodes" in err and f"--out {out_dir} --episodes 4" in err
    assert sorted(ep.seed for ep in read_episodes(out_dir)) == [0, 1, 2]
