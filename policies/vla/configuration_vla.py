"""Configuration of kinema's VLA: a vision-language-action policy with a flow-matching action expert."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
VISION_ENCODER_NAMES = ("patchify", "spatial_softmax", "patchify_grounded")


@dataclass
class VLAConfig:
    """Architecture of the VLA. The defaults are the CPU-sized `tiny` model (about 3M parameters).

    Every field is stored in the checkpoint's `config.json`; loading a checkpoint into a different architecture
    fails with the mismatching field named.
    """

    backbone: str = "tiny"  # "tiny" (trained from scratch) or "smolvlm" (a local SmolVLM/Idefics3 checkpoint, LoRA)
    cameras: tuple[str, ...] = ("agentview", "wrist")  # observation.images.<camera> inputs, one encoder each
    image_size: int = 64  # images are resized to image_size x image_size before encoding
    state_dim: int = 8  # observation.state size (EE position, quaternion, gripper)
    action_dim: int = 7
    chunk_size: int = 8  # H: actions denoised per chunk
    n_action_steps: int = 4  # actions executed from each chunk before replanning
    num_flow_steps: int = 10  # K: Euler steps integrating the velocity field at inference
    # The initial noise's scale when predict_action_chunk draws it (deploy, select_action): 1 samples the policy's
    # spread, 0 gives its deterministic, mode-seeking chunk. `kinema train` writes its eval.noise_scale here, so that
    # a checkpoint acts as it was evaluated; rollouts and evaluations pass noise of their own.
    inference_noise_scale: float = 1.0
    time_distribution: str = "beta"  # flow time sampling in training: "beta" (pi0), "uniform", "logit_normal"
    # How each camera is encoded: "patchify" (a stride-4 4x4 conv first, features flattened at image_size / 8),
    # "spatial_softmax" (overlapping 3x3 convs down to image_size / 4, then `keypoints` expected image coordinates), or
    # "patchify_grounded" (patchify's features and, beside them, `keypoints` expected coordinates of cells scored against
    # the instruction's words: where the named object and the plate are; modeling_vla.InstructionLocator).
    vision_encoder: str = "patchify"
    vision_channels: tuple[int, ...] = (32, 64, 64)  # conv widths
    keypoints: int = 32  # spatial_softmax, patchify_grounded: attention maps, each giving one (x, y)
    vision_dim: int = 256  # per-camera feature size
    text_dim: int = 64  # width of the word encoder
    text_layers: int = 1  # transformer layers over words
    max_words: int = 16
    ngram_buckets: int = 4096  # hashed character-trigram vocabulary: unseen words still share subwords
    state_hidden: int = 64
    hidden_dim: int = 256  # fused observation feature (the `features()` the critics read)
    expert_hidden: int = 512  # action expert width
    expert_layers: int = 3
    aux_dim: int = 0  # size of the privileged auxiliary target (object positions), 0 disables the aux head
    aux_weight: float = 1.0  # weight of the auxiliary loss against the flow loss in SFT
    # What the aux head reads: "fused" (the fused feature, proprio state included: the head can read the target off
    # the arm's heading), "perception" (camera + instruction features only), or "keypoints" (patchify_grounded only:
    # its keypoint coordinates alone). Pointing is taught by `where_weight`'s cell loss, not through this head.
    aux_input: str = "fused"
    # patchify_grounded: weight of its locators' cell classification on the pixel labels (`where_target`) beside the
    # aux loss in SFT; keypoint 0 learns the named target, 1 the goal, the others stay free. 0: no pixel supervision.
    where_weight: float = 1.0
    # patchify_grounded: its locators score cells of a map at image_size / locator_stride: 4 (4-pixel cells at 64 px)
    # or 2 (2-pixel cells, four times the cells; a pixel is about a centimetre on the table: benchmarks/RESULTS.md).
    locator_stride: int = 4
    # How the instruction reaches the rest of the policy: "pooled" (its pooled word feature modulates every camera's
    # convs (FiLM) and joins the fused feature) or "locator" (patchify_grounded only: through the locators' keypoints
    # alone, FiLM and the fused feature see a constant; held-out paraphrases then move nothing but where it points).
    instruction_input: str = "pooled"
    # patchify_grounded: cameras whose locator's target and goal points (keypoints 0 and 1) reach the policy through the
    # state, as the pixel oracle's true labels do (benchmarks/privileged_oracle.py): normalised by the pixel labels'
    # statistics, in the unshifted image's frame (training's random shift taken back out), joined to the proprio
    # state before its MLP, and detached, so that only the cell loss moves the locator. Those cameras' coordinates
    # then leave the fused feature. Empty: every camera's coordinates sit among its features (the flow loss reaches
    # the locator through them).
    state_points: tuple[str, ...] = ()
    # Training only: what those points are while the policy trains. "located" (the locator's own) or "labels" (the
    # simulator's pixel labels where a sample has them, teacher forcing: the head learns to read exact points, as the
    # pixel oracle's does; acting always reads the locator's). benchmarks/RESULTS.md has what each gives.
    state_points_training: str = "located"
    state_dropout: float = 0.0  # training only: per-sample probability of zeroing the normalised EE pose (state[:7])
    augment_shift: int = 4  # random-shift augmentation (pixels) in training; 0 disables
    # Training only, tiny backbone (ours): instructions start at a random word position, and this share of them get
    # one or two random letter strings inserted, so that the encoder reads word order and passes over unknown words
    # (held-out paraphrases: benchmarks/instruction_probe.py). Off by default: no success gain measured yet.
    text_position_jitter: bool = False
    text_filler_words: float = 0.0
    # Tiny backbone: how words know their order. "absolute": a learned embedding per word slot (a paraphrase that moves
    # the object's words moves what the locators read); "relative": no slot embedding, each word mixes its left and
    # right neighbours through a width-3 convolution, so "red cube" binds wherever it sits in the sentence. Off by
    # default: it reads push's paraphrases but loses held-out colour-shape pairs (benchmarks/RESULTS.md).
    text_positions: str = "absolute"
    # Recap's improvement indicator (rl.method recap): the action expert also reads whether a step was an improvement
    # (diffusion_rl.recap: 0 unconditioned, 1 an improvement, 2 not one), as a learned embedding added to its context.
    advantage_input: bool = False
    advantage_dropout: float = 0.0  # training only: share of samples whose indicator is dropped (unconditioned)
    # The embedding enters the context times this scale: under Adam it then learns that many times faster than the
    # weights around it (an embedding added after SFT at the RL learning rate barely moves: ours)
    advantage_scale: float = 1.0
    # Acting: the indicator asked for (1: improvements) and classifier-free guidance β on it (1: plain conditioning;
    # > 1: v = v_uncond + β (v_cond − v_uncond), one more expert pass per flow step).
    advantage_condition: int = 1
    advantage_guidance: float = 1.0
    lora_rank: int = 8  # LoRA rank when the backbone is a pretrained VLM (0: backbone fully frozen, heads only)
    # --- backbone "smolvlm" only (ignored by "tiny"; see policies/vla/smolvlm.py) ---
    backbone_path: str = ""  # local SmolVLM/Idefics3 checkpoint folder; checkpoints reference it, never copy it
    backbone_layers: int = 0  # text layers run (the expert reads layer L's hidden states; SmolVLA uses half); 0: all
    backbone_image_size: int = 0  # side the VLM's vision tower sees; 0: its native size (512 for SmolVLM)
    backbone_dtype: str = "float32"  # "float32", "bfloat16" or "float16" for the frozen backbone weights
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # text-model linear layers given LoRA
    freeze_vision: bool = True  # False: LoRA on the vision tower's attention and the connector too
    max_text_tokens: int = 32  # instruction tokens kept (the checkpoint's own tokenizer)
    pool_queries: int = 4  # learned queries pooling the prefix's hidden states into the context
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (task names seen, dataset), not architecture

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        self.vision_channels = tuple(self.vision_channels)
        self.state_points = tuple(self.state_points)
        if self.n_action_steps < 1 or self.n_action_steps > self.chunk_size:
            raise ValueError(
                f"VLAConfig.n_action_steps must be in [1, chunk_size={self.chunk_size}]; got {self.n_action_steps}"
            )
        if self.image_size % 8 != 0 or self.image_size < 32:
            raise ValueError(f"VLAConfig.image_size must be a multiple of 8 and >= 32; got {self.image_size}")
        if self.vision_encoder not in VISION_ENCODER_NAMES:
            raise ValueError(f"VLAConfig.vision_encoder must be one of {', '.join(map(repr, VISION_ENCODER_NAMES))}; got {self.vision_encoder!r}")
        if not self.where_weight >= 0:
            raise ValueError(f"VLAConfig.where_weight must be >= 0; got {self.where_weight}")
        if self.locator_stride not in (2, 4):
            raise ValueError(f"VLAConfig.locator_stride must be 2 or 4 (the locator's map at image_size / 2 or / 4); got {self.locator_stride}")
        if self.keypoints < 1:
            raise ValueError(f"VLAConfig.keypoints must be >= 1; got {self.keypoints}")
        if self.time_distribution not in ("beta", "uniform", "logit_normal"):
            raise ValueError(
                f"VLAConfig.time_distribution must be 'beta', 'uniform' or 'logit_normal'; got {self.time_distribution!r}"
            )
        if self.aux_input not in ("perception", "fused", "keypoints"):
            raise ValueError(f"VLAConfig.aux_input must be 'perception', 'fused' or 'keypoints'; got {self.aux_input!r}")
        if self.aux_input == "keypoints" and (self.vision_encoder != "patchify_grounded" or self.backbone != "tiny"):
            raise ValueError("VLAConfig.aux_input 'keypoints' reads the keypoints of vision_encoder 'patchify_grounded' "
                             f"(tiny backbone); got vision_encoder {self.vision_encoder!r}, backbone {self.backbone!r}")
        if self.instruction_input not in ("pooled", "locator"):
            raise ValueError(f"VLAConfig.instruction_input must be 'pooled' or 'locator'; got {self.instruction_input!r}")
        if self.instruction_input == "locator" and (self.vision_encoder != "patchify_grounded" or self.backbone != "tiny"):
            raise ValueError("VLAConfig.instruction_input 'locator' passes the instruction through the locators of vision_encoder "
                             f"'patchify_grounded' (tiny backbone); got vision_encoder {self.vision_encoder!r}, backbone {self.backbone!r}")
        if self.state_points and (self.vision_encoder != "patchify_grounded" or self.backbone != "tiny" or self.keypoints < 2):
            raise ValueError("VLAConfig.state_points passes the target and goal points (keypoints 0 and 1) of vision_encoder "
                             "'patchify_grounded' (tiny backbone, keypoints >= 2) to the state; got vision_encoder "
                             f"{self.vision_encoder!r}, backbone {self.backbone!r}, keypoints {self.keypoints}")
        if self.state_points_training not in ("located", "labels"):
            raise ValueError(f"VLAConfig.state_points_training must be 'located' or 'labels'; got {self.state_points_training!r}")
        if unknown := [cam for cam in self.state_points if cam not in self.cameras]:
            raise ValueError(f"VLAConfig.state_points names cameras {unknown} the policy does not read; its cameras: {list(self.cameras)}")
        if not 0.0 <= self.state_dropout < 1.0:
            raise ValueError(f"VLAConfig.state_dropout must be in [0, 1); got {self.state_dropout}")
        if self.text_positions not in ("absolute", "relative"):
            raise ValueError(f"VLAConfig.text_positions must be 'absolute' or 'relative'; got {self.text_positions!r}")
        if self.text_position_jitter and self.text_positions != "absolute":
            raise ValueError("VLAConfig.text_position_jitter moves absolute word slots; text_positions 'relative' has none")
        if not 0.0 <= self.text_filler_words <= 1.0:
            raise ValueError(f"VLAConfig.text_filler_words is a share of instructions, in [0, 1]; got {self.text_filler_words}")
        if not self.cameras:
            raise ValueError("VLAConfig.cameras must name at least one camera")
        if self.inference_noise_scale < 0:
            raise ValueError(f"VLAConfig.inference_noise_scale must be >= 0 (1: sampled, 0: zero noise); got {self.inference_noise_scale}")
        if not 0.0 <= self.advantage_dropout < 1.0:
            raise ValueError(f"VLAConfig.advantage_dropout must be in [0, 1); got {self.advantage_dropout}")
        if self.advantage_condition not in (0, 1, 2):
            raise ValueError(f"VLAConfig.advantage_condition must be 0 (unconditioned), 1 (improvement) or 2 (not one); got {self.advantage_condition}")
        if self.advantage_scale <= 0:
            raise ValueError(f"VLAConfig.advantage_scale must be > 0; got {self.advantage_scale}")
        if self.advantage_guidance < 1.0:
            raise ValueError(f"VLAConfig.advantage_guidance must be >= 1 (1: plain conditioning); got {self.advantage_guidance}")
        if self.num_flow_steps < 1:
            raise ValueError(f"VLAConfig.num_flow_steps must be >= 1; got {self.num_flow_steps}")
        self.lora_targets = tuple(self.lora_targets)
        if self.backbone not in ("tiny", "smolvlm"):
            raise ValueError(f"VLAConfig.backbone must be 'tiny' or 'smolvlm'; got {self.backbone!r}")
        if self.backbone == "smolvlm":
            if not self.backbone_path:
                raise ValueError("VLAConfig.backbone_path must name a local SmolVLM/Idefics3 checkpoint folder when backbone='smolvlm'")
            # Absolute, so that a checkpoint's config.json still finds the backbone from another working directory.
            self.backbone_path = os.path.abspath(os.path.expanduser(self.backbone_path))
            for name in ("lora_rank", "backbone_layers", "backbone_image_size"):
                if getattr(self, name) < 0:
                    raise ValueError(f"VLAConfig.{name} must be >= 0; got {getattr(self, name)}")
            for name in ("pool_queries", "max_text_tokens"):
                if getattr(self, name) < 1:
                    raise ValueError(f"VLAConfig.{name} must be >= 1; got {getattr(self, name)}")
            if self.backbone_dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"VLAConfig.backbone_dtype must be 'float32', 'bfloat16' or 'float16'; got {self.backbone_dtype!r}")
            if self.lora_alpha <= 0:
                raise ValueError(f"VLAConfig.lora_alpha must be > 0; got {self.lora_alpha}")

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "policy_type": "vla", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VLAConfig:
        from policies.checkpoint import config_fields

        data = dict(data)
        data.setdefault("aux_input", "fused")  # checkpoints written before `aux_input` fed the aux head the fused feature
        data.setdefault("vision_encoder", "patchify")  # and before `vision_encoder`, every camera was patchified
        return cls(**config_fields(cls, data, policy_type="vla", name="VLA", format_version=FORMAT_VERSION))

    ARCHITECTURE_FIELDS = (
        "backbone", "cameras", "image_size", "state_dim", "action_dim", "chunk_size", "vision_encoder", "vision_channels", "keypoints", "vision_dim",
        "locator_stride", "text_dim", "text_layers", "max_words", "ngram_buckets", "state_hidden", "hidden_dim", "expert_hidden",
        "expert_layers", "aux_dim", "aux_input", "state_points", "lora_rank", "backbone_layers", "backbone_image_size", "lora_alpha", "lora_targets",
        "freeze_vision", "max_text_tokens", "pool_queries", "advantage_input",
    )  # fmt: skip
