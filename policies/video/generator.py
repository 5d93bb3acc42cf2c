"""A diffusers video flow model (Wan) seen by the RL core: the `FlowPolicy` protocol, LoRA adapters, sampling.

`VideoGenerator` holds diffusers' own components (WanTransformer3DModel, AutoencoderKLWan or the exact pixel-space
stand-in, FlowMatchEulerDiscreteScheduler, a UMT5 text encoder and a T5 tokenizer) and adds what RL needs:

- `generate(...)` samples through diffusers' `WanPipeline`, the path users run after training, with or without CFG;
  `euler_sample(...)` is the same ODE without the pipeline's overhead (equal latents, tested), `sample_sde(...)`
  Flow-GRPO's stochastic sampler with per-step log-probs.
- `flow_loss`, `sde_log_prob`, `features` implement `diffusion_rl.protocol.FlowPolicy`; every formula comes from
  `diffusion_rl.flow` (one flow module for all models).
- LoRA through peft with named adapters (`modeling_lora.NamedLoraAdapters`): "default" trains, "old"/"ref" are
  snapshots made by `copy_adapter`, the base model is the reserved name "base". `EMA` keeps a moving average of
  any named parameters.

Conventions (diffusers' and `diffusion_rl.flow`'s): t = 1 is noise, x_t = (1 − t)·x_0 + t·ε, v = ε − x_0; the
transformer receives timestep = t · num_train_timesteps. Latents are (B, C, F', h, w) and normalised with the
VAE's latents_mean/std exactly as `WanPipeline` un-normalises them; videos are (B, F, C, H, W) floats in [0, 1].

API notes for the trainer (policies/video is the producer, kinema/video the consumer):
- `velocity`, `x0_pred`, `flow_loss`, `sde_log_prob` keep autograd on; `euler_sample`/`sample_sde`/`generate`
  run without grad unless `grad=True` (euler_sample only).
- Switching adapters (`adapter=` arguments, `use_adapter`) never changes which parameters require grad: only the
  active adapter's LoRA weights do, as set by `set_adapter`.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from diffusion_rl import flow
from diffusion_rl.flow import SDEStep
from policies._hf import quiet_transformers
from policies.checkpoint import atomic_folder
from policies.video.configuration_video import VideoGeneratorConfig, check_video_shape, preset_config
from policies.video.modeling_lora import BASE, EMA, NamedLoraAdapters
from policies.video.modeling_wan import (
    WanX0Transformer3DModel,
    build_scheduler,
    build_text_encoder,
    build_transformer,
    build_vae,
    component_loading,
    config_from_components,
    load_component,
    load_text_encoder,
)
from policies.video.tokenizer import build_tokenizer

__all__ = ["BASE", "EMA", "VideoGenerator"]

KINEMA_CONFIG = "kinema_video.json"
FORMAT_VERSION = 1
COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


class VideoGenerator(NamedLoraAdapters, nn.Module):
    """A Wan-style text-to-video flow model with the RL core's policy interface. Build with `from_preset` or
    `from_pretrained`; the constructor takes ready components."""

    def __init__(
        self,
        config: VideoGeneratorConfig,
        *,
        transformer: nn.Module,
        vae: nn.Module,
        text_encoder: nn.Module,
        tokenizer: Any,
        scheduler: Any,
    ) -> None:
        super().__init__()
        prediction = getattr(transformer.config, "prediction_type", "velocity")
        space = "pixel" if type(vae).__name__ == "PixelSpaceAutoencoder" else "vae"
        if (config.prediction, config.latent_space) != (prediction, space):
            raise ValueError(
                f"config says prediction={config.prediction!r}, latent_space={config.latent_space!r} but the "
                f"components are a {type(transformer).__name__} predicting {prediction!r} and a "
                f"{type(vae).__name__} ({space!r}); make the config match the components"
            )
        self.config = config
        self.transformer = transformer
        self.vae = vae.requires_grad_(False).eval()
        self.text_encoder = text_encoder.requires_grad_(False).eval()
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._prompt_cache: dict[str, Tensor] = {}
        self._pipe = None
        self._init_adapters()

    # ==============================================================================================================
    # Construction, saving, loading
    # ==============================================================================================================

    @classmethod
    def from_preset(cls, name: str = "tiny", *, seed: int = 0, **overrides: Any) -> VideoGenerator:
        """A randomly initialised generator from a named preset (`configuration_video.PRESETS`); nothing downloaded."""
        return cls.from_config(preset_config(name, **overrides), seed=seed)

    @classmethod
    def from_config(cls, config: VideoGeneratorConfig, *, seed: int = 0) -> VideoGenerator:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            tokenizer = build_tokenizer()
            return cls(
                config,
                transformer=build_transformer(config),
                vae=build_vae(config),
                text_encoder=build_text_encoder(config, vocab_size=len(tokenizer)),
                tokenizer=tokenizer,
                scheduler=build_scheduler(config),
            )

    def save_pretrained(
        self,
        directory: str | os.PathLike,
        *,
        adapters: bool | Sequence[str] = True,
        adapter_weights: Mapping[str, Mapping[str, Tensor]] | None = None,
        fuse: str | None = None,
        extra_files: Mapping[str, str] | None = None,
    ) -> Path:
        """Write a diffusers-layout folder (component folders + model_index.json) plus `kinema_video.json` and
        `adapters/<name>/` in diffusers' LoRA format. Atomic: written to a temporary sibling, then renamed over
        `directory`.

        The transformer is saved without its LoRA layers (plain diffusers weights); adapters are saved apart.
        Stock diffusers loads the folder: `WanPipeline.from_pretrained(directory)`, with `trust_remote_code=True`
        when it holds kinema's own x0 transformer or pixel-space autoencoder (their code is copied into their
        component folders, see `custom_component_module`), then `pipe.load_lora_weights(directory/"adapters"/name)`.

        Args:
            adapters: True (every adapter), False (none) or the names of the adapters to save.
            adapter_weights: {name: LoRA state} saved (or fused) instead of the adapter's current weights, e.g. an
                EMA of them (same keys as `adapter_state_dict`).
            fuse: an adapter whose LoRA is merged into the saved transformer weights, W + (alpha/rank)·B·A; the
                folder is then a plain model with that adapter built in (it is not saved as an adapter as well).
            extra_files: {relative path: text} written into the folder before the rename (a README, metadata).
        """
        from safetensors.torch import save_file

        if adapters is True:
            names = list(self._adapters)
        elif adapters is False:
            names = []
        else:
            names = list(adapters)
        for name in [*names, *([fuse] if fuse else []), *(adapter_weights or {})]:
            self._check_adapter(name)
        if fuse is not None and fuse in names:
            if adapters is not True:
                raise ValueError(f"adapter {fuse!r} cannot be both fused into the weights and saved as an adapter")
            names.remove(fuse)
        weights = {name: dict(adapter_weights[name]) if adapter_weights and name in adapter_weights
                   else self.adapter_state_dict(name) for name in [*names, *([fuse] if fuse else [])]}  # fmt: skip
        base = self.base_state_dict()
        if fuse is not None:
            base = fused_state_dict(base, weights[fuse], self._adapters[fuse])
        with atomic_folder(directory) as tmp:
            (tmp / "transformer").mkdir()
            self.transformer.save_config(tmp / "transformer")
            save_file(base, str(tmp / "transformer" / WEIGHTS_NAME), metadata={"format": "pt"})
            self.vae.save_pretrained(tmp / "vae", safe_serialization=True)
            with quiet_transformers():
                self.text_encoder.save_pretrained(tmp / "text_encoder", safe_serialization=True)
            self.tokenizer.save_pretrained(tmp / "tokenizer")
            self.scheduler.save_pretrained(tmp / "scheduler")
            module, source = custom_component_module()
            for component in ("transformer", "vae"):  # kinema's own classes travel with their code
                if is_custom_component(getattr(self, component)):
                    (tmp / component / f"{module}.py").write_text(source, encoding="utf-8")
            (tmp / "model_index.json").write_text(json.dumps(self._model_index(), indent=2))
            meta = {
                "format_version": FORMAT_VERSION,
                "config": self.config.to_dict(),
                "adapters": {k: dict(self._adapters[k]) for k in names},
                "active_adapter": self._active if self._active in names else (names[0] if names else None),
            }
            if fuse is not None:
                meta["fused_adapter"] = {"name": fuse, **dict(self._adapters[fuse])}
            for name in names:
                self._save_adapter(name, tmp / "adapters" / name, weights[name])
            (tmp / KINEMA_CONFIG).write_text(json.dumps(meta, indent=2))
            for rel, text in (extra_files or {}).items():
                path = tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
        return Path(directory)

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike, *, torch_dtype: torch.dtype | None = None, **overrides: Any
    ) -> VideoGenerator:
        """Load a diffusers-layout folder (ours, or a real Wan checkpoint such as Wan2.1-T2V-1.3B-Diffusers).

        Every component folder must be present; a missing one is an error naming it and the path. Without a
        `kinema_video.json` (a foreign checkpoint) the config is read off the components: velocity prediction for
        the plain Wan transformer, VAE latents, 81 frames at 480x832. `overrides` replace config fields (e.g.
        num_frames). `torch_dtype` (e.g. torch.bfloat16 on a GPU) applies to the transformer, VAE and text
        encoder; the RL math stays in float32. A non-Euler scheduler (Wan ships UniPC) is replaced, with a warning,
        by the flow-match Euler scheduler with its shift: the RL samplers and log-probs are defined for Euler steps.
        """
        from diffusers import FlowMatchEulerDiscreteScheduler
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        path = Path(directory)
        if not path.is_dir():
            raise FileNotFoundError(f"no video generator folder at {path}")
        for component in COMPONENTS:
            if not (path / component).is_dir():
                raise FileNotFoundError(
                    f"{path} is missing the '{component}' component: expected a folder {path / component} "
                    f"(a diffusers-layout model has {', '.join(COMPONENTS)})"
                )
        meta = json.loads((path / KINEMA_CONFIG).read_text()) if (path / KINEMA_CONFIG).is_file() else None
        if meta is not None and meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{path / KINEMA_CONFIG} has format_version {meta.get('format_version')!r}; this kinema reads "
                f"{FORMAT_VERSION}. Re-save it with the kinema version that wrote it, or drop the file to load the "
                "bare diffusers components."
            )

        transformer = load_component(path, "transformer", torch_dtype=torch_dtype)
        vae = load_component(path, "vae", torch_dtype=torch_dtype)
        with quiet_transformers():
            text_encoder = load_text_encoder(path / "text_encoder", torch_dtype=torch_dtype)
            with component_loading(path / "tokenizer", "tokenizer"):
                tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer", local_files_only=True)
        with component_loading(path / "scheduler", "scheduler"):
            sched_cfg = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
        if sched_cfg.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
            with component_loading(path / "scheduler", "scheduler"):
                scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler", local_files_only=True)
        else:
            shift = sched_cfg.get("flow_shift", sched_cfg.get("shift", 1.0))
            warnings.warn(
                f"{path / 'scheduler'} holds a {sched_cfg.get('_class_name')}; sampling uses "
                f"FlowMatchEulerDiscreteScheduler(shift={shift}) instead (the RL samplers are Euler steps)",
                stacklevel=2,
            )
            scheduler = FlowMatchEulerDiscreteScheduler(
                num_train_timesteps=sched_cfg.get("num_train_timesteps", 1000), shift=shift
            )

        if meta is not None:
            config = VideoGeneratorConfig.from_dict({**meta["config"], **overrides})
        else:
            config = config_from_components(transformer, vae, scheduler, overrides)
        gen = cls(config, transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                  scheduler=scheduler)
        if meta is not None and meta.get("adapters"):
            for name, spec in meta["adapters"].items():
                file = path / "adapters" / name / LORA_WEIGHTS_NAME
                if not file.is_file():
                    raise FileNotFoundError(
                        f"{path} lists adapter {name!r} but its weights are missing: expected {file}"
                    )
                gen.add_adapter(name, rank=spec["rank"], alpha=spec["alpha"], targets=spec["targets"])
                prefix = "transformer."
                state = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in load_file(str(file)).items()}
                gen.load_adapter_state_dict(name, state)
            if meta.get("active_adapter"):
                gen.set_adapter(meta["active_adapter"])
        return gen

    @torch.no_grad()
    def fuse_adapter(self, name: str) -> None:
        """Merge adapter `name` into the transformer's weights (W + (alpha/rank)·B·A) and remove every adapter: the
        model then computes what it computed with `name` active, as a plain model a new adapter can start from."""
        self._check_adapter(name)
        fused = fused_state_dict(self.base_state_dict(), self.adapter_state_dict(name), self._adapters[name])
        self.transformer.unload_lora()  # peft's layers out, their base layers back in place
        self.transformer.load_state_dict(fused)
        self._adapters.clear()
        self._active = None
        self.transformer.requires_grad_(True)

    def _save_adapter(self, name: str, folder: Path, state: Mapping[str, Tensor] | None = None) -> None:
        # diffusers' own LoRA format, so that a plain `WanPipeline.from_pretrained(dir)` user can run
        # `pipe.load_lora_weights(dir / "adapters" / name)`; the metadata carries rank and alpha.
        from diffusers import WanPipeline

        spec = self._adapters[name]
        metadata = {"r": spec["rank"], "lora_alpha": spec["alpha"], "target_modules": spec["targets"]}
        state = self.adapter_state_dict(name) if state is None else state
        folder.mkdir(parents=True)
        WanPipeline.save_lora_weights(
            folder,
            transformer_lora_layers={k: v.detach().contiguous() for k, v in state.items()},
            transformer_lora_adapter_metadata=metadata,
            safe_serialization=True,
        )

    def _model_index(self) -> dict[str, Any]:
        import diffusers

        custom, _ = custom_component_module()

        def entry(module: Any) -> list[str]:
            # diffusers imports the named library and takes the class from it: the top-level package for its own
            # and transformers' classes. kinema's own classes are named by the module file saved in the component's
            # folder, which diffusers runs with `trust_remote_code=True` (no kinema import needed).
            if is_custom_component(module):
                return [custom, type(module).__name__]
            return [type(module).__module__.split(".")[0], type(module).__name__]

        return {
            "_class_name": "WanPipeline",
            "_diffusers_version": diffusers.__version__,
            "boundary_ratio": None,
            "expand_timesteps": False,
            "transformer": entry(self.transformer),
            "transformer_2": [None, None],
            "vae": entry(self.vae),
            "text_encoder": entry(self.text_encoder),
            "tokenizer": entry(self.tokenizer),
            "scheduler": entry(self.scheduler),
        }

    # ==============================================================================================================
    # Pipeline and text
    # ==============================================================================================================

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def train(self, mode: bool = True) -> VideoGenerator:
        # The frozen encoders stay in eval mode: a text encoder's dropout would make prompt embeddings random.
        super().train(mode)
        self.vae.eval()
        self.text_encoder.eval()
        return self

    def pipeline(self):
        """diffusers' `WanPipeline` over these very modules (no copies): what users run after training."""
        if self._pipe is None:
            from diffusers import WanPipeline

            self._pipe = WanPipeline(
                tokenizer=self.tokenizer,
                text_encoder=self.text_encoder,
                vae=self.vae,
                scheduler=self.scheduler,
                transformer=self.transformer,
            )
            self._pipe.set_progress_bar_config(disable=True)
        return self._pipe

    @torch.no_grad()
    def encode_prompts(self, prompts: str | Sequence[str]) -> Tensor:
        """Prompt embeddings (B, L, D), L = max_sequence_length, through the pipeline's own text path; cached."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        missing = sorted({p for p in prompts if p not in self._prompt_cache})
        if missing:
            embeds, _ = self.pipeline().encode_prompt(
                missing,
                do_classifier_free_guidance=False,
                max_sequence_length=self.config.max_sequence_length,
                device=self.device,
                dtype=torch.float32,
            )
            for p, e in zip(missing, embeds):
                self._prompt_cache[p] = e
        return torch.stack([self._prompt_cache[p] for p in prompts]).to(self.device)

    def negative_prompt_embeds(self, batch_size: int) -> Tensor:
        """The unconditional (negative) prompt's embeddings (B, L, D), for CFG."""
        return self.encode_prompts([self.config.negative_prompt] * batch_size)

    # ==============================================================================================================
    # Latents <-> videos
    # ==============================================================================================================

    def _latent_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.vae.config
        shape = (1, cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean, device=like.device, dtype=like.dtype).view(shape)
        std = torch.tensor(cfg.latents_std, device=like.device, dtype=like.dtype).view(shape)
        return mean, std

    def latent_shape(self, batch_size: int, *, num_frames: int | None = None, height: int | None = None,
                     width: int | None = None) -> tuple[int, int, int, int, int]:
        """(B, C, F', h, w) of the latents for a video of the given (or configured) size."""
        f, h, w = num_frames or self.config.num_frames, height or self.config.height, width or self.config.width
        self.check_shape(f, h, w)
        t, s = self.vae.config.scale_factor_temporal, self.vae.config.scale_factor_spatial
        return (batch_size, self.transformer.config.in_channels, (f - 1) // t + 1, h // s, w // s)

    def check_shape(self, num_frames: int, height: int, width: int) -> None:
        """Raise a ValueError explaining why a (frames, height, width) cannot go through this model's VAE/patches."""
        check_video_shape(
            num_frames, height, width,
            temporal=self.vae.config.scale_factor_temporal,
            spatial=self.vae.config.scale_factor_spatial,
            patch=self.transformer.config.patch_size[1],
        )

    def encode_video(self, videos: Tensor) -> Tensor:
        """Videos (B, F, C, H, W) in [0, 1] -> normalised latents (B, C', F', h, w) (the VAE's mode, no sampling)."""
        if videos.ndim != 5 or videos.shape[2] != 3:
            raise ValueError(f"videos must be (B, F, 3, H, W) in [0, 1]; got shape {tuple(videos.shape)}")
        self.check_shape(videos.shape[1], videos.shape[3], videos.shape[4])
        x = videos.to(self.device, self.vae.dtype).permute(0, 2, 1, 3, 4) * 2.0 - 1.0
        z = self.vae.encode(x).latent_dist.mode()
        mean, std = self._latent_stats(z)
        return (z - mean) / std

    def decode_latents(self, latents: Tensor) -> Tensor:
        """Normalised latents (B, C', F', h, w) -> videos (B, F, C, H, W) in [0, 1]. Differentiable."""
        mean, std = self._latent_stats(latents)
        x = self.vae.decode(latents.to(self.vae.dtype) * std + mean, return_dict=False)[0]
        return (x * 0.5 + 0.5).clamp(0.0, 1.0).permute(0, 2, 1, 3, 4)

    # ==============================================================================================================
    # The model as a flow: velocity, x̂_0, losses
    # ==============================================================================================================

    def _timestep(self, t: Tensor | float, batch_size: int, frames: int | None = None) -> Tensor:
        """t as (B,), or (B, F') with one flow time per latent frame (`frames` = F' of the latents it goes with)."""
        t = torch.as_tensor(t, dtype=torch.float32, device=self.device)
        t = t.expand(batch_size) if t.ndim == 0 else t
        if t.shape != (batch_size,) and t.shape != (batch_size, frames):
            per_frame = f" or ({batch_size}, {frames}) (one per latent frame)" if frames is not None else ""
            raise ValueError(f"t must be a scalar, ({batch_size},){per_frame}; got shape {tuple(t.shape)}")
        return t

    @staticmethod
    def frame_times(t: Tensor) -> Tensor:
        """t (B,) as it is; per-frame t (B, F') as (B, 1, F', 1, 1), to broadcast against latents (B, C, F', h, w)."""
        return t[:, None, :, None, None] if t.ndim == 2 else t

    def _forward(self, x_t: Tensor, t: Tensor, prompt_embeds: Tensor, *, native: bool) -> Tensor:
        if prompt_embeds.shape[0] != x_t.shape[0]:
            raise ValueError(f"prompt_embeds batch {prompt_embeds.shape[0]} != x_t batch {x_t.shape[0]}")
        timestep = t * self.config.num_train_timesteps  # as WanPipeline passes scheduler.timesteps (= σ·1000)
        if t.ndim == 2:  # one time per latent frame -> per token (Wan2.2 ti2v's per-token timesteps)
            p_t, p_h, p_w = self.transformer.config.patch_size
            if p_t != 1:
                raise ValueError(f"per-frame flow times need a temporal patch of 1; this transformer's is {p_t}")
            timestep = timestep.repeat_interleave((x_t.shape[3] // p_h) * (x_t.shape[4] // p_w), dim=1)
        kwargs = dict(hidden_states=x_t.to(self.dtype), timestep=timestep,
                      encoder_hidden_states=prompt_embeds.to(self.device, self.dtype))
        if native and isinstance(self.transformer, WanX0Transformer3DModel):
            out = self.transformer.forward_native(**kwargs)
        else:
            out = self.transformer(**kwargs, return_dict=False)[0]
        return out.float()

    def velocity(
        self,
        x_t: Tensor,
        t: Tensor | float,
        prompt_embeds: Tensor,
        *,
        adapter: str | None = None,
        guidance_scale: float = 1.0,
        negative_prompt_embeds: Tensor | None = None,
    ) -> Tensor:
        """v(x_t, t) under x_t = (1 − t)x_0 + tε, v = ε − x_0, whatever the parameterisation. (B, C, F', h, w).

        t: (B,) or scalar in [0, 1], or (B, F') one time per latent frame (a sequence whose frames are at different
        noise levels: the video policy's slots). adapter: None (the active one), a name, or "base". guidance_scale > 1 applies
        CFG against `negative_prompt_embeds` (default: the config's negative prompt), as WanPipeline does.
        """
        t = self._timestep(t, x_t.shape[0], x_t.shape[2])
        with self.use_adapter(adapter):
            v = self._forward(x_t, t, prompt_embeds, native=False)
            if guidance_scale > 1.0:
                neg = negative_prompt_embeds if negative_prompt_embeds is not None else \
                    self.negative_prompt_embeds(x_t.shape[0])
                v = flow.cfg_velocity(v, self._forward(x_t, t, neg, native=False), guidance_scale)
        return v

    @torch.no_grad()
    def velocities(self, x_t: Tensor, t: Tensor | float, prompt_embeds: Tensor, adapters: Sequence[str]) -> list[Tensor]:
        """`velocity` under each of `adapters` ("base": none) at the same inputs, unguided, in one batched pass
        (`mixed_adapters`): e.g. the old policy and the frozen base model of an update. No gradients."""
        k, b = len(adapters), x_t.shape[0]
        t = self._timestep(t, b)
        rows = [name for name in adapters for _ in range(b)]
        with self.mixed_adapters(rows):
            v = self._forward(x_t.repeat(k, *[1] * (x_t.dim() - 1)), t.repeat(k),
                              prompt_embeds.repeat(k, *[1] * (prompt_embeds.dim() - 1)), native=False)
        return list(v.split(b))

    def x0_pred(self, x_t: Tensor, t: Tensor | float, prompt_embeds: Tensor, *, adapter: str | None = None) -> Tensor:
        """x̂_0(x_t, t): the network's output for x0 prediction, x_t − t·v for velocity prediction."""
        t = self._timestep(t, x_t.shape[0], x_t.shape[2])
        with self.use_adapter(adapter):
            if self.config.prediction == "x0":
                return self._forward(x_t, t, prompt_embeds, native=True)
            return flow.x0_from_velocity(x_t.float(), self._forward(x_t, t, prompt_embeds, native=False), self.frame_times(t))

    def flow_loss(
        self,
        batch: Mapping[str, Any],
        *,
        weights: Tensor | None = None,
        targets: Mapping[str, Tensor] | None = None,
    ) -> Tensor:
        """Per-sample flow-matching loss (B,), in the model's own prediction space.

        batch: "x0" latents (B, C, F', h, w), "prompt_embeds" (B, L, D), optional "t" (B,) and "noise".
        targets: {"x0": x_0*} (AWR) or {"velocity": v*} (OPSD, a teacher); converted into the model's space with
        `flow.velocity_from_x0` / `flow.x0_from_velocity` at the same (x_t, t). Default target: x_0 for x0
        prediction, ε − x_0 for velocity prediction. The active adapter is trained.
        """
        x0 = batch["x0"].to(self.device, torch.float32)
        B = x0.shape[0]
        t = batch.get("t")
        t = flow.sample_time(B, distribution=self.config.time_distribution, device=self.device) if t is None \
            else self._timestep(t, B)
        noise = batch.get("noise")
        noise = torch.randn_like(x0) if noise is None else noise.to(x0)
        x_t = flow.interpolate(x0, noise, t)
        targets = dict(targets or {})
        unknown = set(targets) - {"x0", "velocity"}
        if unknown or len(targets) > 1:
            raise ValueError(f"targets takes one of 'x0' or 'velocity'; got {sorted(targets)}")
        if self.config.prediction == "x0":
            pred = self._forward(x_t, t, batch["prompt_embeds"], native=True)
            if "velocity" in targets:
                target = flow.x0_from_velocity(x_t, targets["velocity"].to(x_t), t)
            else:
                target = targets.get("x0", x0).to(x_t)
        else:
            pred = self._forward(x_t, t, batch["prompt_embeds"], native=False)
            if "x0" in targets:
                target = flow.velocity_from_x0(x_t, targets["x0"].to(x_t), t, eps=self.config.x0_min_t)
            else:
                target = targets.get("velocity", flow.velocity_target(x0, noise)).to(x_t)
        return flow.flow_matching_loss(pred, target.detach(), weights=weights)

    def sde_log_prob(self, batch: Mapping[str, Any], *, noise_level: float = 0.7) -> SDEStep:
        """Flow-SDE log-prob of a recorded step: batch "x_t", "t", "t_next", "x_next", "prompt_embeds"; optional
        "guidance_scale" and "negative_prompt_embeds" (as sampled), "adapter". Grad flows through the velocity."""
        v = self.velocity(
            batch["x_t"], batch["t"], batch["prompt_embeds"],
            adapter=batch.get("adapter"),
            guidance_scale=float(batch.get("guidance_scale", 1.0)),
            negative_prompt_embeds=batch.get("negative_prompt_embeds"),
        )
        return flow.sde_step_with_logprob(
            v, batch["x_t"].float(), batch["t"], batch["t_next"], noise_level=noise_level, prev_sample=batch["x_next"]
        )

    @torch.no_grad()
    def features(self, batch: Mapping[str, Any]) -> Tensor:
        """(B, 5C'): latents pooled to 2x2 over space (and over time), plus each channel's std; for critics.

        batch: "x0" latents, or "videos" (B, F, C, H, W) in [0, 1] (encoded first).
        """
        z = batch["x0"] if "x0" in batch else self.encode_video(batch["videos"])
        z = z.float()
        pooled = torch.nn.functional.adaptive_avg_pool3d(z, (1, 2, 2)).flatten(1)
        return torch.cat([pooled, z.flatten(2).std(dim=2)], dim=1)

    # ==============================================================================================================
    # Samplers
    # ==============================================================================================================

    def sigmas(self, num_steps: int) -> Tensor:
        """The pipeline's sampling times (num_steps + 1,), from the scheduler (shift applied), ending at 0."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)  # the shared one is stateful
        sched.set_timesteps(num_steps, device=self.device)
        return sched.sigmas.to(torch.float32)

    def initial_noise(self, batch_size: int, *, generator: torch.Generator | None = None, **shape: int) -> Tensor:
        """The starting latents at t = 1, drawn exactly as WanPipeline.prepare_latents draws them."""
        from diffusers.utils.torch_utils import randn_tensor

        return randn_tensor(self.latent_shape(batch_size, **shape), generator=generator, device=self.device,
                            dtype=torch.float32)

    def _velocity_fn(self, prompt_embeds, guidance_scale, negative_prompt_embeds):
        if guidance_scale > 1.0 and negative_prompt_embeds is None:
            negative_prompt_embeds = self.negative_prompt_embeds(prompt_embeds.shape[0])

        def fn(x: Tensor, t: Tensor) -> Tensor:
            return self.velocity(x, t, prompt_embeds, guidance_scale=guidance_scale,
                                 negative_prompt_embeds=negative_prompt_embeds)

        return fn

    def euler_sample(
        self,
        prompt_embeds: Tensor,
        *,
        num_steps: int,
        guidance_scale: float = 1.0,
        negative_prompt_embeds: Tensor | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
        adapter: str | None = None,
        return_trajectory: bool = False,
        grad: bool = False,
    ) -> Tensor | tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The pipeline's ODE sampler without the pipeline: latents (B, C, F', h, w) [, visited (x_t, t)].

        Same schedule, same starting noise for the same seed, same CFG: equal to `generate(..., return_latents=True)`.
        """
        if noise is None:
            generator = _generator(seed, generator)
            noise = self.initial_noise(prompt_embeds.shape[0], generator=generator)
        with torch.set_grad_enabled(grad), self.use_adapter(adapter):
            return flow.euler_sample(
                self._velocity_fn(prompt_embeds, guidance_scale, negative_prompt_embeds),
                noise,
                schedule=self.sigmas(num_steps),
                return_trajectory=return_trajectory,
            )

    @torch.no_grad()
    def sample_sde(
        self,
        prompt_embeds: Tensor,
        *,
        num_steps: int,
        noise_level: float = 0.7,
        guidance_scale: float = 1.0,
        negative_prompt_embeds: Tensor | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        adapter: str | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Flow-GRPO's SDE rollout on the pipeline's schedule: (x_0 latents, records).

        records: "x_t", "x_next" (S, B, C, F', h, w); "t", "t_next", "log_prob" (S, B). Feed step i back as
        `sde_log_prob({"x_t": r["x_t"][i], "t": r["t"][i], "t_next": ..., "x_next": ..., "prompt_embeds": ...})`.
        """
        generator = _generator(seed, generator)
        noise = self.initial_noise(prompt_embeds.shape[0], generator=generator)
        step_generator = generator
        if generator is not None and generator.device != self.device:
            # The start is drawn like the pipeline's (any generator); the step noise needs one on the model's device.
            seed_ = int(torch.randint(0, 2**62, (1,), generator=generator))
            step_generator = torch.Generator(device=self.device).manual_seed(seed_)
        sched = self.sigmas(num_steps)
        with self.use_adapter(adapter):
            x0, states, nexts, log_probs = flow.sde_sample(
                self._velocity_fn(prompt_embeds, guidance_scale, negative_prompt_embeds),
                noise, schedule=sched, noise_level=noise_level, generator=step_generator,
            )
        B = prompt_embeds.shape[0]
        records = {
            "x_t": states,
            "x_next": nexts,
            "t": sched[:-1, None].expand(-1, B).contiguous(),
            "t_next": sched[1:, None].expand(-1, B).contiguous(),
            "log_prob": log_probs,
        }
        return x0, records

    @torch.no_grad()
    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        num_inference_steps: int = 10,
        guidance_scale: float = 1.0,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        adapter: str | None = None,
        return_latents: bool = False,
        num_frames: int | None = None,
        height: int | None = None,
        width: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Sample through diffusers' `WanPipeline`: videos (B, F, C, H, W) in [0, 1] [, final latents].

        guidance_scale 1.0 is CFG-free (one transformer call per step); > 1 guides against the negative prompt.
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        f, h, w = num_frames or self.config.num_frames, height or self.config.height, width or self.config.width
        self.check_shape(f, h, w)  # the pipeline would only warn and round
        embeds = self.encode_prompts(prompts)
        negative = self.negative_prompt_embeds(len(prompts)) if guidance_scale > 1.0 else None
        captured: dict[str, Tensor] = {}

        def keep_latents(pipe, i, t, kwargs):
            captured["latents"] = kwargs["latents"]
            return {}

        with self.use_adapter(adapter):
            out = self.pipeline()(
                prompt_embeds=embeds,
                negative_prompt_embeds=negative,
                num_frames=f, height=h, width=w,
                num_inference_steps=num_inference_steps,
                guidance_scale=guidance_scale,
                generator=_generator(seed, generator),
                output_type="pt",
                callback_on_step_end=keep_latents if return_latents else None,
                max_sequence_length=self.config.max_sequence_length,
            )
        videos = out.frames.float()
        return (videos, captured["latents"].float()) if return_latents else videos


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------


def custom_component_module() -> tuple[str, str]:
    """(module name, source) of `policies/video/wan_components.py` as saved into component folders.

    The name carries a hash of the source: diffusers copies a folder's module into one shared cache under its file
    name, so two versions of the code must not share one."""
    import hashlib

    from policies.video import wan_components

    source = Path(wan_components.__file__).read_text(encoding="utf-8")
    return f"kinema_video_{hashlib.sha256(source.encode()).hexdigest()[:10]}", source


def is_custom_component(module: Any) -> bool:
    """A component of kinema's own class (the x0 transformer, the pixel-space autoencoder): its folder needs the code."""
    return type(module).__module__ == "policies.video.wan_components"


@torch.no_grad()
def fused_state_dict(base: Mapping[str, Tensor], lora: Mapping[str, Tensor], spec: Mapping[str, Any]) -> dict[str, Tensor]:
    """Transformer weights with a LoRA merged in: W + (alpha/rank)·B·A for every `<module>.lora_A/B.weight` pair
    (peft's scaling without rsLoRA), computed in float32 and stored in W's dtype."""
    out = dict(base)
    scale = float(spec["alpha"]) / float(spec["rank"])
    suffix = ".lora_A.weight"
    for key in [k for k in lora if k.endswith(suffix)]:
        module = key[: -len(suffix)]
        target = f"{module}.weight"
        if target not in out or f"{module}.lora_B.weight" not in lora:
            raise ValueError(f"cannot fuse LoRA key {key!r}: no base weight {target!r} or no matching lora_B")
        w = out[target]
        delta = lora[f"{module}.lora_B.weight"].float() @ lora[key].float()
        out[target] = (w.float() + scale * delta.to(w.device)).to(w.dtype).contiguous()
    if not any(k.endswith(suffix) for k in lora):
        raise ValueError("fused_state_dict: the LoRA state holds no lora_A weights")
    return out


def _generator(seed: int | None, generator: torch.Generator | None) -> torch.Generator | None:
    if seed is not None and generator is not None:
        raise ValueError("pass seed or generator, not both")
    return torch.Generator().manual_seed(int(seed)) if seed is not None else generator
