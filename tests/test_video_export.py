"""The deliverable of `kinema video train`: `RUN_DIR/final/`, a diffusers folder that stock diffusers loads in a
process that never imports kinema and samples what kinema sampled; `kinema video export` / `sample`; the held-out
judge reported beside the training reward. Tiny configs, nothing downloaded (HF_HUB_OFFLINE in the child)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from kinema.video.config import load_video_config  # noqa: E402
from kinema.video.export import export_run, resolve_folder, sample_folder  # noqa: E402
from kinema.video.trainer import VideoTrainer  # noqa: E402
from kinema.video.workflow import JUDGE_DIR, SIM_DIR, JUDGE_SIM_DIR, train_video  # noqa: E402
from policies.video.generator import VideoGenerator, custom_component_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# The default run (VideoAWR toward the success reward, with its held-out judge), shrunk: 5 frames of 16², 2 rounds.
TINY_RUN = [
    "--data.episodes", "16", "--data.wrong_grasp", "1.0", "--data.frames", "5", "--data.size", "16",
    "--pretrain.steps", "30", "--train.rounds", "2", "--train.updates_per_round", "2", "--train.prompts_per_round", "2",
    "--train.group_size", "2", "--train.batch_size", "4", "--train.lr", "3e-3", "--model.num_inference_steps", "3",
    "--eval.interval", "1", "--eval.prompts", "2", "--eval.samples_per_prompt", "2", "--judge.steps", "40",
]  # fmt: skip

# Runs in a fresh interpreter: stock diffusers only. Prints one JSON line; writes each folder's frames to a .pt.
STOCK = r"""
import json, sys, torch
torch.set_num_threads(1)
from diffusers import WanPipeline

jobs = json.loads(sys.argv[1])
report = {}
for job in jobs:
    folder = job["folder"]
    s = json.load(open(folder + "/kinema_export.json"))["sampling"]
    if job.get("refused"):  # without trust_remote_code diffusers must refuse, and say what to pass
        try:
            WanPipeline.from_pretrained(folder)
            report["refused"] = "loaded"
        except ValueError as e:
            report["refused"] = str(e)
    pipe = WanPipeline.from_pretrained(folder, trust_remote_code=True)
    if job["lora"]:
        pipe.load_lora_weights(folder + "/adapters/default")
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(
        prompt=job["prompts"], num_frames=s["num_frames"], height=s["height"], width=s["width"],
        num_inference_steps=s["num_inference_steps"], guidance_scale=s["guidance_scale"],
        max_sequence_length=s["max_sequence_length"], generator=torch.Generator().manual_seed(job["seed"]),
        output_type="pt",
    ).frames
    torch.save(frames, job["out"])
report["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in ("kinema", "policies", "diffusion_rl", "sim"))
print(json.dumps(report))
"""


def stock_diffusers(jobs: list[dict], cwd: Path) -> dict:
    """Run STOCK in a fresh interpreter, away from the repository (cwd elsewhere, no PYTHONPATH), offline."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(cwd / "hf_home"))
    out = subprocess.run([sys.executable, "-c", STOCK, json.dumps(jobs)], capture_output=True, text=True, cwd=cwd,
                         env=env, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory):
    """A tiny default run; the videos of its evaluations as kinema sampled them (in order)."""
    run = tmp_path_factory.mktemp("video") / "run"
    evaluations: list[tuple[dict, torch.Tensor]] = []
    real_evaluate = VideoTrainer.evaluate

    def recording(self, adapter="default"):
        record, videos = real_evaluate(self, adapter)
        evaluations.append((record, videos.detach().clone()))
        return record, videos

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VideoTrainer, "evaluate", recording)
        from rich.console import Console
        import io

        train_video(load_video_config(None, ["--out", str(run), *TINY_RUN]), console=Console(file=io.StringIO(), width=200))
    torch.set_num_threads(threads)
    cfg = load_video_config(str(run / "config.yaml"), [])
    return run, cfg, evaluations


@pytest.mark.slow
def test_default_runs_final_folder_samples_what_kinema_sampled_in_a_fresh_stock_diffusers_process(default_run, tmp_path):
    run, cfg, evaluations = default_run
    final = run / "final"
    for name in ("model_index.json", "README.md", "kinema_export.json", "adapters/default/pytorch_lora_weights.safetensors"):
        assert (final / name).is_file(), name
    info = json.loads((final / "kinema_export.json").read_text())
    assert info["round"] == 2 and info["method"] == "awr" and "evaluation EMA" in info["weights"]
    # diffusers' LoRA key names for the Wan transformer
    keys = load_file(str(final / "adapters/default/pytorch_lora_weights.safetensors")).keys()
    assert "transformer.blocks.0.attn1.to_q.lora_A.weight" in keys and all(k.startswith("transformer.blocks.") for k in keys)
    # The last evaluation is the run's "after": its prompts and seed, as kinema sampled them.
    record, after_videos = evaluations[-1]
    n_p, n_s = cfg.eval.prompts, cfg.eval.samples_per_prompt
    pool = json.loads((run / "state.json").read_text())["prompts"]
    prompts = [pool[i % len(pool)] for i in range(n_p) for _ in range(n_s)]

    fused = export_run(run, fuse=True, out=tmp_path / "fused")
    assert not (fused / "adapters").exists()
    report = stock_diffusers([
        {"folder": str(final), "lora": True, "prompts": prompts, "seed": cfg.eval.seed, "out": str(tmp_path / "final.pt"), "refused": True},
        {"folder": str(fused), "lora": False, "prompts": prompts, "seed": cfg.eval.seed, "out": str(tmp_path / "fused.pt")},
    ], cwd=tmp_path)  # fmt: skip
    assert report["modules"] == [], f"the stock process imported {report['modules']}"
    assert "trust_remote_code=True" in report["refused"]
    stock = torch.load(tmp_path / "final.pt")
    torch.testing.assert_close(stock, after_videos, rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.load(tmp_path / "fused.pt"), after_videos, rtol=0, atol=1e-4)
    # ... and post-training moved them: the first evaluation (before) differs.
    assert (evaluations[0][1] - after_videos).abs().max() > 1e-3

    # Through kinema: the folder loaded back, and `kinema video sample` on the run folder (one prompt, its seed).
    loaded = VideoGenerator.from_pretrained(final)
    ours = loaded.generate(prompts, num_inference_steps=info["sampling"]["num_inference_steps"], seed=cfg.eval.seed)
    torch.testing.assert_close(ours, after_videos, rtol=0, atol=1e-5)
    mp4, png, one = sample_folder(run, prompts[0], tmp_path / "one.mp4", seed=3)
    assert mp4.stat().st_size > 0 and png.is_file()
    torch.testing.assert_close(one, loaded.generate(prompts[:1], num_inference_steps=3, seed=3), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_export_from_checkpoints_rebuilds_the_workflows_final_folder(default_run, tmp_path):
    run, _, _ = default_run
    again = export_run(run, out=tmp_path / "again")  # from pretrained/ + the last checkpoint, without the trainer
    a = load_file(str(run / "final/adapters/default/pytorch_lora_weights.safetensors"))
    b = load_file(str(again / "adapters/default/pytorch_lora_weights.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    r1 = export_run(run, round=1)
    assert r1 == run / "exports" / "round-001" and json.loads((r1 / "kinema_export.json").read_text())["round"] == 1
    b1 = load_file(str(r1 / "adapters/default/pytorch_lora_weights.safetensors"))
    assert any(not torch.equal(a[k], b1[k]) for k in a)
    r0 = export_run(run, round=0)
    assert not (r0 / "adapters").exists() and json.loads((r0 / "kinema_export.json").read_text())["lora"] is None
    with pytest.raises(ValueError, match="no checkpoint of round 7; checkpointed rounds: 1, 2"):
        export_run(run, round=7)
    # the command: exit code 2 and the reason
    from kinema.cli import main

    assert main(["video", "export", str(run), "--round", "7"]) == 2
    assert main(["video", "sample", str(run), "--prompt", "open the drawer", "--out", str(tmp_path / "s.mp4"), "--samples", "2"]) == 0
    assert (tmp_path / "s.mp4").stat().st_size > 0 and (tmp_path / "s.png").is_file()


@pytest.mark.slow
def test_held_out_judge_is_fitted_on_other_episodes_and_reported_beside_the_reward(default_run):
    from diffusion_rl.data.lerobot_v3 import read_episodes

    run, _, evaluations = default_run
    reward_seeds = {ep.seed for ep in read_episodes(run / SIM_DIR)}
    judge_seeds = {ep.seed for ep in read_episodes(run / JUDGE_SIM_DIR)}
    assert len(judge_seeds) == 16 and not reward_seeds & judge_seeds
    reward_cfg = json.loads((run / "success_reward" / "config.json").read_text())["config"]
    judge_cfg = json.loads((run / JUDGE_DIR / "config.json").read_text())["config"]
    assert judge_cfg["channels"] != reward_cfg["channels"] and judge_cfg["hidden_dim"] != reward_cfg["hidden_dim"]

    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    judge = next(r for r in records if r["kind"] == "judge")
    assert judge["heldout_clips"] >= 4 and 0.0 <= judge["judge/accuracy"] <= 1.0 and "judge/auc" in judge
    assert "reward/auc" in judge and "agreement" in judge  # the training reward on the same held-out clips
    evals = [r for r in records if r["kind"] == "eval"]
    assert all("eval/judge_success" in r and "eval/success" in r for r in evals)
    before, after = evals[0], evals[-1]
    assert after["stage"] == "after"
    assert after["judge/success/judge_gain"] == pytest.approx(after["eval/judge_success"] - before["eval/judge_success"])
    assert after["judge/success/gap"] == pytest.approx(
        (after["eval/success"] - before["eval/success"]) - (after["eval/judge_success"] - before["eval/judge_success"]))
    report = (run / "report.md").read_text()
    assert "Held-out judge" in report and "| held-out judge (success) |" in report and "Reward-hacking signal (success)" in report
    assert "final/" in report and (run / "judge_calibration.png").is_file() and (run / "reward_curves.png").is_file()
    # the judge never took part in training: the evaluation records are the only place it shows
    assert not any(k.startswith(("rollout/judge", "reward/judge")) for r in records if r["kind"] == "round" for k in r)


# ------------------------------------------------------------------------------------------------------------------
# Fast: the folder format itself
# ------------------------------------------------------------------------------------------------------------------


def _randomised(preset: str = "tiny", **overrides) -> VideoGenerator:
    g = VideoGenerator.from_preset(preset, seed=0, num_frames=5, height=16, width=16, **overrides)
    g.add_adapter("default", rank=4, alpha=8.0)
    gen_ = torch.Generator().manual_seed(1)
    g.load_adapter_state_dict("default", {k: torch.randn(v.shape, generator=gen_) * 0.05
                                          for k, v in g.adapter_state_dict("default").items()})  # fmt: skip
    return g


def test_saved_component_code_is_the_one_kinema_runs_and_needs_only_torch_and_diffusers(tmp_path):
    import ast

    from diffusion_rl.flow import velocity_from_x0
    from policies.video import wan_components

    folder = _randomised().save_pretrained(tmp_path / "m")
    module, source = custom_component_module()
    index = json.loads((folder / "model_index.json").read_text())
    assert index["transformer"] == [module, "WanX0Transformer3DModel"] and index["vae"] == [module, "PixelSpaceAutoencoder"]
    own = Path(wan_components.__file__).read_text(encoding="utf-8")
    for component in ("transformer", "vae"):
        assert (folder / component / f"{module}.py").read_text(encoding="utf-8") == own == source
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(ast.parse(own)) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [None])}  # fmt: skip
    assert imported <= {"__future__", "typing", "torch", "diffusers"}, imported
    x, x0, t = torch.randn(3, 4, 2, 2, 2), torch.randn(3, 4, 2, 2, 2), torch.tensor([0.5, 1e-5, 1.0])
    torch.testing.assert_close(wan_components.velocity_from_x0(x, x0, t, eps=1e-3), velocity_from_x0(x, x0, t, eps=1e-3),
                               rtol=0, atol=0)  # fmt: skip
    # A stack of diffusers' own classes carries no code and needs no trust_remote_code.
    plain = VideoGenerator.from_preset("tiny-velocity", seed=0, latent_space="vae").save_pretrained(tmp_path / "plain")
    assert not list(plain.rglob("*.py"))
    assert json.loads((plain / "model_index.json").read_text())["transformer"] == ["diffusers", "WanTransformer3DModel"]


def test_fused_and_ema_weights_save_what_was_asked(tmp_path):
    g = _randomised()
    prompts = ["open the drawer"]
    with_lora = g.generate(prompts, num_inference_steps=3, seed=0)
    fused = VideoGenerator.from_pretrained(g.save_pretrained(tmp_path / "fused", fuse="default"))
    assert fused.adapters == [] and json.loads((tmp_path / "fused/kinema_video.json").read_text())["fused_adapter"]["rank"] == 4
    torch.testing.assert_close(fused.generate(prompts, num_inference_steps=3, seed=0), with_lora, rtol=0, atol=1e-5)
    # adapter_weights replace the adapter's current weights in the file (an EMA's, for instance), not in the model
    other = {k: torch.zeros_like(v) for k, v in g.adapter_state_dict("default").items()}
    zeroed = VideoGenerator.from_pretrained(g.save_pretrained(tmp_path / "z", adapters=["default"], adapter_weights={"default": other}))
    torch.testing.assert_close(zeroed.generate(prompts, num_inference_steps=3, seed=0),
                               g.generate(prompts, num_inference_steps=3, seed=0, adapter="base"), rtol=0, atol=1e-6)  # fmt: skip
    assert not torch.equal(g.adapter_state_dict("default")[next(iter(other))], next(iter(other.values())))
    with pytest.raises(ValueError, match="cannot be both fused"):
        g.save_pretrained(tmp_path / "x", adapters=["default"], fuse="default")


def test_sample_needs_an_exported_folder_and_says_how_to_make_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(FileNotFoundError, match="kinema video export"):
        resolve_folder(run)
    with pytest.raises(FileNotFoundError, match="neither a generator folder"):
        resolve_folder(tmp_path)
    with pytest.raises(FileNotFoundError, match="no pre-trained generator"):
        export_run(run)
