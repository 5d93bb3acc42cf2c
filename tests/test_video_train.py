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
import video_method_regression
from cli_in_process import kinema_in_process
from method_regression import same
from test_board import scalars

from diffusion_rl.flow import sde_step_with_logprob
from kinema.media import write_mp4
from kinema.video.config import METHODS, VideoTrainConfig, load_video_config
from kinema.video.methods import REF, TRAINED
from kinema.video.trainer import VideoTrainer, base_weights
from kinema.video.workflow import load_teacher_clips
from policies.video.generator import BASE, VideoGenerator
from policies.video.rewards import make_rewards
from policies.video.rewards.base import VideoReward

PROMPTS, TINY = video_method_regression.PROMPTS, video_method_regression.TINY  # the tiny trainer both files build


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


def test_distill_fake_score_takes_dmd_fake_updates_steps_per_student_update():
    trainer, gen, _ = make_trainer("distill", "--train.distill.dmd_fake_updates", "3")
    fake_before = gen.adapter_state_dict("fake")
    record = trainer.train_round()  # two student updates
    steps = {int(s["step"]) for s in trainer.method.fake_opt.state_dict()["state"].values()}
    assert steps == {6} and trainer.optimizer.state_dict()["state"][0]["step"] == 2
    assert np.isfinite(record["distill/fake_loss"])
    fake = gen.adapter_state_dict("fake")
    assert any(not torch.equal(fake[k], fake_before[k]) for k in fake)
    with pytest.raises(ValueError, match="train.distill.dmd_fake_updates must be >= 1; got 0"):
        load_video_config(None, ["--train.method", "distill", "--train.distill.dmd_fake_updates", "0"])


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


@pytest.mark.parametrize("method", METHODS)
def test_resume_restores_optimizer_and_ema_exactly(tmp_path: Path, method: str):
    first, gen_a, _ = make_trainer(method)
    first.train_round()
    first.save(tmp_path / "ckpt")
    saved_opt = [t.clone() for t in _optimizer_tensors(first.optimizer)]
    saved = {name: gen_a.adapter_state_dict(name) for name in gen_a.adapters}
    first.train_round()
    expected = {name: gen_a.adapter_state_dict(name) for name in gen_a.adapters}
    expected_eval, _ = first.evaluate()  # through the evaluation EMA where the method keeps one (AWR)

    second, gen_b, _ = make_trainer(method)
    second.load(tmp_path / "ckpt")
    assert second.round == 1 and second.updates == 2
    for a, b in zip(saved_opt, _optimizer_tensors(second.optimizer), strict=True):
        assert torch.equal(a, b)
    for name, state in saved.items():  # the EMA reference and the fake score too
        got = gen_b.adapter_state_dict(name)
        assert all(torch.equal(got[k], state[k]) for k in state), f"adapter {name} not restored"
    second.train_round()
    for name, state in expected.items():
        got = gen_b.adapter_state_dict(name)
        assert all(torch.equal(got[k], state[k]) for k in state), f"adapter {name} differs after resume"
    assert second.evaluate()[0] == expected_eval


def test_checkpoint_of_another_method_is_refused(tmp_path: Path):
    awr, _, _ = make_trainer("awr")
    awr.save(tmp_path / "ckpt")
    nft, _, _ = make_trainer("nft")
    with pytest.raises(ValueError, match="trained with method 'awr'"):
        nft.load(tmp_path / "ckpt")


def test_flow_grpo_ratio_is_one_before_the_first_update():
    trainer, gen, cfg = make_trainer("flow_grpo", "--train.flow_grpo.steps_per_update", "2")
    ro = trainer.collect()
    ex = ro.extra

    def ratios() -> torch.Tensor:
        out = []
        with torch.no_grad():
            for j in range(ex["states"].shape[0]):
                t, t_next = ex["sched"][j].expand(len(ro.prompts)), ex["sched"][j + 1].expand(len(ro.prompts))
                v = gen.velocity(ex["states"][j], t, ro.embeds, adapter=TRAINED)
                step = sde_step_with_logprob(
                    v, ex["states"][j], t, t_next, noise_level=cfg.train.flow_grpo.noise_level, prev_sample=ex["nexts"][j]
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
    # Names and presets are checked when the config loads, before any sim clip is collected.
    with pytest.raises(ValueError, match="rewards.names: unknown reward 'brightness'; valid rewards: .*exposure.*motion.*success"):
        load_video_config(None, ["--rewards.names", "[exposure, brightness]"])
    with pytest.raises(ValueError, match="model.preset: unknown video generator preset 'huge'.*valid presets"):
        load_video_config(None, ["--model.preset", "huge"])
    with pytest.raises(ValueError, match="model.device 'tpu' is not a torch device"):
        load_video_config(None, ["--model.device", "tpu"])
    with pytest.raises(ValueError, match="data.camera 'frontview' is not a camera the sim records; valid: agentview, wrist"):
        load_video_config(None, ["--data.camera", "frontview"])
    assert load_video_config(None, ["--data.camera", "wrist"]).data.camera == "wrist"


def test_options_of_an_older_run_load_into_each_methods_group_and_old_names_on_the_command_line_say_the_new_one(tmp_path: Path):
    """Before each method had its own group (train.awr, train.opsd, ...), options were flat in train.options: an old
    run's config.yaml still loads, an option several methods read reaching each of them."""
    old = tmp_path / "config.yaml"
    old.write_text("train:\n  method: opsd\n  options:\n    opsd_teacher: privileged_prompt\n    teacher_guidance: 2.5\n"
                   "    tilt_beta: 0.5\n    awr_temperature: 0.25\n    grpo_clip: 0.001\n    adv_clip_max: 3.0\n")
    cfg = load_video_config(str(old))
    assert cfg.train.opsd.teacher == "privileged_prompt" and cfg.train.opsd.tilt_beta == 0.5
    assert cfg.train.opsd.teacher_guidance == cfg.train.afd.teacher_guidance == cfg.train.distill.teacher_guidance == 2.5
    assert cfg.train.awr.temperature == 0.25 and cfg.train.flow_grpo.clip == 0.001
    assert cfg.train.nft.adv_clip_max == cfg.train.afd.adv_clip_max == cfg.train.flow_grpo.adv_clip_max == 3.0
    assert not hasattr(cfg.train, "options")
    with pytest.raises(ValueError, match="'train.options.awr_temperature' is now 'train.awr.temperature'"):
        load_video_config(None, ["--train.options.awr_temperature", "0.3"])
    with pytest.raises(ValueError, match="train.opsd.teacher 'oracle' is not known; valid: cfg, privileged_prompt, model"):
        load_video_config(None, ["--train.method", "opsd", "--train.opsd.teacher", "oracle"])


def kinema_video(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kinema.cli", "video", *args], capture_output=True, text=True, timeout=900)


def test_command_reports_bad_input_with_exit_code_2(tmp_path: Path):
    result = kinema_in_process("video", "train", "--train.method", "ppo", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "valid: awr, nft, distill, afd, opsd, flow_grpo" in result.stderr


@pytest.mark.slow
def test_video_train_end_to_end_and_resume(tmp_path: Path):
    run = tmp_path / "run"
    args = [
        "--out", str(run), "--data.episodes", "12", "--data.frames", "5", "--data.size", "16", "--pretrain.steps", "20",
        "--train.rounds", "2", "--train.updates_per_round", "2", "--train.prompts_per_round", "2", "--train.group_size", "2",
        "--model.num_inference_steps", "3", "--eval.interval", "1", "--eval.prompts", "2", "--eval.samples_per_prompt", "2",
    ]  # fmt: skip
    first = kinema_video("train", *args, "--tensorboard", "true")
    assert first.returncode == 0, first.stderr[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "reward_curves.png", "report.md", "state.json", "success_calibration.png",
                 "samples/before.png", "samples/after.png", "samples/before.mp4", "samples/after.mp4",
                 "final/model_index.json", "final/README.md", "final/adapters/default/pytorch_lora_weights.safetensors"):  # fmt: skip
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
    board = scalars(run)  # the TensorBoard view, stepped by round
    assert [step for step, _ in board["eval/round/eval/success"]] == [1, 2, 3]
    assert [step for step, _ in board["eval/after/eval/success"]] == [2, 3]
    again = kinema_in_process("video", "train", *args)
    assert again.returncode == 2 and "already holds a run" in again.stderr


# ------------------------------------------------------------------------------------------------------------------
# Teachers, degeneracy, schedules, device plumbing
# ------------------------------------------------------------------------------------------------------------------


class _Spy:
    """Records the adapter and the embeddings every velocity call of a generator gets."""

    def __init__(self, gen: VideoGenerator) -> None:
        self.calls: list[tuple[str | None, torch.Tensor]] = []
        self.embeds: list[torch.Tensor] = []
        velocity, encode = gen.velocity, gen.encode_prompts

        def spy_velocity(x, t, emb, *, adapter=None, **kw):
            self.calls.append((adapter, emb))
            return velocity(x, t, emb, adapter=adapter, **kw)

        def spy_encode(prompts):
            out = encode(prompts)
            self.embeds.append(out)
            return out

        gen.velocity, gen.encode_prompts = spy_velocity, spy_encode


def _rows_from(spy: _Spy) -> bool:
    """Every embedding row a velocity call got is a row the spied generator's own text encoder produced."""
    pool = torch.cat([e.flatten(1) for e in spy.embeds])
    return all(bool((emb.flatten(1)[:, None] == pool[None]).all(-1).any(1).all()) for _, emb in spy.calls)


def _teacher(preset: str, **shape: int) -> VideoGenerator:
    """A teacher saved with a LoRA adapter that changes its output (it must run *with* it)."""
    teacher = VideoGenerator.from_preset(preset, seed=1, **shape)
    teacher.add_adapter("default", rank=4, alpha=8)
    with torch.no_grad():
        for p in teacher.lora_parameters("default").values():
            p.normal_(0, 0.05)
    return teacher


def test_afd_teacher_model_uses_its_own_encoder_latents_and_adapters():
    # A tiny student (pixel space, 5 x 16 x 16) and a tiny-vae teacher (VAE latents, 5 x 32 x 32).
    teacher = _teacher("tiny-vae", num_frames=5, height=32, width=32)
    spy = _Spy(teacher)
    cfg = load_video_config(None, [*TINY, "--train.method", "afd"])
    gen = VideoGenerator.from_preset("tiny", seed=0, num_frames=5, height=16, width=16)
    trainer = VideoTrainer(cfg, gen, make_rewards(["exposure", "sharpness"]), PROMPTS, teacher=teacher)
    ro = trainer.collect()
    videos = trainer.teacher_videos(ro)
    assert videos.shape == ro.videos.shape == (4, 5, 3, 16, 16)  # resized to the student's clips
    assert spy.calls and all(adapter is None for adapter, _ in spy.calls)  # as saved: its LoRA on
    assert _rows_from(spy)  # its own text encoder's embeddings
    # Group members share their prompt's teacher video.
    assert torch.equal(videos[0], videos[1]) and not torch.equal(videos[0], videos[2])
    record = trainer.train_round()
    assert np.isfinite(record["train/loss"]) and 0.0 <= record["afd/disc_accuracy"] <= 1.0


def test_opsd_teacher_model_must_share_the_latent_shape():
    opsd = ["--train.method", "opsd", "--train.opsd.teacher", "model", "--train.opsd.teacher_path", "x"]
    cfg = load_video_config(None, [*TINY, *opsd])
    gen = VideoGenerator.from_preset("tiny", seed=0, num_frames=5, height=16, width=16)
    other = _teacher("tiny-vae", num_frames=5, height=32, width=32)
    with pytest.raises(ValueError, match="latents must match: teacher latents .* student"):
        VideoTrainer(cfg, gen, make_rewards(["exposure"]), PROMPTS, teacher=other)
    same = _teacher("tiny", num_frames=5, height=16, width=16)
    spy = _Spy(same)
    trainer = VideoTrainer(cfg, VideoGenerator.from_preset("tiny", seed=0, num_frames=5, height=16, width=16),
                           make_rewards(["exposure"]), PROMPTS, teacher=same)  # fmt: skip
    record = trainer.train_round()
    assert np.isfinite(record["train/loss"])
    assert spy.calls and all(adapter is None for adapter, _ in spy.calls)
    assert _rows_from(spy)
    # ... which differ from the student's (another text encoder): reading the student's would fail the line above.
    assert not torch.equal(trainer.generator.encode_prompts(PROMPTS[:1]), same.encode_prompts(PROMPTS[:1]))


class _Constant(VideoReward):
    names = ("constant",)

    def score(self, videos, prompts):
        return {"constant": torch.zeros(videos.shape[0])}


@pytest.mark.parametrize("method", ["afd", "awr"])
def test_reward_degenerate_groups_gate_reward_methods_but_not_afd(method: str):
    clips = {p: torch.full((1, 5, 3, 16, 16), 0.9) for p in PROMPTS}
    trainer, gen, _ = make_trainer(method, teacher_clips=clips)
    trainer.rewards = make_rewards([_Constant()])
    before = gen.adapter_state_dict(TRAINED)
    record = trainer.train_round()
    assert record["adv/degenerate_group_fraction"] == 1.0
    assert record["train/idle_round"] == float(method != "afd") and trainer.round == 1
    after = gen.adapter_state_dict(TRAINED)
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    # AFD's weight comes from its discriminator; AWR has nothing to learn from a constant reward.
    assert moved == (method == "afd")
    assert record["adv/weight_mean"] == (1.0 if method == "afd" else 0.0)


def test_afd_moves_the_student_toward_the_teacher_videos():
    """Same student, same noise: AFD against bright teacher clips ends brighter than against dark ones."""

    def brightness_after(level: float) -> tuple[float, float]:
        torch.manual_seed(0)  # peft draws the LoRA A matrices from the global generator
        clips = {p: torch.full((1, 5, 3, 16, 16), level) for p in PROMPTS[:2]}
        trainer, _, _ = make_trainer("afd", "--train.lr", "3e-3", "--train.afd.disc_lr", "1e-3", teacher_clips=clips)
        trainer.prompts = PROMPTS[:2]
        before = float(trainer.sample(PROMPTS[:2] * 2, seed=3).mean())
        for _ in range(8):
            record = trainer.train_round()
        assert record["afd/disc_accuracy"] == 1.0  # the judge tells the teacher from the student
        return before, float(trainer.sample(PROMPTS[:2] * 2, seed=3).mean())

    before, bright = brightness_after(0.9)
    _, dark = brightness_after(0.1)
    # Seeds 0-3 all ordered so (bright - dark 1e-3 to 4e-3 on this untrained model); seed 0 also has both moving.
    assert bright > before > dark, (before, bright, dark)


def test_awr_reference_schedule_and_shifted_timesteps():
    trainer, gen, _ = make_trainer("awr", "--anchor.ref_schedule", "flowawr")
    decays = []
    for step in (0, 74, 76, 175, 10_000):
        trainer.updates = step
        decays.append(trainer.method.ref_decay())
    assert decays == [0.0, 0.0, pytest.approx(0.0075), pytest.approx(0.75), 0.999]
    const, _, _ = make_trainer("awr", "--anchor.ref_warmup_updates", "3")
    const.updates = 2
    assert const.method.ref_decay() == 0.0
    const.updates = 3
    assert const.method.ref_decay() == 0.9
    # The AWR timesteps come from the model's own (shifted) schedule.
    gen.scheduler.register_to_config(shift=3.0)
    sched = gen.sigmas(20)
    ro = trainer.collect()
    trainer.method.prepare(ro)
    seen = []
    orig = gen.velocity
    gen.velocity = lambda x, t, *a, **k: (seen.append(t), orig(x, t, *a, **k))[1]
    trainer.method.loss(ro, torch.arange(4), 0)
    allowed = sched[sched >= 0.5]
    assert all(any(torch.isclose(v, allowed).any() for v in t) for t in seen)
    assert not torch.isclose(allowed, torch.tensor(0.55)).any()  # 0.55 is on the unshifted grid, not the shifted one


def test_awr_shared_noise_gives_a_group_one_timestep_and_one_noise():
    """`awr_shared_noise` (ours): the samples of one prompt group are noised alike, so they differ by x0 alone."""
    trainer, _, _ = make_trainer("awr")
    x0 = torch.randn(6, 4, 2, 4, 4)
    groups = torch.tensor([3, 3, 1, 1, 1, 7])
    x_t, t, noise = trainer.method.noised(x0, low=0.5, groups=groups)
    for g in (3, 1):
        rows = groups == g
        assert (t[rows] == t[rows][0]).all() and (noise[rows] == noise[rows][0]).all()
    assert not torch.equal(noise[0], noise[2]) and not torch.equal(noise[2], noise[5])
    assert torch.allclose(x_t, (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise)
    _, _, own = trainer.method.noised(x0, low=0.5)  # the default: one draw per sample
    assert len({tuple(n.flatten()[:3].tolist()) for n in own}) == 6


def test_awr_evaluates_a_separate_ema_of_the_trained_adapter():
    trainer, gen, cfg = make_trainer("awr", "--train.lr", "3e-3")
    assert trainer.eval_ema is not None and trainer.eval_ema.decay == 0.9
    trainer.train_round()
    prompts, _ = trainer.eval_prompts()
    raw = trainer.sample(prompts, seed=cfg.eval.seed)
    with trainer.eval_ema.swap_in():
        ema = trainer.sample(prompts, seed=cfg.eval.seed)
    _, videos = trainer.evaluate()
    assert torch.equal(videos, ema) and (raw - ema).abs().max() > 0
    assert torch.equal(trainer.sample(prompts, seed=cfg.eval.seed), raw)  # the trained weights are back
    off, _, _ = make_trainer("awr", "--train.awr.eval_ema", "0")
    assert off.eval_ema is None


def test_round_metrics_hold_per_reward_stats_and_tensors_live_on_the_model_device():
    from torch.utils._python_dispatch import TorchDispatchMode

    trainer, gen, cfg = make_trainer("nft")
    devices = set()

    class Devices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    devices.add(o.device)
            return out

    with Devices():
        record = trainer.train_round()
    assert devices == {gen.device} and str(gen.device) == cfg.model.device
    for name in ("exposure", "sharpness"):
        for stat in ("mean", "std", "min", "max", "group_std"):
            assert np.isfinite(record[f"reward/{name}/{stat}"])
        assert record[f"reward/{name}/min"] <= record[f"reward/{name}/mean"] <= record[f"reward/{name}/max"]
    assert {"adv/mean", "adv/std", "adv/abs_max", "adv/degenerate_group_fraction"} <= set(record)


def test_model_path_takes_the_run_video_shape(tmp_path: Path):
    from kinema.video.workflow import load_generator

    VideoGenerator.from_preset("tiny", seed=0).save_pretrained(tmp_path / "gen")  # 9 x 32 x 32
    cfg = load_video_config(None, ["--data.frames", "5", "--data.size", "16"])
    gen = load_generator(tmp_path / "gen", cfg)
    assert (gen.config.num_frames, gen.config.height, gen.config.width) == (5, 16, 16)
    assert gen.initial_noise(1).shape == gen.latent_shape(1) and gen.device == torch.device("cpu")
    with pytest.raises(ValueError, match="model.dtype 'fp8' is not known"):
        load_video_config(None, ["--model.dtype", "fp8"])


# ------------------------------------------------------------------------------------------------------------------
# Resume: no duplicate records after a kill, Ctrl-C saves only between rounds
# ------------------------------------------------------------------------------------------------------------------


def test_run_resume_drops_records_the_checkpoint_does_not_cover(tmp_path: Path):
    from kinema.common import Run

    run = Run(tmp_path, console=None)
    run.log({"kind": "pretrain"})
    for r in (1, 2):
        run.log({"kind": "round", "round": r})
    run.save_state({"round": 2, "latest_checkpoint": "checkpoints/round-002"})
    run.log({"kind": "round", "round": 3})  # after the checkpoint, then a kill (mid-write: a torn line)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "rou')
    state = Run(tmp_path, console=None).resume()
    assert state["round"] == 2 and state["metrics_records"] == 3
    assert [r.get("round") for r in run.records()] == [None, 1, 2]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("}\n")
    assert not list(tmp_path.glob(".*tmp*"))  # the rewrite left no temporary file


def _workflow_cfg(run: Path, *extra: str) -> VideoTrainConfig:
    return load_video_config(None, [
        "--out", str(run), "--data.episodes", "4", "--data.frames", "5", "--data.size", "16", "--pretrain.steps", "2",
        "--train.rounds", "5", "--train.updates_per_round", "1", "--train.prompts_per_round", "2", "--train.group_size", "2",
        "--train.batch_size", "4", "--model.num_inference_steps", "2", "--eval.interval", "2", "--eval.prompts", "2",
        "--eval.samples_per_prompt", "2", "--rewards.names", "[exposure, sharpness]", *extra,
    ])  # fmt: skip


def test_workflow_resume_after_a_kill_and_ctrl_c_between_rounds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import os
    import signal

    from kinema.video.workflow import train_video

    run = tmp_path / "run"
    real_round = VideoTrainer.train_round

    def killed_in_round_4(self, on_update=None):
        if self.round == 3:  # rounds 1-3 done, checkpoint after round 2: round 3's record is past it
            raise SystemExit("killed")
        return real_round(self, on_update)

    monkeypatch.setattr(VideoTrainer, "train_round", killed_in_round_4)
    with pytest.raises(SystemExit):
        train_video(_workflow_cfg(run))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"] == [1, 2, 3]

    def ctrl_c_in_round_4(self, on_update=None):
        if self.round == 3:
            os.kill(os.getpid(), signal.SIGINT)  # mid-round: the round still finishes, then it is saved
        return real_round(self, on_update)

    monkeypatch.setattr(VideoTrainer, "train_round", ctrl_c_in_round_4)
    with pytest.raises(KeyboardInterrupt):
        train_video(_workflow_cfg(run), resume=True)
    state = json.loads((run / "state.json").read_text())
    assert state["round"] == 4 and state["latest_checkpoint"] == "checkpoints/interrupted"
    assert torch.load(run / "checkpoints/interrupted/trainer.pt", weights_only=False)["round"] == 4

    monkeypatch.setattr(VideoTrainer, "train_round", real_round)
    train_video(_workflow_cfg(run), resume=True)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["kind"] == "round"] == [1, 2, 3, 4, 5]
    assert [(r["stage"], r["round"]) for r in records if r["kind"] == "eval"] == [
        ("before", 0), ("round", 2), ("round", 4), ("round", 5), ("after", 5)]  # fmt: skip
    assert [r["train/updates"] for r in records if r["kind"] == "round"] == [1, 2, 3, 4, 5]


def test_ctrl_c_during_pretraining_says_so_and_the_same_command_reuses_what_was_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
):
    import io
    import os
    import signal

    from rich.console import Console

    from kinema.video import workflow

    run = tmp_path / "run"
    real_pretrain = workflow.pretrain
    calls = []

    def ctrl_c_at_step_1(gen, *args, on_step=None, **kw):
        calls.append(kw["steps"])

        def step(i, loss):
            if i == 1:
                os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: Python's own handler raises KeyboardInterrupt
            on_step(i, loss)

        return real_pretrain(gen, *args, on_step=step, **kw)

    monkeypatch.setattr(workflow, "pretrain", ctrl_c_at_step_1)
    # A terminal's Ctrl-C: Python's default handler. (A shell starts background jobs with SIGINT ignored, and
    # Python then installs no handler: CI launched with `&` would otherwise never see the KeyboardInterrupt.)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    out = io.StringIO()
    cfg = _workflow_cfg(run, "--pretrain.steps", "5", "--train.rounds", "1")
    with pytest.raises(KeyboardInterrupt):
        workflow.train_video(cfg, console=Console(file=out, width=400))
    assert "interrupted before the first checkpoint" in out.getvalue()
    assert "sim_videos kept and reused" in out.getvalue()
    assert not (run / "state.json").exists() and not (run / "pretrained").exists()
    assert (run / "sim_videos" / "meta" / "info.json").is_file()

    monkeypatch.setattr(workflow, "pretrain", real_pretrain)
    sim_mtime = (run / "sim_videos" / "meta" / "info.json").stat().st_mtime_ns
    workflow.train_video(cfg, console=Console(file=io.StringIO()))
    assert (run / "sim_videos" / "meta" / "info.json").stat().st_mtime_ns == sim_mtime  # read back, not re-collected
    state = json.loads((run / "state.json").read_text())
    assert state["round"] == 1 and state["final_done"] and calls == [5]


@pytest.mark.parametrize("name", list(video_method_regression.RUNS))
def test_each_method_reproduces_its_recorded_rounds(name: str):
    """Two tiny rounds per method, as recorded before the methods moved into kinema/video/methods/ (one file each):
    tight on the machine kind that recorded them, loose on another (kernels sum in another order)."""
    recorded, path, tol = video_method_regression.reference()
    got, expected = video_method_regression.run_method(name), recorded[name]
    assert sorted(got["numbers"]) == sorted(expected["numbers"])
    differ = {k: (got["numbers"][k], v) for k, v in expected["numbers"].items() if not same(got["numbers"][k], v, **tol)}
    assert not differ, f"{differ} (got, recorded in {path.name} at {tol})"
    assert got["adapters"].keys() == expected["adapters"].keys()
    for key in [*got["adapters"], "method_state"]:
        a = got["adapters"][key] if key != "method_state" else got[key]
        b = expected["adapters"][key] if key != "method_state" else expected[key]
        assert same(a, b, **tol), (key, a, b)


def test_a_method_added_as_the_docs_show_is_listed_configured_and_trained(tmp_path: Path):
    """docs/video.md's example method, as written there: one file, plus the registry entry (made here at run time)."""
    docs = (Path(__file__).parents[1] / "docs" / "video.md").read_text()
    section = docs[docs.index("## Adding a post-training method") :]
    code = section[section.index("```python\n") + len("```python\n") : section.index("```\n", section.index("```python"))]
    (tmp_path / "rwr.py").write_text(code)
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {str(tmp_path)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from kinema.video import methods\n"
        "from rwr import RewardWeightedRegression\n"
        "methods.VIDEO_METHODS[RewardWeightedRegression.name] = RewardWeightedRegression\n"
        "if sys.argv[1] == 'help':\n"
        "    from kinema.cli import main\n"
        "    sys.exit(main(['video', 'train', '--help']))\n"
        "import torch\n"
        "from test_video_train import make_trainer\n"
        "torch.set_num_threads(1)\n"
        "trainer, gen, cfg = make_trainer('rwr', '--train.rwr.temperature', '0.5')\n"
        "before = {k: v.clone() for k, v in gen.adapter_state_dict('default').items()}\n"
        "record = trainer.train_round()\n"
        "moved = sum(not torch.equal(v, before[k]) for k, v in gen.adapter_state_dict('default').items())\n"
        "print(json.dumps({'temperature': cfg.train.rwr.temperature, 'moved': moved, 'tensors': len(before), **record}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, "train"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["temperature"] == 0.5 and out["method"] == "rwr" and out["moved"] == out["tensors"] > 0
    assert np.isfinite(out["train/loss"]) and out["rwr/weight_max"] > 0
    helped = subprocess.run([sys.executable, "-c", script, "help"], capture_output=True, text=True, timeout=120)
    assert "rwr: flow matching on the round's samples" in helped.stdout and "train.rwr.temperature=1.0" in helped.stdout
