"""The builders of every component of the tiny Wan stack from a config, and the loaders of saved component folders.

kinema's own two diffusers components, `WanX0Transformer3DModel` (clean-sample prediction, velocity out) and
`PixelSpaceAutoencoder` (an exact pixel-space "VAE"), live in `policies.video.wan_components`, a file that needs
only torch and diffusers: it is copied into the component folders of every saved generator, so that stock diffusers
loads them with `trust_remote_code=True`. They are re-exported here.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

from policies.video.configuration_video import VideoGeneratorConfig
from policies.video.wan_components import PixelSpaceAutoencoder, WanX0Transformer3DModel

__all__ = [
    "COMPONENT_CLASSES",
    "PixelSpaceAutoencoder",
    "WanX0Transformer3DModel",
    "build_scheduler",
    "build_text_encoder",
    "build_transformer",
    "build_vae",
    "load_component",
    "load_text_encoder",
]


# ---------------------------------------------------------------------------------------------------------------
# Builders (random weights, offline)
# ---------------------------------------------------------------------------------------------------------------


def transformer_kwargs(config: VideoGeneratorConfig) -> dict[str, Any]:
    channels = config.latent_channels()
    return dict(
        patch_size=config.patch_size,
        num_attention_heads=config.num_attention_heads,
        attention_head_dim=config.attention_head_dim,
        in_channels=channels,
        out_channels=channels,
        text_dim=config.text_dim,
        freq_dim=config.freq_dim,
        ffn_dim=config.ffn_dim,
        num_layers=config.num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=config.rope_max_seq_len,
    )


def build_transformer(config: VideoGeneratorConfig) -> WanTransformer3DModel:
    """A random transformer: the plain Wan class for velocity prediction, the x0 subclass otherwise."""
    kwargs = transformer_kwargs(config)
    if config.prediction == "velocity":
        return WanTransformer3DModel(**kwargs)
    return WanX0Transformer3DModel(
        **kwargs,
        prediction_type="x0",
        x0_min_t=config.x0_min_t,
        num_train_timesteps=config.num_train_timesteps,
    )


def build_vae(config: VideoGeneratorConfig) -> AutoencoderKLWan | PixelSpaceAutoencoder:
    if config.latent_space == "pixel":
        return PixelSpaceAutoencoder(
            scale_factor_temporal=config.pixel_scale_temporal, scale_factor_spatial=config.pixel_scale_spatial
        )
    z = config.vae_z_dim
    return AutoencoderKLWan(
        base_dim=config.vae_base_dim,
        z_dim=z,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * z,
        latents_std=[1.0] * z,
    )


def build_scheduler(config: VideoGeneratorConfig) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config.num_train_timesteps, shift=config.flow_shift)


def build_text_encoder(config: VideoGeneratorConfig, vocab_size: int):
    from transformers import UMT5Config, UMT5EncoderModel

    if config.text_dim % config.text_heads:
        raise ValueError(f"text_dim={config.text_dim} must be divisible by text_heads={config.text_heads}")
    cfg = UMT5Config(
        vocab_size=vocab_size,
        d_model=config.text_dim,
        d_kv=config.text_dim // config.text_heads,
        d_ff=config.text_ff,
        num_layers=config.text_layers,
        num_heads=config.text_heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return UMT5EncoderModel(cfg)


# Classes a saved component folder may name, by folder; from_pretrained resolves `_class_name` through this.
COMPONENT_CLASSES: dict[str, dict[str, type]] = {
    "transformer": {"WanTransformer3DModel": WanTransformer3DModel, "WanX0Transformer3DModel": WanX0Transformer3DModel},
    "vae": {"AutoencoderKLWan": AutoencoderKLWan, "PixelSpaceAutoencoder": PixelSpaceAutoencoder},
}


# ---------------------------------------------------------------------------------------------------------------
# Loading foreign or saved component folders
# ---------------------------------------------------------------------------------------------------------------


@contextmanager
def component_loading(folder: Path, component: str):
    """Turn a damaged component (truncated weights, bad JSON, a wrongly typed config field) into an error naming the
    component and its folder; a missing file stays the FileNotFoundError that names it."""
    try:
        yield
    except FileNotFoundError:
        raise
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"the '{component}' component in {folder} could not be loaded: {type(e).__name__}: {e}") from e


def load_component(path: Path, component: str, *, torch_dtype: torch.dtype | None = None):
    """A diffusers model folder `path/component`, its class read from `_class_name` (only the classes we know)."""
    folder = path / component
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} is missing the '{component}' component's config: expected {cfg_file}")
    with component_loading(folder, component):
        class_name = json.loads(cfg_file.read_text()).get("_class_name")
    classes = COMPONENT_CLASSES[component]
    if class_name not in classes:
        raise ValueError(f"{cfg_file}: unsupported {component} class {class_name!r}; supported: {sorted(classes)}")
    cls = classes[class_name]
    if not (any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))):
        raise FileNotFoundError(f"{path} is missing the '{component}' component's weights in {folder}")
    kwargs = {"torch_dtype": torch_dtype} if torch_dtype is not None else {}
    with component_loading(folder, component):
        return cls.from_pretrained(folder, local_files_only=True, **kwargs)


def load_text_encoder(folder: Path, *, torch_dtype: torch.dtype | None = None):
    import transformers

    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"missing the 'text_encoder' component's config: expected {cfg_file}")
    with component_loading(folder, "text_encoder"):
        arch = (json.loads(cfg_file.read_text()).get("architectures") or ["UMT5EncoderModel"])[0]
    allowed = ("UMT5EncoderModel", "T5EncoderModel")
    if arch not in allowed:
        raise ValueError(f"{cfg_file}: unsupported text encoder {arch!r}; supported: {list(allowed)}")
    kwargs = {"dtype": torch_dtype} if torch_dtype is not None else {}
    with component_loading(folder, "text_encoder"):
        return getattr(transformers, arch).from_pretrained(folder, local_files_only=True, **kwargs)


def config_from_components(transformer, vae, scheduler, overrides: dict[str, Any]) -> VideoGeneratorConfig:
    """A config describing foreign (non-kinema) diffusers components: Wan's own defaults for the video shape."""
    tc = transformer.config
    fields: dict[str, Any] = dict(
        preset="pretrained",
        prediction=getattr(tc, "prediction_type", "velocity"),
        latent_space="pixel" if type(vae).__name__ == "PixelSpaceAutoencoder" else "vae",
        num_frames=81, height=480, width=832,
        num_layers=tc.num_layers, num_attention_heads=tc.num_attention_heads,
        attention_head_dim=tc.attention_head_dim, ffn_dim=tc.ffn_dim, patch_size=tuple(tc.patch_size),
        freq_dim=tc.freq_dim, rope_max_seq_len=tc.rope_max_seq_len, text_dim=tc.text_dim,
        max_sequence_length=512, flow_shift=float(scheduler.config.shift),
        num_train_timesteps=int(scheduler.config.num_train_timesteps),
    )
    if fields["latent_space"] == "vae":
        fields["vae_z_dim"] = vae.config.z_dim
    else:
        fields["pixel_scale_temporal"] = vae.config.scale_factor_temporal
        fields["pixel_scale_spatial"] = vae.config.scale_factor_spatial
    return VideoGeneratorConfig(**{**fields, **overrides})
