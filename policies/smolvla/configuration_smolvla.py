"""Configuration of kinema's SmolVLA: LeRobot's SmolVLA checkpoint fields that decide what it computes, plus kinema's
own (where the VLM lives locally, how a task's cameras map onto the checkpoint's image features, what trains).

A SmolVLA checkpoint is LeRobot's folder, unchanged: `config.json` (LeRobot's `SmolVLAConfig`, `"type": "smolvla"`),
`model.safetensors`, the pre/post-processor files (normalisation stats, tokenizer name). kinema adds one file beside
them, `kinema_smolvla.json` (`KINEMA_FILE`), which LeRobot ignores; so what kinema saves, LeRobot loads. The fields
every LeRobot flow VLA shares are in policies/lerobot_flow.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from policies.lerobot_flow import LeRobotFlowConfig

KINEMA_FILE = "kinema_smolvla.json"


@dataclass
class SmolVLAConfig(LeRobotFlowConfig):
    """What kinema reads of a LeRobot SmolVLA checkpoint (`from_lerobot_config`) beyond the shared fields, and where
    its VLM is (`vlm_path`, stored in `kinema_smolvla.json`)."""

    lerobot_type: ClassVar[str] = "smolvla"
    kinema_file: ClassVar[str] = KINEMA_FILE
    kinema_own: ClassVar[tuple[str, ...]] = ("vlm_path",)

    resize_imgs_with_padding: tuple[int, int] | None = (512, 512)
    num_vlm_layers: int = 16
    num_expert_layers: int = -1  # <= 0: as many as the VLM's layers
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    attention_mode: str = "cross_attn"
    add_image_special_tokens: bool = False
    prefix_length: int = -1
    vlm_model_name: str = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"
    vlm_path: str = ""  # kinema's: local folder with the VLM's config.json and tokenizer (its weights come from the checkpoint)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.resize_imgs_with_padding is not None:
            self.resize_imgs_with_padding = tuple(self.resize_imgs_with_padding)
        if self.attention_mode not in ("cross_attn", "self_attn"):
            raise ValueError(f"SmolVLAConfig.attention_mode must be 'cross_attn' or 'self_attn'; got {self.attention_mode!r}")

    @classmethod
    def refuse(cls, data: dict[str, Any]) -> None:
        for flag in ("adapt_to_pi_aloha", "use_delta_joint_actions_aloha"):
            if data.get(flag):
                raise ValueError(f"the checkpoint sets {flag}; kinema's SmolVLA port does not implement it (LeRobot's ALOHA runtime conversion)")
        super().refuse(data)

