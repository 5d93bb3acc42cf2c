"""What every LeRobot flow-matching VLA (SmolVLA, π0) is to kinema, whatever its architecture: a checkpoint folder
as LeRobot writes it, loaded, acted with, post-trained by the RL core and saved back in LeRobot's layout.

An architecture (policies/smolvla, policies/pi0) gives its model (`encode` the observation into a `Prefix`, and
`velocity(prefix, x_t, t)`), which weights train, and how its folder names the tokenizer and VLM. Everything else is
here, once: the config fields LeRobot's flow VLAs share, the normalisation from its processor files, the tokenizer
call, the images' layout, the flow loss, DiffusionNFT, the SDE steps, acting, LoRA merged on save, and the folder.

LeRobot's flow convention is kinema's: x_t = t·ε + (1 − t)·x_0, target ε − x_0, Euler from t = 1 (noise) to 0, so
the RL core's losses and samplers apply unchanged. Actions enter and leave in the dataset's units: normalised by the
checkpoint's own processor stats inside.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffusion_rl.flow import (
    SDEStep,
    euler_sample,
    flow_matching_loss,
    interpolate,
    nft_loss,
    sample_time,
    sde_sample,
    sde_step_with_logprob,
    time_schedule,
    velocity_target,
)
from policies.acting import ChunkedActing

FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
PROCESSOR_FILES = ("policy_preprocessor.json", "policy_postprocessor.json")
IMAGE_PREFIX = "observation.images."
NORMALIZATION_MODES = ("IDENTITY", "MEAN_STD", "MIN_MAX")
# What moves in training: "expert" (LeRobot's default, train_expert_only), "lora" (the expert, and LoRA on the VLM's
# text attention), "vlm" (its text layers too; the vision tower frozen, LeRobot's freeze_vision_encoder), "all"
# (everything: a model trained from scratch on a CPU-sized VLM)
TRAINABLE = ("expert", "lora", "vlm", "all")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # trainable "lora": the VLM's text attention


# ----- the config fields LeRobot's flow VLAs share ----------------------------------------------------------------------------
@dataclass
class LeRobotFlowConfig:
    """What kinema reads of a LeRobot flow VLA's `config.json` (`from_lerobot_config`), and kinema's own fields (the
    second block), stored beside the checkpoint in `kinema_file`, which LeRobot ignores; so what kinema saves, LeRobot
    loads. An architecture's config adds its own fields and names its LeRobot type."""

    lerobot_type: ClassVar[str] = ""  # config.json's "type"
    kinema_file: ClassVar[str] = ""
    kinema_own: ClassVar[tuple[str, ...]] = ()  # the architecture's own kinema fields, saved in kinema_file too

    image_features: tuple[str, ...] = ("observation.images.agentview", "observation.images.wrist")  # in prefix order
    state_dim: int = 8  # observation.state's size in the checkpoint's dataset
    action_dim: int = 7
    chunk_size: int = 50
    n_action_steps: int = 50
    max_state_dim: int = 32  # state and action are zero-padded to these widths
    max_action_dim: int = 32
    empty_cameras: int = 0  # image features the checkpoint expects that no camera gives: all -1, masked out
    tokenizer_max_length: int = 48
    pad_language_to: str = "longest"
    num_steps: int = 10  # Euler steps from t = 1 (noise) to 0
    min_period: float = 4e-3
    max_period: float = 4.0
    normalization_mapping: dict[str, str] = field(
        default_factory=lambda: {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    )
    # --- kinema's own ---
    # kinema camera -> the checkpoint's image feature it fills; cameras left out fill the feature of the same name
    camera_map: dict[str, str] = field(default_factory=dict)
    image_size: int = 64  # the side kinema's env renders for this policy (the policy resizes with padding itself)
    trainable: str = "expert"  # "expert" | "lora" | "vlm" | "all" (TRAINABLE above)
    lora_rank: int = 16  # trainable "lora": rank and alpha of the VLM's adapters (merged into the weights on save)
    lora_alpha: float = 16.0
    inference_noise_scale: float = 1.0
    hidden_dim: int = 0  # the size of `features()`; filled by the policy from its model
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes (tasks post-trained on), not architecture

    def __post_init__(self) -> None:
        name = type(self).__name__
        self.image_features = tuple(self.image_features)
        if not self.image_features:
            raise ValueError(f"{name}.image_features is empty: the checkpoint names no observation.images.* input")
        if self.n_action_steps < 1 or self.n_action_steps > self.chunk_size:
            raise ValueError(f"{name}.n_action_steps must be in [1, chunk_size={self.chunk_size}]; got {self.n_action_steps}")
        if self.state_dim > self.max_state_dim or self.action_dim > self.max_action_dim:
            raise ValueError(
                f"{name}: state_dim {self.state_dim} / action_dim {self.action_dim} exceed max_state_dim "
                f"{self.max_state_dim} / max_action_dim {self.max_action_dim}"
            )
        if self.pad_language_to not in ("longest", "max_length"):
            raise ValueError(f"{name}.pad_language_to must be 'longest' or 'max_length'; got {self.pad_language_to!r}")
        for kind, mode in self.normalization_mapping.items():
            if mode not in NORMALIZATION_MODES:
                raise ValueError(f"{name}.normalization_mapping[{kind!r}] is {mode!r}; kinema's port supports {list(NORMALIZATION_MODES)}")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"{name}.trainable must be one of {list(TRAINABLE)}; got {self.trainable!r}")
        if self.lora_rank < 1 or self.lora_alpha <= 0:
            raise ValueError(f"{name}.lora_rank must be >= 1 and lora_alpha > 0; got {self.lora_rank}, {self.lora_alpha}")
        if self.num_steps < 1:
            raise ValueError(f"{name}.num_steps must be >= 1; got {self.num_steps}")
        unknown = sorted(set(self.camera_map.values()) - set(self.image_features))
        if unknown:
            raise ValueError(f"{name}.camera_map names {unknown}, which the checkpoint does not take; its image features: {list(self.image_features)}")

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
    def refuse(cls, data: dict[str, Any]) -> None:
        """Raise for what the checkpoint computes that the port does not (an architecture adds its own)."""
        if (data.get("rtc_config") or {}).get("enabled"):
            raise ValueError(f"the checkpoint enables real-time chunking (rtc_config); kinema's {cls.lerobot_type} port acts without it")

    @classmethod
    def lerobot_fields(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Fields taken from config.json under other names or shapes than this config's (an architecture adds its own)."""
        return {}

    @classmethod
    def from_lerobot_config(cls, data: dict[str, Any], **kinema: Any) -> LeRobotFlowConfig:
        """From LeRobot's `config.json` (a dict); refuses what the port does not compute."""
        if data.get("type") != cls.lerobot_type:
            raise ValueError(f"not a LeRobot {cls.lerobot_type} config: its type is {data.get('type')!r}, expected {cls.lerobot_type!r}")
        cls.refuse(data)
        inputs, outputs = data.get("input_features") or {}, data.get("output_features") or {}
        images = tuple(k for k, v in inputs.items() if v.get("type") == "VISUAL")
        if "observation.state" not in inputs or "action" not in outputs:
            raise ValueError(
                f"the checkpoint's features lack observation.state or action; kinema's {cls.lerobot_type} port expects both "
                f"(input_features: {list(inputs)}, output_features: {list(outputs)})"
            )
        names = {f.name for f in fields(cls)}
        taken = {k: data[k] for k in names if k in data and k not in ("image_features", "state_dim", "action_dim")}
        unknown = sorted(set(kinema) - names)
        if unknown:
            raise ValueError(f"unknown {cls.lerobot_type} fields {unknown}; valid: {sorted(names)}")
        return cls(
            image_features=images,
            state_dim=int(inputs["observation.state"]["shape"][-1]),
            action_dim=int(outputs["action"]["shape"][-1]),
            **{**taken, **cls.lerobot_fields(data), **kinema},  # kinema's (its file, then the caller's) over the checkpoint's
        )

    def kinema_fields(self) -> dict[str, Any]:
        own = ("camera_map", "image_size", "trainable", "lora_rank", "lora_alpha", "inference_noise_scale",
               "n_action_steps", "num_steps", "extra", *self.kinema_own)  # fmt: skip
        return {"format_version": FORMAT_VERSION, "policy_type": self.lerobot_type,
                **{name: json.loads(json.dumps(getattr(self, name))) for name in own}}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {"policy_type": self.lerobot_type, **asdict(self)}

    @classmethod
    def read_kinema_fields(cls, directory: str | os.PathLike) -> dict[str, Any]:
        """kinema's fields saved beside a checkpoint ({} for a checkpoint LeRobot wrote)."""
        path = Path(directory) / cls.kinema_file
        if not path.is_file():
            return {}
        data = json.loads(path.read_text())
        version = data.pop("format_version", FORMAT_VERSION)
        data.pop("policy_type", None)
        if version > FORMAT_VERSION:
            raise ValueError(f"{path} has format_version {version}; this kinema reads up to {FORMAT_VERSION}: upgrade kinema")
        return data


# ----- the pieces LeRobot's flow VLAs compute with ---------------------------------------------------------------------------
def rope(x: Tensor, positions: Tensor, base: float = 10_000.0) -> Tensor:
    """Rotary embedding of x (B, L, H, D) at integer positions (B, L): the two halves rotated as a complex pair."""
    half = x.shape[-1] // 2
    timescale = base ** ((2.0 / x.shape[-1]) * torch.arange(half, dtype=torch.float32, device=x.device))
    radians = (positions[..., None].float() / timescale)[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = x.float().split(half, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Masked softmax attention in float32. q (B, Lq, H, D); k, v (B, Lk, KV, D) shared by H / KV heads each; mask
    (B, Lq, Lk) bool. Masked scores get the float minimum rather than -inf, so a fully masked (padding) query gives a
    finite average instead of NaN. Returns (B, Lq, H·D)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    scores = torch.where(mask[:, None], scores, torch.finfo(torch.float32).min)
    probs = scores.softmax(dim=-1).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(q.shape[0], q.shape[1], -1)


def attention_mask_2d(pad: Tensor, blocks: Tensor) -> Tensor:
    """(B, L, L): token i sees token j when both are real and j's block (cumulative `blocks`, 1 opens a block) is
    not after i's (big_vision's prefix-LM masks, as π0 and SmolVLA use them)."""
    level = torch.cumsum(blocks.long(), dim=1)
    return (level[:, None, :] <= level[:, :, None]) & pad[:, None, :] & pad[:, :, None]


def time_embedding(t: Tensor, width: int, min_period: float, max_period: float) -> Tensor:
    """Sine-cosine embedding (B, width) of the flow time, periods spaced geometrically (computed in float64)."""
    fraction = torch.linspace(0.0, 1.0, width // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t[:, None].double()
    return torch.cat([torch.sin(angle), torch.cos(angle)], dim=1).float()


def pad_to(x: Tensor, width: int) -> Tensor:
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def heads(x: Tensor, layer: nn.Module) -> Tensor:
    """(..., H·D) -> (..., H, D), D being the layer's head_dim."""
    return x.view(*x.shape[:-1], -1, layer.self_attn.head_dim)


def decoder_qkv(layer: nn.Module, normed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder layer's (Llama, Gemma) queries, keys and values (B, L, heads, D) of its normed input."""
    attn = layer.self_attn
    normed = normed.to(attn.q_proj.weight.dtype)
    return heads(attn.q_proj(normed), layer), heads(attn.k_proj(normed), layer), heads(attn.v_proj(normed), layer)


def decoder_finish(layer: nn.Module, residual: Tensor, attention: Tensor) -> Tensor:
    """Output projection and residual, then the MLP block and its residual (a Llama decoder layer's second half)."""
    hidden = layer.self_attn.o_proj(attention.to(layer.self_attn.o_proj.weight.dtype)) + residual
    return layer.mlp(layer.post_attention_layernorm(hidden).to(layer.mlp.down_proj.weight.dtype)) + hidden


@dataclass
class Prefix:
    """One pass over the observation prefix: every layer's keys (rotated) and values, which tokens are real, the
    observation feature the critics read, and what the expert's suffix takes besides the chunk (π0: the state)."""

    keys: list[Tensor]  # per VLM layer, (B, Lp, KV, D)
    values: list[Tensor]
    pad: Tensor  # (B, Lp) bool
    feature: Tensor  # (B, hidden_dim)
    state: Tensor | None = None  # (B, max_state_dim), normalised: the state where the expert reads it

    def __len__(self) -> int:
        return self.pad.shape[0]

    def _map(self, fn: Any) -> Prefix:
        return Prefix([fn(k) for k in self.keys], [fn(v) for v in self.values], fn(self.pad), fn(self.feature),
                      None if self.state is None else fn(self.state))  # fmt: skip

    def __getitem__(self, rows: Any) -> Prefix:
        """The prefix of some batch rows (a slice or an index tensor), as a (B, ...) feature would be indexed."""
        return self._map(lambda x: x[rows])

    def repeat_interleave(self, repeats: int, dim: int = 0) -> Prefix:
        """Each row repeated `repeats` times in place (several chunks sampled per observation share its pass)."""
        if dim != 0:
            raise ValueError("a prefix repeats along its batch dimension (dim 0) only")
        return self._map(lambda x: x.repeat_interleave(repeats, dim=0))


# ----- the policy ------------------------------------------------------------------------------------------------------------
class LeRobotFlowPolicy(ChunkedActing, nn.Module):
    """A LeRobot flow VLA checkpoint as a kinema policy: `FlowPolicy` for the RL core, `ChunkedActing` for runners.

    Batches are kinema's: `observation.images.<camera>` (uint8 (B, H, W, 3) or float (B, 3, H, W) in [0, 1]),
    `observation.state` (B, state_dim), `task` (B strings), `action` (B, chunk, action_dim) in the dataset's units.
    An architecture sets `self.model` (with `state_proj`, `encode` and `velocity`), `self.tokenizer`, `vlm_prefix`
    (its VLM's parameter names), `vision_marker` and `expert`, and implements `_lora_target`, `_resize` and
    `from_pretrained`."""

    scales_initial_noise = True
    vlm_prefix: ClassVar[str] = ""  # parameter names of the VLM (frozen unless trainable says otherwise)
    vision_marker: ClassVar[str] = ""  # a part of the vision tower's parameter names (trainable "vlm" freezes it)

    def __init__(self, config: LeRobotFlowConfig, stats: Mapping[str, Mapping[str, Tensor]] | None) -> None:
        super().__init__()
        self.config = config
        self.stats: dict[str, dict[str, Tensor]] = {k: {s: torch.as_tensor(v, dtype=torch.float32) for s, v in d.items()} for k, d in (stats or {}).items()}
        self.normalization_eps = 1e-8
        self._lerobot_files: dict[str, bytes] = {}  # config.json and the processor files, rewritten on save
        self._queue: deque[np.ndarray] = deque()

    # ----- what trains -------------------------------------------------------------------------------------------------
    def _lora_target(self) -> nn.Module:
        """The VLM's text model, where trainable "lora" puts its adapters."""
        raise NotImplementedError

    def set_trainable(self, trainable: str) -> None:
        """"expert": the action expert, the projections in and out of it and state_proj (LeRobot's train_expert_only);
        "lora": those, plus LoRA (`lora_rank`) on the VLM's text attention (q, k, v, o), its base weights frozen;
        "vlm": the VLM's text model and connector too (the vision tower frozen, as LeRobot's freeze_vision_encoder);
        "all": the vision tower too. The unused language-model heads never train."""
        self.config.trainable = trainable
        if trainable == "lora" and not self._lora_injected():
            from peft import LoraConfig, inject_adapter_in_model

            inject_adapter_in_model(LoraConfig(r=self.config.lora_rank, lora_alpha=self.config.lora_alpha,
                                               target_modules=list(LORA_TARGETS)), self._lora_target())  # fmt: skip
        for name, param in self.named_parameters():
            in_vlm = name.startswith(self.vlm_prefix)
            frozen = "lm_head" in name or (in_vlm and (trainable in ("expert", "lora") or (trainable == "vlm" and self.vision_marker in name)))
            param.requires_grad_(not frozen or "lora_" in name)

    def _lora_injected(self) -> bool:
        return any("lora_" in name for name, _ in self.named_parameters())

    def lerobot_state_dict(self) -> dict[str, Tensor]:
        """The weights under LeRobot's names: any LoRA merged into its base weight, W + (alpha/rank)·B·A."""
        state = self.state_dict()
        scale = self.config.lora_alpha / self.config.lora_rank
        out = {}
        for key, value in state.items():
            if ".lora_" in key:
                continue
            if ".base_layer." in key:
                module, leaf = key.split(".base_layer.")
                if leaf == "weight":
                    value = value + scale * (state[f"{module}.lora_B.default.weight"] @ state[f"{module}.lora_A.default.weight"])
                key = f"{module}.{leaf}"
            out[key] = value.detach()
        return out

    @property
    def device(self) -> torch.device:
        return self.model.state_proj.weight.device

    def set_normalization(self, stats: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the checkpoint's mean/std of `observation.state` and `action` by these (a dataset's), e.g. for a
        policy trained from scratch on a task; saved into the processor files, so LeRobot normalises alike."""
        for key, kind in (("observation.state", "STATE"), ("action", "ACTION")):
            mode = self.config.normalization_mapping.get(kind, "IDENTITY")
            if mode == "IDENTITY":
                continue
            if mode != "MEAN_STD":
                raise ValueError(f"the checkpoint normalises {key} with {mode}; only MEAN_STD stats can be taken from a dataset")
            mean, std = (torch.as_tensor(np.asarray(stats[key][s]).reshape(-1), dtype=torch.float32) for s in ("mean", "std"))
            self.stats[key] = {"mean": mean, "std": std.clamp(min=1e-3)}  # a constant dimension stays finite

    # ----- inputs ----------------------------------------------------------------------------------------------------
    def _normalize(self, x: Tensor, key: str, kind: str, inverse: bool = False) -> Tensor:
        mode = self.config.normalization_mapping.get(kind, "IDENTITY")
        if mode == "IDENTITY" or key not in self.stats:
            if mode != "IDENTITY":
                raise KeyError(f"the checkpoint normalises {key} with {mode} but its processor files hold no stats for it")
            return x
        stats = {k: v.to(x.device) for k, v in self.stats[key].items()}
        if mode == "MEAN_STD":
            return x * stats["std"] + stats["mean"] if inverse else (x - stats["mean"]) / (stats["std"] + self.normalization_eps)
        span = stats["max"] - stats["min"]
        span = torch.where(span == 0, torch.full_like(span, self.normalization_eps), span)
        return (x + 1) / 2 * span + stats["min"] if inverse else 2 * (x - stats["min"]) / span - 1

    def tokenize(self, tasks: list[str]) -> tuple[Tensor, Tensor]:
        """The instruction's tokens: each task ends with a newline, padded on the right (LeRobot's processors)."""
        texts = [t if t.endswith("\n") else f"{t}\n" for t in tasks]
        out = self.tokenizer(texts, max_length=self.config.tokenizer_max_length, truncation=True,
                             padding=self.config.pad_language_to, padding_side="right", return_tensors="pt")  # fmt: skip
        return out["input_ids"].to(self.device), out["attention_mask"].to(self.device).bool()

    def _resize(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) in [0, 1] to the size the model sees, as the architecture's LeRobot code resizes."""
        raise NotImplementedError

    def _images(self, batch: Mapping[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
        """Per image feature, (B, 3, H, W) in [-1, 1], and whether each row has it."""
        cfg, images, masks = self.config, [], []
        missing = []
        for feature, camera in zip(cfg.image_features, cfg.cameras, strict=True):
            key = f"{IMAGE_PREFIX}{camera}"
            if key not in batch:
                missing.append(feature)
                continue
            img = torch.as_tensor(batch[key], device=self.device)
            if img.dtype == torch.uint8:
                img = img.permute(0, 3, 1, 2).float() / 255.0 if img.shape[-1] == 3 else img.float() / 255.0
            images.append(self._resize(img.float()) * 2.0 - 1.0)
            masks.append(torch.ones(img.shape[0], dtype=torch.bool, device=self.device))
        if len(missing) > cfg.empty_cameras:
            raise KeyError(
                f"the {cfg.lerobot_type} checkpoint expects image features {missing} that the batch does not give (looked for "
                f"{[f'{IMAGE_PREFIX}{c}' for f, c in zip(cfg.image_features, cfg.cameras) if f in missing]}); map the "
                "task's cameras onto them with `camera_map` (kinema camera -> checkpoint feature)"
            )
        if not images:
            raise KeyError(f"the batch gives none of the checkpoint's image features {list(cfg.image_features)}")
        for _ in missing:  # LeRobot's empty cameras: all -1, masked out
            images.append(-torch.ones_like(images[0]))
            masks.append(torch.zeros_like(masks[0]))
        return images, masks

    def _state(self, batch: Mapping[str, Any]) -> Tensor:
        state = torch.as_tensor(batch["observation.state"], device=self.device, dtype=torch.float32)
        if state.shape[-1] != self.config.state_dim:
            raise ValueError(f"observation.state has {state.shape[-1]} values; the {self.config.lerobot_type} checkpoint was trained on {self.config.state_dim}")
        return pad_to(self._normalize(state, "observation.state", "STATE"), self.config.max_state_dim)

    def encode(self, batch: Mapping[str, Any]) -> tuple[Prefix, Tensor]:
        """(context, features): the prefix pass the expert reads (`context=` of flow_loss, predict_action_chunk and
        sde_log_prob, so one pass serves several), and the observation feature the critics read."""
        tokens, token_mask = self.tokenize(list(batch["task"]))
        images, image_masks = self._images(batch)
        prefix = self.model.encode(images, image_masks, tokens, token_mask, self._state(batch))
        return prefix, prefix.feature

    def _context(self, batch: Mapping[str, Any], context: Any) -> Prefix:
        if context is None:
            return self.encode(batch)[0]
        if not isinstance(context, Prefix):
            raise TypeError(f"a {self.config.lerobot_type} policy's context is its prefix pass (`policy.encode(batch)[0]`), "
                            f"not a {type(context).__name__}; its features() are for critics only")  # fmt: skip
        return context

    def model_actions(self, actions: Any) -> Tensor:
        """Dataset-unit actions (B, chunk, action_dim) -> the model's space (normalised, zero-padded)."""
        actions = torch.as_tensor(actions, device=self.device, dtype=torch.float32)
        return pad_to(self._normalize(actions, "action", "ACTION"), self.config.max_action_dim)

    def dataset_actions(self, x: Tensor) -> Tensor:
        return self._normalize(x[..., : self.config.action_dim], "action", "ACTION", inverse=True)

    # ----- the RL core's FlowPolicy --------------------------------------------------------------------------------
    def context_features(self, context: Prefix) -> Tensor:
        return context.feature

    def features(self, batch: Mapping[str, Any]) -> Tensor:
        return self.encode(batch)[1]

    def flow_loss(self, batch: Mapping[str, Any], *, weights: Tensor | None = None,
                  targets: Mapping[str, Tensor] | None = None, context: Prefix | None = None) -> Tensor:  # fmt: skip
        """Per-sample flow-matching loss (B,) through the RL core's `flow_matching_loss`: without padding, LeRobot's
        `forward(reduction="none")` (the mean over the chunk and every padded action dimension); padded steps
        (`action_is_pad`) are left out of the mean, as the VLA's are."""
        x0 = self.model_actions(batch["action"])
        B = x0.shape[0]
        prefix = self._context(batch, context)
        t = batch.get("t")
        t = sample_time(B, distribution="beta", device=self.device) if t is None else torch.as_tensor(t, device=self.device)
        noise = batch.get("noise")
        noise = torch.randn_like(x0) if noise is None else pad_to(torch.as_tensor(noise, device=self.device), x0.shape[-1])
        target = velocity_target(x0, noise)
        if targets is not None and "velocity" in targets:
            target = pad_to(targets["velocity"], x0.shape[-1])
        elif targets is not None and "x0" in targets:
            target = velocity_target(pad_to(targets["x0"], x0.shape[-1]), noise)
        pad = batch.get("action_is_pad")
        mask = None if pad is None else ~torch.as_tensor(pad, device=self.device)
        return flow_matching_loss(self.model.velocity(prefix, interpolate(x0, noise, t), t), target, weights=weights, mask=mask)

    def nft_loss(self, batch: Mapping[str, Any], *, old: LeRobotFlowPolicy, r: Tensor, beta: float = 1.0, adv_clip_max: float = 5.0,
                 context: Prefix | None = None, space: str = "x0_adaptive") -> Tensor:  # fmt: skip
        """Per-sample DiffusionNFT loss (B,) on recorded chunks, in the model's space (see VLAPolicy.nft_loss)."""
        x0 = self.model_actions(batch["action"])
        prefix = self._context(batch, context)
        t = sample_time(x0.shape[0], distribution="beta", device=self.device)
        x_t = interpolate(x0, torch.randn_like(x0), t)
        with torch.no_grad():
            v_old = old.model.velocity(old.encode(batch)[0], x_t, t)
        pad = batch.get("action_is_pad")
        mask = None if pad is None else ~torch.as_tensor(pad, device=self.device)
        return nft_loss(self.model.velocity(prefix, x_t, t), v_old, x_t=x_t, x0=x0, t=t, r=r.to(self.device), beta=beta,
                        adv_clip_max=adv_clip_max, mask=mask, space=space)  # fmt: skip

    def sde_log_prob(self, batch: Mapping[str, Any], *, noise_level: float = 0.7, context: Prefix | None = None) -> SDEStep:
        prefix = self._context(batch, context)
        v = self.model.velocity(prefix, batch["x_t"], batch["t"])
        return sde_step_with_logprob(v, batch["x_t"], batch["t"], batch["t_next"], noise_level=noise_level, prev_sample=batch["x_next"])

    # ----- acting --------------------------------------------------------------------------------------------------
    def _noise(self, B: int, noise: Tensor | None) -> Tensor:
        if noise is None:
            shape = (B, self.config.chunk_size, self.config.max_action_dim)
            return torch.randn(shape, device=self.device) * self.config.inference_noise_scale
        # kinema's runners draw noise over the action's own dimensions; the padded ones then start at 0
        return pad_to(torch.as_tensor(noise, device=self.device, dtype=torch.float32), self.config.max_action_dim)

    @torch.no_grad()
    def predict_action_chunk(self, batch: Mapping[str, Any], *, noise: Tensor | None = None, context: Prefix | None = None) -> Tensor:
        """(B, chunk_size, action_dim) in the dataset's units: K Euler steps from t = 1 (noise) to 0."""
        prefix = self._context(batch, context)
        x = euler_sample(lambda x, t: self.model.velocity(prefix, x, t), self._noise(len(prefix), noise), num_steps=self.config.num_steps)
        return self.dataset_actions(x)

    def sample_chunk_sde(self, batch: Mapping[str, Any], *, noise_level: float = 0.7) -> tuple[Tensor, dict[str, Tensor]]:
        """A chunk by Flow-SDE steps, every step recorded for PPO/GRPO (see VLAPolicy.sample_chunk_sde); the record
        is in the model's space."""
        with torch.no_grad():
            prefix = self.encode(batch)[0]
            sched = time_schedule(self.config.num_steps, device=self.device)
            noise = torch.randn(len(prefix), self.config.chunk_size, self.config.max_action_dim, device=self.device)
            x, states, nexts, log_probs = sde_sample(lambda x, t: self.model.velocity(prefix, x, t), noise, schedule=sched,
                                                     noise_level=noise_level)  # fmt: skip
        record = {"x_t": states.transpose(0, 1), "t": sched[:-1], "t_next": sched[1:], "x_next": nexts.transpose(0, 1),
                  "log_prob": log_probs.transpose(0, 1)}  # fmt: skip
        return self.dataset_actions(x), record

    # ----- persistence: LeRobot's folder ---------------------------------------------------------------------------
    config_class: ClassVar[type[LeRobotFlowConfig]] = LeRobotFlowConfig

    @classmethod
    def read_folder(cls, directory: str | os.PathLike, kinema: dict[str, Any]) -> tuple[Path, dict[str, Any], LeRobotFlowConfig]:
        """(folder, its config.json, the config): LeRobot's fields, then kinema's file beside them, then `kinema`."""
        folder = Path(directory)
        name = cls.config_class.lerobot_type
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{folder} has no config.json; expected a LeRobot {name} checkpoint folder (config.json, {WEIGHTS}, policy_*processor files)")
        if not (folder / WEIGHTS).is_file():
            raise FileNotFoundError(f"{folder} has no {WEIGHTS}")
        data = json.loads(config_file.read_text())
        return folder, data, cls.config_class.from_lerobot_config(data, **{**cls.config_class.read_kinema_fields(folder), **kinema})

    def take_folder(self, folder: Path, state: Mapping[str, Tensor], *, source: str) -> None:
        """The folder's weights (`state`), its normaliser's eps, and its LeRobot files (written back on save)."""
        self.normalization_eps = read_normalizer_eps(folder)
        self.load_weights(state, source=source)
        self.keep_lerobot_files(folder)

    def keep_lerobot_files(self, folder: Path) -> None:
        """Keep the folder's config.json and processor files (stats files too), to write back on save."""
        self._lerobot_files = {name: (folder / name).read_bytes() for name in ("config.json", *PROCESSOR_FILES) if (folder / name).is_file()}
        for extra in folder.glob("policy_*processor*.safetensors"):
            self._lerobot_files[extra.name] = extra.read_bytes()

    def load_weights(self, state: Mapping[str, Tensor], *, source: str) -> None:
        """LeRobot-named weights (`model.safetensors`), into this model: a LoRA-wrapped layer takes the checkpoint's
        weight as its base, and its adapter starts at zero (the checkpoint holds it merged)."""
        if self._lora_injected():
            plain = {k.replace(".base_layer.", "."): k for k in self.state_dict() if ".lora_" not in k}
            state = {plain.get(k, k): v for k, v in state.items()}
            lora = {k: v for k, v in self.state_dict().items() if ".lora_" in k}
            state = {**state, **lora}
        from policies.checkpoint import state_dict_mismatch

        if mismatch := state_dict_mismatch(self.state_dict(), state):
            raise ValueError(f"{source}: the weights do not fit the {self.config.lerobot_type} its config.json describes: {mismatch}")
        self.load_state_dict(state)

    def _rewrite_files(self, files: dict[str, bytes]) -> dict[str, bytes]:
        """The kept LeRobot files as this save writes them (an architecture may rename what they point to)."""
        return files

    def save_pretrained(self, directory: str | os.PathLike, *, extra_files: Mapping[str, bytes] | None = None, **rewrite: Any) -> None:
        """LeRobot's folder (config.json, model.safetensors, the processor files as loaded, with this policy's stats)
        plus kinema's fields, written atomically; `rewrite` goes to the architecture's `_rewrite_files`."""
        from safetensors.torch import save_file

        from policies.checkpoint import atomic_folder

        if "config.json" not in self._lerobot_files:
            raise ValueError(f"this {self.config.lerobot_type} was not loaded from a LeRobot folder: nothing to take its config.json and processor files from")
        files = self._rewrite_files(dict(self._lerobot_files), **rewrite)
        for name in [n for n in files if n.startswith("policy_") and n.endswith(".safetensors")]:
            files[name] = self._stats_file(files[name])
        with atomic_folder(directory) as tmp:
            state = {k: v.cpu().contiguous() for k, v in self.lerobot_state_dict().items()}
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
            for name, content in {**files, **(extra_files or {})}.items():
                target = (tmp / name).resolve()
                if not target.is_relative_to(tmp.resolve()):
                    raise ValueError(f"{name!r} would be written outside the checkpoint folder {directory}")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            (tmp / self.config.kinema_file).write_text(json.dumps(self.config.kinema_fields(), indent=2) + "\n")

    def _stats_file(self, original: bytes) -> bytes:
        """A processor's stats file with this policy's stats for the features and statistics it holds."""
        from safetensors.torch import load as load_bytes
        from safetensors.torch import save as save_bytes

        tensors = load_bytes(original)
        for key in tensors:
            feature, stat = key.rsplit(".", 1)
            if stat in self.stats.get(feature, {}):
                tensors[key] = self.stats[feature][stat].to(tensors[key].dtype).contiguous()
        return save_bytes(tensors)


# ----- the folder ----------------------------------------------------------------------------------------------------------
def local_folder(candidates: tuple[str, ...], hub_name: str, *, missing: str) -> str:
    """The first candidate that is a local folder, else `hub_name` in the local Hugging Face cache; nothing is
    downloaded. `missing`: what the error says is missing and how to name it (the places tried are added)."""
    tried = []
    for candidate in candidates:
        if candidate and Path(candidate).expanduser().is_dir():
            return str(Path(candidate).expanduser().resolve())
        if candidate:
            tried.append(candidate)
    if hub_name:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(hub_name, local_files_only=True)
        except Exception:  # not in the local cache (or not a repo id): say what to do below
            tried.append(f"{hub_name} in the local Hugging Face cache")
    raise FileNotFoundError(missing.replace("{tried}", str(tried)))


def processor_step(folder: Path, file: str, registry_name: str) -> dict[str, Any] | None:
    path = folder / file
    if not path.is_file():
        return None
    for step in json.loads(path.read_text()).get("steps", []):
        if step.get("registry_name") == registry_name:
            return step
    return None


def read_processor_stats(folder: Path) -> dict[str, dict[str, Tensor]]:
    """The normaliser's stats ({feature: {"mean", "std", "min", "max", ...}}) from LeRobot's processor files."""
    from safetensors.torch import load_file

    step = processor_step(folder, "policy_preprocessor.json", "normalizer_processor")
    if step is None or "state_file" not in step:
        raise FileNotFoundError(f"{folder}: no normalizer step with stats in policy_preprocessor.json; a LeRobot checkpoint folder has one")
    stats: dict[str, dict[str, Tensor]] = {}
    for key, value in load_file(str(folder / step["state_file"])).items():
        feature, stat = key.rsplit(".", 1)
        stats.setdefault(feature, {})[stat] = value.float()
    return stats


def read_normalizer_eps(folder: Path) -> float:
    step = processor_step(folder, "policy_preprocessor.json", "normalizer_processor") or {}
    return float(step.get("config", {}).get("eps", 1e-8))
