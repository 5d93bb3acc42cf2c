"""`kinema train --policy.type smolvla` and `pi0` on LeRobot's tiny checkpoints (tests/fixtures/smolvla, pi0): the
run keeps LeRobot's layout, every registered method trains them (recap refused), bad settings are named. Apart from
test_smolvla.py and test_pi0.py so that pytest-xdist (`--dist loadfile`) can put them on different workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from policies import load_policy

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINT, VLM = FIXTURES / "smolvla" / "tiny-smolvla", FIXTURES / "smolvla" / "tiny-smolvlm"
PI0 = FIXTURES / "pi0" / "tiny-pi0"


@dataclass(frozen=True)
class Kind:
    """A LeRobot flow VLA type as these tests drive it: its options, and its weights' names for expert and VLM."""

    checkpoint: Path
    options: tuple[str, ...]
    expert: str
    vlm: str


KINDS = {
    "smolvla": Kind(CHECKPOINT, ("--policy.type", "smolvla", "--policy.checkpoint", str(CHECKPOINT), "--policy.vlm_path", str(VLM)),
                    ".lm_expert.", ".vlm."),
    "pi0": Kind(PI0, ("--policy.type", "pi0", "--policy.checkpoint", str(PI0)), ".gemma_expert.", ".paligemma."),
}  # fmt: skip

torch.set_num_threads(1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_kinema_train_post_trains_a_lerobot_checkpoint_and_keeps_lerobots_layout(tmp_path, kind):
    """`kinema train --policy.type smolvla` (or pi0): SFT on the task's demos and one HABC round move the action expert and
    leave the VLM as it was (trainable "expert"); the final checkpoint is LeRobot's folder with kinema's file beside."""
    run = tmp_path / "run"
    args = ["--task", "drawer", "--demos.episodes", "3", "--sft.steps", "4", "--sft.batch_size", "4", "--rl.rounds", "1",
            "--rl.episodes_per_round", "2", "--rl.updates_per_round", "3", "--rl.batch_size", "4", "--rl.habc.critic_steps", "3",
            "--eval.episodes", "1", "--eval.round_episodes", "1", "--eval.videos", "0", "--eval.heldout", "false",
            "--workers", "0", "--num_envs", "2", "--policy.image_size", "32", "--task_config", '{"horizon": 30}',
            *KINDS[kind].options, "--policy.n_action_steps", "2", "--out", str(run)]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "kinema.cli", "train", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MUJOCO_GL": "egl"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    final = run / "checkpoints" / "final"
    checkpoint, expert, vlm = KINDS[kind].checkpoint, KINDS[kind].expert, KINDS[kind].vlm
    assert json.loads((final / "config.json").read_text()) == json.loads((checkpoint / "config.json").read_text())
    assert (final / "policy_preprocessor.json").read_bytes() == (checkpoint / "policy_preprocessor.json").read_bytes()
    before, after = load_file(str(checkpoint / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert set(before) == set(after)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(vlm not in k for k in moved)
    assert any(expert in k for k in moved)
    policy = load_policy(final)
    assert policy.config.n_action_steps == 2 and policy.config.extra["tasks"] == ["drawer"]
    from test_train_methods import assert_eval_and_deploy_act_alike

    assert_eval_and_deploy_act_alike(final)


def test_a_smolvla_run_needs_its_checkpoint_and_refuses_what_it_cannot_use(tmp_path):
    from kinema import common
    from kinema.train.config import TrainConfig

    def load_config(*overrides: str) -> TrainConfig:
        return common.load_config(None, ["--policy.type", "smolvla", *overrides], config_class=TrainConfig)

    with pytest.raises(ValueError, match="policy.checkpoint"):
        load_config()
    with pytest.raises(ValueError, match="no config.json"):
        load_config("--policy.checkpoint", str(tmp_path))
    with pytest.raises(ValueError, match="init_policy.*policy.checkpoint"):
        load_config("--policy.checkpoint", str(CHECKPOINT), "--init_policy", str(tmp_path))
    with pytest.raises(ValueError, match="policy.trainable"):
        load_config("--policy.checkpoint", str(CHECKPOINT), "--policy.trainable", "head")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["pa_rl", "dsrl", "residual", "nft", "flow_ppo_gae", "hg_dagger", "awr", "recap"])
def test_each_method_runs_a_round_on_a_tiny_lerobot_checkpoint(tmp_path, name, kind):
    """Every registered method's tiny round (method_regression's options, a smaller budget) on the tiny SmolVLA and
    pi0: the methods that train a separate action expert train theirs; recap, whose improvement indicator is an input
    LeRobot's checkpoints do not have, is refused when the config loads. (none, sft_continued and habc: the train test above; flow_ppo
    with GAE, whose critic gives the tiny round's failures advantages that move the expert.)"""
    from method_regression import RUNS
    from rich.console import Console

    from kinema import common
    from kinema.train.config import METHODS, TrainConfig
    from kinema.train.workflow import train

    assert {args[args.index("--rl.method") + 1] for args in RUNS.values()} == set(METHODS)
    tiny = ["--task", "drawer", "--demos.episodes", "2", "--sft.steps", "2", "--sft.batch_size", "4", "--rl.rounds", "1",
            "--rl.episodes_per_round", "2", "--rl.updates_per_round", "2", "--rl.batch_size", "4", "--eval.episodes", "1",
            "--eval.round_episodes", "1", "--eval.videos", "0", "--eval.heldout", "false", "--workers", "0", "--num_envs", "2",
            "--policy.image_size", "32", "--task_config", '{"horizon": 40}']  # fmt: skip
    overrides = [*tiny, *RUNS[name], *KINDS[kind].options, "--eval.baseline", "false", "--out", str(tmp_path / name)]
    if name == "recap":
        with pytest.raises(ValueError, match=f"rl.method 'recap' does not train a '{kind}' policy"):
            common.load_config(None, overrides, config_class=TrainConfig)
        return
    run = train(common.load_config(None, overrides, config_class=TrainConfig), console=Console(file=open(os.devnull, "w")))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"] == [1]
    after = load_file(str(run / "checkpoints" / "final" / "model.safetensors"))
    sft = load_file(str(run / "checkpoints" / "sft" / "model.safetensors"))
    if name not in ("dsrl", "residual"):  # those two train actors of their own; the checkpoint stays as SFT left it
        assert any(not torch.equal(sft[k], after[k]) for k in sft if KINDS[kind].expert in k), name
    assert all(torch.equal(sft[k], after[k]) for k in sft if KINDS[kind].vlm in k)
