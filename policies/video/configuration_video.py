"""Configuration of the video generator wrapper: one typed dataclass, named presets, shape checks.

A preset names the sizes of every component (transformer, text encoder, VAE or pixel space); the user-facing knobs
(frames, size, parameterisation, LoRA) sit next to it. Shape rules come from diffusers' Wan stack:

- the Wan VAE keeps the first frame and compresses the rest 4x in time, so `num_frames` must be 4k + 1;
- `WanPipeline` insists on height and width divisible by 16, and patchifies the latents by the transformer's
  patch, so they must also be multiples of (spatial compression x patch).

The pipeline only warns and rounds on a bad frame count; here a bad shape is an error that explains the rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

Prediction = Literal["velocity", "x0"]
LatentSpace = Literal["vae", "pixel"]
TimeDistribution = Literal["uniform", "logit_normal"]

# LoRA targets of every Wan transformer block: self-attention (attn1), cross-attention (attn2) and the MLP
# (`ffn.net.0.proj` is GELU's input projection, `ffn.net.2` the output). peft matches these as name suffixes.
WAN_LORA_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")

# Wan2.1-T2V-1.3B's transformer, as published (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json;
# the reference configs list dim 1536 = 12 heads x 128, ffn 8960, 30 layers, freq 256, patch (1, 2, 2)).
# Its text encoder is umt5-xxl (d_model 4096), its VAE stride (4, 8, 8) with z_dim 16.
WAN21_T2V_1_3B_TRANSFORMER: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
WAN21_T2V_1_3B_PARAMETERS = 1_418_996_800


@dataclass
class VideoGeneratorConfig:
    """Everything needed to rebuild a generator's components and use them the same way.

    Saved as `kinema_video.json` next to the diffusers component folders.
    """

    preset: str = "tiny"  # the name this config was built from (informational once built)
    # --- video shape -------------------------------------------------------------------------------------------
    num_frames: int = 9  # 4k + 1 (the Wan VAE keeps frame 0 and compresses the rest 4x in time)
    height: int = 32  # divisible by 16 (WanPipeline) and by spatial compression x patch
    width: int = 32
    # --- parameterisation and space ----------------------------------------------------------------------------
    prediction: Prediction = "x0"  # what the transformer outputs; `velocity()` always returns v = ε − x_0
    x0_min_t: float = 1e-3  # ε in v = (x_t − x̂_0)/max(t, ε), for x0 prediction
    latent_space: LatentSpace = "pixel"  # "vae": AutoencoderKLWan; "pixel": an exact space-to-depth "VAE"
    pixel_scale_temporal: int = 4  # pixel space: frames folded into channels (4 keeps the 4k + 1 rule)
    pixel_scale_spatial: int = 2  # pixel space: pixels folded into channels per side
    # --- transformer (WanTransformer3DModel) -------------------------------------------------------------------
    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 24  # divisible by 6 is not needed; rope splits it (t, h, w) with h = w = 2(d//6)
    ffn_dim: int = 256
    patch_size: tuple[int, int, int] = (1, 2, 2)
    freq_dim: int = 64
    rope_max_seq_len: int = 64
    # --- text encoder (UMT5EncoderModel) and tokenizer ---------------------------------------------------------
    text_dim: int = 32  # UMT5 d_model = the transformer's text_dim
    text_layers: int = 2
    text_heads: int = 2
    text_ff: int = 64
    max_sequence_length: int = 16  # prompts are padded/truncated to this many tokens
    negative_prompt: str = ""  # the unconditional prompt for CFG
    # --- VAE (latent_space = "vae"; AutoencoderKLWan) ----------------------------------------------------------
    vae_base_dim: int = 16
    vae_z_dim: int = 8
    # --- scheduler (FlowMatchEulerDiscreteScheduler) -----------------------------------------------------------
    flow_shift: float = 1.0  # diffusers' σ' = sσ/(1 + (s − 1)σ); Wan uses 3–5 at 480p
    num_train_timesteps: int = 1000
    # --- training ----------------------------------------------------------------------------------------------
    time_distribution: TimeDistribution = "uniform"  # flow_loss's per-sample t when the batch carries none
    # --- LoRA (peft) -------------------------------------------------------------------------------------------
    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_targets: tuple[str, ...] = WAN_LORA_TARGETS

    def __post_init__(self) -> None:
        self.patch_size = tuple(int(p) for p in self.patch_size)  # JSON round-trips tuples as lists
        self.lora_targets = tuple(self.lora_targets)
        _one_of("prediction", self.prediction, ("velocity", "x0"))
        _one_of("latent_space", self.latent_space, ("vae", "pixel"))
        _one_of("time_distribution", self.time_distribution, ("uniform", "logit_normal"))
        for name in ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "text_dim", "text_layers",
                     "text_heads", "text_ff", "max_sequence_length", "lora_rank", "pixel_scale_temporal",
                     "pixel_scale_spatial", "vae_base_dim", "vae_z_dim", "num_train_timesteps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"VideoGeneratorConfig.{name} must be >= 1; got {getattr(self, name)}")
        if len(self.patch_size) != 3:
            raise ValueError(f"VideoGeneratorConfig.patch_size must be (t, h, w); got {self.patch_size}")
        if self.attention_head_dim % 2:
            raise ValueError(
                f"VideoGeneratorConfig.attention_head_dim must be even (rotary); got {self.attention_head_dim}"
            )
        if not self.lora_targets:
            raise ValueError("VideoGeneratorConfig.lora_targets must name at least one module suffix")
        if self.flow_shift <= 0:
            raise ValueError(f"VideoGeneratorConfig.flow_shift must be > 0; got {self.flow_shift}")
        if not 0 < self.x0_min_t < 1:
            raise ValueError(f"VideoGeneratorConfig.x0_min_t must be in (0, 1); got {self.x0_min_t}")
        check_video_shape(self.num_frames, self.height, self.width, **self.compression())

    # ---------------------------------------------------------------------------------------------------------------

    def compression(self) -> dict[str, int]:
        """Temporal and spatial compression of the latent space, and the transformer's spatial patch."""
        if self.latent_space == "pixel":
            temporal, spatial = self.pixel_scale_temporal, self.pixel_scale_spatial
        else:
            temporal, spatial = 4, 8  # AutoencoderKLWan with temperal_downsample (F, T, T) and 3 down blocks
        return dict(temporal=temporal, spatial=spatial, patch=self.patch_size[1])

    def latent_channels(self) -> int:
        if self.latent_space == "pixel":
            return 3 * self.pixel_scale_temporal * self.pixel_scale_spatial**2
        return self.vae_z_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VideoGeneratorConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown VideoGeneratorConfig key(s) {unknown}; valid keys: {sorted(names)}")
        return cls(**data)

    def replace(self, **changes: Any) -> VideoGeneratorConfig:
        return self.from_dict({**self.to_dict(), **changes})


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"VideoGeneratorConfig.{name} must be one of {list(allowed)}; got {value!r}")


def check_video_shape(num_frames: int, height: int, width: int, *, temporal: int, spatial: int, patch: int) -> None:
    """Raise a ValueError that explains why (num_frames, height, width) cannot go through the Wan stack."""
    problems = []
    if num_frames < 1 or (num_frames - 1) % temporal:
        k = max((num_frames - 1) // temporal, 0)
        near = sorted({temporal * k + 1, temporal * (k + 1) + 1})
        problems.append(
            f"num_frames={num_frames} is not {temporal}k + 1: the latent space keeps the first frame and compresses "
            f"the others {temporal}x in time (the Wan VAE's causal layout); use one of {near}"
        )
    multiple = math.lcm(16, spatial * patch)
    for name, size in (("height", height), ("width", width)):
        if size < multiple or size % multiple:
            lower = max(multiple, size // multiple * multiple)
            problems.append(
                f"{name}={size} is not a multiple of {multiple}: WanPipeline needs multiples of 16, and the latents "
                f"({spatial}x smaller) are cut into {patch}x{patch} patches; use {lower} or {lower + multiple}"
            )
    if problems:
        raise ValueError("incompatible video shape: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------

# "tiny": the CPU default. Pixel space (a random Wan VAE decodes to grey mush, and pixel space is exact), x0
# prediction (velocity prediction with wide pixel patches plateaued into noise in the prototype).
# "tiny-vae": the same transformer on a small AutoencoderKLWan, for tests of the latent path and for users who
# train the VAE first. "tiny-velocity": the textbook parameterisation, for comparisons.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "tiny-vae": dict(latent_space="vae", height=32, width=32),
    "tiny-velocity": dict(prediction="velocity"),
}


def preset_config(name: str, **overrides: Any) -> VideoGeneratorConfig:
    """The named preset's config, with field overrides. An unknown name lists the valid ones."""
    if name not in PRESETS:
        import difflib

        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown video generator preset {name!r}{hint}; valid presets: {sorted(PRESETS)}")
    return VideoGeneratorConfig(**{"preset": name, **PRESETS[name], **overrides})
