"""SmolVLA (Shukor et al., 2025) in kinema: LeRobot's architecture, computed as LeRobot computes it, so that a
SmolVLA a lab fine-tuned with LeRobot post-trains through kinema's RL core and goes back to LeRobot unchanged.

The model (parameter names are LeRobot's, so a checkpoint's `model.safetensors` loads and saves as it is):
- the prefix: each camera through the VLM's vision tower and connector (image tokens scaled by √width), the
  instruction's tokens (scaled the same way), and the padded state projected to one token; the VLM's text layers are
  truncated to `num_vlm_layers`. Images and words attend to each other; the state token attends to all of them and
  nothing of the prefix attends to it.
- the action expert: a narrower copy of the VLM's text model (`expert_width_multiplier`) over the noisy chunk fused
  with the flow time's sine-cosine embedding. Every `self_attn_every_n_layers`-th layer it attends to the prefix's
  keys and values and to its own (causally across the chunk); the layers between, it cross-attends to the prefix's
  keys and values through projections of its own.
- flow matching with LeRobot's convention: x_t = t·ε + (1 − t)·x_0, target ε − x_0, Euler from t = 1 to 0 (kinema's
  own convention, so the RL core's losses and samplers apply unchanged).

The prefix never attends to the actions, so one pass over it gives every layer's keys and values (`encode`), which
acting and training alike reuse for every expert pass; LeRobot's training pass computes the same in one joint pass.

Actions enter and leave in the dataset's units: normalised by the checkpoint's own processor stats inside.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
from policies.smolvla.configuration_smolvla import IMAGE_PREFIX, KINEMA_FILE, SmolVLAConfig, read_kinema_fields

WEIGHTS = "model.safetensors"
PROCESSOR_FILES = ("policy_preprocessor.json", "policy_postprocessor.json")
ROPE_BASE = 10_000.0  # SmolVLA's own RoPE, whatever the VLM's config says
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # trainable "lora": the VLM's text attention


# ----- the pieces LeRobot's SmolVLA computes with -------------------------------------------------------------------------
def rope(x: Tensor, positions: Tensor) -> Tensor:
    """Rotary embedding of x (B, L, H, D) at integer positions (B, L): the two halves rotated as a complex pair."""
    half = x.shape[-1] // 2
    timescale = ROPE_BASE ** ((2.0 / x.shape[-1]) * torch.arange(half, dtype=torch.float32, device=x.device))
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


def resize_with_pad(images: Tensor, width: int, height: int) -> Tensor:
    """Resize (B, C, H, W) keeping the aspect ratio, then pad on the left and top with 0 to (height, width)."""
    h, w = images.shape[2:]
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    images = F.interpolate(images, size=(new_h, new_w), mode="bilinear", align_corners=False)
    return F.pad(images, (max(0, width - new_w), 0, max(0, height - new_h), 0), value=0.0)


def vision_position_ids(rows: int, cols: int, per_side: int, device: torch.device) -> Tensor:
    """(rows·cols,) indices into the vision tower's position table for an unpadded image of rows × cols patches:
    each patch's fractional coordinate, shrunk by 1e-6, bucketed on the table's grid (transformers 4.x)."""
    grid = torch.arange(1 / per_side, 1.0, 1 / per_side, device=device)
    h = torch.bucketize(torch.arange(rows, dtype=torch.float32, device=device) / rows * (1 - 1e-6), grid, right=True)
    w = torch.bucketize(torch.arange(cols, dtype=torch.float32, device=device) / cols * (1 - 1e-6), grid, right=True)
    return (h[:, None] * per_side + w[None, :]).flatten()


def expert_intermediate_size(width: int, multiplier: int = 4, multiple_of: int = 256) -> int:
    hidden = multiplier * int(2 * width / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@dataclass
class Prefix:
    """One pass over the observation prefix: every layer's keys (rotated) and values, which tokens are real, and the
    state token's final hidden state (the observation feature the critics read)."""

    keys: list[Tensor]  # per VLM layer, (B, Lp, KV, D)
    values: list[Tensor]
    pad: Tensor  # (B, Lp) bool
    feature: Tensor  # (B, text width)

    def __getitem__(self, rows: Any) -> Prefix:
        """The prefix of some batch rows (a slice or an index tensor), as a (B, ...) feature would be indexed."""
        return Prefix([k[rows] for k in self.keys], [v[rows] for v in self.values], self.pad[rows], self.feature[rows])

    def repeat_interleave(self, repeats: int, dim: int = 0) -> Prefix:
        """Each row repeated `repeats` times in place (several chunks sampled per observation share its pass)."""
        if dim != 0:
            raise ValueError("a prefix repeats along its batch dimension (dim 0) only")
        rep = lambda x: x.repeat_interleave(repeats, dim=0)  # noqa: E731
        return Prefix([rep(k) for k in self.keys], [rep(v) for v in self.values], rep(self.pad), rep(self.feature))


# ----- the VLM and its action expert --------------------------------------------------------------------------------------
class VLMWithExpert(nn.Module):
    """The SmolVLM (vision tower, connector, truncated text model) and the action expert beside it."""

    def __init__(self, config: SmolVLAConfig, vlm_config: Any) -> None:
        super().__init__()
        from transformers import AutoModel, SmolVLMForConditionalGeneration

        self.vlm = SmolVLMForConditionalGeneration(vlm_config)
        text = self.vlm.model.text_model
        if config.num_vlm_layers > 0:
            text.layers = text.layers[: config.num_vlm_layers]
        self.num_vlm_layers = len(text.layers)
        text_config = vlm_config.text_config
        expert_config = copy.deepcopy(text_config)
        expert_config.hidden_size = int(text_config.hidden_size * config.expert_width_multiplier)
        expert_config.intermediate_size = expert_intermediate_size(expert_config.hidden_size)
        expert_config.num_hidden_layers = config.num_expert_layers if config.num_expert_layers > 0 else self.num_vlm_layers
        if self.num_vlm_layers % expert_config.num_hidden_layers:
            raise ValueError(f"SmolVLA: num_vlm_layers {self.num_vlm_layers} is not a multiple of num_expert_layers {expert_config.num_hidden_layers}")
        self.lm_expert = AutoModel.from_config(expert_config)
        self.cross = [self._is_cross(config, i) for i in range(self.num_vlm_layers)]
        kv_in = text_config.num_key_value_heads * text_config.head_dim
        kv_out = expert_config.num_key_value_heads * expert_config.head_dim
        for index, layer in enumerate(self.lm_expert.layers):
            if self._is_cross(config, index):  # reads the VLM's keys and values: projections from the VLM's width
                layer.self_attn.k_proj = nn.Linear(kv_in, kv_out, bias=expert_config.attention_bias)
                layer.self_attn.v_proj = nn.Linear(kv_in, kv_out, bias=expert_config.attention_bias)
        self.lm_expert.embed_tokens = None
        self.expert_width = expert_config.hidden_size
        self.text_width = text_config.hidden_size
        # VLM layer i pairs with expert layer i // stride; the VLM layers between run without the expert
        self.stride = self.num_vlm_layers // len(self.lm_expert.layers)

    @staticmethod
    def _is_cross(config: SmolVLAConfig, index: int) -> bool:
        every = config.self_attn_every_n_layers
        return "cross" in config.attention_mode and not (every > 0 and index % every == 0)

    @property
    def vlm_model(self) -> nn.Module:
        return self.vlm.model

    def expert_layer(self, index: int) -> nn.Module | None:
        return self.lm_expert.layers[index // self.stride] if index % self.stride == 0 else None

    def embed_image(self, pixels: Tensor) -> Tensor:
        """Image tokens (B, N, text width): patches with their position embeddings, the vision encoder, the connector.
        Position ids as transformers 4.x computes them, the version LeRobot runs SmolVLA with (5.x buckets the
        patches differently, which moves every image token)."""
        vision = self.vlm_model.vision_model
        embeddings = vision.embeddings
        patches = embeddings.patch_embedding(pixels.to(vision.dtype)).flatten(2).transpose(1, 2)
        rows, cols = pixels.shape[2] // embeddings.patch_size, pixels.shape[3] // embeddings.patch_size
        hidden = patches + embeddings.position_embedding(vision_position_ids(rows, cols, embeddings.num_patches_per_side, pixels.device))
        hidden = vision.post_layernorm(vision.encoder(inputs_embeds=hidden, attention_mask=None).last_hidden_state)
        return self.vlm_model.connector(hidden)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        return self.vlm_model.text_model.get_input_embeddings()(tokens)

    def encode(self, embeddings: Tensor, pad: Tensor, blocks: Tensor) -> Prefix:
        """The VLM's text layers over the prefix; every layer's keys and values kept for the expert."""
        mask = attention_mask_2d(pad, blocks)
        positions = torch.cumsum(pad.long(), dim=1) - 1
        text = self.vlm_model.text_model
        keys, values, hidden = [], [], embeddings.to(text.norm.weight.dtype)  # the VLM's stream in its own dtype
        for layer in self.vlm_model.text_model.layers:
            q, k, v = _project(layer, layer.input_layernorm(hidden))
            k = rope(k, positions)
            keys.append(k)
            values.append(v)
            hidden = _finish(layer, hidden, attend(rope(q, positions), k, v, mask))
        feature = self.vlm_model.text_model.norm(hidden)[:, -1]  # the state token: it attends to everything
        return Prefix(keys, values, pad, feature)

    def expert(self, prefix: Prefix, suffix: Tensor) -> Tensor:
        """The action expert over the suffix (B, Ls, expert width), reading the prefix's keys and values."""
        B, Ls = suffix.shape[:2]
        causal = torch.ones(Ls, Ls, dtype=torch.bool, device=suffix.device).tril()
        offsets = prefix.pad.sum(dim=1, keepdim=True)
        steps = torch.arange(Ls, device=suffix.device)[None].expand(B, Ls)
        see_prefix = prefix.pad[:, None, :].expand(B, Ls, -1)
        hidden = suffix
        for index in range(self.num_vlm_layers):
            layer = self.expert_layer(index)
            if layer is None:
                continue
            normed = layer.input_layernorm(hidden)
            if self.cross[index]:
                q = _heads(layer.self_attn.q_proj(normed), layer)
                flat_k = prefix.keys[index].flatten(2)
                k = _heads(layer.self_attn.k_proj(flat_k.to(layer.self_attn.k_proj.weight.dtype)), layer)
                v = _heads(layer.self_attn.v_proj(prefix.values[index].flatten(2).to(layer.self_attn.v_proj.weight.dtype)), layer)
                out = attend(rope(q, steps), k, v, see_prefix)
            else:
                q, k, v = _project(layer, normed)
                positions = offsets + steps
                keys = torch.cat([prefix.keys[index].to(k.dtype), rope(k, positions)], dim=1)
                values = torch.cat([prefix.values[index].to(v.dtype), v], dim=1)
                mask = torch.cat([see_prefix, causal[None].expand(B, Ls, Ls)], dim=2)
                out = attend(rope(q, positions), keys, values, mask)
            hidden = _finish(layer, hidden, out)
        return self.lm_expert.norm(hidden)


def _heads(x: Tensor, layer: nn.Module) -> Tensor:
    return x.view(*x.shape[:-1], -1, layer.self_attn.head_dim)


def _project(layer: nn.Module, normed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    attn = layer.self_attn
    normed = normed.to(attn.q_proj.weight.dtype)
    return _heads(attn.q_proj(normed), layer), _heads(attn.k_proj(normed), layer), _heads(attn.v_proj(normed), layer)


def _finish(layer: nn.Module, residual: Tensor, attention: Tensor) -> Tensor:
    """Output projection and residual, then the MLP block and its residual (a Llama decoder layer's second half)."""
    hidden = layer.self_attn.o_proj(attention.to(layer.self_attn.o_proj.weight.dtype)) + residual
    return layer.mlp(layer.post_attention_layernorm(hidden).to(layer.mlp.down_proj.weight.dtype)) + hidden


class SmolVLAFlowModel(nn.Module):
    """LeRobot's `VLAFlowMatching`: the VLM with its expert, and the projections in and out of the expert."""

    def __init__(self, config: SmolVLAConfig, vlm_config: Any) -> None:
        super().__init__()
        self.config = config
        self.vlm_with_expert = VLMWithExpert(config, vlm_config)
        width, expert = self.vlm_with_expert.text_width, self.vlm_with_expert.expert_width
        self.state_proj = nn.Linear(config.max_state_dim, width)
        self.action_in_proj = nn.Linear(config.max_action_dim, expert)
        self.action_out_proj = nn.Linear(expert, config.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * expert, expert)
        self.action_time_mlp_out = nn.Linear(expert, expert)
        self.image_tokens: tuple[Tensor, Tensor] | None = None  # (before, after) ids when add_image_special_tokens

    def encode(self, images: list[Tensor], image_masks: list[Tensor], tokens: Tensor, token_mask: Tensor, state: Tensor) -> Prefix:
        """images: per image feature, (B, 3, H, W) in [-1, 1]; state: (B, max_state_dim), normalised."""
        vwe = self.vlm_with_expert
        parts, pads, blocks = [], [], []

        def add(embedding: Tensor, pad: Tensor, block: int) -> None:
            parts.append(embedding)
            pads.append(pad)
            blocks.append(torch.full(pad.shape, block, dtype=torch.long, device=pad.device))

        B = state.shape[0]
        for image, real in zip(images, image_masks, strict=True):
            if self.image_tokens is not None:
                before = vwe.embed_tokens(self.image_tokens[0].to(state.device))[None].expand(B, -1, -1)
                add(before, torch.ones(B, before.shape[1], dtype=torch.bool, device=state.device), 0)
            embedded = vwe.embed_image(image)
            add(embedded * math.sqrt(embedded.shape[-1]), real[:, None].expand(B, embedded.shape[1]), 0)
            if self.image_tokens is not None:
                after = vwe.embed_tokens(self.image_tokens[1].to(state.device))[None].expand(B, -1, -1)
                add(after, torch.ones(B, after.shape[1], dtype=torch.bool, device=state.device), 0)
        words = vwe.embed_tokens(tokens)
        add(words * math.sqrt(words.shape[-1]), token_mask.bool(), 0)
        add(self.state_proj(state)[:, None], torch.ones(B, 1, dtype=torch.bool, device=state.device), 1)
        embeddings, pad, block = torch.cat(parts, dim=1), torch.cat(pads, dim=1), torch.cat(blocks, dim=1)
        if embeddings.shape[1] < self.config.prefix_length:
            extra = self.config.prefix_length - embeddings.shape[1]
            embeddings, pad, block = F.pad(embeddings, (0, 0, 0, extra)), F.pad(pad, (0, extra)), F.pad(block, (0, extra))
        return vwe.encode(embeddings, pad, block)

    def velocity(self, prefix: Prefix, x_t: Tensor, t: Tensor) -> Tensor:
        """v_θ(x_t, t) (B, chunk, max_action_dim) for the noisy chunk x_t in the model's (normalised, padded) space."""
        actions = self.action_in_proj(x_t)
        time = time_embedding(t.expand(x_t.shape[0]), actions.shape[-1], self.config.min_period, self.config.max_period)
        fused = torch.cat([actions, time.to(actions.dtype)[:, None].expand_as(actions)], dim=-1)
        suffix = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(fused)))
        out = self.vlm_with_expert.expert(prefix, suffix)[:, -self.config.chunk_size :]
        return self.action_out_proj(out.float())


# ----- the policy kinema trains and acts with --------------------------------------------------------------------------------
class SmolVLAPolicy(ChunkedActing, nn.Module):
    """A LeRobot SmolVLA checkpoint as a kinema policy: `FlowPolicy` for the RL core, `ChunkedActing` for runners.

    `from_pretrained(folder, vlm_path=...)` loads LeRobot's folder (or one kinema saved); `save_pretrained` writes
    LeRobot's layout back, so `SmolVLAPolicy.from_pretrained` in LeRobot loads what kinema post-trained.
    Batches are kinema's: `observation.images.<camera>` (uint8 (B, H, W, 3) or float (B, 3, H, W) in [0, 1]),
    `observation.state` (B, state_dim), `task` (B strings), `action` (B, chunk, action_dim) in the dataset's units.
    """

    scales_initial_noise = True

    def __init__(self, config: SmolVLAConfig, *, vlm_config: Any = None, tokenizer: Any = None,
                 stats: Mapping[str, Mapping[str, Tensor]] | None = None) -> None:  # fmt: skip
        super().__init__()
        if vlm_config is None or tokenizer is None:
            vlm_config, tokenizer = load_vlm(config.vlm_path)
        self.model = SmolVLAFlowModel(config, vlm_config)
        self.tokenizer = tokenizer
        config.hidden_dim = self.model.vlm_with_expert.text_width
        self.config = config
        if config.add_image_special_tokens:
            ids = [tokenizer.convert_tokens_to_ids(getattr(tokenizer, name, default)) for name, default in
                   (("fake_image_token", "<fake_token_around_image>"), ("global_image_token", "<global-img>"))]  # fmt: skip
            self.model.image_tokens = (torch.tensor(ids), torch.tensor(ids[:1]))
        self.stats: dict[str, dict[str, Tensor]] = {k: {s: torch.as_tensor(v, dtype=torch.float32) for s, v in d.items()} for k, d in (stats or {}).items()}
        self.normalization_eps = 1e-8
        self._lerobot_files: dict[str, bytes] = {}  # config.json and the processor files, rewritten on save
        self._queue: deque[np.ndarray] = deque()
        self.set_trainable(config.trainable)

    # ----- what trains -------------------------------------------------------------------------------------------------
    def set_trainable(self, trainable: str) -> None:
        """"expert": the action expert, the projections in and out of it and state_proj (LeRobot's train_expert_only);
        "lora": those, plus LoRA (`lora_rank`) on the VLM's text attention (q, k, v, o), its base weights frozen;
        "vlm": the VLM's text model and connector too (the vision tower frozen, as LeRobot's freeze_vision_encoder);
        "all": the vision tower too. The unused language-model head never trains."""
        self.config.trainable = trainable
        if trainable == "lora" and not self._lora_injected():
            from peft import LoraConfig, inject_adapter_in_model

            text = self.model.vlm_with_expert.vlm.model.text_model
            inject_adapter_in_model(LoraConfig(r=self.config.lora_rank, lora_alpha=self.config.lora_alpha,
                                               target_modules=list(LORA_TARGETS)), text)  # fmt: skip
        for name, param in self.named_parameters():
            in_vlm = name.startswith("model.vlm_with_expert.vlm.")
            frozen = in_vlm and (trainable in ("expert", "lora") or "lm_head" in name or (trainable == "vlm" and ".vision_model." in name))
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
        SmolVLA trained from scratch on a task; saved into the processor files, so LeRobot normalises alike."""
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
        """SmolVLA's instruction tokens: each task ends with a newline, padded on the right (LeRobot's processors)."""
        texts = [t if t.endswith("\n") else f"{t}\n" for t in tasks]
        out = self.tokenizer(texts, max_length=self.config.tokenizer_max_length, truncation=True,
                             padding=self.config.pad_language_to, padding_side="right", return_tensors="pt")  # fmt: skip
        return out["input_ids"].to(self.device), out["attention_mask"].to(self.device).bool()

    def _images(self, batch: Mapping[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
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
            if cfg.resize_imgs_with_padding is not None:
                img = resize_with_pad(img.float(), *cfg.resize_imgs_with_padding)
            images.append(img * 2.0 - 1.0)
            masks.append(torch.ones(img.shape[0], dtype=torch.bool, device=self.device))
        if len(missing) > cfg.empty_cameras:
            raise KeyError(
                f"the SmolVLA checkpoint expects image features {missing} that the batch does not give (looked for "
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
            raise ValueError(f"observation.state has {state.shape[-1]} values; the SmolVLA checkpoint was trained on {self.config.state_dim}")
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
            raise TypeError(f"a SmolVLA's context is its prefix pass (`policy.encode(batch)[0]`), not a {type(context).__name__}; "
                            "its features() are for critics only")  # fmt: skip
        return context

    def model_actions(self, actions: Any) -> Tensor:
        """Dataset-unit actions (B, chunk, action_dim) -> the model's space (normalised, zero-padded)."""
        actions = torch.as_tensor(actions, device=self.device, dtype=torch.float32)
        return pad_to(self._normalize(actions, "action", "ACTION"), self.config.max_action_dim)

    def dataset_actions(self, x: Tensor) -> Tensor:
        return self._normalize(x[..., : self.config.action_dim], "action", "ACTION", inverse=True)

    # ----- the RL core's FlowPolicy --------------------------------------------------------------------------------
    @property
    def expert(self) -> nn.Module:
        """The action expert with the projections in and out of it: what trains under πRL's `train_expert_only`."""
        m = self.model
        return nn.ModuleList([m.vlm_with_expert.lm_expert, m.action_in_proj, m.action_out_proj, m.action_time_mlp_in, m.action_time_mlp_out])

    def context_features(self, context: Prefix) -> Tensor:
        return context.feature

    def features(self, batch: Mapping[str, Any]) -> Tensor:
        """The state token's final hidden state (B, hidden_dim): it attends to the images, the words and the state."""
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

    def nft_loss(self, batch: Mapping[str, Any], *, old: SmolVLAPolicy, r: Tensor, beta: float = 1.0, adv_clip_max: float = 5.0,
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
        x = euler_sample(lambda x, t: self.model.velocity(prefix, x, t), self._noise(prefix.pad.shape[0], noise),
                         num_steps=self.config.num_steps)  # fmt: skip
        return self.dataset_actions(x)

    def sample_chunk_sde(self, batch: Mapping[str, Any], *, noise_level: float = 0.7) -> tuple[Tensor, dict[str, Tensor]]:
        """A chunk by Flow-SDE steps, every step recorded for PPO/GRPO (see VLAPolicy.sample_chunk_sde); the record
        is in the model's space."""
        with torch.no_grad():
            prefix = self.encode(batch)[0]
            sched = time_schedule(self.config.num_steps, device=self.device)
            noise = torch.randn(prefix.pad.shape[0], self.config.chunk_size, self.config.max_action_dim, device=self.device)
            x, states, nexts, log_probs = sde_sample(lambda x, t: self.model.velocity(prefix, x, t), noise, schedule=sched,
                                                     noise_level=noise_level)  # fmt: skip
        record = {"x_t": states.transpose(0, 1), "t": sched[:-1], "t_next": sched[1:], "x_next": nexts.transpose(0, 1),
                  "log_prob": log_probs.transpose(0, 1)}  # fmt: skip
        return self.dataset_actions(x), record

    # ----- persistence: LeRobot's folder ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, vlm_path: str | None = None, map_location: str = "cpu",
                        **kinema: Any) -> SmolVLAPolicy:  # fmt: skip
        """A LeRobot SmolVLA folder (or one kinema saved). `vlm_path`: a local folder with the VLM's config.json and
        tokenizer (the checkpoint's `vlm_model_name`); without it, kinema's saved one, then `vlm_model_name` itself
        when it is a local folder, then that name in the local Hugging Face cache. Nothing is downloaded."""
        from safetensors.torch import load_file

        folder = Path(directory)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{folder} has no config.json; expected a LeRobot SmolVLA checkpoint folder (config.json, {WEIGHTS}, policy_*processor files)")
        data = json.loads(config_file.read_text())
        fields = {**read_kinema_fields(folder), **kinema}
        if vlm_path:
            fields["vlm_path"] = vlm_path
        config = SmolVLAConfig.from_lerobot_config(data, **fields)
        config.vlm_path = resolve_vlm_path(config.vlm_path, data.get("vlm_model_name", ""), source=str(folder))
        vlm_config, tokenizer = load_vlm(config.vlm_path)
        policy = cls(config, vlm_config=vlm_config, tokenizer=tokenizer, stats=read_processor_stats(folder))
        policy.normalization_eps = read_normalizer_eps(folder)
        weights = folder / WEIGHTS
        if not weights.is_file():
            raise FileNotFoundError(f"{folder} has no {WEIGHTS}")
        policy.load_weights(load_file(str(weights), device=map_location), source=str(folder))
        policy._lerobot_files = {name: (folder / name).read_bytes() for name in ("config.json", *PROCESSOR_FILES) if (folder / name).is_file()}
        for extra in folder.glob("policy_*processor*.safetensors"):
            policy._lerobot_files[extra.name] = extra.read_bytes()
        return policy

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
            raise ValueError(f"{source}: the weights do not fit the SmolVLA its config.json and VLM ({self.config.vlm_path}) describe: {mismatch}")
        self.load_state_dict(state)

    def save_pretrained(self, directory: str | os.PathLike, *, vlm_model_name: str | None = None,
                        extra_files: Mapping[str, bytes] | None = None) -> None:  # fmt: skip
        """LeRobot's folder (config.json, model.safetensors, the processor files as loaded) plus kinema's fields,
        written atomically. `vlm_model_name`: record another VLM name or local path for LeRobot to build from
        (default: the checkpoint's own); the tokenizer step's name follows it."""
        from safetensors.torch import save_file

        from policies.checkpoint import atomic_folder

        if "config.json" not in self._lerobot_files:
            raise ValueError("this SmolVLA was not loaded from a LeRobot folder: nothing to take its config.json and processor files from")
        files = dict(self._lerobot_files)
        if vlm_model_name is not None:
            config = json.loads(files["config.json"])
            config["vlm_model_name"] = vlm_model_name
            files["config.json"] = json.dumps(config, indent=4).encode()
            pre = json.loads(files["policy_preprocessor.json"])
            for step in pre["steps"]:
                if step.get("registry_name") == "tokenizer_processor":
                    step["config"]["tokenizer_name"] = vlm_model_name
            files["policy_preprocessor.json"] = json.dumps(pre, indent=2).encode()
        for name in [n for n in files if n.startswith("policy_") and n.endswith(".safetensors")]:
            files[name] = self._stats_file(files[name])
        with atomic_folder(directory) as tmp:
            state = {k: v.cpu().contiguous() for k, v in self.lerobot_state_dict().items()}
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
            for name, content in {**files, **(extra_files or {})}.items():
                (tmp / name).write_bytes(content)
            (tmp / KINEMA_FILE).write_text(json.dumps(self.config.kinema_fields(), indent=2) + "\n")


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


# ----- the VLM, the processor files ---------------------------------------------------------------------------------------
def resolve_vlm_path(vlm_path: str, vlm_model_name: str, *, source: str) -> str:
    """The local folder holding the VLM's config.json and tokenizer."""
    tried = []
    for candidate in (vlm_path, vlm_model_name):
        if candidate and Path(candidate).expanduser().is_dir():
            return str(Path(candidate).expanduser().resolve())
        if candidate:
            tried.append(candidate)
    if vlm_model_name:
        try:
            from huggingface_hub import snapshot_download

            return snapshot_download(vlm_model_name, local_files_only=True)
        except Exception:  # not in the local cache (or not a repo id): say what to do below
            tried.append(f"{vlm_model_name} in the local Hugging Face cache")
    raise FileNotFoundError(
        f"{source}: no local folder for the SmolVLA's VLM (tried {tried}); name a local copy of the checkpoint's "
        "vlm_model_name (its config.json and tokenizer files are read; nothing is downloaded): `kinema train "
        f"--policy.vlm_path DIR`, or for `kinema eval` / `kinema deploy` a file {KINEMA_FILE} beside the checkpoint "
        'holding {"vlm_path": "DIR"}'
    )


def load_vlm(path: str) -> tuple[Any, Any]:
    """(the VLM's config, its tokenizer) from a local folder."""
    from transformers import AutoConfig, AutoTokenizer

    from policies._hf import quiet_transformers

    if not path or not Path(path).is_dir():
        raise FileNotFoundError(f"SmolVLAConfig.vlm_path {path!r} is not a local folder; expected the VLM's config.json and tokenizer files")
    with quiet_transformers():
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if config.model_type != "smolvlm":
        raise ValueError(f"{path} holds a {config.model_type!r} model; SmolVLA's VLM is a SmolVLM (model_type 'smolvlm')")
    return config, tokenizer


def _processor_step(folder: Path, file: str, registry_name: str) -> dict[str, Any] | None:
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

    step = _processor_step(folder, "policy_preprocessor.json", "normalizer_processor")
    if step is None or "state_file" not in step:
        raise FileNotFoundError(f"{folder}: no normalizer step with stats in policy_preprocessor.json; a LeRobot 0.4 SmolVLA folder has one")
    stats: dict[str, dict[str, Tensor]] = {}
    for key, value in load_file(str(folder / step["state_file"])).items():
        feature, stat = key.rsplit(".", 1)
        stats.setdefault(feature, {})[stat] = value.float()
    return stats


def read_normalizer_eps(folder: Path) -> float:
    step = _processor_step(folder, "policy_preprocessor.json", "normalizer_processor") or {}
    return float(step.get("config", {}).get("eps", 1e-8))
