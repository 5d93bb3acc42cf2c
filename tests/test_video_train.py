"""The video post-training trainer (`kinema video train`): every method, LoRA-only updates, CFG-free sampling,
exact resume, Flow-GRPO's ratio, config errors, and the command end to end at a tiny budget.

Learning claims (reward vs time, speed-up over Flow-GRPO, diversity) live in benchmarks/video_rl.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_rl.flow import sde_step_with_logprob
from kinema.media import write_mp4
from kinema.video.config import METHODS, VideoTrainConfig, load_video_config
from kinema.video.trainer import BASE, REF, TRAINED, VideoTrainer, base_weights
from kinema.video.workflow import build_rewards, load_teacher_clips
from policies.video.generator import VideoGenerator
from policies.video.rewards import make_rewards

PROMPTS = ["put the red cube on the blue plate", "open the drawer", "push the green cube to the left"]
TINY = [
    "--data.frames", "5", "--data.size", "16", "--train.prompts_per_round", "2", "--train.group_size", "2",
    "--train.updates_per_round", "2", "--train.batch_size", "4", "--model.num_inference_steps", "3",
    "--eval.prompts", "2", "--eval.samples_per_prompt", "2", "--rewards.names", "[exposure, sharpness]",
]  # fmt: skip


@pytest.fixture(autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make_trainer(method: str, *extra: str, teacher_clips=None) -> tuple[VideoTrainer, VideoGenerator, VideoTrainConfig]:
    cfg = load_video_config(None, [*TINY, "--train.method", method, *extra])
    gen = VideoGenerator.from_preset("tiny", seed=0, num_frames=5, height=16, width=16)
    trainer = VideoTrainer(cfg, gen, make_rewards(["exposure", "sharpness"]), PROMPTS, teacher_clips=teacher_clips)
    return trainer, gen, cfg


@pytest.mark.parametrize("method", METHODS)
def test_every_method_changes_only_the_lora_weights(method: str):
    trainer, gen, _ = make_trainer(method)
    base = base_weights(gen)
    lora = {name: gen.adapter_state_dict(name) for name in gen.adapters}
    record = trainer.train_round()  # two updates
    assert trainer.updates == 2 and np.isfinite(record["train/loss"])
    after = base_weights(gen)
    assert after.keys() == base.keys()
    assert all(torch.equal(base[k], after[k]) for k in base), "a base weight moved"
    new = gen.adapter_state_dict(TRAINED)
    changed = [k for k in new if not torch.equal(new[k], lora[TRAINED][k])]
    assert len(changed) == len(new), f"{len(new) - len(changed)} LoRA tensors of the trained adapter did not move"
    if REF in gen.adapters:  # the EMA reference follows the student
        ref = gen.adapter_state_dict(REF)
        assert any(not torch.equal(ref[k], lora[REF][k]) for k in ref)
    for name in ("rollout/exposure", "rollout/sharpness", "rollout/diversity"):
        assert np.isfinite(record[name])


def test_cfg_free_sampling_after_awr_goes_through_the_pipeline():
    trainer, gen, _ = make_trainer("awr", "--train.lr", "3e-3")
    for _ in range(2):
        trainer.train_round()
    prompts = PROMPTS[:2]
    ours = trainer.sample(prompts, seed=7)  # CFG-free ODE of the trained adapter
    assert ours.shape == (2, 5, 3, 16, 16) and torch.isfinite(ours).all()
    assert float(ours.min()) >= 0.0 and float(ours.max()) <= 1.0
    # The standard path users run after training: diffusers' WanPipeline, no guidance, the same noise.
    piped = gen.generate(prompts, num_inference_steps=3, guidance_scale=1.0, seed=7, adapter=TRAINED)
    torch.testing.assert_close(piped, ours, atol=1e-4, rtol=0)
    base = trainer.sample(prompts, seed=7, adapter=BASE)
    assert (base - ours).abs().max() > 1e-4, "post-training left the CFG-free samples unchanged"


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state_dict()["state"].values() for v in state.values() if torch.is_tensor(v)]


def test_resume_restores_optimizer_and_ema_exactly(tmp_path: Path):
    first, gen_a, _ = make_trainer("awr")
    first.train_round()
    first.save(tmp_path / "ckpt")
    saved_opt = [t.clone() for t in _optimizer_tensors(first.optimizer)]
    saved_ref = gen_a.adapter_state_dict(REF)
    first.train_round()
    expected = {name: gen_a.adapter_state_dict(name) for name in gen_a.adapters}

    second, gen_b, _ = make_trainer("awr")
    second.load(tmp_path / "ckpt")
    assert second.round == 1 and second.updates == 2
    for a, b in zip(saved_opt, _optimizer_tensors(second.optimizer), strict=True):
        assert torch.equal(a, b)
    ref = gen_b.adapter_state_dict(REF)
    assert all(torch.equal(ref[k], saved_ref[k]) for k in ref)
    second.train_round()
    for name, state in expected.items():
        got = gen_b.adapter_state_dict(name)
        assert all(torch.equal(got[k], state[k]) for k in state), f"adapter {name} differs after resume"


def test_checkpoint_of_another_method_is_refused(tmp_path: Path):
    awr, _, _ = make_trainer("awr")
    awr.save(tmp_path / "ckpt")
    nft, _, _ = make_trainer("nft")
    with pytest.raises(ValueError, match="trained with method 'awr'"):
        nft.load(tmp_path / "ckpt")


def test_flow_grpo_ratio_is_one_before_the_first_update():
    trainer, gen, cfg = make_trainer("flow_grpo", "--train.options.grpo_steps_per_update", "2")
    ro = trainer.collect()
    ex = ro.extra

    def ratios() -> torch.Tensor:
        out = []
        with torch.no_grad():
            for j in range(ex["states"].shape[0]):
                t, t_next = ex["sched"][j].expand(len(ro.prompts)), ex["sched"][j + 1].expand(len(ro.prompts))
                v = gen.velocity(ex["states"][j], t, ro.embeds, adapter=TRAINED)
                step = sde_step_with_logprob(
                    v, ex["states"][j], t, t_next, noise_level=cfg.train.options.grpo_noise_level, prev_sample=ex["nexts"][j]
                )  # fmt: skip
                out.append((step.log_prob - ex["log_probs"][j]).exp())
        return torch.stack(out)

    assert torch.equal(ratios(), torch.ones_like(ratios()))
    record = trainer.train_round()
    assert record["grpo/first_ratio_max_dev"] < 1e-6 and "grpo/kl_ref" in record
    assert (ratios() - 1).abs().max() > 0, "the update left the policy unchanged"


def test_afd_learns_from_a_folder_of_teacher_videos(tmp_path: Path):
    rng = np.random.default_rng(0)
    for i, prompt in enumerate(PROMPTS[:2]):
        frames = rng.integers(0, 255, size=(12, 32, 32, 3), dtype=np.uint8)
        write_mp4(tmp_path / f"clip{i}.mp4", frames, fps=8)
        (tmp_path / f"clip{i}.txt").write_text(prompt + "\n")
    clips = load_teacher_clips(tmp_path, frames=5, size=16)
    assert sorted(clips) == sorted(PROMPTS[:2]) and clips[PROMPTS[0]].shape == (1, 5, 3, 16, 16)
    trainer, gen, _ = make_trainer("afd", teacher_clips=clips)
    trainer.prompts = sorted(clips)
    record = trainer.train_round()
    assert np.isfinite(record["afd/disc_loss"]) and np.isfinite(record["train/loss"])
    (tmp_path / "clip1.txt").unlink()
    with pytest.raises(FileNotFoundError, match="no prompt file clip1.txt"):
        load_teacher_clips(tmp_path, frames=5, size=16)


def test_unknown_method_reward_or_shape_is_explained(tmp_path: Path):
    with pytest.raises(ValueError, match="train.method 'grpo' is not known; valid: awr, nft, distill, afd, opsd, flow_grpo"):
        load_video_config(None, ["--train.method", "grpo"])
    with pytest.raises(ValueError, match="unknown config key 'train.rollouts'.*valid keys here: method, rounds"):
        load_video_config(None, ["--train.rollouts", "3"])
    with pytest.raises(ValueError, match="data.frames must be 4k \\+ 1.*use 5 or 9"):
        load_video_config(None, ["--data.frames", "8"])
    with pytest.raises(ValueError, match="rewards.weights has 1 entries for 2 rewards"):
        load_video_config(None, ["--rewards.names", "[success, motion]", "--rewards.weights", "[1.0]"])
    cfg = load_video_config(None, ["--rewards.names", "[exposure, brightness]"])
    from kinema.train.workflow import Run

    with pytest.raises(ValueError, match="unknown reward 'brightness'; valid rewards: .*exposure.*motion.*success"):
        build_rewards(cfg, None, Run(tmp_path, console=None), console=None)


def kinema_video(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kinema.video.commands", *args], capture_output=True, text=True, timeout=900)


def test_command_reports_bad_input_with_exit_code_2(tmp_path: Path):
    result = kinema_video("train", "--train.method", "ppo", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "valid: awr, nft, distill, afd, opsd, flow_grpo" in result.stderr


@pytest.mark.slow
def test_video_train_end_to_end_and_resume(tmp_path: Path):
    run = tmp_path / "run"
    args = [
        "--out", str(run), "--data.episodes", "12", "--data.frames", "5", "--data.size", "16", "--pretrain.steps", "20",
        "--train.rounds", "2", "--train.updates_per_round", "2", "--train.prompts_per_round", "2", "--train.group_size", "2",
        "--model.num_inference_steps", "3", "--eval.interval", "1", "--eval.prompts", "2", "--eval.samples_per_prompt", "2",
    ]  # fmt: skip
    first = kinema_video("train", *args)
    assert first.returncode == 0, first.stderr[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "reward_curves.png", "report.md", "state.json", "success_calibration.png",
                 "samples/before.png", "samples/after.png", "samples/before.mp4", "samples/after.mp4"):  # fmt: skip
        assert (run / name).is_file(), name
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("round") == 2 and {"success_reward", "pretrain"} <= set(kinds)
    assert [r["stage"] for r in records if r["kind"] == "eval"] == ["before", "round", "round", "after"]
    assert "eval/success" in records[-1] and "| success |" in (run / "report.md").read_text()
    assert json.loads((run / "state.json").read_text())["latest_checkpoint"] == "checkpoints/round-002"

    second = kinema_video("train", "--resume", str(run), "--train.rounds", "3")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed" in second.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"] == [1, 2, 3]
    assert [r["round"] for r in records if r.get("stage") == "after"] == [2, 3]
    again = kinema_video("train", *args)
    assert again.returncode == 2 and "already holds a run" in again.stderr
