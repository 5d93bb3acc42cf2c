"""The VLA as the RL core sees it: per-sample flow loss, chunks, SDE log-probs, checkpoints, language conditioning."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from diffusion_rl.protocol import FlowPolicy
from policies.vla import VLAConfig, VLAPolicy
from policies.vla.text import HashTokenizer, TextEncoder, word_ngrams

torch.set_num_threads(1)


def tiny_config(**kw) -> VLAConfig:
    base = dict(
        image_size=32, vision_channels=(8, 16, 16), vision_dim=32, text_dim=16, hidden_dim=32, expert_hidden=64,
        expert_layers=2, state_hidden=16, chunk_size=4, n_action_steps=2, num_flow_steps=4, augment_shift=0,
    )  # fmt: skip
    base.update(kw)
    return VLAConfig(**base)


def fake_batch(B: int = 6, config: VLAConfig | None = None, seed: int = 0) -> dict:
    config = config or tiny_config()
    g = torch.Generator().manual_seed(seed)
    s = config.image_size
    return {
        "observation.images.agentview": torch.randint(0, 256, (B, s, s, 3), dtype=torch.uint8, generator=g),
        "observation.images.wrist": torch.randint(0, 256, (B, s, s, 3), dtype=torch.uint8, generator=g),
        "observation.state": torch.randn(B, 8, generator=g),
        "task": ["put the red cube on the blue plate"] * B,
        "action": torch.rand(B, config.chunk_size, 7, generator=g) * 2 - 1,
    }


def test_implements_the_core_protocol():
    assert isinstance(VLAPolicy(tiny_config()), FlowPolicy)


def test_flow_loss_is_per_sample_and_weights_of_one_change_nothing():
    torch.manual_seed(0)
    model = VLAPolicy(tiny_config())
    batch = fake_batch()
    t = torch.rand(6)
    noise = torch.randn(6, 4, 7)
    plain = model.flow_loss({**batch, "t": t, "noise": noise})
    weighted = model.flow_loss({**batch, "t": t, "noise": noise}, weights=torch.ones(6))
    assert plain.shape == (6,)
    torch.testing.assert_close(plain, weighted)
    doubled = model.flow_loss({**batch, "t": t, "noise": noise}, weights=torch.full((6,), 2.0))
    torch.testing.assert_close(doubled, 2 * plain)


def test_padded_chunk_steps_do_not_count():
    """Targets past the episode end never enter the loss (the expert's output is pinned to isolate the mask)."""
    torch.manual_seed(0)
    model = VLAPolicy(tiny_config())
    model.expert.forward = lambda x_t, t, context, advantage=None: torch.zeros_like(x_t)
    batch = fake_batch()
    pad = torch.zeros(6, 4, dtype=torch.bool)
    pad[:, 2:] = True
    t, noise = torch.rand(6), torch.randn(6, 4, 7)
    a = model.flow_loss({**batch, "t": t, "noise": noise, "action_is_pad": pad})
    changed = batch["action"].clone()
    changed[:, 2:] = 5.0
    b = model.flow_loss({**batch, "action": changed, "t": t, "noise": noise, "action_is_pad": pad})
    torch.testing.assert_close(a, b)
    unmasked = model.flow_loss({**batch, "action": changed, "t": t, "noise": noise})
    assert (unmasked > a).all()


def test_chunks_are_bounded_and_deterministic_given_noise():
    model = VLAPolicy(tiny_config()).eval()
    batch = fake_batch()
    noise = torch.randn(6, 4, 7)
    a = model.predict_action_chunk(batch, noise=noise)
    b = model.predict_action_chunk(batch, noise=noise)
    assert a.shape == (6, 4, 7) and a.abs().max() <= 1.0
    torch.testing.assert_close(a, b)


def test_select_action_replans_every_n_action_steps():
    model = VLAPolicy(tiny_config(n_action_steps=2)).eval()
    calls = []
    original = model.predict_action_chunk
    model.predict_action_chunk = lambda batch, **kw: (calls.append(1), original(batch, **kw))[1]
    obs = {k: (v[0].numpy() if torch.is_tensor(v) else v[0]) for k, v in fake_batch(1).items() if k != "action"}
    actions = [model.select_action(obs) for _ in range(5)]
    assert len(calls) == 3 and all(a.shape == (7,) for a in actions)
    model.reset()
    model.select_action(obs)
    assert len(calls) == 4


def test_sde_log_prob_ratio_is_one_before_any_update():
    torch.manual_seed(0)
    model = VLAPolicy(tiny_config()).eval()
    batch = fake_batch()
    chunk, record = model.sample_chunk_sde(batch, noise_level=0.5)
    assert chunk.shape == (6, 4, 7)
    k = 1  # a stochastic step
    step = model.sde_log_prob(
        {**batch, "x_t": record["x_t"][:, k], "t": record["t"][k].expand(6), "t_next": record["t_next"][k].expand(6),
         "x_next": record["x_next"][:, k]},
        noise_level=0.5,
    )  # fmt: skip
    ratio = torch.exp(step.log_prob - record["log_prob"][:, k])
    torch.testing.assert_close(ratio, torch.ones(6), atol=1e-5, rtol=0)


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = VLAPolicy(tiny_config(aux_dim=5))
    model.set_normalization({"observation.state": {"mean": np.arange(8.0), "std": np.full(8, 2.0)}})
    model.save_pretrained(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary files left behind"
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["format_version"] == 1 and config["policy_type"] == "vla" and config["aux_dim"] == 5
    loaded = VLAPolicy.from_pretrained(str(tmp_path / "ckpt")).eval()
    torch.testing.assert_close(loaded.state_mean, torch.arange(8.0))
    noise = torch.randn(6, 4, 7)
    batch = fake_batch()
    torch.testing.assert_close(model.eval().predict_action_chunk(batch, noise=noise), loaded.predict_action_chunk(batch, noise=noise))
    # Saving again over an existing checkpoint replaces it in one step.
    model.save_pretrained(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    VLAPolicy(tiny_config(hidden_dim=32)).save_pretrained(str(tmp_path / "a"))
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config["hidden_dim"] = 48
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match this VLA architecture.*checkpoint \\(32"):
        VLAPolicy.from_pretrained(str(tmp_path / "a"))
    config["format_version"] = 99
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="format_version 99 is not supported"):
        VLAPolicy.from_pretrained(str(tmp_path / "a"))
    with pytest.raises(FileNotFoundError, match="missing config.json, model.safetensors"):
        (tmp_path / "empty").mkdir()
        VLAPolicy.from_pretrained(str(tmp_path / "empty"))


def test_a_damaged_checkpoint_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "a"
    VLAPolicy(tiny_config()).save_pretrained(str(path))
    good_config, good_weights = (path / "config.json").read_text(), (path / "model.safetensors").read_bytes()
    (path / "config.json").write_text(good_config.replace('"image_size": 32', '"image_size": "big"'))
    assert '"big"' in (path / "config.json").read_text()
    with pytest.raises(ValueError, match="config.json field image_size is 'big'; expected int"):
        VLAPolicy.from_pretrained(str(path))
    for text, match in (("[1, 2]", "holds a list"), ('{"policy_type": "vla",', "is not valid JSON")):
        (path / "config.json").write_text(text)
        with pytest.raises(ValueError, match=f"config.json {match}.*damaged"):
            VLAPolicy.from_pretrained(str(path))
    (path / "config.json").write_text(good_config)
    (path / "model.safetensors").write_bytes(good_weights[: len(good_weights) // 2])  # a copy cut short
    with pytest.raises(ValueError, match="model.safetensors cannot be read as safetensors.*damaged"):
        VLAPolicy.from_pretrained(str(path))


def test_tokenizer_handles_unseen_words_and_is_stable_across_processes():
    tok = HashTokenizer(4096, 16)
    ids, mask = tok(["put the red cube on the dish", "x"])
    assert ids.shape == (2, 16, 12) and mask[0].sum() == 7 and mask[1].sum() == 1
    # "dishes" (unseen) shares trigrams with "dish".
    assert len(set(word_ngrams("dish", 4096)) & set(word_ngrams("dishes", 4096))) >= 3
    code = "from policies.vla.text import word_ngrams; print(word_ngrams('plate', 4096))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == str(word_ngrams("plate", 4096))


def test_filler_words_are_inserted_around_the_instruction_in_order():
    tok = HashTokenizer(4096, 16)
    text = "put the red cube on the blue plate"
    plain, plain_mask = tok([text] * 64)
    torch.manual_seed(0)
    ids, mask = tok([text] * 64, filler_words=1.0)
    assert set(mask.sum(1).tolist()) == {9, 10}  # one or two inserted into every instruction
    for row, keep in zip(ids, mask):
        words = [tuple(w.tolist()) for w in row[keep]]
        it = iter(words)
        assert all(tuple(w.tolist()) in it for w in plain[0][plain_mask[0]])  # the instruction, in order, around them
    full = " ".join(["word"] * 15)
    assert tok([full] * 32, filler_words=1.0)[1].sum(1).max() == 16  # never past max_words, nothing cut
    assert torch.equal(tok([text] * 64, filler_words=0.0)[0], plain)


def test_position_jitter_and_fillers_let_the_encoder_read_moved_and_padded_paraphrases():
    """Known answer: name the plate's colour, the second colour word. Trained on three templates where it sits in
    one slot, the plain encoder reads slots and often misses it when "could you please" moves it three words on or
    an unknown "now" one on; with position jitter and filler words it reads word order and passes over new words."""
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
    train = ["put the {a} cube on the {b} plate", "move the {a} cube onto the {b} plate", "set the {a} cube on the {b} plate"]
    moved = ["could you please put the {a} cube on the {b} plate", "now move the {a} cube onto the {b} plate"]
    pairs = [(a, b) for a in range(8) for b in range(8) if a != b]

    def accuracy(augment: bool) -> list[float]:
        torch.manual_seed(0)
        tok, enc, head = HashTokenizer(1024, 16), TextEncoder(1024, 32, 1, 16), torch.nn.Linear(32, 8)
        opt = torch.optim.Adam([*enc.parameters(), *head.parameters()], 3e-3)
        for _ in range(300):
            picks = torch.randint(len(pairs), (64,)).tolist()
            texts = [train[i % 3].format(a=colours[pairs[p][0]], b=colours[pairs[p][1]]) for i, p in enumerate(picks)]
            ids, mask = tok(texts, filler_words=0.5 if augment else 0.0)
            logits = head(enc(ids, mask, jitter_positions=augment)[1])
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor([pairs[p][1] for p in picks]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        enc.eval()
        with torch.no_grad():
            out = []
            for template in moved:
                ids, mask = tok([template.format(a=colours[a], b=colours[b]) for a, b in pairs])
                out.append((head(enc(ids, mask)[1]).argmax(1) == torch.tensor([b for _, b in pairs])).float().mean().item())
            return out

    assert min(accuracy(True)) > 0.95
    assert sum(accuracy(False)) / 2 < 0.8  # the plain encoder does not (0.71 here: 0.84 and 0.57)


def test_relative_word_positions_read_a_phrase_wherever_it_starts():
    """Known answer, as above, with no augmentation: relative positions (neighbours, no slot) read the plate's colour
    after "could you please" or "now" moved it, and a phrase shifted along the slots gives the same word features."""
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
    train = ["put the {a} cube on the {b} plate", "move the {a} cube onto the {b} plate", "set the {a} cube on the {b} plate"]
    moved = ["could you please put the {a} cube on the {b} plate", "now move the {a} cube onto the {b} plate"]
    pairs = [(a, b) for a in range(8) for b in range(8) if a != b]
    torch.manual_seed(0)
    tok, enc, head = HashTokenizer(1024, 16), TextEncoder(1024, 32, 1, 16, positions="relative"), torch.nn.Linear(32, 8)
    opt = torch.optim.Adam([*enc.parameters(), *head.parameters()], 3e-3)
    for _ in range(300):
        picks = torch.randint(len(pairs), (64,)).tolist()
        ids, mask = tok([train[i % 3].format(a=colours[pairs[p][0]], b=colours[pairs[p][1]]) for i, p in enumerate(picks)])
        loss = torch.nn.functional.cross_entropy(head(enc(ids, mask)[1]), torch.tensor([pairs[p][1] for p in picks]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    enc.eval()
    with torch.no_grad():
        for template in moved:
            ids, mask = tok([template.format(a=colours[a], b=colours[b]) for a, b in pairs])
            assert (head(enc(ids, mask)[1]).argmax(1) == torch.tensor([b for _, b in pairs])).float().mean() > 0.95
        ids, mask = tok(["put the red cube on the blue plate"])
        shifted, shifted_mask = torch.roll(ids, 3, dims=1), torch.roll(mask, 3, dims=1)  # three empty slots first
        torch.testing.assert_close(enc(shifted, shifted_mask)[0][:, 3:10], enc(ids, mask)[0][:, :7])
        absolute = TextEncoder(1024, 32, 1, 16)
        assert not torch.allclose(absolute(shifted, shifted_mask)[0][:, 3:10], absolute(ids, mask)[0][:, :7])
    with pytest.raises(ValueError, match="text_positions"):
        tiny_config(text_positions="rotary")


def test_instruction_augmentations_act_in_training_only():
    torch.manual_seed(0)
    model = VLAPolicy(tiny_config(text_position_jitter=True, text_filler_words=0.5))
    batch = fake_batch(16)
    assert not torch.allclose(model.features(batch), model.features(batch))
    model.eval()
    torch.testing.assert_close(model.features(batch), model.features(batch))


def test_instruction_conditions_the_actions():
    """Two instructions with opposite target chunks on identical images: the policy must follow the words."""
    torch.manual_seed(0)
    config = tiny_config(expert_hidden=64)
    model = VLAPolicy(config)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = fake_batch(8, config)
    batch["task"] = ["push the red cube"] * 4 + ["push the blue cube"] * 4
    batch["action"] = torch.cat([torch.full((4, 4, 7), 0.6), torch.full((4, 4, 7), -0.6)])
    for k in ("observation.images.agentview", "observation.images.wrist", "observation.state"):
        batch[k] = batch[k][:1].expand_as(batch[k]).clone()
    for _ in range(250):
        loss = model.flow_loss(batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    chunks = model.predict_action_chunk(batch)
    assert chunks[:4].mean() > 0.3 and chunks[4:].mean() < -0.3


def test_aux_head_reads_perception_not_the_state():
    """aux_input="perception": the privileged-position head must find objects in the images (with the state in its
    input it learned to read the target off the arm's heading instead, on pick_place)."""
    torch.manual_seed(0)
    batch = fake_batch()
    moved = {**batch, "observation.state": batch["observation.state"] + 3.0}
    batch["aux_target"] = moved["aux_target"] = torch.randn(6, 5)
    perceiving = VLAPolicy(tiny_config(aux_dim=5, aux_input="perception")).eval()
    torch.testing.assert_close(perceiving.aux_loss(batch, perceiving.encode(batch)[1]), perceiving.aux_loss(moved, perceiving.encode(moved)[1]))
    assert not torch.allclose(perceiving.features(batch), perceiving.features(moved))  # the actions still see the state
    fused = VLAPolicy(tiny_config(aux_dim=5, aux_input="fused")).eval()
    assert not torch.allclose(fused.aux_loss(batch, fused.encode(batch)[1]), fused.aux_loss(moved, fused.encode(moved)[1]))


def test_state_dropout_hides_the_pose_in_training_only():
    torch.manual_seed(0)
    model = VLAPolicy(tiny_config(state_dropout=0.9))
    batch = fake_batch(B=64)
    moved = {**batch, "observation.state": batch["observation.state"].clone()}
    moved["observation.state"][:, :7] += 2.0  # another end-effector pose, the same gripper
    model.train()
    torch.manual_seed(1)
    a = model.features(batch)
    torch.manual_seed(1)
    b = model.features(moved)
    same = torch.isclose(a, b).all(dim=1)
    assert 0.75 < same.float().mean() < 1.0  # ~90 % of the samples had their pose hidden, the rest did not
    model.eval()
    assert not torch.isclose(model.features(batch), model.features(moved)).all(dim=1).any()
    with pytest.raises(ValueError, match="state_dropout must be in"):
        tiny_config(state_dropout=1.0)


def test_checkpoints_from_before_aux_input_keep_the_fused_aux_head(tmp_path):
    VLAPolicy(tiny_config(aux_dim=5, aux_input="fused")).save_pretrained(str(tmp_path / "old"))
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config["aux_input"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    assert VLAPolicy.from_pretrained(str(tmp_path / "old")).config.aux_input == "fused"
