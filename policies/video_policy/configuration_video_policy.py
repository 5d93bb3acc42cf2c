"""Configuration of kinema's video-diffusion policy (Cosmos Policy's recipe on the generator stack's Wan transformer)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

FORMAT_VERSION = 1
PLANNING_VALUES = ("world", "joint")
SLOT_TIMES = ("independent", "shared")
ACTING = ("actions", "joint")
ACTION_HEADS = ("slot", "expert")
ACTION_GRADIENTS = ("trunk", "stop")
# What a config.json written before a field existed describes: the model as it was then trained and acted.
LEGACY_FIELDS = {"slot_times": "shared", "acting": "joint", "action_head": "slot", "state_clip": 0.0}


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
    # --- noise levels and what acting denoises ---
    # "independent" (UWM): the given slots at flow time 0, the action slot and the world slots (future frames, future
    # state, value) each at a time of their own in training; "shared" (Cosmos Policy): one time for the whole sequence
    slot_times: str = "independent"
    # "actions": acting denoises the action slot alone, on the sequence [current..., action] (slot_times independent);
    # "joint": the whole sequence, future frames and value included, as Cosmos Policy acts
    acting: str = "actions"
    actions_only_share: float = 0.5  # acting "actions": share of policy-mode training samples on [current..., action]
    # --- what denoises the action chunk ---
    # "slot": the transformer, as one slot of the sequence (Cosmos Policy); "expert": a flow MLP on the transformer's
    # features of the current slots (Video Policy's action head); the action slot is then given only in world/value modes
    action_head: str = "expert"
    # expert head: "trunk" lets the action loss train the transformer too; "stop" stops it at the trunk's features
    # (Video Policy: the transformer learns from the video loss alone, the head from the actions). With the expert
    # head the demonstrations train the world slots with the action slot as noise: the world model given a chunk
    # (planning's values, predicted futures) learns from rollouts, in RL rounds
    action_gradients: str = "trunk"
    expert_hidden: int = 256
    expert_layers: int = 3
    expert_token_dim: int = 16  # each current-slot token's feature projected to this width before the expert reads it
    # Which transformer block's output over the current slots the expert reads: -1 the last (as before), k block k
    # (the blocks after it are not run for the head). The last block's outputs at the given slots feed no generated
    # slot, so the video loss never shapes them; an earlier block's are the keys and values the futures are read from.
    expert_layer: int = -1
    # The instruction read by the expert head itself as well (the mean of its text embedding beside the trunk's
    # features), not only through the trunk's cross-attention
    expert_text: bool = False
    # --- values, planning, learning from experience ---
    value_discount: float = 0.99  # value target: outcome · γ^(steps from the chunk's end to the episode's end)
    planning_candidates: int = 1  # best-of-N chunks ranked by predicted value; 1: no planning
    planning_value: str = "world"  # "world": re-predict future + value given each chunk (Cosmos); "joint": the policy pass's value
    planning_value_samples: int = 1  # world-model passes per candidate (majority vote on success, then the mean)
    experience_fraction: float = 0.5  # RL updates: replay steps (uniform) per demo/credit batch step, world/value modes
    # z-scored states bounded at this many stds before they become a slot (0: unbounded, as checkpoints written before
    # it act). The state is a slot the flow loss predicts (future.state), and a dimension nearly constant in the
    # demonstrations (the gripper's tilt: std 2e-3) sits tens of stds out in a rollout: a squared error in the hundreds
    # that swamps the actions' loss
    state_clip: float = 5.0
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
        if not 0.0 < self.value_discount <= 1.0:
            raise ValueError(f"VideoPolicyConfig.value_discount must be in (0, 1]; got {self.value_discount}")
        if not 0.0 <= self.experience_fraction <= 1.0:
            raise ValueError(f"VideoPolicyConfig.experience_fraction must be in [0, 1]; got {self.experience_fraction}")
        choices = {"planning_value": PLANNING_VALUES, "slot_times": SLOT_TIMES, "acting": ACTING, "action_head": ACTION_HEADS,
                   "action_gradients": ACTION_GRADIENTS}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"VideoPolicyConfig.{name} must be one of {list(allowed)}; got {getattr(self, name)!r}")
        if self.acting == "actions" and self.slot_times != "independent":
            raise ValueError("VideoPolicyConfig.acting 'actions' denoises the action slot with the world slots left out, "
                             "which needs slot_times 'independent' (with 'shared' use acting 'joint')")  # fmt: skip
        if self.action_gradients == "stop" and self.action_head != "expert":
            raise ValueError("VideoPolicyConfig.action_gradients 'stop' stops the action loss at the trunk's features, "
                             "which only the expert head reads: set action_head 'expert'")  # fmt: skip
        if self.action_head == "expert":
            if self.slot_times != "independent" or self.acting != "actions":
                raise ValueError("VideoPolicyConfig.action_head 'expert' reads the clean current slots and denoises the "
                                 "actions alone: it needs slot_times 'independent' and acting 'actions'")  # fmt: skip
            if self.planning_value == "joint":
                raise ValueError("VideoPolicyConfig.planning_value 'joint' reads the value the sequence denoises beside "
                                 "the action slot; with action_head 'expert' values come from the world model ('world')")  # fmt: skip
        if (self.expert_layer != -1 or self.expert_text) and self.action_head != "expert":
            raise ValueError("VideoPolicyConfig.expert_layer and expert_text shape what the expert head reads: set action_head 'expert'")
        if self.state_clip < 0:
            raise ValueError(f"VideoPolicyConfig.state_clip must be >= 0 (0: unbounded); got {self.state_clip}")
        if not 0.0 <= self.actions_only_share <= 1.0:
            raise ValueError(f"VideoPolicyConfig.actions_only_share must be in [0, 1]; got {self.actions_only_share}")
        if self.acting == "actions" and self.action_head == "slot" and self.actions_only_share == 0.0:
            raise ValueError("VideoPolicyConfig.acting 'actions' with the slot head acts on [current..., action], which "
                             "actions_only_share 0 never trains: set it above 0 (default 0.5)")  # fmt: skip
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
    def current_slots(self) -> int:
        """The given current slots (each camera's frame and the state), which lead the sequence."""
        return len(self.cameras) + 1

    @property
    def action_sequence(self) -> int:
        """Length of the sequence that acting "actions" denoises: the current slots and the action slot."""
        return self.current_slots + 1

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

        fields = config_fields(cls, data, policy_type="video", name="video policy", format_version=FORMAT_VERSION)
        return cls(**{**LEGACY_FIELDS, **fields})

    ARCHITECTURE_FIELDS = (
        "generator_path", "video_size", "pixel_scale_spatial", "num_layers", "num_attention_heads", "attention_head_dim",
        "ffn_dim", "text_dim", "max_text_tokens", "lora_rank", "lora_alpha", "cameras", "image_size", "state_dim",
        "action_dim", "chunk_size", "slot_times", "action_head", "expert_hidden", "expert_layers", "expert_token_dim",
        "expert_layer", "expert_text", "state_clip",
    )  # fmt: skip
