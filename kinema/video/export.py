"""The post-trained generator as a deliverable, and sampling from it.

    kinema video export RUN_DIR [--round N] [--fuse] [--out DIR]
    kinema video sample RUN_DIR_or_FOLDER --prompt "..." [--seed S] [--steps N] [--guidance G] --out FILE.mp4

`RUN_DIR/final/` (written at the end of every `kinema video train` run, and by `kinema video export RUN_DIR`) is a
diffusers folder that stock diffusers loads in a process that never imports kinema:

    pipe = WanPipeline.from_pretrained(final, trust_remote_code=True)
    pipe.load_lora_weights(final / "adapters" / "default")      # not with --fuse: the LoRA is in the weights

- `adapters/default/pytorch_lora_weights.safetensors`: the post-trained LoRA in diffusers' format (keys
  `transformer.blocks.N.attn1.to_q.lora_A.weight`, ...; rank and alpha in the file's metadata). It holds the weights
  kinema evaluated: the evaluation EMA of the trained adapter where the method keeps one (VideoAWR), else the
  trained adapter itself.
- The tiny default's transformer (clean-sample prediction) and pixel-space autoencoder are kinema's own classes
  (no diffusers class computes them). Their code, one file that imports only torch and diffusers, is saved in
  their component folders and named by `model_index.json`; diffusers runs such code only with
  `trust_remote_code=True`, and says so when it is missing. A folder of diffusers' own classes (a velocity model
  on the Wan VAE, a real Wan checkpoint) needs no such flag.
- `kinema_export.json`: where the weights come from (run, round, checkpoint, method) and the sampling arguments
  kinema used (steps, guidance, frames, size, max_sequence_length), which `WanPipeline`'s defaults (81 frames of
  480×832, 50 steps, guidance 5, 512 tokens) do not match; `README.md` spells out the snippet.

With those arguments and the same seed, the stock pipeline samples what kinema's evaluation sampled (tested in a
fresh process to float tolerance).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from kinema.video.config import VideoTrainConfig
    from kinema.video.trainer import VideoTrainer
    from policies.video.generator import VideoGenerator

FINAL_DIR = "final"
EXPORTS_DIR = "exports"
EXPORT_INFO = "kinema_export.json"
EXPORT_FORMAT = 1
ADAPTER = "default"  # the trained adapter (kinema.video.methods.TRAINED), the only one exported


# ----------------------------------------------------------------------------------------------------------------
# Writing the folder
# ----------------------------------------------------------------------------------------------------------------


def sampling_arguments(cfg: VideoTrainConfig, generator: VideoGenerator) -> dict[str, Any]:
    """The pipeline arguments kinema's evaluation samples with (CFG-free by default, the run's video shape)."""
    gc = generator.config
    return {
        "num_inference_steps": int(cfg.model.num_inference_steps),
        "guidance_scale": float(cfg.model.guidance_scale),
        "num_frames": int(gc.num_frames),
        "height": int(gc.height),
        "width": int(gc.width),
        "max_sequence_length": int(gc.max_sequence_length),
        "negative_prompt": gc.negative_prompt,
    }


def evaluation_weights(trainer: VideoTrainer) -> tuple[dict[str, Tensor], str]:
    """The LoRA weights the trainer's evaluation samples with, and what they are."""
    if trainer.eval_ema is not None:
        shadow = {k: v.detach().clone() for k, v in trainer.eval_ema.shadow.items()}
        return shadow, f"the evaluation EMA of the trained adapter (decay {trainer.eval_ema.decay})"
    return trainer.generator.adapter_state_dict(ADAPTER), "the trained adapter"


def export_generator(
    generator: VideoGenerator,
    out: str | os.PathLike,
    *,
    weights: dict[str, Tensor] | None,
    fuse: bool = False,
    info: dict[str, Any],
) -> Path:
    """Write `generator` (base weights) with `weights` as its `default` LoRA (None: no adapter, the base model) to
    `out`, atomically, with `kinema_export.json` and a README.md. `fuse` merges the LoRA into the weights."""
    from policies.video.generator import custom_component_module, is_custom_component

    out = Path(out)
    has_lora = weights is not None
    if has_lora and ADAPTER not in generator.adapters:
        raise ValueError(f"the generator has no {ADAPTER!r} adapter to export; adapters: {generator.adapters}")
    custom = [f"{c}/{custom_component_module()[0]}.py" for c in ("transformer", "vae") if is_custom_component(getattr(generator, c))]
    info = {
        "format_version": EXPORT_FORMAT,
        **info,
        "lora": None if not has_lora else ("fused into the transformer weights" if fuse else f"adapters/{ADAPTER}"),
        "custom_code": custom,
    }
    readme = folder_readme(out, info, generator)
    kwargs: dict[str, Any] = {"extra_files": {EXPORT_INFO: json.dumps(info, indent=2) + "\n", "README.md": readme}}
    if not has_lora:
        kwargs["adapters"] = False
    elif fuse:
        kwargs.update(adapters=False, fuse=ADAPTER, adapter_weights={ADAPTER: weights})
    else:
        kwargs.update(adapters=[ADAPTER], adapter_weights={ADAPTER: weights})
    return generator.save_pretrained(out, **kwargs)


def export_trainer(trainer: VideoTrainer, out: str | os.PathLike, *, run_root: Path, fuse: bool = False,
                   evaluation: dict[str, float] | None = None) -> Path:
    """The trainer's post-trained generator as evaluated, to `out` (the workflow's `RUN_DIR/final`)."""
    weights, source = evaluation_weights(trainer)
    info = {
        "run": str(Path(run_root).resolve()),
        "round": trainer.round,
        "method": trainer.method.name,
        "checkpoint": f"checkpoints/round-{trainer.round:03d}",
        "weights": source,
        "sampling": sampling_arguments(trainer.cfg, trainer.generator),
        "prompts": list(trainer.prompts),
        "evaluation": dict(evaluation or {}),
    }
    return export_generator(trainer.generator, out, weights=weights, fuse=fuse, info=info)


def export_run(run_dir: str | os.PathLike, *, round: int | None = None, fuse: bool = False,
               out: str | os.PathLike | None = None) -> Path:
    """`kinema video export`: the generator of a run folder after round `round` (default: its latest checkpoint),
    rebuilt from `pretrained/` and the round's checkpoint (the evaluation EMA where the method keeps one).

    Default destination: `RUN_DIR/final` for the latest checkpoint, `RUN_DIR/exports/round-NNN[-fused]` for another
    round. `round=0` exports the pre-trained model, without adapter."""
    from safetensors.torch import load_file

    from kinema.video.config import load_video_config
    from policies.video.generator import VideoGenerator

    root = Path(run_dir)
    if not (root / "config.yaml").is_file():
        raise FileNotFoundError(f"{root} is not a `kinema video train` run folder (no config.yaml)")
    if not (root / "pretrained" / "model_index.json").is_file():
        raise FileNotFoundError(f"{root} holds no pre-trained generator yet ({root / 'pretrained'}): nothing to export")
    cfg = load_video_config(str(root / "config.yaml"), [])
    state = json.loads((root / "state.json").read_text()) if (root / "state.json").is_file() else {}
    checkpoints = run_checkpoints(root)
    latest = state.get("latest_checkpoint")
    if round is None:
        if not latest:
            raise ValueError(f"{root} has no checkpoint yet (it stopped before round 1 ended); `--round 0` exports the "
                             "pre-trained model")
        ckpt = root / latest
        round = int(torch.load(ckpt / "trainer.pt", weights_only=False, map_location="cpu")["round"])
    elif round == 0:
        ckpt = None
    else:
        if round not in checkpoints:
            have = ", ".join(str(r) for r in sorted(checkpoints)) or "none"
            raise ValueError(f"{root} has no checkpoint of round {round}; checkpointed rounds: {have} (and 0, the "
                             f"pre-trained model; checkpoints are written every eval.interval = {cfg.eval.interval} rounds)")
        ckpt = checkpoints[round]
    if out is None:
        is_latest = ckpt is not None and latest is not None and ckpt.resolve() == (root / latest).resolve()
        out = root / FINAL_DIR if is_latest else root / EXPORTS_DIR / (f"round-{round:03d}" + ("-fused" if fuse else ""))

    gen = VideoGenerator.from_pretrained(root / "pretrained")
    info: dict[str, Any] = {"run": str(root.resolve()), "round": round, "method": cfg.train.method,
                            "checkpoint": None if ckpt is None else str(ckpt.relative_to(root))}
    weights = None
    if ckpt is None:
        info["weights"] = "the pre-trained model (no adapter)"
    else:
        trainer_state = torch.load(ckpt / "trainer.pt", weights_only=False, map_location="cpu")
        if trainer_state.get("method") != cfg.train.method:
            raise ValueError(f"{ckpt} was trained with method {trainer_state.get('method')!r}, the run's config says {cfg.train.method!r}")
        stored = load_file(str(ckpt / "adapters.safetensors"))
        prefix = f"{ADAPTER}/"
        weights = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
        if not weights:
            raise ValueError(f"{ckpt / 'adapters.safetensors'} holds no {ADAPTER!r} adapter")
        info["weights"] = "the trained adapter"
        ema = trainer_state.get("eval_ema")
        if ema is not None:
            weights = {k: v.clone() for k, v in ema["shadow"].items()}
            info["weights"] = f"the evaluation EMA of the trained adapter (decay {ema['decay']})"
        gen.add_adapter(ADAPTER, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha)
        gen.load_adapter_state_dict(ADAPTER, {k: v.to(gen.device, gen.dtype) for k, v in weights.items()})
    info["sampling"] = sampling_arguments(cfg, gen)
    info["prompts"] = state.get("prompts", [])
    info["evaluation"] = evaluation_of_round(root, round)
    return export_generator(gen, out, weights=weights, fuse=fuse, info=info)


def run_checkpoints(root: Path) -> dict[int, Path]:
    """{round: checkpoint folder} of a run (round-NNN folders, and an interrupted one by the round it holds)."""
    found: dict[int, Path] = {}
    folder = root / "checkpoints"
    if not folder.is_dir():
        return found
    for ckpt in sorted(folder.iterdir()):
        if not (ckpt / "trainer.pt").is_file() or ckpt.name.startswith("."):
            continue
        if ckpt.name.startswith("round-") and ckpt.name[6:].isdigit():
            found[int(ckpt.name[6:])] = ckpt
        else:
            r = int(torch.load(ckpt / "trainer.pt", weights_only=False, map_location="cpu")["round"])
            found.setdefault(r, ckpt)
    return found


def evaluation_of_round(root: Path, round: int) -> dict[str, float]:
    """The eval/ metrics logged for `round` (the last such record), {} when none."""
    path = root / "metrics.jsonl"
    if not path.is_file():
        return {}
    found: dict[str, float] = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("kind") == "eval" and r.get("round") == round:
            found = {k: v for k, v in r.items() if k.startswith("eval/")}
    return found


def folder_readme(out: Path, info: dict[str, Any], generator: VideoGenerator) -> str:
    s = info.get("sampling") or {}
    folder = str(out.resolve())
    remote = bool(info["custom_code"])
    load = f'pipe = WanPipeline.from_pretrained(folder{", trust_remote_code=True" if remote else ""})'
    lora = info["lora"] == f"adapters/{ADAPTER}"
    prompt = (info.get("prompts") or ["put the red cube on the blue plate"])[0]
    negative = s.get("negative_prompt") if s.get("negative_prompt") and (s.get("guidance_scale") or 1.0) > 1.0 else None
    lines = [
        f"# A video generator post-trained by kinema ({info.get('method', '?')}, round {info.get('round', '?')})",
        "",
        f"A diffusers `WanPipeline` folder. LoRA: {info['lora'] or 'none (the pre-trained model)'}; weights: "
        f"{info.get('weights', '?')}. Exported from {info.get('run', '?')}.",
        "",
        "## Load it with stock diffusers (no kinema needed)",
        "",
        "```python",
        "import torch",
        "from diffusers import WanPipeline",
        "",
        f'folder = "{folder}"',
        load,
        *([f'pipe.load_lora_weights(folder + "/adapters/{ADAPTER}")'] if lora else []),
        "frames = pipe(",
        f"    prompt={json.dumps(prompt)},",
        *([f"    negative_prompt={json.dumps(negative)},"] if negative else []),
        f"    num_frames={s.get('num_frames')}, height={s.get('height')}, width={s.get('width')},",
        f"    num_inference_steps={s.get('num_inference_steps')}, guidance_scale={s.get('guidance_scale')}, "
        f"max_sequence_length={s.get('max_sequence_length')},",
        '    generator=torch.Generator().manual_seed(0), output_type="np",',
        ").frames[0]  # (frames, height, width, 3) in [0, 1]",
        "```",
        "",
        "These arguments are the ones kinema sampled with; `WanPipeline`'s defaults (81 frames of 480×832, 50 steps, "
        "guidance 5.0, 512 tokens) are a real Wan's and give other videos here. With the same seed, this samples "
        "what kinema's evaluation sampled (float tolerance).",
        "",
    ]
    if remote:
        lines += [
            "## Why `trust_remote_code=True`",
            "",
            "This model's " + " and ".join(f"`{p.split('/')[0]}`" for p in info["custom_code"]) + " are kinema's own "
            "diffusers classes (`WanX0Transformer3DModel` predicts the clean sample and returns the flow velocity "
            "the scheduler expects; `PixelSpaceAutoencoder` is an exact, parameter-free pixel-space stand-in for the "
            "Wan VAE): no class of diffusers computes them. Their code is in "
            + ", ".join(f"`{p}`" for p in info["custom_code"]) + ", one file that imports only torch and diffusers; "
            "`model_index.json` names it, and diffusers runs a folder's own code only when `trust_remote_code=True` "
            "is passed (without it, it stops with \"contains custom code ... Pass `trust_remote_code=True`\"). "
            "Read the file first, as for any model code. diffusers logs `Expected types for vae: (AutoencoderKLWan,), "
            "got PixelSpaceAutoencoder`: expected, harmless.",
            "",
        ]
    lines += [
        "## With kinema",
        "",
        "```bash",
        f"kinema video sample {folder} --prompt {json.dumps(prompt)} --out sample.mp4   # and sample.png",
        "```",
        "",
        "or `VideoGenerator.from_pretrained(folder).generate(prompts, num_inference_steps=..., seed=...)` in Python "
        "(`policies.video.generator`).",
        "",
    ]
    if info.get("prompts"):
        lines += ["## Prompts it was post-trained on", "", *[f"- {p}" for p in info["prompts"]], ""]
    ev = info.get("evaluation") or {}
    if ev:
        lines += ["## Its evaluation in the run", "", "| metric | value |", "|---|---|",
                  *[f"| {k.removeprefix('eval/')} | {v:.4g} |" for k, v in ev.items() if isinstance(v, (int, float))], ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Sampling from an exported folder
# ----------------------------------------------------------------------------------------------------------------


def resolve_folder(source: str | os.PathLike) -> Path:
    """A generator folder: `source` itself, or a run folder's `final/`."""
    path = Path(source)
    if (path / "model_index.json").is_file():
        return path
    if (path / FINAL_DIR / "model_index.json").is_file():
        return path / FINAL_DIR
    if (path / "config.yaml").is_file():
        raise FileNotFoundError(f"{path} is a run folder without {FINAL_DIR}/ (a run from before exports, or one not "
                                f"finished): write it with `kinema video export {path}`")
    raise FileNotFoundError(f"{path} is neither a generator folder (model_index.json) nor a run folder with {FINAL_DIR}/")


def sample_folder(
    source: str | os.PathLike,
    prompt: str,
    out: str | os.PathLike,
    *,
    seed: int = 0,
    steps: int | None = None,
    guidance: float | None = None,
    samples: int = 1,
    device: str = "cpu",
) -> tuple[Path, Path, Tensor]:
    """`kinema video sample`: `samples` videos of `prompt` from an exported (or any saved) generator folder, through
    diffusers' `WanPipeline` with the arguments the run sampled with (`kinema_export.json`) unless given; written as
    one MP4 (side by side) and a PNG grid beside it. Returns (mp4, png, videos (B, F, C, H, W))."""
    from kinema.video.report import write_grid, write_videos_mp4
    from policies.video.generator import VideoGenerator

    if samples < 1:
        raise ValueError(f"--samples must be >= 1; got {samples}")
    folder = resolve_folder(source)
    info = json.loads((folder / EXPORT_INFO).read_text()) if (folder / EXPORT_INFO).is_file() else {}
    s = info.get("sampling") or {}
    steps = int(steps if steps is not None else s.get("num_inference_steps", 8))
    guidance = float(guidance if guidance is not None else s.get("guidance_scale", 1.0))
    if steps < 1:
        raise ValueError(f"--steps must be >= 1; got {steps}")
    out = Path(out)
    if out.suffix.lower() != ".mp4":
        raise ValueError(f"--out must name an .mp4 file; got {out}")
    gen = VideoGenerator.from_pretrained(folder).to(torch.device(device))
    videos = gen.generate([prompt] * samples, num_inference_steps=steps, guidance_scale=guidance, seed=seed)
    mp4 = write_videos_mp4(videos, out)
    png = write_grid(videos, out.with_suffix(".png"), prompts=[prompt] * samples,
                     title=f"{folder.parent.name}/{folder.name}: seed {seed}, {steps} steps, guidance {guidance:g}")
    return mp4, png, videos
