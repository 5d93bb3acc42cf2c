"""The real path without weights: Wan2.1-T2V-1.3B's transformer config on the `meta` device.

It must count the published 1,418,996,800 parameters, and kinema's LoRA targets must resolve in every block.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from diffusers import WanTransformer3DModel  # noqa: E402
from peft import LoraConfig  # noqa: E402

from policies.video.configuration_video import (  # noqa: E402
    WAN21_T2V_1_3B_PARAMETERS,
    WAN21_T2V_1_3B_TRANSFORMER,
    WAN_LORA_TARGETS,
)
from policies.video.modeling_wan import WanX0Transformer3DModel  # noqa: E402

LAYERS, DIM, FFN = 30, 12 * 128, 8960


def _meta_transformer(cls=WanTransformer3DModel, **extra):
    with torch.device("meta"):
        return cls(**WAN21_T2V_1_3B_TRANSFORMER, **extra)


def test_full_size_wan21_1_3b_parameter_count_matches_the_published_size():
    model = _meta_transformer()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == WAN21_T2V_1_3B_PARAMETERS == 1_418_996_800
    assert len(model.blocks) == LAYERS
    assert model.blocks[0].attn1.to_q.weight.shape == (DIM, DIM)
    assert model.blocks[0].attn2.to_k.weight.shape == (DIM, DIM)  # text_dim 4096 is projected to DIM first
    assert model.condition_embedder.text_embedder.linear_1.weight.shape == (DIM, 4096)
    assert model.blocks[0].ffn.net[0].proj.weight.shape == (FFN, DIM)
    # kinema's x0-prediction subclass adds configuration, not parameters.
    x0 = _meta_transformer(WanX0Transformer3DModel, prediction_type="x0")
    assert sum(p.numel() for p in x0.parameters()) == WAN21_T2V_1_3B_PARAMETERS


def test_full_size_lora_targets_resolve_in_every_block():
    model = _meta_transformer()
    rank = 8
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(WAN_LORA_TARGETS))
    model.add_adapter(config, adapter_name="default")
    wrapped = sorted(
        name[: -len(".lora_A.default")] for name, _ in model.named_modules() if name.endswith(".lora_A.default")
    )
    expected = sorted(
        f"blocks.{n}.{mod}"
        for n in range(LAYERS)
        for mod in [f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.0")]
        + ["ffn.net.0.proj", "ffn.net.2"]
    )
    assert wrapped == expected
    # Nothing outside the blocks (patch embedding, time/text embedders, proj_out) is adapted.
    assert all(re.match(r"blocks\.\d+\.", name) for name in wrapped)
    lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    per_block = 8 * (DIM + DIM) * rank + 2 * (DIM + FFN) * rank
    assert lora == LAYERS * per_block == 10_936_320


def test_full_size_x0_transformer_with_lora_runs_a_480p_81_frame_forward_on_meta():
    # Shapes only (meta tensors carry no data): 81 frames at 480x832 are 21 x 60 x 104 latents for the Wan VAE.
    model = _meta_transformer(WanX0Transformer3DModel, prediction_type="x0")
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=list(WAN_LORA_TARGETS)), adapter_name="default")
    with torch.device("meta"):
        latents = torch.empty(1, 16, 21, 60, 104)
        out = model(
            hidden_states=latents,
            timestep=torch.full((1,), 500.0),
            encoder_hidden_states=torch.empty(1, 512, 4096),
            return_dict=False,
        )[0]
    assert out.shape == latents.shape and out.device.type == "meta"
