"""π0 (Black et al., 2024) in kinema: LeRobot's pi0 (openpi's PyTorch port), computed as LeRobot computes it, so
that a π0 a lab fine-tuned with LeRobot post-trains through kinema's RL core and goes back to LeRobot unchanged.

The model (parameter names are LeRobot's, so a checkpoint's `model.safetensors` loads and saves as it is):
- the prefix: each camera through PaliGemma's SigLIP tower and its linear projector, then the instruction's tokens
  (Gemma's embedding, scaled by √width); PaliGemma's Gemma runs over them with full attention between real tokens.
- the suffix, through the action expert (a narrower Gemma with the same depth, heads and head width): the padded
  state projected to one token, then the noisy chunk fused with the flow time's sine-cosine embedding. At every
  layer the expert's queries attend to the prefix's keys and values of the same layer and to the suffix's own: the
  state token to itself, each action token to the state and the whole chunk (π0's blockwise mask).
- flow matching as every LeRobot flow VLA (policies/lerobot_flow.py): x_t = t·ε + (1 − t)·x_0, target ε − x_0,
  Euler from t = 1 to 0; training times from Beta(1.5, 1)·0.999 + 0.001.

The prefix never attends to the suffix, so one pass over it gives every layer's keys and values (`encode`); LeRobot's
training pass computes the same in one joint pass. The observation feature the critics read: the prefix's final
hidden states averaged over its real tokens, beside the normalised state (which π0 reads in the suffix).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
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
    processor_step,
    read_processor_stats,
    rope,
    time_embedding,
)
from policies.pi0.configuration_pi0 import GEMMA_HEADS, GEMMA_VARIANTS, SIGLIP_SO400M, VOCAB, Pi0Config

VLM = "model.paligemma_with_expert.paligemma.model."
EXPERT = "model.paligemma_with_expert.gemma_expert.model."


# ----- sizes ---------------------------------------------------------------------------------------------------------------
@dataclass
class Pi0Sizes:
    """The two Gemma towers' and the vision tower's sizes: (width, depth, mlp, kv heads, head_dim) each."""

    vlm: tuple[int, int, int, int, int]
    expert: tuple[int, int, int, int, int]
    vocab: int
    vision: dict[str, int]  # hidden_size, num_hidden_layers, intermediate_size, patch_size

    @classmethod
    def from_variants(cls, config: Pi0Config) -> Pi0Sizes:
        """A fresh π0's sizes, from the variant names its config.json records."""
        for name in (config.paligemma_variant, config.action_expert_variant):
            if name not in GEMMA_VARIANTS:
                raise ValueError(f"pi0 variant {name!r} is not one of openpi's {list(GEMMA_VARIANTS)}; a checkpoint's sizes come from its weights")
        return cls(GEMMA_VARIANTS[config.paligemma_variant], GEMMA_VARIANTS[config.action_expert_variant], VOCAB, dict(SIGLIP_SO400M))

    @classmethod
    def from_weights(cls, state: Mapping[str, Tensor], *, source: str) -> Pi0Sizes:
        """The sizes a LeRobot pi0 `model.safetensors` holds (its config.json names variants only)."""

        def shape(key: str) -> torch.Size:
            if key not in state:
                raise ValueError(f"{source}: {key} is not among the weights; expected a LeRobot pi0 model.safetensors")
            return state[key].shape

        def gemma(prefix: str) -> tuple[int, int, int, int, int]:
            depth = len({k.split(".")[0] for k in (key[len(prefix) + 7 :] for key in state if key.startswith(prefix + "layers."))})
            layer = f"{prefix}layers.0."
            head_dim = shape(layer + "self_attn.q_proj.weight")[0] // GEMMA_HEADS
            width = shape(layer + "input_layernorm.weight")[0]
            return width, depth, shape(layer + "mlp.gate_proj.weight")[0], shape(layer + "self_attn.k_proj.weight")[0] // head_dim, head_dim

        vision = f"{VLM}vision_tower.vision_model."
        patch = shape(vision + "embeddings.patch_embedding.weight")
        layers = len({k[len(vision) + 15 :].split(".")[0] for k in state if k.startswith(vision + "encoder.layers.")})
        return cls(gemma(f"{VLM}language_model."), gemma(EXPERT), shape(f"{VLM}language_model.embed_tokens.weight")[0],
                   {"hidden_size": patch[0], "num_hidden_layers": layers, "patch_size": patch[-1],
                    "intermediate_size": shape(vision + "encoder.layers.0.mlp.fc1.weight")[0]})  # fmt: skip


def gemma_config(sizes: tuple[int, int, int, int, int], vocab: int) -> Any:
    from transformers import GemmaConfig

    width, depth, mlp, kv_heads, head_dim = sizes
    return GemmaConfig(hidden_size=width, num_hidden_layers=depth, intermediate_size=mlp, num_attention_heads=GEMMA_HEADS,
                       num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, hidden_activation="gelu_pytorch_tanh")  # fmt: skip


# ----- the model -----------------------------------------------------------------------------------------------------------
class VisionTower(nn.Module):
    """SigLIP under the names LeRobot's checkpoints hold (`vision_tower.vision_model.*`; transformers 5.25 dropped
    the `vision_model` level)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import SiglipVisionModel

        self.vision_model = SiglipVisionModel(config)


class PaliGemmaWithExpert(nn.Module):
    """PaliGemma (SigLIP tower, projector, Gemma) and the Gemma action expert beside it (transformers' classes hold
    the weights under LeRobot's names; the passes are written out below, as LeRobot's are)."""

    def __init__(self, sizes: Pi0Sizes, *, image_size: int, vision_heads: int) -> None:
        super().__init__()
        from transformers import GemmaForCausalLM, PaliGemmaConfig, PaliGemmaForConditionalGeneration, SiglipVisionConfig

        from policies._hf import quiet_transformers

        vision = SiglipVisionConfig(**sizes.vision, num_attention_heads=vision_heads, image_size=image_size,
                                    hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False)  # fmt: skip
        config = PaliGemmaConfig(vision_config=vision.to_dict(), text_config=gemma_config(sizes.vlm, sizes.vocab).to_dict(),
                                 projection_dim=sizes.vlm[0], tie_word_embeddings=False)  # fmt: skip
        with quiet_transformers():
            self.paligemma = PaliGemmaForConditionalGeneration(config)
            self.paligemma.model.vision_tower = VisionTower(self.paligemma.config.vision_config)
            self.gemma_expert = GemmaForCausalLM(gemma_config(sizes.expert, sizes.vocab))
        self.gemma_expert.model.embed_tokens = None  # the expert reads embeddings only
        self.vlm_width, self.expert_width = sizes.vlm[0], sizes.expert[0]

    @property
    def language_model(self) -> nn.Module:
        return self.paligemma.model.language_model

    def embed_image(self, pixels: Tensor) -> Tensor:
        """Image tokens (B, patches, VLM width): SigLIP's last hidden state through the linear projector (unscaled, as
        transformers >= 5.4 and LeRobot main compute it)."""
        model = self.paligemma.model
        return model.multi_modal_projector(model.vision_tower.vision_model(pixel_values=pixels).last_hidden_state)

    def encode(self, embeddings: Tensor, pad: Tensor, state: Tensor) -> Prefix:
        """Gemma over the prefix (full attention between real tokens); every layer's keys and values kept."""
        mask = attention_mask_2d(pad, torch.zeros_like(pad))
        positions = torch.cumsum(pad.long(), dim=1) - 1
        keys, values, hidden = [], [], embeddings
        for layer in self.language_model.layers:
            q, k, v = decoder_qkv(layer, layer.input_layernorm(hidden))
            k = rope(k, positions)
            keys.append(k)
            values.append(v)
            hidden = decoder_finish(layer, hidden, attend(rope(q, positions), k, v, mask))
        real = pad[..., None].float()  # averaged in float32 whatever the VLM's dtype
        pooled = (self.language_model.norm(hidden).float() * real).sum(1) / real.sum(1).clamp(min=1)
        return Prefix(keys, values, pad, torch.cat([pooled, state], dim=-1), state=state)

    def expert(self, prefix: Prefix, suffix: Tensor, blocks: Tensor) -> Tensor:
        """The action expert over the suffix (B, Ls, expert width), each layer reading the same layer's prefix keys
        and values; `blocks` (Ls,) opens the suffix's attention blocks."""
        B, Ls = suffix.shape[:2]
        own = attention_mask_2d(torch.ones(B, Ls, dtype=torch.bool, device=suffix.device), blocks.expand(B, Ls))
        mask = torch.cat([prefix.pad[:, None, :].expand(B, Ls, -1), own], dim=2)
        positions = prefix.pad.sum(dim=1, keepdim=True) + torch.arange(Ls, device=suffix.device)[None]
        hidden = suffix
        for index, layer in enumerate(self.gemma_expert.model.layers):
            q, k, v = decoder_qkv(layer, layer.input_layernorm(hidden))
            keys = torch.cat([prefix.keys[index].to(k.dtype), rope(k, positions)], dim=1)
            values = torch.cat([prefix.values[index].to(v.dtype), v], dim=1)
            hidden = decoder_finish(layer, hidden, attend(rope(q, positions), keys, values, mask))
        return self.gemma_expert.model.norm(hidden)


class Pi0FlowModel(nn.Module):
    """LeRobot's `PI0Pytorch`: PaliGemma with its expert, and the projections in and out of the expert."""

    def __init__(self, config: Pi0Config, sizes: Pi0Sizes) -> None:
        super().__init__()
        self.config = config
        self.paligemma_with_expert = PaliGemmaWithExpert(sizes, image_size=config.image_resolution[0], vision_heads=config.vision_heads)
        expert = sizes.expert[0]
        self.action_in_proj = nn.Linear(config.max_action_dim, expert)
        self.action_out_proj = nn.Linear(expert, config.max_action_dim)
        self.state_proj = nn.Linear(config.max_state_dim, expert)
        self.action_time_mlp_in = nn.Linear(2 * expert, expert)
        self.action_time_mlp_out = nn.Linear(expert, expert)

    def encode(self, images: list[Tensor], image_masks: list[Tensor], tokens: Tensor, token_mask: Tensor, state: Tensor) -> Prefix:
        """images: per image feature, (B, 3, R, R) in [-1, 1]; state: (B, max_state_dim), normalised."""
        pwe = self.paligemma_with_expert
        parts, pads = [], []
        for image, real in zip(images, image_masks, strict=True):
            embedded = pwe.embed_image(image)
            parts.append(embedded)
            pads.append(real[:, None].expand(-1, embedded.shape[1]))
        parts.append(pwe.language_model.embed_tokens(tokens))  # Gemma's embedding scales by √width itself
        pads.append(token_mask.bool())
        return pwe.encode(torch.cat(parts, dim=1), torch.cat(pads, dim=1), state)

    def velocity(self, prefix: Prefix, x_t: Tensor, t: Tensor) -> Tensor:
        """v_θ(x_t, t) (B, chunk, max_action_dim) for the noisy chunk x_t in the model's (normalised, padded) space."""
        actions = self.action_in_proj(x_t)
        time = time_embedding(t.expand(x_t.shape[0]), actions.shape[-1], self.config.min_period, self.config.max_period)
        fused = torch.cat([actions, time.to(actions.dtype)[:, None].expand_as(actions)], dim=-1)
        chunk = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(fused)))
        suffix = torch.cat([self.state_proj(prefix.state)[:, None], chunk], dim=1)
        # the suffix's blocks: the state token alone, then the chunk (each action sees the state and every action)
        blocks = torch.zeros(suffix.shape[1], dtype=torch.long, device=suffix.device)
        blocks[:2] = 1
        out = self.paligemma_with_expert.expert(prefix, suffix, blocks)[:, -x_t.shape[1] :]
        return self.action_out_proj(out.float())


def lerobot_keys(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A pi0 `model.safetensors` under the names LeRobot's model has, with the fixes LeRobot's `from_pretrained`
    makes: keys of checkpoints converted from openpi lack "model." and name action_time_mlp_* time_mlp_*; one that
    holds only the (tied) lm_head gives the language model's embedding from it. (The language heads, absent or not,
    compute nothing: `from_pretrained` keeps the model's own where a checkpoint has none.)"""
    out = {}
    for key, value in state.items():
        key = key if key.startswith("model.") else f"model.{key}"
        out[key.replace("model.time_mlp_in.", "model.action_time_mlp_in.").replace("model.time_mlp_out.", "model.action_time_mlp_out.")] = value
    head, embedding = "model.paligemma_with_expert.paligemma.lm_head.weight", f"{VLM}language_model.embed_tokens.weight"
    if embedding not in out and head in out:
        out[embedding] = out[head]
    return out


def resize_with_pad(images: Tensor, height: int, width: int) -> Tensor:
    """openpi's resize: (B, C, H, W) in [0, 1] resized keeping the aspect ratio (bilinear, clamped to [0, 1]), then
    padded with 0 evenly on both sides (the odd pixel after) to (height, width)."""
    h, w = images.shape[2:]
    ratio = max(w / width, h / height)
    new_h, new_w = int(h / ratio), int(w / ratio)
    images = F.interpolate(images, size=(new_h, new_w), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    return F.pad(images, (left, width - new_w - left, top, height - new_h - top), value=0.0)


# ----- the policy kinema trains and acts with ----------------------------------------------------------------------------
class Pi0Policy(LeRobotFlowPolicy):
    """A LeRobot pi0 checkpoint as a kinema policy (policies/lerobot_flow.LeRobotFlowPolicy: the RL core's
    `FlowPolicy`, acting, LeRobot's folder). `from_pretrained(folder)` loads LeRobot's folder (or one kinema saved);
    `save_pretrained` writes LeRobot's layout back, so LeRobot's `PI0Policy.from_pretrained` loads what kinema
    post-trained."""

    config_class = Pi0Config
    vlm_prefix = "model.paligemma_with_expert.paligemma."
    vision_marker = ".vision_tower."

    def __init__(self, config: Pi0Config, *, tokenizer: Any, sizes: Pi0Sizes | None = None,
                 stats: Mapping[str, Mapping[str, Tensor]] | None = None) -> None:  # fmt: skip
        super().__init__(config, stats)
        self.model = Pi0FlowModel(config, sizes or Pi0Sizes.from_variants(config))
        self.tokenizer = tokenizer
        config.hidden_dim = self.model.paligemma_with_expert.vlm_width + config.max_state_dim
        self.set_trainable(config.trainable)

    def _lora_target(self) -> nn.Module:
        return self.model.paligemma_with_expert.language_model

    def _resize(self, images: Tensor) -> Tensor:
        side = self.config.image_resolution
        return images if tuple(images.shape[2:]) == side else resize_with_pad(images, *side)

    @property
    def expert(self) -> nn.Module:
        """The action expert with the projections in and out of it and state_proj: what LeRobot's
        train_expert_only trains."""
        m = self.model
        return nn.ModuleList([m.paligemma_with_expert.gemma_expert, m.action_in_proj, m.action_out_proj, m.state_proj,
                              m.action_time_mlp_in, m.action_time_mlp_out])  # fmt: skip

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, tokenizer_path: str | None = None, map_location: str = "cpu",
                        **kinema: Any) -> Pi0Policy:  # fmt: skip
        """A LeRobot pi0 folder (or one kinema saved). The tokenizer: `tokenizer_path`, else kinema's saved one, else
        the one LeRobot saved beside the checkpoint, else the processor's tokenizer name in the local Hugging Face
        cache. Nothing is downloaded."""
        from safetensors.torch import load_file

        if tokenizer_path:
            kinema["tokenizer_path"] = tokenizer_path
        folder, _, config = cls.read_folder(directory, kinema)
        state = lerobot_keys(load_file(str(folder / WEIGHTS), device=map_location))
        tokenizer_dir = resolve_tokenizer_path(config.tokenizer_path, folder)
        if config.tokenizer_path:  # saved absolute, so that the checkpoint loads from any working directory
            config.tokenizer_path = tokenizer_dir
        tokenizer = load_tokenizer(tokenizer_dir)
        policy = cls(config, tokenizer=tokenizer, sizes=Pi0Sizes.from_weights(state, source=str(folder)), stats=read_processor_stats(folder))
        unused = {k: v for k, v in policy.state_dict().items() if k.endswith("lm_head.weight") and k not in state}
        policy.take_folder(folder, {**state, **unused}, source=str(folder))
        name = tokenizer_name(folder)
        beside = (folder / name).resolve() if name and not Path(name).is_absolute() else None
        if beside and beside.is_dir() and beside.is_relative_to(folder.resolve()):  # LeRobot main's: it goes with the folder
            for file in sorted((folder / name).iterdir()):
                policy._lerobot_files[f"{name}/{file.name}"] = file.read_bytes()
        return policy


# ----- the tokenizer ---------------------------------------------------------------------------------------------------------
def tokenizer_name(folder: Path) -> str:
    """The tokenizer LeRobot's preprocessor names: a folder beside the checkpoint (LeRobot main) or a hub name."""
    step = processor_step(folder, "policy_preprocessor.json", "tokenizer_processor") or {}
    return step.get("config", {}).get("tokenizer_name", "")


def resolve_tokenizer_path(tokenizer_path: str, folder: Path) -> str:
    """The local folder holding the tokenizer: `tokenizer_path`, or the preprocessor's tokenizer name as a folder
    beside the checkpoint or as a local path, or that name in the local Hugging Face cache."""
    name = tokenizer_name(folder)
    return local_folder((tokenizer_path, str(folder / name) if name else "", name), name, missing=(
        f"{folder}: no local folder for the pi0's tokenizer (tried {{tried}}); name a local copy of PaliGemma's tokenizer "
        "(nothing is downloaded): `kinema train --policy.tokenizer_path DIR`, or a file kinema_pi0.json beside the "
        'checkpoint holding {"tokenizer_path": "DIR"}'))  # fmt: skip


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    from policies._hf import quiet_transformers

    with quiet_transformers():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)


