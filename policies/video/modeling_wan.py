"""The two diffusers components kinema adds to the Wan stack, and the builders of every component from a config.

- `WanX0Transformer3DModel`: a `WanTransformer3DModel` whose network predicts the clean sample x̂_0 and whose
  `forward` returns the velocity v = (x_t − x̂_0)/max(t, ε). `WanPipeline` and the Euler scheduler only ever see a
  velocity, so the standard sampling path is unchanged; the raw x̂_0 is `forward_native`. Saved with its own
  `_class_name`, which model_index.json names by module, so `WanPipeline.from_pretrained` rebuilds this class.
  (Loading the folder directly as a plain `WanTransformer3DModel` only warns about the extra keys, and would read
  x̂_0 as v: load through the pipeline or `VideoGenerator.from_pretrained`.)
- `PixelSpaceAutoencoder`: a parameter-free, exactly invertible stand-in for `AutoencoderKLWan` that folds
  (temporal x spatial x spatial) pixel blocks into channels. It has the Wan VAE's causal layout (frame 0 alone,
  then groups of `scale_factor_temporal` frames) and its config keys (z_dim, latents_mean/std, scale factors), so
  `WanPipeline` decodes through it unchanged. Frame 0 is repeated to fill its group; decoding averages the copies.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput, DiagonalGaussianDistribution
from diffusers.models.modeling_outputs import AutoencoderKLOutput, Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from torch import Tensor

from diffusion_rl.flow import velocity_from_x0
from policies.video.configuration_video import VideoGeneratorConfig


class WanX0Transformer3DModel(WanTransformer3DModel):
    """Wan transformer with clean-sample prediction; `forward` converts it to the flow velocity.

    Args (beyond `WanTransformer3DModel`'s):
        prediction_type: "x0" (the network outputs x̂_0) or "velocity" (it outputs v; then this class is a plain
            Wan transformer).
        x0_min_t: ε in v = (x_t − x̂_0)/max(t, ε): keeps the last sampling step finite.
        num_train_timesteps: the scheduler's timestep scale (timestep = t · num_train_timesteps).
    """

    @register_to_config
    def __init__(
        self,
        patch_size: tuple[int, ...] = (1, 2, 2),
        num_attention_heads: int = 40,
        attention_head_dim: int = 128,
        in_channels: int = 16,
        out_channels: int = 16,
        text_dim: int = 4096,
        freq_dim: int = 256,
        ffn_dim: int = 13824,
        num_layers: int = 40,
        cross_attn_norm: bool = True,
        qk_norm: str | None = "rms_norm_across_heads",
        eps: float = 1e-6,
        image_dim: int | None = None,
        added_kv_proj_dim: int | None = None,
        rope_max_seq_len: int = 1024,
        pos_embed_seq_len: int | None = None,
        prediction_type: str = "x0",
        x0_min_t: float = 1e-3,
        num_train_timesteps: int = 1000,
    ) -> None:
        if prediction_type not in ("x0", "velocity"):
            raise ValueError(f"prediction_type must be 'x0' or 'velocity'; got {prediction_type!r}")
        super().__init__(
            patch_size=patch_size,
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=in_channels,
            out_channels=out_channels,
            text_dim=text_dim,
            freq_dim=freq_dim,
            ffn_dim=ffn_dim,
            num_layers=num_layers,
            cross_attn_norm=cross_attn_norm,
            qk_norm=qk_norm,
            eps=eps,
            image_dim=image_dim,
            added_kv_proj_dim=added_kv_proj_dim,
            rope_max_seq_len=rope_max_seq_len,
            pos_embed_seq_len=pos_embed_seq_len,
        )

    def forward_native(
        self, hidden_states: Tensor, timestep: Tensor, encoder_hidden_states: Tensor, **kwargs: Any
    ) -> Tensor:
        """The network's own output (x̂_0 for prediction_type "x0"), (B, C, F, h, w)."""
        kwargs["return_dict"] = False
        return super().forward(hidden_states, timestep, encoder_hidden_states, **kwargs)[0]

    def forward(
        self,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        encoder_hidden_states_image: Tensor | None = None,
        return_dict: bool = True,
        attention_kwargs: dict[str, Any] | None = None,
    ) -> Tensor | Transformer2DModelOutput:
        out = self.forward_native(
            hidden_states,
            timestep,
            encoder_hidden_states,
            encoder_hidden_states_image=encoder_hidden_states_image,
            attention_kwargs=attention_kwargs,
        )
        if self.config.prediction_type == "x0":
            if timestep.ndim != 1:
                raise ValueError("x0 prediction needs one timestep per sample (B,); per-token timesteps (Wan2.2 "
                                 f"ti2v) are not supported; got shape {tuple(timestep.shape)}")
            t = timestep.to(torch.float32) / self.config.num_train_timesteps
            out = velocity_from_x0(hidden_states.float(), out.float(), t, eps=self.config.x0_min_t).to(out.dtype)
        return (out,) if not return_dict else Transformer2DModelOutput(sample=out)


class PixelSpaceAutoencoder(ModelMixin, ConfigMixin):
    """An exact "VAE" for pixel-space flow models.

    (B, 3, T·k + 1, H, W) in [-1, 1] <-> (B, 3·T·S², k + 1, H/S, W/S).

    Channel order of a latent voxel: (colour, frame-in-group, row-in-block, column-in-block).
    """

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        scale_factor_temporal: int = 4,
        scale_factor_spatial: int = 2,
        z_dim: int | None = None,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
    ) -> None:
        super().__init__()
        expected = in_channels * scale_factor_temporal * scale_factor_spatial**2
        if z_dim is not None and z_dim != expected:
            raise ValueError(f"PixelSpaceAutoencoder z_dim must be {expected} (channels x T x S²); got {z_dim}")
        # WanPipeline reads these keys: unit normalisation keeps latents = pixels in [-1, 1].
        self.register_to_config(
            z_dim=expected,
            latents_mean=list(latents_mean) if latents_mean is not None else [0.0] * expected,
            latents_std=list(latents_std) if latents_std is not None else [1.0] * expected,
        )
        # A buffer gives the module a dtype and a device for diffusers' accounting, and (persistent) a weights file,
        # without which diffusers' from_pretrained refuses the folder. It carries no information.
        self.register_buffer("anchor", torch.zeros(()))

    def _fold(self, x: Tensor) -> Tensor:
        T, S = self.config.scale_factor_temporal, self.config.scale_factor_spatial
        B, C, F, H, W = x.shape
        if (F - 1) % T or H % S or W % S:
            raise ValueError(f"PixelSpaceAutoencoder needs frames {T}k + 1 and sizes divisible by {S}; got {(F, H, W)}")
        x = torch.cat([x[:, :, :1].expand(B, C, T - 1, H, W), x], dim=2)  # frame 0 fills its own group
        k = x.shape[2] // T
        x = x.reshape(B, C, k, T, H // S, S, W // S, S).permute(0, 1, 3, 5, 7, 2, 4, 6)
        return x.reshape(B, C * T * S * S, k, H // S, W // S)

    def _unfold(self, z: Tensor) -> Tensor:
        T, S, C = self.config.scale_factor_temporal, self.config.scale_factor_spatial, self.config.in_channels
        B, Z, k, h, w = z.shape
        if Z != C * T * S * S:
            raise ValueError(f"PixelSpaceAutoencoder latents need {C * T * S * S} channels; got {Z}")
        x = z.reshape(B, C, T, S, S, k, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(B, C, k * T, h * S, w * S)
        first = x[:, :, :T].mean(dim=2, keepdim=True)  # the repeated copies of frame 0
        return torch.cat([first, x[:, :, T:]], dim=2)

    def encode(self, x: Tensor, return_dict: bool = True) -> AutoencoderKLOutput | tuple:
        z = self._fold(x)
        dist = DiagonalGaussianDistribution(torch.cat([z, torch.zeros_like(z)], dim=1), deterministic=True)
        return AutoencoderKLOutput(latent_dist=dist) if return_dict else (dist,)

    def decode(self, z: Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        x = self._unfold(z)
        return DecoderOutput(sample=x) if return_dict else (x,)

    def forward(self, sample: Tensor, return_dict: bool = True) -> DecoderOutput | tuple:
        return self.decode(self.encode(sample).latent_dist.mode(), return_dict=return_dict)


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
