"""A local SmolVLM/Idefics3 checkpoint as the VLA's prefix backbone, with LoRA (peft) on its text model.

SmolVLA-style: every camera goes through the VLM's vision tower and connector (pixel shuffle + projection) to
image tokens in the text model's embedding space; the normalised state becomes one token; the instruction is
tokenised with the checkpoint's own tokenizer (byte-level BPE for SmolVLM, so unseen words still tokenise). The
prefix [images..., state, words] runs through the first `backbone_layers` text layers (the rest are dropped, as
SmolVLA drops the upper half), and learned-query attention pooling plus an MLP turn those hidden states into the
(B, hidden_dim) context the flow-matching action expert, the critics and the success model read.

Checkpoints reference the backbone, they do not copy it: `state_dict()` of this module holds the LoRA weights and
the heads only (the frozen base weights are dropped by a state-dict hook, and a load hook accepts their absence),
so a checkpoint or a trainer file stays megabytes for a gigabyte backbone. `config.json` keeps `backbone_path`;
`backbone.json` records a fingerprint of the backbone (its config plus sampled bytes of its weights) so that
loading against a different backbone fails with the difference named instead of silently producing garbage.

Nothing is downloaded: every `from_pretrained` here passes `local_files_only=True`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from policies._hf import quiet_transformers
from policies.vla.configuration_vla import VLAConfig

SUPPORTED_MODEL_TYPES = ("idefics3", "smolvlm")  # SmolVLM(1) saves as idefics3, SmolVLM2 as smolvlm: same layout
VISION_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
BACKBONE_FILE = "backbone.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAMPLE_BYTES = 1 << 20  # per sampled block of each weights file in the fingerprint


# ----- the backbone on disk -------------------------------------------------------------------------------------------
def read_backbone_config(path: str) -> dict[str, Any]:
    """The checkpoint's config.json, after checking that `path` is a local SmolVLM/Idefics3 checkpoint."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"VLAConfig.backbone_path {path!r} is not a directory; expected a local SmolVLM/Idefics3 checkpoint "
            "folder (config.json, *.safetensors, tokenizer files). Nothing is downloaded: fetch it beforehand. A "
            "checkpoint whose backbone lives elsewhere here loads with VLAPolicy.from_pretrained(..., backbone_path=...)."
        )
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"VLAConfig.backbone_path {path!r} has no config.json; expected a SmolVLM/Idefics3 checkpoint folder")
    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"VLAConfig.backbone_path {path!r} holds a {model_type!r} model; expected a SmolVLM/Idefics3 checkpoint "
            f"(config.json model_type one of {list(SUPPORTED_MODEL_TYPES)})"
        )
    return config


def backbone_fingerprint(path: str) -> str:
    """A stable id of the backbone's content: config.json plus, per weights file, its size, its safetensors header
    and three 1 MiB blocks (start, middle, end). Hashing whole multi-gigabyte files on every load would cost
    seconds; this still tells a different checkpoint (other weights, other shapes) apart."""
    folder = Path(path)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with open(weights, "rb") as f:
            for offset in (0, max(0, size // 2 - _SAMPLE_BYTES // 2), max(0, size - _SAMPLE_BYTES)):
                f.seek(offset)
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


# ----- state-dict hooks: the frozen base weights are referenced by path, never saved -------------------------------------
def _is_frozen_base(key: str) -> bool:
    return "lora_" not in key


def _drop_frozen_backbone(module: nn.Module, state_dict: dict[str, Tensor], prefix: str, local_metadata: Any) -> None:
    start = prefix + "backbone."
    for key in [k for k in state_dict if k.startswith(start) and _is_frozen_base(k)]:
        del state_dict[key]


def _allow_missing_frozen_backbone(module: nn.Module, incompatible_keys: Any) -> None:
    frozen = module._frozen_backbone_keys  # names relative to this module ("backbone.…"); missing keys are the root's

    def is_frozen(key: str) -> bool:
        at = key.find("backbone.")
        while at >= 0:
            if (at == 0 or key[at - 1] == ".") and key[at:] in frozen:
                return True
            at = key.find("backbone.", at + 1)
        return False

    incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if not is_frozen(k)]


# ----- the prefix encoder -------------------------------------------------------------------------------------------------
class AttentionPool(nn.Module):
    """Learned queries read the prefix's hidden states (padding masked): a few spatially selective summaries,
    where a mean over tokens would blur away where things are."""

    def __init__(self, width: int, queries: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.queries = nn.Parameter(torch.randn(queries, width) / math.sqrt(width))

    def forward(self, hidden: Tensor, mask: Tensor) -> Tensor:
        keys = self.norm(hidden)
        scores = torch.einsum("bld,qd->bql", keys, self.queries) / math.sqrt(hidden.shape[-1])
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.einsum("bql,bld->bqd", scores.softmax(-1), keys)


class SmolVLMPrefix(nn.Module):
    """(images per camera, instructions, normalised state) -> the (B, hidden_dim) context, through a local VLM."""

    def __init__(self, config: VLAConfig) -> None:
        super().__init__()
        from peft import LoraConfig, inject_adapter_in_model
        from transformers import AutoModel, AutoTokenizer

        path = config.backbone_path
        self.backbone_path = path
        raw = read_backbone_config(path)
        with quiet_transformers():
            backbone = AutoModel.from_pretrained(path, local_files_only=True, dtype=_DTYPES[config.backbone_dtype])
            self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        for part in ("vision_model", "connector", "text_model"):
            if not hasattr(backbone, part):
                raise ValueError(f"backbone {path!r} ({type(backbone).__name__}) has no {part}; expected the Idefics3 layout")
        self.tokenizer.padding_side = "right"  # the prefix's valid tokens then keep their positions whatever the padding
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.tokenizer.pad_token is None:
            raise ValueError(f"the tokenizer in {path!r} has no pad, eos or unk token to pad instructions with")

        layers = backbone.text_model.layers
        if config.backbone_layers > len(layers):
            raise ValueError(f"VLAConfig.backbone_layers {config.backbone_layers} exceeds the backbone's {len(layers)} text layers")
        if config.backbone_layers:
            # The hidden states of layer L (after the text model's final norm) are what the expert reads; the layers
            # above L would only cost time and memory, so they are dropped before LoRA goes in.
            backbone.text_model.layers = layers[: config.backbone_layers]
        self.num_text_layers = len(backbone.text_model.layers)

        vision = backbone.config.vision_config
        self.patch_size, self.scale_factor = int(vision.patch_size), int(backbone.config.scale_factor)
        self.vision_size = config.backbone_image_size or int(vision.image_size)
        if self.vision_size % (self.patch_size * self.scale_factor):
            raise ValueError(
                f"VLAConfig.backbone_image_size {self.vision_size} must be a multiple of patch_size*scale_factor="
                f"{self.patch_size * self.scale_factor} (the connector's pixel shuffle needs whole patch groups)"
            )
        self.tokens_per_image = (self.vision_size // self.patch_size // self.scale_factor) ** 2
        mean, std = _image_normalisation(Path(path))
        self.register_buffer("pixel_mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

        backbone.requires_grad_(False)
        self.lora_modules: list[str] = []
        if config.lora_rank > 0:
            available = sorted({n.rsplit(".", 1)[-1] for n, m in backbone.text_model.named_modules() if isinstance(m, nn.Linear)})
            unknown = sorted(set(config.lora_targets) - set(available))
            if unknown or not config.lora_targets:
                raise ValueError(
                    f"VLAConfig.lora_targets {list(config.lora_targets)}: {unknown or 'empty'}; "
                    f"the text model's linear layers are {available}"
                )
            pattern = rf"text_model\.layers\.\d+\.\w+\.({'|'.join(config.lora_targets)})"
            if not config.freeze_vision:
                pattern += rf"|vision_model\.encoder\.layers\.\d+\.self_attn\.({'|'.join(VISION_LORA_TARGETS)})"
                pattern += r"|connector\.modality_projection\.proj"
            lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0, target_modules=pattern)
            inject_adapter_in_model(lora, backbone)
            self.lora_modules = sorted(n for n, m in backbone.named_modules() if hasattr(m, "lora_A"))
            for name, param in backbone.named_parameters():
                param.requires_grad_("lora_" in name)
        self.backbone = backbone
        self._frozen_backbone_keys = {"backbone." + k for k in backbone.state_dict() if _is_frozen_base(k)}
        self.register_state_dict_post_hook(_drop_frozen_backbone)
        self.register_load_state_dict_post_hook(_allow_missing_frozen_backbone)

        width = int(backbone.config.text_config.hidden_size)
        self.state_token = nn.Linear(config.state_dim, width)
        self.pool = AttentionPool(width, config.pool_queries)
        self.fuse = nn.Sequential(
            nn.Linear(config.pool_queries * width, config.hidden_dim), nn.GELU(), nn.Linear(config.hidden_dim, config.hidden_dim), nn.GELU()
        )
        self.max_text_tokens = config.max_text_tokens
        self.freeze_vision = config.freeze_vision or config.lora_rank == 0
        self.fingerprint = backbone_fingerprint(path)
        self.model_type = raw["model_type"]

    # ----- pieces of the prefix ------------------------------------------------------------------------------------------
    def image_tokens(self, images: Sequence[Tensor]) -> Tensor:
        """Per camera (B, 3, H, W) in [0, 1] -> (B, cameras * tokens_per_image, width)."""
        B = images[0].shape[0]
        pixels = torch.cat(list(images), 0)
        if pixels.shape[-1] != self.vision_size or pixels.shape[-2] != self.vision_size:
            pixels = F.interpolate(pixels, size=(self.vision_size, self.vision_size), mode="bilinear", align_corners=False, antialias=True)
        pixels = ((pixels - self.pixel_mean) / self.pixel_std).to(self.backbone.dtype)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_vision):
            hidden = self.backbone.vision_model(pixel_values=pixels).last_hidden_state
            tokens = self.backbone.connector(hidden)
        # (cameras*B, n, D) -> (B, cameras*n, D), cameras in config order
        return tokens.view(len(images), B, tokens.shape[1], -1).transpose(0, 1).reshape(B, -1, tokens.shape[-1])

    def text_tokens(self, texts: list[str], device: torch.device) -> tuple[Tensor, Tensor]:
        enc = self.tokenizer(texts, padding="longest", truncation=True, max_length=self.max_text_tokens, return_tensors="pt")
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()
        return self.backbone.text_model.get_input_embeddings()(ids), mask

    def forward(self, images: Sequence[Tensor], texts: list[str], state: Tensor) -> Tensor:
        device = state.device
        image = self.image_tokens(images)
        words, word_mask = self.text_tokens(texts, device)
        state_tok = self.state_token(state)[:, None].to(image.dtype)
        embeds = torch.cat([image, state_tok, words], dim=1)
        # Images and state first, the right-padded words last: under causal attention the valid tokens' hidden states
        # do not depend on how much padding the batch's longest instruction forces.
        prefix = torch.ones(embeds.shape[0], image.shape[1] + 1, dtype=torch.bool, device=device)
        mask = torch.cat([prefix, word_mask], dim=1)
        hidden = self.backbone.text_model(inputs_embeds=embeds, attention_mask=mask.long(), use_cache=False).last_hidden_state
        pooled = self.pool(hidden.float(), mask)
        return self.fuse(pooled.flatten(1))

    def describe(self) -> dict[str, Any]:
        """What `backbone.json` records next to a checkpoint."""
        return {
            "path": os.path.abspath(self.backbone_path),
            "model_type": self.model_type,
            "fingerprint": self.fingerprint,
            "text_layers_used": self.num_text_layers,
            "tokens_per_image": self.tokens_per_image,
            "vision_size": self.vision_size,
            "lora_modules": len(self.lora_modules),
        }


def _image_normalisation(folder: Path) -> tuple[list[float], list[float]]:
    """The checkpoint's own image mean/std (preprocessor_config.json) when it has them; SigLIP's 0.5/0.5 otherwise."""
    mean, std = [0.5] * 3, [0.5] * 3
    pre = folder / "preprocessor_config.json"
    if pre.is_file():
        data = json.loads(pre.read_text())
        mean, std = list(data.get("image_mean", mean)), list(data.get("image_std", std))
    return [float(x) for x in mean], [float(x) for x in std]


def check_backbone_record(record: Mapping[str, Any], prefix: SmolVLMPrefix, *, source: str) -> None:
    """Refuse a checkpoint whose LoRA and heads were trained on another backbone than the one found now."""
    if record.get("fingerprint") != prefix.fingerprint:
        raise ValueError(
            f"checkpoint {source} was trained on the backbone at {record.get('path')!r} (fingerprint "
            f"{record.get('fingerprint')}); the backbone at {prefix.backbone_path!r} has fingerprint {prefix.fingerprint}: "
            "a different config or different weights. Pass the original backbone (from_pretrained(..., backbone_path=...))."
        )


# ----- a tiny random checkpoint of the architecture, built offline --------------------------------------------------------
TINY_CORPUS = (
    "put the red cube on the blue plate", "place the green block onto the yellow plate", "open the drawer",
    "close the drawer", "pick up the cube", "push the button", "stack the cubes", "move the bowl to the left",
)  # fmt: skip


def write_tiny_idefics3(
    directory: str,
    *,
    vision_hidden: int = 32,
    text_hidden: int = 32,
    vision_layers: int = 2,
    text_layers: int = 3,
    image_size: int = 64,
    patch_size: int = 8,
    scale_factor: int = 2,
    vocab_size: int = 320,
    seed: int = 0,
) -> str:
    """Save a random Idefics3 checkpoint (tiny SigLIP-style tower, tiny Llama, byte-level BPE tokenizer trained on
    a few sentences in code) with `save_pretrained`, the way a real SmolVLM folder looks. For tests and CPU smoke
    runs: nothing is downloaded, and byte-level BPE tokenises any word (unseen ones fall back to bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_end|>", "<image>", "<fake_token_around_image>", "<global-img>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(TINY_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", eos_token="<|im_end|>")
    config = Idefics3Config(
        vision_config=dict(
            hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=vision_layers,
            num_attention_heads=4, image_size=image_size, patch_size=patch_size,
        ),
        text_config=dict(
            model_type="llama", hidden_size=text_hidden, intermediate_size=2 * text_hidden, num_hidden_layers=text_layers,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
            max_position_embeddings=512,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
    )  # fmt: skip
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Idefics3ForConditionalGeneration(config)
    finally:
        torch.random.set_rng_state(state)
    with quiet_transformers():
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory
