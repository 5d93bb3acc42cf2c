"""HG-DAgger (rl.method hg_dagger), the human-in-the-loop control: on real rollouts with the simulated human, what it
imitates is exactly the demonstrations plus the human's segments, aggregated over every round (a resume included)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from method_regression import TINY
from rich.console import Console

from diffusion_rl.data import ExecutedBy, Segment
from diffusion_rl.data.lerobot_v3 import read_episodes
from kinema.common import load_config, load_run_config
from kinema.train.buffer import StepBuffer
from kinema.train.config import TrainConfig
from kinema.train.methods.hg_dagger import human_segments, imitation_mask
from kinema.train.workflow import train
from sim.env import CAMERAS

QUIET = Console(file=open("/dev/null", "w"))


def test_hg_dagger_refuses_to_run_without_the_human_naming_the_key():
    with pytest.raises(ValueError, match="rl.method hg_dagger .* needs rl.interventions true"):
        load_config(None, ["--rl.method", "hg_dagger"], config_class=TrainConfig)
    with pytest.raises(ValueError, match="rl.hg_dagger.sampling 'all' is not known; valid: uniform, demo_fraction"):
        load_config(None, ["--rl.method", "hg_dagger", "--rl.interventions", "true", "--rl.hg_dagger.sampling", "all"],
                    config_class=TrainConfig)  # fmt: skip
    with pytest.raises(ValueError, match="rl.human_steps 'recovery' is not known; valid: all, correction"):
        load_config(None, ["--rl.method", "hg_dagger", "--rl.interventions", "true", "--rl.human_steps", "recovery"],
                    config_class=TrainConfig)  # fmt: skip


@pytest.mark.slow
def test_hg_dagger_imitates_the_demos_plus_every_rounds_human_segments_and_nothing_of_the_policy(tmp_path: Path):
    torch.set_num_threads(1)
    run = tmp_path / "run"
    args = [*TINY, "--rl.method", "hg_dagger", "--rl.interventions", "true", "--rl.replay_rounds", "1",
            "--rl.episodes_per_round", "3", "--eval.episodes", "1", "--eval.round_episodes", "1",
            "--task_config", '{"horizon": 60}']  # fmt: skip
    train(load_run_config(None, [*args, "--rl.rounds", "1", "--out", str(run)], None, config_class=TrainConfig), console=QUIET)
    # A second round after a resume: the aggregate is rebuilt from the first round's rollouts.
    train(load_run_config(None, ["--rl.rounds", "2"], str(run), config_class=TrainConfig), resume=True, console=QUIET)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2]

    human_steps = []
    for r in (1, 2):
        episodes = read_episodes(run / "rollouts" / f"round-{r:03d}")
        masks = [imitation_mask(ep) for ep in episodes]
        assert all(np.array_equal(m, ep.executed_by == ExecutedBy.HUMAN) for m, ep in zip(masks, episodes))
        segments = human_segments(episodes)
        # The imitated steps are the human's, in order, each once; the policy's own steps are none of them.
        np.testing.assert_array_equal(
            np.concatenate([s.action for s in segments]), np.concatenate([ep.action[m] for ep, m in zip(episodes, masks)])
        )
        np.testing.assert_array_equal(
            np.concatenate([s.observations["observation.state"] for s in segments]),
            np.concatenate([ep.observations["observation.state"][m] for ep, m in zip(episodes, masks)]),
        )
        assert all((s.executed_by == ExecutedBy.HUMAN).all() for s in segments)
        assert sum(m.sum() for m in masks) < sum(len(ep) for ep in episodes)  # the policy acted too
        human_steps.append(int(sum(m.sum() for m in masks)))
        # A chunk target ends where the human handed back: nothing of the policy's next actions is imitated.
        buffer = StepBuffer.from_episodes(segments, CAMERAS)
        chunk = 8
        batch = buffer.batch(np.arange(len(buffer)), chunk)
        remaining = buffer.episode_length[buffer.episode_of_step] - buffer.step_in_episode
        expected_pad = np.arange(chunk)[None] >= remaining[:, None]
        np.testing.assert_array_equal(batch["action_is_pad"].numpy(), expected_pad)
        assert buffer.imitable_index().size == len(buffer)  # every human step is imitated (recovery and correction)
        # `rl.human_steps correction`: the same human steps less the recovery drive, cut at each recovery as at a hand-back.
        corrections = human_segments(episodes, "correction")
        recovery = [ep.segment[m] == Segment.RECOVERY for ep, m in zip(episodes, masks)]
        assert sum(r.sum() for r in recovery) > 0, "the default human recovers (drives back) before correcting"
        np.testing.assert_array_equal(
            np.concatenate([s.action for s in corrections]),
            np.concatenate([ep.action[m][~r] for ep, m, r in zip(episodes, masks, recovery)]),
        )
        assert all((s.segment != Segment.RECOVERY).all() and (s.executed_by == ExecutedBy.HUMAN).all() for s in corrections)
    assert min(human_steps) > 0, "the untrained policy stalls, so the simulated human must have taken over"
    # DAgger aggregates: round 2 imitates both rounds' human steps although the replay window keeps one round.
    assert [r["hg_dagger/human_steps"] for r in rounds] == [human_steps[0], sum(human_steps)]
    assert [r["hg_dagger/human_steps_new"] for r in rounds] == human_steps
    # Resumed with `--rl.human_steps correction`: the aggregate is rebuilt without the recovery steps, and round 3
    # adds its corrections only.
    train(load_run_config(None, ["--rl.rounds", "3", "--rl.human_steps", "correction"], str(run), config_class=TrainConfig),
          resume=True, console=QUIET)  # fmt: skip
    third = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "round"' in line][-1]
    corrections = [sum(int((imitation_mask(ep, "correction")).sum()) for ep in read_episodes(run / "rollouts" / f"round-{r:03d}"))
                   for r in (1, 2, 3)]  # fmt: skip
    assert third["round"] == 3 and third["hg_dagger/human_steps_new"] == corrections[2]
    assert third["hg_dagger/human_steps"] == sum(corrections) < sum(human_steps) + corrections[2]
    # No credit weighting: every aggregated step at weight 1, beside the demonstrations (pooled: one uniform set).
    assert all(r["weights/nonzero_share"] == 1.0 for r in rounds)
    demos = next(r for r in records if r["kind"] == "demos")
    assert 0 < rounds[1]["actor/replay_share"] < 1 and demos["steps"] > 0


@pytest.mark.slow
def test_human_steps_correction_leaves_the_humans_recovery_out_of_any_methods_imitation(tmp_path: Path, monkeypatch):
    """`rl.human_steps correction` is one switch for every method: HABC's replay weights are 0 on exactly the human's
    recovery steps and stay 1 on the human's corrections (HG-DAgger's segments lose them in the test above)."""
    import kinema.train.methods.base as base

    torch.set_num_threads(1)
    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs.get("replay_weights"))
        return base_actor_updates(*args, **kwargs)

    base_actor_updates = base.actor_updates
    monkeypatch.setattr(base, "actor_updates", recording)
    run = tmp_path / "run"
    args = [*TINY, "--rl.method", "habc", "--rl.interventions", "true", "--rl.human_steps", "correction",
            "--rl.episodes_per_round", "3", "--rl.rounds", "1", "--eval.episodes", "1", "--eval.round_episodes", "1",
            "--task_config", '{"horizon": 60}', "--out", str(run)]  # fmt: skip
    train(load_run_config(None, args, None, config_class=TrainConfig), console=QUIET)
    weights = next(w for w in seen if w is not None)  # the round's actor update (SFT draws no replay)
    episodes = read_episodes(run / "rollouts" / "round-001")  # the replay window, in the buffer's order
    human = np.concatenate([ep.executed_by == ExecutedBy.HUMAN for ep in episodes])
    recovery = human & np.concatenate([ep.segment == Segment.RECOVERY for ep in episodes])
    assert len(weights) == len(human) and recovery.sum() > 0, "the untrained policy stalls: the human drives back"
    assert (weights[recovery] == 0).all() and (weights[human & ~recovery] > 0).all()
    record = next(json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"kind": "round"' in line)
    assert record["weights/human_steps_left_out"] == recovery.sum()
    with pytest.raises(ValueError, match="rl.human_steps correction .* needs rl.interventions true"):
        load_config(None, ["--rl.human_steps", "correction"], config_class=TrainConfig)
