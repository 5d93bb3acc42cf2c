"""Configuration of kinema's SmolVLA: LeRobot's SmolVLA checkpoint fields that decide what it computes, plus kinema's
own (where the VLM lives locally, how a task's cameras map onto the checkpoint's image features, what trains).

A SmolVLA checkpoint is LeRobot's folder, unchanged: `config.json` (LeRobot's `SmolVLAConfig`, `"type": "smolvla"`),
`model.safetensors`, the pre/post-processor files (normalisation stats, tokenizer name). kinema adds one file beside
them, `kinema_smolvla.json` (`KINEMA_FILE`), which LeRobot ignores; so what kinema saves, LeRobot loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

KINEMA_FILE = "kinema_smolvla.json"
FORMAT_VERSION = 1
# What moves in training: "expert" (LeRobot's default, train_expert_only), "lora" (the expert, and LoRA on the VLM's
# text attention), "vlm" (its text layers too; the vision tower frozen, LeRobot's freeze_vision_encoder), "all"
# (everything: a SmolVLA trained from scratch on a CPU-sized VLM)
TRAINABLE = ("expert", "lora", "vlm", "all")
NORMALIZATION_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX")
IMAGE_PREFIX = "observation.images."


@dataclass
class SmolVLAConfig:
    """What kinema reads of a LeRobot SmolVLA checkpoint (`from_lerobot_config`), and kinema's own fields (the last
    block), stored in `kinema_smolvla.json`."""

    image_features: tuple[str, ...] = ("observation.images.agentview", "observation.images.wrist")  # in prefix order
    state_dim: int = 8  # observation.state's size in the checkpoint's dataset
    action_dim: int = 7
    chunk_size: int = 50
    n_action_steps: int = 50
    max_state_dim: int = 32  # state and action are zero-padded to these widths
    max_action_dim: int = 32
    resize_imgs_with_padding: tuple[int, int] | None = (512, 512)
    empty_cameras: int = 0  # image features the checkpoint expects that no camera gives: all -1, masked out
    tokenizer_max_length: int = 48
    pad_language_to: str = "longest"
    num_steps: int = 10  # Euler steps from t = 1 (noise) to 0
    num_vlm_layers: int = 16
    num_expert_layers: int = -1  # <= 0: as many as the VLM's layers
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    attention_mode: str = "cross_attn"
    add_image_special_tokens: bool = False
    prefix_length: int = -1
    min_period: float = 4e-3
    max_period: float = 4.0
    normalization_mapping: dict[str, str] = field(
        default_factory=lambda: {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    )
    vlm_model_name: str = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    # --- kinema's own ---
    vlm_path: str = ""  # local folder with the VLM's config.json and tokenizer (its weights come from the checkpoint)
    # kinema camera -> the checkpoint's image feature it fills; cameras left out fill the feature of the same name
    camera_map: dict[str, str] = field(default_factory=dict)
    image_size: int = 64  # the side kinema's env renders for this policy (the policy resizes with padding itself)
    trainable: str = "expert"  # "expert" | "lora" | "vlm" | "all" (TRAINABLE above)
    lora_rank: int = 16  # trainable "lora": rank and alpha of the VLM's adapters (merged into the weights on save)
    lora_alpha: float = 16.0
    inference_noise_scale: float = 1.0
    hidden_dim: int = 0  # the VLM's text width: the size of `features()`; filled from the VLM's config
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (tasks post-trained on), not architecture

    def __post_init__(self) -> None:
        self.image_features = tuple(self.image_features)
        if self.resize_imgs_with_padding is not None:
            self.resize_imgs_with_padding = tuple(self.resize_imgs_with_padding)
        if not self.image_features:
            raise ValueError("SmolVLAConfig.image_features is empty: the checkpoint names no observation.images.* input")
        if self.n_action_steps < 1 or self.n_action_steps > self.chunk_size:
            raise ValueError(f"SmolVLAConfig.n_action_steps must be in [1, chunk_size={self.chunk_size}]; got {self.n_action_steps}")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            raise ValueError(
                f"SmolVLAConfig: state_dim {self.state_dim} / action_dim {self.action_dim} exceed max_state_dim "
                f"{self.max_state_dim} / max_action_dim {self.max_action_dim}"
            )
        if self.attention_mode not in ("cross_attn", "self_attn"):
            raise ValueError(f"SmolVLAConfig.attention_mode must be 'cross_attn' or 'self_attn'; got {self.attention_mode!r}")
        if self.pad_language_to not in ("longest", "max_length"):
            raise ValueError(f"SmolVLAConfig.pad_language_to must be 'longest' or 'max_length'; got {self.pad_language_to!r}")
        for kind, mode in self.normalization_mapping.items():
            if mode not in NORMALIZATION_MODES:
                raise ValueError(
                    f"SmolVLAConfig.normalization_mapping[{kind!r}] is {mode!r}; kinema's port supports {list(NORMALIZATION_MODES)}"
                )
        if self.trainable not in TRAINABLE:
            raise ValueError(f"SmolVLAConfig.trainable must be one of {list(TRAINABLE)}; got {self.trainable!r}")
        if self.lora_rank < 1 or self.lora_alpha <= 0:
            raise ValueError(f"SmolVLAConfig.lora_rank must be >= 1 and lora_alpha > 0; got {self.lora_rank}, {self.lora_alpha}")
        if self.num_steps < 1:
            raise ValueError(f"SmolVLAConfig.num_steps must be >= 1; got {self.num_steps}")
        unknown = sorted(set(self.camera_map.values()) - set(self.image_features))
        if unknown:
            raise ValueError(f"SmolVLAConfig.camera_map names {unknown}, which the checkpoint does not take; its image features: {list(self.image_features)}")

    # ----- what kinema's trainers and runners ask of every policy's config -----
    @property
    def cameras(self) -> tuple[str, ...]:
        """kinema cameras this policy reads, in the checkpoint's image-feature order."""
        by_feature = {feature: camera for camera, feature in self.camera_map.items()}
        return tuple(by_feature.get(f, f[len(IMAGE_PREFIX):] if f.startswith(IMAGE_PREFIX) else f) for f in self.image_features)

    @property
    def num_flow_steps(self) -> int:
        return self.num_steps

    @property
    def aux_dim(self) -> int:
        return 0  # no privileged-position head

    # ----- LeRobot's config.json ↔ this -----
    @classmethod
    def from_lerobot_config(cls, data: dict[str, Any], **kinema: Any) -> SmolVLAConfig:
        """From LeRobot's `config.json` (a dict); refuses what the port does not compute."""
        if data.get("type") != "smolvla":
            raise ValueError(f"not a LeRobot SmolVLA config: its type is {data.get('type')!r}, expected 'smolvla'")
        for flag in ("adapt_to_pi_aloha", "use_delta_joint_actions_aloha"):
            if data.get(flag):
                raise ValueError(f"the checkpoint sets {flag}; kinema's SmolVLA port does not implement it (LeRobot's ALOHA runtime conversion)")
        if (data.get("rtc_config") or {}).get("enabled"):
            raise ValueError("the checkpoint enables real-time chunking (rtc_config); kinema's SmolVLA port acts without it")
        inputs, outputs = data.get("input_features") or {}, data.get("output_features") or {}
        images = tuple(k for k, v in inputs.items() if v.get("type") == "VISUAL")
        if "observation.state" not in inputs or "action" not in outputs:
            raise ValueError(
                "the checkpoint's features lack observation.state or action; kinema's SmolVLA port expects both "
                f"(input_features: {list(inputs)}, output_features: {list(outputs)})"
            )
        names = {f.name for f in fields(cls)}
        taken = {k: data[k] for k in names if k in data and k not in ("image_features", "state_dim", "action_dim")}
        unknown = sorted(set(kinema) - names)
        if unknown:
            raise ValueError(f"unknown SmolVLA fields {unknown}; valid: {sorted(names)}")
        return cls(
            image_features=images,
            state_dim=int(inputs["observation.state"]["shape"][-1]),
            action_dim=int(outputs["action"]["shape"][-1]),
            **{**taken, **kinema},  # kinema's (its own file, then the caller's) over the checkpoint's acting choices
        )

    def kinema_fields(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "policy_type": "smolvla", "vlm_path": self.vlm_path,
                "camera_map": dict(self.camera_map), "image_size": self.image_size, "trainable": self.trainable,
                "lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha,
                "inference_noise_scale": self.inference_noise_scale, "n_action_steps": self.n_action_steps,
                "num_steps": self.num_steps, "extra": self.extra}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"policy_type": "smolvla", **asdict(self)}


def read_kinema_fields(directory: str | os.PathLike) -> dict[str, Any]:
    """kinema's fields saved beside a SmolVLA checkpoint ({} for a checkpoint LeRobot wrote)."""
    path = Path(directory) / KINEMA_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    version = data.pop("format_version", FORMAT_VERSION)
    data.pop("policy_type", None)
    if version > FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {version}; this kinema reads up to {FORMAT_VERSION}: upgrade kinema")
    return data
