"""The VLA with a local SmolVLM/Idefics3 backbone (LoRA via peft): a tiny random checkpoint is written offline with
save_pretrained and loaded through `backbone_path`, exactly as a user points at a real SmolVLM folder."""

from __future__ import annotations

import copy
import json
import shutil

import numpy as np
import pytest
import torch

from diffusion_rl.protocol import FlowPolicy
from policies.vla import VLAConfig, VLAPolicy
from policies.vla.smolvlm import write_tiny_idefics3

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory) -> str:
    return write_tiny_idefics3(str(tmp_path_factory.mktemp("smolvlm") / "tiny-idefics3"))


def smol_config(path: str, **kw) -> VLAConfig:
    base = dict(
        backbone="smolvlm", backbone_path=path, image_size=32, hidden_dim=32, expert_hidden=64, expert_layers=2,
        chunk_size=4, n_action_steps=2, num_flow_steps=4, augment_shift=0, backbone_layers=2, lora_rank=4,
    )  # fmt: skip
    base.update(kw)
    return VLAConfig(**base)


def fake_batch(B: int = 4, seed: int = 0, tasks: list[str] | None = None) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "observation.images.agentview": torch.randint(0, 256, (B, 32, 32, 3), dtype=torch.uint8, generator=g),
        "observation.images.wrist": torch.randint(0, 256, (B, 32, 32, 3), dtype=torch.uint8, generator=g),
        "observation.state": torch.randn(B, 8, generator=g),
        "task": tasks or ["put the red cube on the blue plate"] * B,
        "action": torch.rand(B, 4, 7, generator=g) * 2 - 1,
    }


def train_steps(model: VLAPolicy, steps: int, seed: int = 0) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = fake_batch()
    model.train()
    for _ in range(steps):
        loss = model.flow_loss(batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_chunks_features_and_protocol(backbone_dir):
    torch.manual_seed(0)
    model = VLAPolicy(smol_config(backbone_dir)).eval()
    assert isinstance(model, FlowPolicy)
    # 64 px vision side, patch 8, pixel shuffle 2: 16 tokens per camera; 2 of the checkpoint's 3 text layers run.
    assert model.prefix.tokens_per_image == 16 and len(model.prefix.backbone.text_model.layers) == 2
    batch = fake_batch()
    assert model.features(batch).shape == (4, 32)
    noise = torch.randn(4, 4, 7)
    a = model.predict_action_chunk(batch, noise=noise)
    assert a.shape == (4, 4, 7) and a.abs().max() <= 1.0
    torch.testing.assert_close(a, model.predict_action_chunk(batch, noise=noise))
    obs = {k: (v[0].numpy() if torch.is_tensor(v) else v[0]) for k, v in batch.items() if k != "action"}
    assert model.select_action(obs).shape == (7,)


def test_flow_loss_is_per_sample_and_weighted(backbone_dir):
    torch.manual_seed(0)
    model = VLAPolicy(smol_config(backbone_dir))
    batch = {**fake_batch(), "t": torch.rand(4), "noise": torch.randn(4, 4, 7)}
    plain = model.flow_loss(batch)
    assert plain.shape == (4,) and (plain > 0).all()
    torch.testing.assert_close(model.flow_loss(batch, weights=torch.tensor([2.0, 0.0, 1.0, 1.0])), plain * torch.tensor([2.0, 0.0, 1.0, 1.0]))


def test_training_moves_only_lora_and_heads(backbone_dir):
    torch.manual_seed(0)
    model = VLAPolicy(smol_config(backbone_dir))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    backbone = {n for n in before if n.startswith("prefix.backbone.")}
    lora = {n for n in backbone if "lora_" in n}
    assert lora and trainable & backbone == lora, "only LoRA weights of the backbone may train"
    assert all(".text_model." in n for n in lora), "freeze_vision keeps LoRA off the vision tower"
    train_steps(model, 4)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert not (changed & (backbone - lora)), "a frozen backbone weight moved"
    assert {n for n in lora if "lora_B" in n} <= changed and {n for n in lora if "lora_A" in n} <= changed
    assert any(n.startswith("expert.") for n in changed) and any(n.startswith("prefix.fuse.") for n in changed)


def test_state_dict_references_the_backbone_instead_of_copying_it(backbone_dir):
    model = VLAPolicy(smol_config(backbone_dir))
    keys = list(model.state_dict())
    backbone_keys = [k for k in keys if k.startswith("prefix.backbone.")]
    assert backbone_keys and all("lora_" in k for k in backbone_keys)
    # The workflow's EMA copy and trainer files go through deepcopy / load_state_dict(strict=True).
    clone = copy.deepcopy(model)
    assert list(clone.state_dict()) == keys
    clone.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match="Missing key.*lora_A"):
        clone.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_A" not in k})


def test_checkpoint_round_trip(backbone_dir, tmp_path):
    torch.manual_seed(0)
    model = VLAPolicy(smol_config(backbone_dir, aux_dim=3))
    model.set_normalization({"observation.state": {"mean": np.arange(8.0), "std": np.full(8, 2.0)}})
    train_steps(model, 3)  # non-zero LoRA B, so the round trip really carries the adapters
    model.save_pretrained(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["backbone.json", "config.json", "model.safetensors"]
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    record = json.loads((tmp_path / "ckpt" / "backbone.json").read_text())
    assert config["backbone"] == "smolvlm" and config["backbone_path"] == backbone_dir and config["backbone_layers"] == 2
    assert record["model_type"] == "idefics3" and record["text_layers_used"] == 2 and record["lora_modules"] == 8
    loaded = VLAPolicy.from_pretrained(str(tmp_path / "ckpt")).eval()
    torch.testing.assert_close(loaded.state_mean, torch.arange(8.0))
    batch, noise = fake_batch(), torch.randn(4, 4, 7)
    torch.testing.assert_close(model.eval().predict_action_chunk(batch, noise=noise), loaded.predict_action_chunk(batch, noise=noise), rtol=0, atol=0)
    # A moved backbone (same content) loads through the override.
    moved = tmp_path / "moved-backbone"
    shutil.copytree(backbone_dir, moved)
    again = VLAPolicy.from_pretrained(str(tmp_path / "ckpt"), backbone_path=str(moved)).eval()
    assert again.config.backbone_path == str(moved)  # what a resumed run rebuilds from, and the next save records
    torch.testing.assert_close(again.features(batch), model.features(batch), rtol=0, atol=0)


def test_mismatched_checkpoints_are_refused(backbone_dir, tmp_path):
    VLAPolicy(smol_config(backbone_dir)).save_pretrained(str(tmp_path / "a"))
    other = write_tiny_idefics3(str(tmp_path / "other-backbone"), seed=1)  # same shapes, other weights
    with pytest.raises(ValueError, match="trained on the backbone at .*fingerprint"):
        VLAPolicy.from_pretrained(str(tmp_path / "a"), backbone_path=other)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config["backbone_layers"] = 3  # one more text layer -> LoRA weights the checkpoint does not have
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match this VLA architecture: missing .*layers.2"):
        VLAPolicy.from_pretrained(str(tmp_path / "a"))
    config["backbone_layers"], config["lora_rank"] = 2, 8
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lora_A.*checkpoint \(4, 32\) vs model \(8, 32\)"):
        VLAPolicy.from_pretrained(str(tmp_path / "a"))
    tiny = VLAConfig(image_size=32, hidden_dim=32, expert_hidden=64, expert_layers=2, chunk_size=4, n_action_steps=2)
    VLAPolicy(tiny).save_pretrained(str(tmp_path / "tiny"))
    config = json.loads((tmp_path / "tiny" / "config.json").read_text())
    config.update(backbone="smolvlm", backbone_path=backbone_dir)
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="without backbone.json"):
        VLAPolicy.from_pretrained(str(tmp_path / "tiny"))


def test_bad_backbone_paths_name_what_was_expected(backbone_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="backbone_path .*nowhere.* is not a directory; expected a local SmolVLM/Idefics3"):
        VLAPolicy(smol_config(str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        VLAPolicy(smol_config(str(tmp_path / "empty")))
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="holds a 'llama' model; expected a SmolVLM/Idefics3 checkpoint"):
        VLAPolicy(smol_config(str(tmp_path / "llama")))
    with pytest.raises(ValueError, match="backbone_path must name a local SmolVLM/Idefics3"):
        VLAConfig(backbone="smolvlm")
    with pytest.raises(ValueError, match="backbone must be 'tiny' or 'smolvlm'"):
        VLAConfig(backbone="/some/dir")
    with pytest.raises(ValueError, match=r"lora_targets \['qkv'\].*linear layers are \[.*'q_proj'"):
        VLAPolicy(smol_config(backbone_dir, lora_targets=("qkv",)))
    with pytest.raises(ValueError, match="backbone_layers 7 exceeds the backbone's 3 text layers"):
        VLAPolicy(smol_config(backbone_dir, backbone_layers=7))
    with pytest.raises(ValueError, match="backbone_image_size 36 must be a multiple of patch_size\\*scale_factor=16"):
        VLAPolicy(smol_config(backbone_dir, backbone_image_size=36))


def test_unseen_words_tokenise_and_padding_does_not_leak(backbone_dir):
    torch.manual_seed(0)
    model = VLAPolicy(smol_config(backbone_dir)).eval()
    tok = model.prefix.tokenizer
    ids = tok("transfer the dishes to the shelf")["input_ids"]
    assert tok.unk_token_id is None or tok.unk_token_id not in ids
    assert tok.decode(ids).strip() == "transfer the dishes to the shelf"
    # Byte-level BPE: the seen word is one or two pieces, the unseen one falls back to more, smaller pieces.
    assert len(tok(" drawer")["input_ids"]) < len(tok(" zxqwv")["input_ids"])
    batch = fake_batch(2, tasks=["open the drawer", "place the green block onto the yellow plate please now"])
    together = model.features(batch)
    alone = model.features({k: v[:1] for k, v in batch.items()})
    torch.testing.assert_close(alone, together[:1], rtol=1e-5, atol=1e-6)  # the short one was padded in the batch
    swapped = model.features({**batch, "task": ["close the drawer", batch["task"][1]]})
    assert not torch.allclose(swapped[0], together[0]), "the instruction must reach the context"


def test_vision_lora_and_reduced_precision(backbone_dir):
    torch.manual_seed(0)
    model = VLAPolicy(smol_config(backbone_dir, freeze_vision=False))
    vision_lora = [n for n in model.prefix.lora_modules if n.startswith(("vision_model.", "connector."))]
    assert len(vision_lora) == 2 * 4 + 1  # q/k/v/out in both vision layers, plus the connector projection
    model.flow_loss(fake_batch()).mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "vision_model" in n and "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    half = VLAPolicy(smol_config(backbone_dir, backbone_dtype="bfloat16")).eval()
    assert half.prefix.backbone.dtype == torch.bfloat16
    features = half.features(fake_batch())
    assert features.dtype == torch.float32 and torch.isfinite(features).all()


def test_lora_rank_zero_trains_the_heads_only(backbone_dir):
    model = VLAPolicy(smol_config(backbone_dir, lora_rank=0))
    assert not model.prefix.lora_modules
    assert not [n for n, p in model.named_parameters() if p.requires_grad and n.startswith("prefix.backbone.")]
    assert not [k for k in model.state_dict() if k.startswith("prefix.backbone.")]
    assert model.flow_loss(fake_batch()).shape == (4,)
