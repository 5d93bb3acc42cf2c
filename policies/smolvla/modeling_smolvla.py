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

What every LeRobot flow VLA shares (normalisation, the flow loss, acting, the folder) is policies/lerobot_flow.py.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policies.lerobot_flow import (
    WEIGHTS,
    LeRobotFlowPolicy,
    Prefix,
    local_folder,
    attend,
    attention_mask_2d,
    decoder_finish,
    decoder_qkv,
    heads,
    read_processor_stats,
    rope,
    time_embedding,
)
from policies.smolvla.configuration_smolvla import KINEMA_FILE, SmolVLAConfig

__all__ = ["SmolVLAFlowModel", "SmolVLAPolicy"]


# ----- the pieces only SmolVLA computes with ------------------------------------------------------------------------------
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
            q, k, v = decoder_qkv(layer, layer.input_layernorm(hidden))
            k = rope(k, positions)
            keys.append(k)
            values.append(v)
            hidden = decoder_finish(layer, hidden, attend(rope(q, positions), k, v, mask))
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
                q = heads(layer.self_attn.q_proj(normed), layer)
                flat_k = prefix.keys[index].flatten(2)
                k = heads(layer.self_attn.k_proj(flat_k.to(layer.self_attn.k_proj.weight.dtype)), layer)
                v = heads(layer.self_attn.v_proj(prefix.values[index].flatten(2).to(layer.self_attn.v_proj.weight.dtype)), layer)
                out = attend(rope(q, steps), k, v, see_prefix)
            else:
                q, k, v = decoder_qkv(layer, normed)
                positions = offsets + steps
                keys = torch.cat([prefix.keys[index].to(k.dtype), rope(k, positions)], dim=1)
                values = torch.cat([prefix.values[index].to(v.dtype), v], dim=1)
                mask = torch.cat([see_prefix, causal[None].expand(B, Ls, Ls)], dim=2)
                out = attend(rope(q, positions), keys, values, mask)
            hidden = decoder_finish(layer, hidden, out)
        return self.lm_expert.norm(hidden)


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
class SmolVLAPolicy(LeRobotFlowPolicy):
    """A LeRobot SmolVLA checkpoint as a kinema policy (policies/lerobot_flow.LeRobotFlowPolicy: the RL core's
    `FlowPolicy`, acting, LeRobot's folder).

    `from_pretrained(folder, vlm_path=...)` loads LeRobot's folder (or one kinema saved); `save_pretrained` writes
    LeRobot's layout back, so `SmolVLAPolicy.from_pretrained` in LeRobot loads what kinema post-trained.
    """

    # features(): the state token's final hidden state (B, hidden_dim), which attends to the images, words and state
    config_class = SmolVLAConfig
    vlm_prefix = "model.vlm_with_expert.vlm."
    vision_marker = ".vision_model."

    def __init__(self, config: SmolVLAConfig, *, vlm_config: Any = None, tokenizer: Any = None,
                 stats: Mapping[str, Mapping[str, Tensor]] | None = None) -> None:  # fmt: skip
        super().__init__(config, stats)
        if vlm_config is None or tokenizer is None:
            vlm_config, tokenizer = load_vlm(config.vlm_path)
        self.model = SmolVLAFlowModel(config, vlm_config)
        self.tokenizer = tokenizer
        config.hidden_dim = self.model.vlm_with_expert.text_width
        if config.add_image_special_tokens:
            ids = [tokenizer.convert_tokens_to_ids(getattr(tokenizer, name, default)) for name, default in
                   (("fake_image_token", "<fake_token_around_image>"), ("global_image_token", "<global-img>"))]  # fmt: skip
            self.model.image_tokens = (torch.tensor(ids), torch.tensor(ids[:1]))
        self.set_trainable(config.trainable)

    def _lora_target(self) -> nn.Module:
        return self.model.vlm_with_expert.vlm.model.text_model

    def _resize(self, images: Tensor) -> Tensor:
        return images if self.config.resize_imgs_with_padding is None else resize_with_pad(images, *self.config.resize_imgs_with_padding)

    @property
    def expert(self) -> nn.Module:
        """The action expert with the projections in and out of it: what trains under πRL's `train_expert_only`."""
        m = self.model
        return nn.ModuleList([m.vlm_with_expert.lm_expert, m.action_in_proj, m.action_out_proj, m.action_time_mlp_in, m.action_time_mlp_out])

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, vlm_path: str | None = None, map_location: str = "cpu",
                        **kinema: Any) -> SmolVLAPolicy:  # fmt: skip
        """A LeRobot SmolVLA folder (or one kinema saved). `vlm_path`: a local folder with the VLM's config.json and
        tokenizer (the checkpoint's `vlm_model_name`); without it, kinema's saved one, then `vlm_model_name` itself
        when it is a local folder, then that name in the local Hugging Face cache. Nothing is downloaded."""
        from safetensors.torch import load_file

        if vlm_path:
            kinema["vlm_path"] = vlm_path
        folder, data, config = cls.read_folder(directory, kinema)
        config.vlm_path = resolve_vlm_path(config.vlm_path, data.get("vlm_model_name", ""), source=str(folder))
        vlm_config, tokenizer = load_vlm(config.vlm_path)
        policy = cls(config, vlm_config=vlm_config, tokenizer=tokenizer, stats=read_processor_stats(folder))
        policy.take_folder(folder, load_file(str(folder / WEIGHTS), device=map_location), source=f"{folder} (VLM {config.vlm_path})")
        return policy

    def _rewrite_files(self, files: dict[str, bytes], *, vlm_model_name: str | None = None) -> dict[str, bytes]:
        """`vlm_model_name`: record another VLM name or local path for LeRobot to build from (default: the
        checkpoint's own); the tokenizer step's name follows it."""
        if vlm_model_name is None:
            return files
        config = json.loads(files["config.json"])
        config["vlm_model_name"] = vlm_model_name
        files["config.json"] = json.dumps(config, indent=4).encode()
        pre = json.loads(files["policy_preprocessor.json"])
        for step in pre["steps"]:
            if step.get("registry_name") == "tokenizer_processor":
                step["config"]["tokenizer_name"] = vlm_model_name
        files["policy_preprocessor.json"] = json.dumps(pre, indent=2).encode()
        return files


# ----- the VLM ----------------------------------------------------------------------------------------------------------------
def resolve_vlm_path(vlm_path: str, vlm_model_name: str, *, source: str) -> str:
    """The local folder holding the VLM's config.json and tokenizer."""
    return local_folder((vlm_path, vlm_model_name), vlm_model_name, missing=(
        f"{source}: no local folder for the SmolVLA's VLM (tried {{tried}}); name a local copy of the checkpoint's "
        "vlm_model_name (its config.json and tokenizer files are read; nothing is downloaded): `kinema train "
        f"--policy.vlm_path DIR`, or for `kinema eval` / `kinema deploy` a file {KINEMA_FILE} beside the checkpoint "
        'holding {"vlm_path": "DIR"}'))  # fmt: skip


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
