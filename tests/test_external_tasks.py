"""A task from outside kinema's packages (tests/external_task_example.py) through `kinema sim`, `kinema train` and
`kinema eval`, by entry point and by gymnasium id; and the errors when an external task misses the contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest
from cli_in_process import kinema_in_process

HERE = Path(__file__).parent
TASK = "external_task_example:SlideMarker"
CONFIG = {
    "keys": {"observation.images.agentview": "camera_front", "observation.images.wrist": "camera_hand",
             "observation.state": "state"},
    "instruction": "slide the marker to the right", "goal": 0.15, "horizon": 20,
}  # fmt: skip


def kinema(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "kinema.cli", *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_an_external_task_is_collected_trained_and_evaluated_through_the_cli(tmp_path: Path):
    from diffusion_rl.data.lerobot_v3 import read_episodes

    demos = tmp_path / "demos"
    done = kinema("sim", "collect", "--task", TASK, "--task-config", json.dumps(CONFIG), "--policy", "random",
                  "--episodes", "40", "--image-size", "32", "--out", str(demos))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    episodes = read_episodes(demos)
    assert len(episodes) == 40 and {ep.task for ep in episodes} == {CONFIG["instruction"]}
    assert 0 < sum(ep.outcome for ep in episodes) < 40 and max(len(ep) for ep in episodes) <= 20
    assert episodes[0].observations["observation.images.agentview"].shape[1:] == (32, 32, 3)

    run = tmp_path / "run"
    trained = kinema(
        "train", "--task", TASK, "--task_config", json.dumps(CONFIG), "--dataset", str(demos), "--sft.steps", "20",
        "--sft.batch_size", "8", "--rl.rounds", "1", "--rl.episodes_per_round", "4", "--rl.updates_per_round", "4",
        "--rl.batch_size", "8", "--rl.habc.critic_steps", "5", "--eval.episodes", "4", "--eval.round_episodes", "2",
        "--eval.videos", "2", "--workers", "0", "--num_envs", "4", "--policy.image_size", "32", "--out", str(run),
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    # Held-out paraphrases and colours mean nothing here: reported as not applicable, not crashed on.
    assert "held-out paraphrases: not applicable" in trained.stderr and "held-out colours: not applicable" in trained.stderr
    report = (run / "report.md").read_text()
    assert f"successful episodes of {demos}" in report and "RL 1 of 1 rounds" in report
    assert "Not evaluated (not applicable to" in report and (run / "videos" / "before_after.mp4").is_file()
    rollouts = read_episodes(run / "rollouts" / "round-001")
    assert len(rollouts) == 4 and {ep.task_id for ep in rollouts} == {TASK}

    # The registered gymnasium id (gymnasium's module:id form imports the module), on the trained checkpoint.
    out = tmp_path / "eval"
    evaluated = kinema("eval", "--policy", str(run / "checkpoints" / "final"), "--task", "gym:external_task_example:SlideMarker-v0",
                       "--task-config", json.dumps({k: v for k, v in CONFIG.items() if k != "horizon"}), "--episodes", "3",
                       "--workers", "0", "--videos", "0", "--out", str(out))  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    results = json.loads((out / "eval.json").read_text())["results"]
    assert list(results) == ["train"] and results["train"]["episodes"] == 3


def test_an_external_task_that_misses_the_contract_gets_an_error_that_says_what_to_do(tmp_path: Path):
    sys.path.insert(0, str(HERE))
    from sim.tasks import SplitNotApplicable, make

    env = make(TASK, {"goal": 0.1})  # no key mapping: its observations use its own names
    with pytest.raises(ValueError, match=r"observations lack \['observation.images.agentview'.*map them with the task config's `keys`"):
        env.reset(seed=0)
    with pytest.raises(SplitNotApplicable, match="has no held-out objects"):
        make(TASK, CONFIG, objects="heldout")
    assert make(TASK, CONFIG, objects="train", instructions="train").reset(seed=0)[0]["task"] == CONFIG["instruction"]
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        make("no_such_module:Env")
    bad = kinema_in_process("train", "--task", TASK, "--out", str(tmp_path / "run"))
    assert bad.returncode == 2 and "has no scripted expert" in bad.stderr and "--dataset DIR" in bad.stderr
    bad = kinema_in_process("sim", "collect", "--task", TASK, "--episodes", "1", "--out", str(tmp_path / "d"))
    assert bad.returncode == 2 and "collect with --policy" in bad.stderr and "Traceback" not in bad.stderr


class SlideMarkerDiscrete(gym.Env):
    """The example's marker with a discrete action space: its observations meet the contract, its actions do not."""

    def __init__(self) -> None:
        from external_task_example import SlideMarker

        self.inner = SlideMarker()
        self.observation_space, self.action_space = self.inner.observation_space, gym.spaces.Discrete(3)


def test_an_everyday_gymnasium_env_is_refused_at_make_naming_the_contract(tmp_path: Path):
    """CartPole's Box observations and Discrete actions cannot be mapped onto kinema's cameras, state and 7-float
    end-effector actions: the task is refused when made, saying which space misses what (it crashed deep in the
    random policy with "'Box' object has no attribute 'spaces'")."""
    sys.path.insert(0, str(HERE))
    from sim.tasks import make

    cartpole = r"'gym:CartPole-v1': its observation space is Box\(4,\), not a Dict.*observation.state"
    with pytest.raises(ValueError, match=cartpole):
        make("gym:CartPole-v1")
    with pytest.raises(ValueError, match=r"its action space is Discrete\(3\); kinema's policies act with a Box of 7"):
        make("test_external_tasks:SlideMarkerDiscrete", {"keys": CONFIG["keys"]})
    bad = kinema_in_process("sim", "collect", "--task", "gym:CartPole-v1", "--policy", "random", "--episodes", "1",
                 "--out", str(tmp_path / "d"))
    assert bad.returncode == 2 and "observation space is Box(4,)" in bad.stderr, bad.stderr[-2000:]
    assert "Traceback" not in bad.stderr
    assert not (tmp_path / "d").exists()
