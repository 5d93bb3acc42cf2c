"""`kinema train` end to end at a tiny budget: files, metrics, resume, config errors. (Learning claims live in
benchmarks/vla_rl.py; here we check the machinery.)"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_in_process import kinema_in_process
import torch
from test_board import scalars

from diffusion_rl.data.lerobot_v3 import read_episodes
from kinema import common
from kinema.train.config import TrainConfig
from policies.vla import VLAConfig, VLAPolicy


def load_config(*args, **kwargs):
    return common.load_config(*args, config_class=kwargs.pop("config_class", TrainConfig), **kwargs)

TINY = [
    "--task", "drawer", "--demos.episodes", "4", "--sft.steps", "6", "--sft.batch_size", "8",
    "--rl.episodes_per_round", "3", "--rl.updates_per_round", "4", "--rl.batch_size", "8",
    "--rl.habc.critic_steps", "5", "--eval.episodes", "3", "--eval.round_episodes", "2", "--eval.videos", "1",
    "--workers", "0", "--num_envs", "3", "--policy.image_size", "32", "--task_config", '{"horizon": 30}',
]  # fmt: skip


def kinema(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kinema.cli", *args], capture_output=True, text=True, timeout=600)


def train_in_process(*args: str, resume: Path | None = None) -> str:
    """What `kinema train ARGS` (`--resume RUN ARGS`) does, in this process (the command itself is tested end to
    end above, as a subprocess); what it printed, at a terminal's 80 columns."""
    from rich.console import Console

    from kinema.common import load_run_config
    from kinema.train.workflow import train

    printed = io.StringIO()
    cfg = load_run_config(None, list(args), str(resume) if resume else None, config_class=TrainConfig)
    train(cfg, resume=resume is not None, console=Console(file=printed, width=80))
    return printed.getvalue()


@pytest.mark.slow
def test_train_runs_end_to_end_and_resumes(tmp_path: Path):
    run = tmp_path / "run"
    first = kinema(
        "train", *TINY, "--rl.rounds", "1", "--rl.interventions", "true", "--tensorboard", "true", "--out", str(run),
        "--rl.habc.intervention_reweighting", "true", "--rl.habc.intervention_reweighting_after", "1",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "curves.png", "diagnostics.png", "report.md", "state.json"):
        assert (run / name).is_file(), name
    # What the person saw: where the run goes and what it will do, a lasting line per round, the table at the end.
    for text in ("run folder", str(run), "plan", "estimate", "round 1/1 · rollouts", "kinema train: results"):
        assert text in first.stderr, text
    # One before/after grid on the same seeds: MP4s, contact sheets, and what each tile showed.
    assert sorted(p.name for p in (run / "videos").iterdir()) == [
        "after.json", "after.mp4", "after.png", "before.json", "before.mp4", "before.png", "before_after.mp4",
        "before_after.png",
    ]  # fmt: skip
    before, after = (json.loads((run / "videos" / f"{k}.json").read_text()) for k in ("before", "after"))
    assert [e["seed"] for e in before] == [e["seed"] for e in after] and len(before) == 1
    assert before[0]["instruction"] == after[0]["instruction"] and before[0]["instruction"]
    state = json.loads((run / "state.json").read_text())
    assert state["round"] == 1 and state["latest_checkpoint"] == "checkpoints/round-001"
    rollouts = read_episodes(run / "rollouts" / "round-001")
    assert len(rollouts) == 3 and {ep.policy_version for ep in rollouts} == {"round-1"}
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("eval") == 3 and kinds.count("round") == 1  # SFT, round 1, final
    round_record = next(r for r in records if r["kind"] == "round")
    assert {"habc/p_v_mean", "success_model/brier", "rollout/takeover_rate", "actor/loss"} <= set(round_record)
    report = (run / "report.md").read_text()
    assert "| training templates | 0 ± 0 % (n=3) |" in report or "| training templates |" in report
    for text in ("held-out paraphrases", "held-out colours", "gain (points, paired)", "Evaluation seeds: 1000000–1000002",
                 "minutes of wall time", "videos/before_after.png", "diagnostics.png"):  # fmt: skip
        assert text in report, text
    # curves.png draws points where evaluations were made: held-out splits at SFT and at the end only.
    from kinema.train.report import evaluation_series

    series = evaluation_series(records)
    assert set(series) == {("train", "sft"), ("train", "round"), ("train", "final"), ("heldout_instructions", "sft"),
                           ("heldout_instructions", "final"), ("heldout_objects", "sft"), ("heldout_objects", "final")}
    assert [n for *_, n in series[("train", "round")]] == [2] and [n for *_, n in series[("train", "final")]] == [3]
    cpu = [r["cpu_s"] for r in records]  # the run's spend so far, non-decreasing, and stated in the report
    assert cpu == sorted(cpu) and cpu[-1] > 0 and f"Compute: {cpu[-1] / 60:.1f} CPU-minutes" in report

    # Resume with one more round: continues at round 2 from the round-1 checkpoint, keeps everything before. A kill
    # after round 2's rollouts were written but before its checkpoint left them on disk: they are kept aside.
    shutil.copytree(run / "rollouts" / "round-001", run / "rollouts" / "round-002")
    second = kinema("train", "--resume", str(run), "--rl.rounds", "2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed" in second.stderr
    assert len(read_episodes(run / "rollouts" / "interrupted-round-002")) == 3
    assert {ep.policy_version for ep in read_episodes(run / "rollouts" / "round-002")} == {"round-2"}
    state = json.loads((run / "state.json").read_text())
    assert state["round"] == 2 and state["env_steps"] > 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"] == [1, 2]
    # intervention reweighting (IR) starts after the rounds without it, as the paper schedules it
    assert [r["habc/intervention_reweighting"] for r in records if r["kind"] == "round"] == [False, True]
    policy = VLAPolicy.from_pretrained(str(run / "checkpoints" / "round-002"))
    assert policy.config.image_size == 32 and policy.config.extra["tasks"] == ["drawer"]
    # The TensorBoard view (the saved config keeps --tensorboard): one point per round at its env step.
    board = scalars(run)
    env_steps = [r["env_steps"] for r in records if r["kind"] == "round"]
    assert [step for step, _ in board["round/actor/loss"]] == env_steps
    assert [step for step, _ in board["eval/round/train/success"]] == env_steps
    assert board["eval/sft/train/success"][0][0] == 0

    # `kinema eval` on a task the checkpoint never saw: allowed, and said so in the output and the report.
    out = tmp_path / "eval"
    result = kinema(
        "eval", "--policy", str(run / "checkpoints" / "round-002"), "--task", "push", "--episodes", "2",
        "--splits", "train", "--workers", "0", "--videos", "0", "--out", str(out), "--task-config", '{"num_distractors": 0}',
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained on ['drawer'], not on 'push'" in result.stderr
    report = json.loads((out / "eval.json").read_text())
    assert report["results"]["train"]["episodes"] == 2 and report["seen_tasks"] == ["drawer"]
    assert report["task_config"] == {"num_distractors": 0}
    bad = kinema_in_process("eval", "--policy", str(run / "checkpoints" / "round-002"), "--task", "push", "--task-config", "[0]")
    assert bad.returncode != 0 and "--task-config must be a JSON object" in bad.stderr
    assert "unseen" in (out / "report.md").read_text()
    # Bad arguments are refused before the first episode, and the earlier report stays.
    before = (out / "eval.json").read_text()
    for args, message in ((["--episodes", "0"], "--episodes must be >= 1"), (["--splits", "train,"], "unknown split")):
        bad = kinema_in_process("eval", "--policy", str(run / "checkpoints" / "round-002"), "--task", "push", "--out", str(out), *args)
        assert bad.returncode == 2 and message in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert (out / "eval.json").read_text() == before


def test_fresh_train_refuses_an_existing_run(tmp_path: Path):
    (tmp_path / "state.json").write_text("{}")
    (tmp_path / "state.json").write_text(json.dumps({"round": 0}))
    result = kinema_in_process("train", *TINY, "--out", str(tmp_path))
    assert result.returncode == 2 and "already holds a run" in result.stderr


def test_unknown_config_keys_list_the_valid_ones(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown config key 'rl.roundz'.*valid keys here: method, rounds"):
        load_config(None, ["--rl.roundz", "3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: push\nsft:\n  stepz: 3\n")
    with pytest.raises(ValueError, match="unknown config key 'sft.stepz'.*bad.yaml.*valid keys here: steps"):
        load_config(str(bad))
    with pytest.raises(ValueError, match="rl.method .ppo. is not known; valid: habc, sft_continued, awr, flow_ppo"):
        load_config(None, ["--rl.method", "ppo"])
    # A group given a value (the benchmark's `--demos scripted` passed to `kinema train`) names the group's keys.
    with pytest.raises(ValueError, match=r"--demos is a group of config keys, not one value; set its keys: --demos.episodes, .*--demos.source"):
        load_config(None, ["--demos", "scripted", "--demos.source", "scripted"])
    with pytest.raises(ValueError, match=r"--rl.habc is a group of config keys"):
        load_config(None, ["--rl.habc=1"])
    result = kinema_in_process("train", "--rl.roundz", "3")
    assert result.returncode == 2 and "valid keys here" in result.stderr and "Traceback" not in result.stderr


def test_bad_values_and_bad_yaml_name_the_key_or_the_file(tmp_path: Path):
    with pytest.raises(ValueError, match=r"`rl.rounds`: Couldn't parse 'abc' into an int"):
        load_config(None, ["--rl.rounds", "abc"])
    bad = tmp_path / "broken.yaml"
    bad.write_text("rl:\n  rounds: [3\n")
    with pytest.raises(ValueError, match="broken.yaml is not valid YAML"):
        load_config(str(bad))
    result = kinema_in_process("train", "--config", str(bad))
    assert result.returncode == 2 and "is not valid YAML" in result.stderr and "Traceback" not in result.stderr
    with pytest.raises(FileNotFoundError, match="is a folder, not a YAML file"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("config_class", ["train", "video"])
def test_resume_refuses_overrides_of_what_the_run_was_made_with_and_keeps_the_run(tmp_path: Path, config_class: str):
    """`--resume R --policy.image_size 32` once broke R for good (config.yaml rewritten, the checkpoint 64 px): the
    override is refused before anything is written; overrides of the rest (more rounds, a device) still apply."""
    from kinema.common import dump_config, load_run_config
    from kinema.video.config import VideoTrainConfig

    cls, fixed, free = {
        "train": (TrainConfig, ["--policy.image_size", "32"], (["--rl.rounds", "9"], lambda c: c.rl.rounds == 9)),
        "video": (VideoTrainConfig, ["--model.lora_rank", "4"], (["--model.device", "cuda"], lambda c: c.model.device == "cuda")),
    }[config_class]
    kwargs = {"config_class": cls}
    saved = dump_config(load_config(None, [], **kwargs))
    (tmp_path / "config.yaml").write_text(saved)
    key = fixed[0][2:]
    with pytest.raises(ValueError, match=rf"--resume cannot change {key} .* Nothing in .* was changed"):
        load_run_config(None, fixed, str(tmp_path), **kwargs)
    command = ("train",) if config_class == "train" else ("video", "train")
    result = kinema_in_process(*command, "--resume", str(tmp_path), *fixed)  # the CLI checks before the run rewrites config.yaml
    assert result.returncode == 2 and "--resume cannot change" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "config.yaml").read_text() == saved
    assert free[1](load_run_config(None, free[0], str(tmp_path), **kwargs))
    # The benchmark's case: a resume that repeats the run's own values (a path spelt another way too) is accepted.
    same = {"train": ["--policy.image_size", "64", "--init_policy", "", "--task", "drawer"],
            "video": ["--model.lora_rank", "8", "--data.dataset", ""]}[config_class]  # fmt: skip
    load_run_config(None, same, str(tmp_path), **kwargs)


def test_config_files_in_assets_load():
    configs = sorted(
        p for p in (Path(__file__).resolve().parent.parent / "assets" / "configs").glob("*.yaml") if not p.name.startswith("video_")
    )  # video_*.yaml are `kinema video train` configs, loaded in tests/test_video_train.py
    assert configs, "assets/configs/ ships no training configs"
    for path in configs:
        cfg = load_config(str(path))
        assert cfg.rl.rounds >= 0 and np.isfinite(cfg.sft.lr)


def test_shipped_configs_load_by_name():
    cfg = load_config("drawer_habc_hil")
    assert cfg.rl.interventions and cfg.task == "drawer"
    with pytest.raises(FileNotFoundError, match="shipped configs: drawer_habc, drawer_habc_hil"):
        load_config("drawer_hbc")


def _steps_episode(T: int, task: str) -> "Episode":
    from diffusion_rl.data import Episode

    rng = np.random.default_rng(T)
    return Episode(
        observations={
            "observation.state": rng.normal(size=(T, 8)).astype(np.float32),
            "observation.images.agentview": rng.integers(0, 255, (T, 32, 32, 3), np.uint8),
            "observation.images.wrist": rng.integers(0, 255, (T, 32, 32, 3), np.uint8),
        },
        action=rng.uniform(-1, 1, (T, 7)).astype(np.float32),
        task=task,
        outcome=True,
    )


def _record_draws(buffer) -> list[int]:
    """The step indices every minibatch draws from `buffer`, in order (the buffer still builds the batches)."""
    drawn: list[int] = []
    real_batch = buffer.batch
    buffer.batch = lambda index, *a, **k: (drawn.extend(index.tolist()), real_batch(index, *a, **k))[1]
    return drawn


def _unmoving_policy(demos):
    """A tiny VLA on the demos' normalisation with a learning rate of 0: the draws, not the updates, are tested."""
    import torch

    policy = VLAPolicy(VLAConfig(image_size=32, chunk_size=4, n_action_steps=2, num_flow_steps=2))
    policy.set_normalization(demos.stats())
    return policy, torch.optim.SGD(policy.parameters(), lr=0.0)


@pytest.mark.parametrize("mixing, expected_share", [("fixed", 0.25), ("pooled", 5 / 45)])
def test_actor_replay_mixing_fixed_share_or_pooled_by_weight(mixing, expected_share):
    """fixed: demo_fraction of each minibatch is demos. pooled (HABC's loss over demos ∪ rollouts): a demo step counts 1
    and a replay step its weight, so 40 demo steps and replay weights summing to 5 give a replay share of 5/45; a
    zero-weight replay step is never drawn."""
    import torch

    from kinema.train.actor import actor_updates
    from kinema.train.buffer import StepBuffer

    torch.manual_seed(0)
    demos = StepBuffer.from_episodes([_steps_episode(40, "open the drawer")], ("agentview", "wrist"))
    replay = StepBuffer.from_episodes([_steps_episode(10, "open the drawer")], ("agentview", "wrist"))
    weights = np.array([2.0, 1.0, 1.0, 0.5, 0.5, 0, 0, 0, 0, 0], np.float32)
    drawn = _record_draws(replay)
    policy, optimizer = _unmoving_policy(demos)
    stats = actor_updates(policy, optimizer, steps=60, batch_size=16, demos=demos, replay=replay, replay_weights=weights,
                          demo_fraction=0.75, aux_weight=0.0, rng=np.random.default_rng(0), mixing=mixing)
    assert stats["actor/replay_share"] == pytest.approx(expected_share, abs=0.04)
    assert len(drawn) == pytest.approx(expected_share * 60 * 16, abs=0.04 * 60 * 16)
    assert set(drawn) <= {0, 1, 2, 3, 4}
    with pytest.raises(ValueError, match="replay mixing must be one of"):
        actor_updates(policy, optimizer, steps=1, batch_size=4, demos=demos, replay=replay, replay_weights=weights,
                      demo_fraction=0.5, aux_weight=0.0, rng=np.random.default_rng(0), mixing="sometimes")


def test_return_weighted_demos_are_drawn_by_their_steps_to_success():
    """demos.weighting return, τ = 5: every step of a 10-step demo weighs e^4 times one of a 30-step demo, so the
    slow demo's 30 steps get 30e^-4 / (10 + 30e^-4) = 5 % of the draws (uniform: 75 %)."""
    from kinema.train.actor import actor_updates
    from kinema.train.buffer import StepBuffer
    from kinema.train.workflow import demo_step_weights

    episodes = [_steps_episode(10, "open the drawer"), _steps_episode(30, "open the drawer")]
    assert demo_step_weights(episodes, load_config(None, [])) == (None, {})
    weights, stats = demo_step_weights(episodes, load_config(None, ["--demos.weighting", "return", "--demos.temperature", "5"]))
    assert weights.shape == (40,) and np.allclose(weights[:10], weights[0]) and np.allclose(weights[10:], weights[10])
    assert weights[0] / weights[10] == pytest.approx(np.exp(4))
    assert stats["weighted_steps_to_success"] == pytest.approx((10 + 30 * np.exp(-4)) / (1 + np.exp(-4)))
    assert stats["effective_episodes"] == pytest.approx((1 + np.exp(-4)) ** 2 / (1 + np.exp(-8)))

    demos = StepBuffer.from_episodes(episodes, ("agentview", "wrist"))
    drawn = _record_draws(demos)
    policy, optimizer = _unmoving_policy(demos)
    kwargs = dict(steps=40, batch_size=16, demos=demos, replay=None, replay_weights=None, demo_fraction=1.0,
                  aux_weight=0.0)  # fmt: skip
    actor_updates(policy, optimizer, rng=np.random.default_rng(0), demo_weights=weights, **kwargs)
    slow_share = np.mean(np.array(drawn) >= 10)
    assert slow_share == pytest.approx(30 * np.exp(-4) / (10 + 30 * np.exp(-4)), abs=0.03)
    drawn.clear()
    actor_updates(policy, optimizer, rng=np.random.default_rng(0), **kwargs)
    assert np.mean(np.array(drawn) >= 10) == pytest.approx(0.75, abs=0.05)
    with pytest.raises(ValueError, match="demo_weights has 3 entries for 40 demonstration steps"):
        actor_updates(policy, optimizer, rng=np.random.default_rng(0), demo_weights=np.ones(3), **kwargs)


@pytest.mark.slow
def test_a_run_with_return_weighted_demos_says_what_the_rounds_imitate(tmp_path: Path):
    """`kinema train --demos.weighting return`: the demos record and the report give the weighted demos' steps to
    success (no more than the demos' own) and their effective number of episodes."""
    run = tmp_path / "run"
    train_in_process(*TINY, "--rl.rounds", "1", "--rl.method", "sft_continued", "--demos.weighting", "return",
                     "--demos.temperature", "3", "--eval.videos", "0", "--eval.heldout", "false", "--out", str(run))  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    demos = next(r for r in records if r["kind"] == "demos")
    assert demos["weighted_steps_to_success"] <= demos["steps_to_success"] and 1 <= demos["effective_episodes"] <= 4
    assert f"{demos['effective_episodes']:.1f} effective episodes" in (run / "report.md").read_text()


@pytest.mark.slow
def test_a_run_with_idle_demo_steps_dropped_imitates_the_teleoperators_demos_without_their_pauses(tmp_path: Path):
    """`--demos.idle drop`: the steps after which the arm neither moved nor changed its grip (the teleoperator's
    pauses) are cut out of the collected demos before SFT; the record, table and report say how many."""
    from diffusion_rl.credit import idle_steps

    run = tmp_path / "run"
    printed = train_in_process(*TINY, "--rl.method", "none", "--demos.source", "teleop", "--demos.idle", "drop",
                               "--task_config", '{"horizon": 120}', "--eval.videos", "0", "--eval.heldout", "false",
                               "--out", str(run))  # fmt: skip
    demos = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "demos"' in line)
    collected = [ep for ep in read_episodes(run / "demos") if ep.outcome]  # as collected, pauses and all
    states = [torch.tensor(ep.observations["observation.state"], dtype=torch.float64) for ep in collected]
    idle = [idle_steps(x[:, :3], x[:, 3:7], x[:, 7]) for x in states]
    assert demos["idle_steps_dropped"] == sum(int(i.sum()) for i in idle) > 0, "a teleoperator pauses"
    assert demos["steps"] == sum(len(ep) for ep in collected) - demos["idle_steps_dropped"]
    # the demonstrator's steps to success stay what the operator took, pauses included
    assert demos["steps_to_success"] == pytest.approx(np.mean([ep.steps_to_success for ep in collected]))
    assert f"{demos['idle_steps_dropped']} idle steps cut out" in (run / "report.md").read_text()
    assert "less idle" in printed  # the results table's row


def test_cutting_idle_demo_steps_keeps_each_remaining_steps_weight():
    """`without_idle_steps`: a pause cut out of one demo leaves every other step with the weight it had, in order."""
    from diffusion_rl.data import Episode
    from kinema.train.workflow import without_idle_steps

    def demo(x: list[float]) -> Episode:
        state = np.zeros((len(x), 8), np.float32)
        state[:, 0], state[:, 3] = x, 1.0  # moving along x, never turning, the gripper still
        return Episode(observations={"observation.state": state}, action=np.arange(len(x))[:, None].repeat(7, 1), task="t")

    paused, steady = demo([0.0, 0.01, 0.01, 0.01, 0.02]), demo([0.0, 0.01, 0.02])  # steps 1 and 2 of the first idle
    weights = np.array([2.0] * 5 + [0.5] * 3)
    kept, kept_weights, dropped = without_idle_steps([paused, steady], weights)
    assert dropped == 2 and [len(ep) for ep in kept] == [3, 3]
    np.testing.assert_array_equal(kept[0].action[:, 0], [0, 3, 4])
    np.testing.assert_array_equal(kept_weights, [2.0, 2.0, 2.0, 0.5, 0.5, 0.5])
    assert without_idle_steps([steady], None)[1] is None
    wrong = Episode(observations={"observation.state": np.zeros((3, 5), np.float32)}, action=np.zeros((3, 7)), task="t")
    with pytest.raises(ValueError, match=r"kinema's \(8,\) layout; these demos' state is \(5,\): use demos.idle keep"):
        without_idle_steps([steady, wrong], None)


def test_demo_steps_are_imitated_under_each_equivalent_instruction_of_their_episode():
    """`with_instructions`: each sample's instruction is drawn from its own episode's list (all of them in time),
    the same draws for the same generator; a list per episode is required."""
    from diffusion_rl.data import Episode
    from kinema.train.buffer import StepBuffer

    def demo(task: str, n: int) -> Episode:
        return Episode(observations={"observation.state": np.zeros((n, 8), np.float32)}, action=np.zeros((n, 7)), task=task)

    buffer = StepBuffer.from_episodes([demo("open the top drawer", 3), demo("open the red drawer", 4)], [])
    choices = [("open the top drawer", "open the blue drawer"), ("open the red drawer", "open the bottom drawer", "pull the red drawer open")]
    relabelled = buffer.with_instructions(choices, np.random.default_rng(0))
    seen: dict[int, set[str]] = {0: set(), 1: set()}
    for _ in range(40):
        index = np.arange(len(buffer))
        for i, task in zip(index, relabelled.batch(index, 2)["task"]):
            seen[int(buffer.episode_of_step[i])].add(task)
    assert seen == {0: set(choices[0]), 1: set(choices[1])}
    again = buffer.with_instructions(choices, np.random.default_rng(0))
    assert again.batch(np.arange(7), 2)["task"] == buffer.with_instructions(choices, np.random.default_rng(0)).batch(np.arange(7), 2)["task"]
    assert buffer.batch(np.arange(7), 2)["task"] == ["open the top drawer"] * 3 + ["open the red drawer"] * 4  # untouched
    with pytest.raises(ValueError, match="one non-empty list of instructions per episode is needed: 2 episodes, 1 lists"):
        buffer.with_instructions(choices[:1], np.random.default_rng(0))
    with pytest.raises(ValueError, match="demos.instructions 'paraphrased' is not known; valid: as_collected, equivalent"):
        load_config(None, ["--demos.instructions", "paraphrased"])


def test_unknown_demo_weighting_and_a_non_positive_temperature_are_refused():
    with pytest.raises(ValueError, match="demos.weighting 'fastest' is not known; valid: uniform, return"):
        load_config(None, ["--demos.weighting", "fastest"])
    with pytest.raises(ValueError, match="demos.temperature is in steps and must be > 0; got 0.0"):
        load_config(None, ["--demos.weighting", "return", "--demos.temperature", "0"])
    with pytest.raises(ValueError, match="demos.idle 'trim' is not known; valid: keep, drop"):
        load_config(None, ["--demos.idle", "trim"])


def test_unknown_replay_mixing_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="rl.replay_mixing 'sometimes' is not known; valid: fixed, pooled"):
        load_config(None, ["--rl.replay_mixing", "sometimes"])


def test_rounds_on_a_robot_take_only_methods_that_learn_from_recordings_and_the_robot_shorthand_names_its_config():
    from kinema.train.methods import METHODS

    learners = [name for name, m in METHODS.items() if m.learns_from_recordings]
    assert {"habc", "hg_dagger", "sft_continued"} <= set(learners) and "dsrl" not in learners and "flow_ppo_grpo" not in learners
    with pytest.raises(ValueError, match=f"rl.method 'dsrl' cannot train on a robot's recorded episodes .* valid with a robot: {', '.join(learners)}"):
        load_config(None, ["--robot.config", "sim_panda", "--rl.method", "dsrl"])
    with pytest.raises(ValueError, match="robot.episode_seconds must be > 0"):
        load_config(None, ["--robot.config", "sim_panda", "--robot.episode_seconds", "0"])
    with pytest.raises(ValueError, match="robot.reset 'auto' is not known; valid: topic, operator"):
        load_config(None, ["--robot.config", "sim_panda", "--robot.reset", "auto"])
    assert load_config(None, ["--robot.config", "sim_panda"]).robot.config == "sim_panda"


def train_two_rounds_with_a_resume(run: Path, args: list[str]) -> list[dict]:
    """A run of one round, resumed for a second; the two round records."""
    train_in_process(*TINY, *args, "--rl.rounds", "1", "--out", str(run))
    train_in_process("--rl.rounds", "2", resume=run)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2]
    return rounds


@pytest.mark.slow
def test_flow_ppo_runs_and_resumes_with_its_reference(tmp_path: Path):
    """The Flow-SDE PPO arm end to end, and resumed: its KL reference (on by default) loads from checkpoints/sft both
    times. (These tiny rollouts all fail, so no PPO update runs here; the updates and the KL term are tested in
    tests/test_train_ppo.py.)"""
    run = tmp_path / "run"
    args = ["--rl.method", "flow_ppo", "--rl.ppo.group_size", "3", "--eval.heldout", "false", "--eval.videos", "0"]
    rounds = train_two_rounds_with_a_resume(run, args)
    assert all({"ppo/updates", "grpo/n_groups"} <= set(r) and r["grpo/n_groups"] == 1.0 for r in rounds)


@pytest.mark.slow
def test_flow_ppo_with_a_critic_rolls_out_distinct_seeds_and_fits_its_value_head(tmp_path: Path):
    """rl.ppo.advantage gae: no GRPO groups (every rollout its own seed), GAE advantages from the value head, which is
    fitted on the λ-returns every round; its PPO updates run even when every rollout fails."""
    run = tmp_path / "run"
    args = ["--rl.method", "flow_ppo", "--rl.ppo.advantage", "gae", "--eval.heldout", "false", "--eval.videos", "0"]
    train_in_process(*TINY, *args, "--rl.rounds", "1", "--out", str(run))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (round_record,) = [r for r in records if r["kind"] == "round"]
    assert "grpo/n_groups" not in round_record and round_record["ppo/updates"] > 0
    assert {"gae/explained_variance", "gae/value_loss"} <= set(round_record)
    seeds = [ep.seed for ep in read_episodes(run / "rollouts" / "round-001")]
    assert len(seeds) == len(set(seeds)) > 1


def test_unknown_ppo_advantage_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="rl.ppo.advantage must be one of grpo, gae; got 'vtrace'"):
        load_config(None, ["--rl.ppo.advantage", "vtrace"])
    with pytest.raises(ValueError, match=r"rl.ppo.gae_lambda must be in \[0, 1\]; got 1.5"):
        load_config(None, ["--rl.ppo.gae_lambda", "1.5"])


def test_negative_ppo_trust_region_settings_are_refused():
    with pytest.raises(ValueError, match=r"rl.ppo.kl_weight must be >= 0 \(0 turns it off\); got -0.1"):
        load_config(None, ["--rl.ppo.kl_weight", "-0.1"])


def test_curves_of_an_sft_only_run_say_there_were_no_rounds(tmp_path: Path):
    import warnings

    from kinema.train.report import write_curves

    sft_eval = {"kind": "eval", "stage": "sft", "env_steps": 0, "train/success": 0.3, "train/success_se": 0.05, "train/episodes": 100}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns when a legend has nothing to show
        path = write_curves([sft_eval], tmp_path / "curves.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_leftover_demos_of_another_task_or_seed_are_refused_not_reused(tmp_path: Path):
    """A run that failed after collecting leaves `demos/`; starting the folder again reuses them only if they are
    what the config collects (task, seeds and collection settings); a `stack` run once trained on leftover
    `drawer` demos."""
    from kinema.common import read_collected, write_collected
    from sim.rollout import collect_demos

    folder, settings = tmp_path / "demos", {"demos": {"noise": 0.05}, "image_size": 32}
    assert read_collected(folder, task="drawer", seeds=range(2), settings=settings) is None
    written = write_collected(folder, collect_demos("drawer", 2, seeds=range(2), image_size=32), settings=settings)
    assert sorted(ep.seed for ep in written) == [0, 1]
    assert sorted(ep.seed for ep in read_collected(folder, task="drawer", seeds=range(2), settings=settings)) == [0, 1]
    with pytest.raises(ValueError, match="2 episodes of drawer .* collects 2 of stack .* Remove"):
        read_collected(folder, task="stack", seeds=range(2), settings=settings)
    with pytest.raises(ValueError, match="collects 3 of drawer"):
        read_collected(folder, task="drawer", seeds=range(3), settings=settings)
    with pytest.raises(ValueError, match=r"seeds 10000\.\.10001"):
        read_collected(folder, task="drawer", seeds=range(10_000, 10_002), settings=settings)
    with pytest.raises(ValueError, match=r"demos \{'noise': 0.05\} \(this config: \{'noise': 0.2\}\)"):
        read_collected(folder, task="drawer", seeds=range(2), settings={**settings, "demos": {"noise": 0.2}})
    (folder / "collected_with.json").unlink()  # a folder from before the settings were recorded: task and seeds only
    assert len(read_collected(folder, task="drawer", seeds=range(2), settings={"other": 1})) == 2


def test_init_policy_must_match_the_config_and_an_unseen_task_is_noted(tmp_path: Path):
    """`--init_policy` of another architecture was accepted silently, config.yaml then claiming what the run was
    not; a checkpoint of another task is allowed but said so, and the task joins what the checkpoint has seen."""
    from rich.console import Console

    from kinema.train.workflow import train

    ckpt = tmp_path / "sft"
    VLAPolicy(VLAConfig(image_size=32, chunk_size=4, extra={"tasks": ["stack"]})).save_pretrained(ckpt)
    base = [*TINY, "--rl.rounds", "0", "--eval.baseline", "false", "--init_policy", str(ckpt)]
    with pytest.raises(ValueError, match=r"another architecture .* policy.chunk_size 4 \(config: 8\)"):
        train(load_config(None, [*base, "--out", str(tmp_path / "a")]), console=Console(file=open(tmp_path / "a.log", "w")))
    assert not (tmp_path / "a" / "demos").exists()  # refused before any demo was collected
    log = tmp_path / "b.log"
    with log.open("w") as f:  # execution options are not architecture: the config's value replaces the checkpoint's
        overrides = ["--policy.chunk_size", "4", "--policy.num_flow_steps", "3", "--out", str(tmp_path / "b")]
        run = train(load_config(None, [*base, *overrides]), console=Console(file=f, width=200))
    assert "trained on stack; drawer is unseen" in log.read_text() and "policy.num_flow_steps=3" in log.read_text()
    saved = VLAPolicy.from_pretrained(run / "checkpoints" / "sft").config
    assert saved.extra["tasks"] == ["stack", "drawer"] and saved.num_flow_steps == 3


def test_sft_and_updates_run_on_the_learner_threads_and_rollouts_on_threads(tmp_path: Path, monkeypatch):
    """The env workers wait while the learner steps, so SFT and the rounds' updates take `learner_threads`; during
    rollouts and evaluations a second intra-op thread would spin against the env workers, so they take `threads`."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from kinema.train import workflow
    from kinema.train.methods import base

    at_step, at_collect = [], []
    collect = base.collect

    def collect_counting(*args, **kwargs):
        at_collect.append(torch.get_num_threads())
        return collect(*args, **kwargs)

    monkeypatch.setattr(base, "collect", collect_counting)
    hook = register_optimizer_step_pre_hook(lambda *_: at_step.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        cfg = load_config(None, [*TINY, "--rl.rounds", "1", "--rl.method", "habc", "--eval.videos", "0", "--eval.heldout", "false",
                                 "--threads", "1", "--learner_threads", "2", "--out", str(tmp_path / "run")])  # fmt: skip
        workflow.train(cfg)
        assert torch.get_num_threads() == 1  # back to `threads` after the last update
    finally:
        hook.remove()
        torch.set_num_threads(before)
    assert len(at_step) > 6 and set(at_step) == {2}  # SFT, the actor's and the critics' steps
    assert at_collect and set(at_collect) == {1}  # the round's rollouts


def test_learner_threads_default_to_omp_num_threads_else_the_usable_cores(monkeypatch):
    from kinema.common import available_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert available_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert available_threads() == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="learner_threads must be >= 0; got -1"):
        load_config(None, ["--learner_threads", "-1"])


def test_a_run_started_on_busy_cores_says_to_give_each_learner_one_thread():
    """Two runs side by side, each learner on every core, ran 7-11x slower a step than one alone: a run starting on a
    machine whose load already fills its cores says so, unless its learner fits in what is free."""
    from kinema.common import busy_cores_note

    assert busy_cores_note(0, load=0.3, cores=2) is None  # an idle machine
    assert busy_cores_note(0, load=0.7, cores=2) is None  # or one whose last run just ended
    note = busy_cores_note(0, load=1.9, cores=2)
    assert note and "load 1.9 on 2 cores" in note and "learner's 2 threads" in note and "--learner_threads 1" in note
    assert busy_cores_note(1, load=1.9, cores=2) is None  # one thread: what the note asks for
    assert "learner's 4 threads" in busy_cores_note(4, load=6.2, cores=8)  # 2 cores free, 4 asked for
    assert busy_cores_note(2, load=5.6, cores=8) is None


def test_an_unmeasured_kind_of_work_takes_its_kins_pace_scaled_as_their_priors():
    """Before a run's first rollout, its evaluations' measured pace prices the rollouts, scaled by what each costs
    (an evaluation renders a quarter of the frames a rollout records); nothing measured: the prior."""
    from kinema.train.progress import PRIORS, RunPace

    pace = RunPace({"eval": 10, "rollout": 10, "sft": 100})
    pace.add("eval", 4, 2.0)
    assert pace.rate("eval") == 0.5
    assert pace.rate("rollout") == pytest.approx(0.5 * PRIORS["rollout"] / PRIORS["eval"])
    assert pace.rate("sft") == PRIORS["sft"]
    assert pace.seconds_left() == pytest.approx(6 * 0.5 + 10 * pace.rate("rollout") + 100 * PRIORS["sft"])


def test_a_run_logged_to_a_file_says_each_tenth_of_a_phase_and_a_terminal_gets_the_bar_alone():
    """With no terminal to draw a bar on (`nohup kinema train ... > log`), a phase prints one line per tenth of its
    count, with its time left, and the run line none; on a terminal, only the bars."""
    import io

    from rich.console import Console

    from kinema.common import progress_bar
    from kinema.train.progress import RunPace, RunProgress

    for terminal in (False, True):
        out = io.StringIO()
        progress = RunProgress(progress_bar(Console(file=out, force_terminal=terminal, width=120)), RunPace({"sft": 250}))
        with progress.phase("SFT (steps)", 250, kind="sft"):
            for _ in range(250):
                progress.advance()
        with progress.phase("evaluation (episodes)", 20, kind="eval"):
            progress.advance(20)
        lines = [line for line in out.getvalue().splitlines() if line.endswith(" left")]
        if terminal:
            assert lines == []
        else:
            assert [line.split(" · ")[0] for line in lines] == [f"SFT (steps): {25 * k}/250" for k in range(1, 11)] + [
                "evaluation (episodes): 20/20"]  # fmt: skip
            assert lines[-1].endswith("~0 s left") and "run (% of estimate)" not in out.getvalue()


def test_a_grounded_encoder_learns_from_the_demos_pixel_labels_and_is_told_when_they_have_none(tmp_path: Path):
    """patchify_grounded: sim demos carry the pixel labels and its SFT uses them, so no note; a recording from
    before the labels (the fixture's demos) trains, with a note that its locator then learns only through the
    actions."""
    from rich.console import Console

    from kinema.train.workflow import train

    base = [*TINY, "--rl.rounds", "0", "--eval.heldout", "false", "--eval.videos", "0", "--policy.vision_encoder",
            "patchify_grounded", "--policy.keypoints", "2"]  # fmt: skip
    for name, extra in (("fresh", []), ("recording", ["--dataset", str(Path(__file__).parent / "fixtures" / "run-before-methods" / "demos")])):
        log = tmp_path / f"{name}.log"
        with log.open("w") as f:
            train(load_config(None, [*base, *extra, "--out", str(tmp_path / name)]), console=Console(file=f, width=200))
        assert ("carry no pixel labels" in log.read_text()) == (name == "recording"), log.read_text()
