"""RL methods as registered classes: each reproduces the round it was recorded doing before the refactor, runs and
checkpoints from before it still load, the registry drives `--rl.method`, and a method added in one file runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cli_in_process import kinema_in_process
from method_regression import LEAST_EVALUATION, RUNS, TINY, environment_changes, reference, run_method, same

from kinema.common import load_config
from kinema.train.config import TrainConfig

FIXTURE_RUN = Path(__file__).parent / "fixtures" / "run-before-methods"


def kinema(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kinema.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_each_method_reproduces_its_recorded_round(tmp_path: Path, name: str):
    torch.set_num_threads(1)
    recorded, tol, path = reference(name)
    if changed := environment_changes(recorded.get("_environment", {})):
        pytest.skip(f"{path.name} recorded with other package versions {changed} (installed, recorded): floats move "
                    "across releases; after checking that the change is upstream, re-record: python tests/method_regression.py")
    expected = recorded[name]
    got = run_method(name, tmp_path)
    assert sorted(got["numbers"]) == sorted(expected["numbers"])
    differ = {k: (got["numbers"][k], v) for k, v in expected["numbers"].items() if not same(got["numbers"][k], v, **tol)}
    assert not differ, f"{differ} (got, recorded in {path.name} at {tol})"
    # the weights' fingerprints sum thousands of weights: ISA noise moves them by ~1e-7 of their size, a change by far more
    assert same(got["online"], expected["online"]) and same(got["acting"], expected["acting"]), (got, expected)
    checkpoints = tmp_path / name / "checkpoints"
    assert_eval_and_deploy_act_alike(checkpoints / "final" if (checkpoints / "final").is_dir() else checkpoints / "sft")


def assert_eval_and_deploy_act_alike(checkpoint: Path) -> None:
    """`kinema eval`'s runner and `kinema deploy`'s policy (`CheckpointPolicy`, as `kinema sim render` also loads
    through `load_acting`) give the same actions for the same observation and noise, whatever the method."""
    import numpy as np

    from kinema.robot_policies import CheckpointPolicy
    from kinema.train.acting import load_acting
    from sim.rollout import make_vector

    evaluated, deployed = load_acting(checkpoint), CheckpointPolicy(load_acting(checkpoint))
    vector = make_vector("drawer", 2, image_size=evaluated.policy.config.image_size, instructions="train", objects="train")
    try:
        obs = {k: v for k, v in [vector.reset_at(0, 1_000_000)[0], vector.reset_at(1, 1_000_001)[0]][1].items()}
    finally:
        vector.close()
    runner = evaluated.acting.make()
    torch.manual_seed(0)
    by_eval = runner(obs)
    torch.manual_seed(0)
    by_deploy = deployed.predict_action_chunk(obs)[:, : by_eval.shape[1]]
    assert deployed.description == evaluated.acting.description
    np.testing.assert_allclose(by_deploy, by_eval, atol=1e-6, err_msg=f"{checkpoint}: {evaluated.acting.description}")


@pytest.mark.slow
def test_the_same_run_twice_in_one_process_writes_the_same_videos_and_trains_the_same_weights(tmp_path: Path):
    """Reproducibility, which the recorded rounds above rely on: the demos' and rollouts' videos are byte-identical
    (with x264's mb-tree on they were not, nor was the SFT on their frames), and so is what trained."""
    torch.set_num_threads(1)
    first, second = run_method("habc", tmp_path / "a"), run_method("habc", tmp_path / "b")
    videos = {p.relative_to(tmp_path / "a"): p.read_bytes() for p in sorted((tmp_path / "a").rglob("*.mp4"))}
    assert any("demos" in str(p) for p in videos) and any("rollouts" in str(p) for p in videos), sorted(videos)
    differ = [str(p) for p, data in videos.items() if (tmp_path / "b" / p).read_bytes() != data]
    assert not differ, differ
    assert first == second


@pytest.mark.slow
def test_a_run_and_a_checkpoint_written_before_the_methods_split_still_work(tmp_path: Path):
    """The fixture is a habc run folder as kinema wrote it before the split: flat rl.ppo_* keys in config.yaml, one
    `critics` dict in trainer.pt. It resumes for one more round, and its checkpoint evaluates."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURE_RUN, run)
    resumed = kinema("train", "--resume", str(run), "--rl.rounds", "2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed" in resumed.stderr
    state = json.loads((run / "state.json").read_text())
    assert state["round"] == 2 and state["latest_checkpoint"] == "checkpoints/round-002"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"] == [1, 2]
    trainer = torch.load(run / "checkpoints" / "round-002" / "trainer.pt", weights_only=False)
    assert {"success_model", "method"} <= set(trainer) and "critics" not in trainer
    assert "critic" in trainer["method"]  # the habc critic carried over from the old checkpoint's `critics`
    out = tmp_path / "eval"
    evaluated = kinema("eval", "--policy", str(FIXTURE_RUN / "checkpoints" / "round-001"), "--task", "drawer",
                       "--episodes", "1", "--splits", "train", "--workers", "0", "--videos", "0", "--out", str(out))  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((out / "eval.json").read_text())["results"]["train"]["episodes"] == 1


def test_old_key_names_load_from_a_file_and_are_refused_on_the_command_line_with_the_new_name(tmp_path: Path):
    old = tmp_path / "old.yaml"
    old.write_text("rl:\n  method: flow_ppo\n  ppo_lr: 1.0e-05\n  group_size: 2\n  nft_beta: 0.5\n  habc:\n    critic_steps: 7\n")
    cfg = load_config(str(old), [], config_class=TrainConfig)
    assert (cfg.rl.ppo.lr, cfg.rl.ppo.group_size, cfg.rl.nft.beta) == (1e-5, 2, 0.5)
    # Before the split, rl.habc.critic_steps also set the AWR and GAE critics' steps.
    assert cfg.rl.habc.critic_steps == cfg.rl.awr.critic_steps == cfg.rl.ppo.critic_steps == 7
    with pytest.raises(ValueError, match=r"config key 'rl.ppo_lr' is now 'rl.ppo.lr'; pass --rl.ppo.lr"):
        load_config(None, ["--rl.ppo_lr", "1e-5"], config_class=TrainConfig)


def test_the_registry_is_the_list_of_methods_in_errors_and_help():
    from kinema.train.methods import METHODS

    assert list(METHODS) == ["habc", "sft_continued", "awr", "flow_ppo", "nft", "pa_rl", "dsrl", "residual", "hg_dagger", "recap", "none"]
    with pytest.raises(ValueError, match="rl.method 'ppo' is not known; valid: habc, sft_continued, awr, flow_ppo, nft, pa_rl, dsrl, residual, hg_dagger, recap, none"):
        load_config(None, ["--rl.method", "ppo"], config_class=TrainConfig)
    helped = kinema_in_process("train", "--help")
    assert helped.returncode == 0
    for name, cls in METHODS.items():
        assert f"  {name}: {cls.summary}" in helped.stdout
    assert "rl.ppo.noise_level=0.3" in helped.stdout and "rl.nft.beta=1.0" in helped.stdout


@pytest.mark.slow
def test_a_method_added_as_the_readme_shows_is_listed_configured_and_trained(tmp_path: Path):
    """The README's example method, as written there: one file, plus the registry entry (made here at run time)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("### Adding an RL method") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))]
    (tmp_path / "filtered_bc.py").write_text(code)
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from kinema.train import methods\n"
        "from filtered_bc import FilteredBC\n"
        "methods.METHODS[FilteredBC.name] = FilteredBC\n"
        "from kinema.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    run = tmp_path / "run"
    args = ["train", *TINY, *LEAST_EVALUATION, "--rl.method", "filtered_bc", "--rl.filtered_bc.min_replay", "0", "--out", str(run)]
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"round"' in line]
    rounds = [r for r in rounds if r["kind"] == "round"]
    assert [r["method"] for r in rounds] == ["filtered_bc"] and "actor/loss" in rounds[0]
    # Its weights are the rollouts' outcomes: it imitates no replay step unless a rollout succeeded.
    assert (rounds[0]["weights/nonzero_share"] > 0) == (rounds[0]["rollout/success"] > 0)
    helped = subprocess.run([sys.executable, "-c", script, "train", "--help"], capture_output=True, text=True, timeout=120)
    assert "filtered_bc: imitate the round's successful rollouts" in helped.stdout
    assert "rl.filtered_bc.min_replay=1" in helped.stdout
