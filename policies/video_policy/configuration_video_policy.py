"""Configuration of kinema's video-diffusion policy (Cosmos Policy's recipe on the generator stack's Wan transformer)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
PLANNING_VALUES = ("world", "joint")


@dataclass
class VideoPolicyConfig:
    """Architecture and execution options of the video policy. The defaults are the CPU-sized `tiny` model.

    The model is a `policies.video.VideoGenerator` (its Wan transformer, text encoder, VAE or exact pixel space, LoRA
    adapters) whose latent sequence holds one latent frame per slot: the current image of each camera, the current
    state, the action chunk, the future image of each camera and the future state (the chunk's end), and the value.
    """

    # --- the generator: a tiny random one (CPU), or a local diffusers-layout Wan checkpoint with LoRA (GPU) ---
    # local WanPipeline folder (e.g. Wan2.1-T2V-1.3B-Diffusers), or a `kinema video train` run folder (its final/, the
    # post-trained adapter fused in); referenced, never copied
    generator_path: str = ""
    generator_dtype: str = "float32"  # "float32" | "bfloat16" | "float16" for a generator_path's frozen weights
    video_size: int = 32  # side of the frames the video model sees (observations are resized to it)
    pixel_scale_spatial: int = 4  # tiny pixel space: pixels folded into channels per side (16 tokens per slot at 32)
    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 24
    ffn_dim: int = 256
    text_dim: int = 32
    max_text_tokens: int = 16
    lora_rank: int = 16  # generator_path only: LoRA on the pretrained transformer (the tiny one trains fully)
    lora_alpha: float = 16.0
    seed: int = 0  # the tiny generator's initial weights
    # --- the robot interface (what the VLA has) ---
    cameras: tuple[str, ...] = ("agentview", "wrist")
    image_size: int = 64  # observation images (resized to video_size inside)
    state_dim: int = 8
    action_dim: int = 7
    chunk_size: int = 8
    n_action_steps: int = 4
    num_flow_steps: int = 10
    time_distribution: str = "uniform"  # flow time of training samples: "uniform" | "logit_normal"
    # --- values, planning, learning from experience ---
    value_discount: float = 0.99  # value target: outcome · γ^(steps from the chunk's end to the episode's end)
    planning_candidates: int = 1  # best-of-N chunks ranked by predicted value; 1: no planning
    planning_value: str = "world"  # "world": re-predict future + value given each chunk (Cosmos); "joint": the policy pass's value
    planning_value_samples: int = 1  # world-model passes per candidate (majority vote on success, then the mean)
    experience_fraction: float = 0.5  # RL updates: replay steps (uniform) per demo/credit batch step, world/value modes
    aux_dim: int = 0  # accepted for the trainer's interface; the video policy has no privileged head
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (tasks seen), not architecture

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        if not self.cameras:
            raise ValueError("VideoPolicyConfig.cameras must name at least one camera")
        if self.n_action_steps < 1 or self.n_action_steps > self.chunk_size:
            raise ValueError(f"VideoPolicyConfig.n_action_steps must be in [1, chunk_size={self.chunk_size}]; got {self.n_action_steps}")
        for name in ("num_flow_steps", "planning_candidates", "planning_value_samples", "video_size", "chunk_size", "action_dim", "state_dim"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"VideoPolicyConfig.{name} must be >= 1; got {getattr(self, name)}")
        if self.video_size % 16:
            raise ValueError(f"VideoPolicyConfig.video_size must be a multiple of 16 (WanPipeline); got {self.video_size}")
        if self.time_distribution not in ("uniform", "logit_normal"):
            raise ValueError(f"VideoPolicyConfig.time_distribution must be 'uniform' or 'logit_normal'; got {self.time_distribution!r}")
        if self.planning_value not in PLANNING_VALUES:
            raise ValueError(f"VideoPolicyConfig.planning_value must be one of {list(PLANNING_VALUES)}; got {self.planning_value!r}")
        if not 0.0 < self.value_discount <= 1.0:
            raise ValueError(f"VideoPolicyConfig.value_discount must be in (0, 1]; got {self.value_discount}")
        if not 0.0 <= self.experience_fraction <= 1.0:
            raise ValueError(f"VideoPolicyConfig.experience_fraction must be in [0, 1]; got {self.experience_fraction}")
        if self.generator_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"VideoPolicyConfig.generator_dtype must be 'float32', 'bfloat16' or 'float16'; got {self.generator_dtype!r}")
        if self.generator_path:
            # Absolute, so that a checkpoint's config.json still finds the generator from another working directory.
            self.generator_path = os.path.abspath(os.path.expanduser(self.generator_path))
            # A `kinema video train` run folder stands for its exported generator
            final = os.path.join(self.generator_path, "final")
            if not os.path.isdir(os.path.join(self.generator_path, "transformer")) and os.path.isdir(final):
                self.generator_path = final

    # --- the latent layout ----------------------------------------------------------------------------------------
    @property
    def slots(self) -> tuple[str, ...]:
        """One latent frame per slot, in sequence order (Cosmos Policy's layout without its blank first frame: each
        image here is encoded on its own, so no slot absorbs the causal VAE's first-frame special case)."""
        return (
            *(f"current.{c}" for c in self.cameras), "current.state", "action",
            *(f"future.{c}" for c in self.cameras), "future.state", "value",
        )  # fmt: skip

    @property
    def hidden_dim(self) -> int:
        """Width of `features()`, what the critics read: pooled current latents (2x2 per camera), state, instruction."""
        if self.generator_path:  # read off the loaded components when the policy is built (recorded in extra)
            channels, text = self.extra.get("latent_channels", 16), self.extra.get("generator_text_dim", 4096)
        else:
            channels, text = 3 * self.pixel_scale_spatial**2, self.text_dim
        return len(self.cameras) * 4 * int(channels) + self.state_dim + int(text)

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "policy_type": "video", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VideoPolicyConfig:
        from policies.checkpoint import config_fields

        return cls(**config_fields(cls, data, policy_type="video", name="video policy", format_version=FORMAT_VERSION))

    ARCHITECTURE_FIELDS = (
        "generator_path", "video_size", "pixel_scale_spatial", "num_layers", "num_attention_heads", "attention_head_dim",
        "ffn_dim", "text_dim", "max_text_tokens", "lora_rank", "lora_alpha", "cameras", "image_size", "state_dim",
        "action_dim", "chunk_size",
    )  # fmt: skip
