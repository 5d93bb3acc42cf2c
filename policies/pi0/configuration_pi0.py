"""Configuration of kinema's π0: LeRobot's pi0 checkpoint fields that decide what it computes, plus kinema's own.

A π0 checkpoint is LeRobot's folder, unchanged: `config.json` (LeRobot main's `PI0Config`, `"type": "pi0"`),
`model.safetensors`, the pre/post-processor files (normalisation stats) and the tokenizer LeRobot saves beside them.
kinema adds `kinema_pi0.json` (`KINEMA_FILE`), which LeRobot ignores. The fields every LeRobot flow VLA shares are in
policies/lerobot_flow.py.

config.json names the two towers by variant ("gemma_2b", "gemma_300m") and not their sizes; kinema reads the sizes
from the weights (`Pi0Sizes.from_weights`), so a checkpoint of any size loads. Two numbers are in neither: π0's 8
query heads (openpi's Gemma configs, fixed) and the vision tower's heads (SigLIP-so400m's 16; `vision_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from policies.lerobot_flow import LeRobotFlowConfig

KINEMA_FILE = "kinema_pi0.json"
GEMMA_HEADS = 8  # openpi's gemma_2b and gemma_300m, and LeRobot's joint attention, which reshapes to 8 heads
GEMMA_VARIANTS = {  # openpi's `gemma.get_config`: (width, depth, mlp_dim, kv heads, head_dim)
    "gemma_2b": (2048, 18, 16_384, 1, 256),
    "gemma_300m": (1024, 18, 4096, 1, 256),
}
SIGLIP_SO400M = {"hidden_size": 1152, "num_hidden_layers": 27, "intermediate_size": 4304, "patch_size": 14}
VOCAB = 257_152


@dataclass
class Pi0Config(LeRobotFlowConfig):
    """What kinema reads of a LeRobot pi0 checkpoint beyond the shared fields (`from_lerobot_config`), and where its
    tokenizer is (`tokenizer_path`, stored in `kinema_pi0.json` with `vision_heads`)."""

    lerobot_type: ClassVar[str] = "pi0"
    kinema_file: ClassVar[str] = KINEMA_FILE
    kinema_own: ClassVar[tuple[str, ...]] = ("tokenizer_path", "vision_heads")

    image_resolution: tuple[int, int] = (224, 224)  # images are resized with (centred) padding to this
    paligemma_variant: str = "gemma_2b"  # the sizes of a fresh model; a checkpoint's come from its weights
    action_expert_variant: str = "gemma_300m"
    pad_language_to: str = "max_length"  # LeRobot's pi0 processor pads every instruction to tokenizer_max_length
    tokenizer_path: str = ""  # kinema's: a local tokenizer folder; empty: the one saved beside the checkpoint
    vision_heads: int = 16  # kinema's: the vision tower's attention heads (SigLIP-so400m's), in neither config nor weights

    def __post_init__(self) -> None:
        super().__post_init__()
        self.image_resolution = tuple(self.image_resolution)
        if len(self.image_resolution) != 2 or self.image_resolution[0] != self.image_resolution[1]:
            raise ValueError(f"Pi0Config.image_resolution must be square (PaliGemma's); got {self.image_resolution}")
        if self.vision_heads < 1:
            raise ValueError(f"Pi0Config.vision_heads must be >= 1; got {self.vision_heads}")

    @classmethod
    def refuse(cls, data: dict[str, Any]) -> None:
        if data.get("use_relative_actions"):
            raise ValueError("the checkpoint sets use_relative_actions; kinema's pi0 port acts in absolute actions "
                             "(LeRobot's relative-actions processor is not ported)")  # fmt: skip
        super().refuse(data)

    @classmethod
    def lerobot_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        return {"num_steps": data["num_inference_steps"]} if "num_inference_steps" in data else {}
