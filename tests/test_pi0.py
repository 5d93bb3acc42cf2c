"""kinema's pi0 port against LeRobot's own code.

tests/fixtures/pi0 holds a tiny pi0 built, saved and run by LeRobot main (`lerobot_pi0.py make-fixture` in LeRobot's
venv: transformers 5.5.4): its folder as LeRobot writes it (with the tokenizer it saves beside the checkpoint), and
reference.safetensors with fixed inputs, noise, tokens, the action chunk, the velocity field at four flow times and
the training loss. The port must reproduce them; what kinema saves after training must act the same under LeRobot's
code (with KINEMA_LEROBOT_PI0_PYTHON set to that venv's Python: LeRobot main is not on the package registry, so
.ci/run cannot build it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from policies import load_policy
from policies.pi0 import Pi0Config, Pi0Policy
from policies.pi0.configuration_pi0 import KINEMA_FILE

torch.set_num_threads(1)
FIXTURE = Path(__file__).parent / "fixtures" / "pi0"
CHECKPOINT = FIXTURE / "tiny-pi0"
LEROBOT_PYTHON = os.environ.get("KINEMA_LEROBOT_PI0_PYTHON", "")
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def reference() -> dict:
    return {**load_file(str(FIXTURE / "reference.safetensors")), "tasks": json.loads((FIXTURE / "tasks.json").read_text())}


def load(**kw) -> Pi0Policy:
    return Pi0Policy.from_pretrained(CHECKPOINT, **kw).eval()


def observation(ref: dict) -> dict:
    return {"observation.images.agentview": ref["image.agentview"], "observation.images.wrist": ref["image.wrist"],
            "observation.state": ref["state"], "task": ref["tasks"]}  # fmt: skip


def train_steps(policy: Pi0Policy, reference: dict, steps: int, lr: float = 1e-2) -> None:
    """A few Adam steps of the flow loss on the fixture's observation and random actions; leaves it in eval mode."""
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=lr)
    batch = {**observation(reference), "action": torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(7))}
    policy.train()
    for _ in range(steps):
        opt.zero_grad()
        policy.flow_loss(batch).mean().backward()
        opt.step()
    policy.eval()


def test_port_reproduces_lerobot_pi0(reference):
    """Tokens, the chunk from fixed noise (40×48 frames resized with π0's centred padding to 32), and the velocity
    field at four flow times from the prefix's cache, as LeRobot's code computed them."""
    policy = load()
    tokens, mask = policy.tokenize(reference["tasks"])
    assert torch.equal(tokens, reference["tokens"]) and torch.equal(mask.long(), reference["token_mask"])
    batch = observation(reference)
    torch.testing.assert_close(policy.predict_action_chunk(batch, noise=reference["noise"]), reference["actions"], **TOLERANCE)
    prefix = policy.encode(batch)[0]
    for x_t, t, v in zip(reference["x_t"], reference["times"], reference["velocity"], strict=True):
        torch.testing.assert_close(policy.model.velocity(prefix, x_t, t.expand(2)), v, **TOLERANCE)


def test_flow_loss_is_lerobots_per_sample_loss(reference):
    """LeRobot's training pass (prefix and suffix jointly) gives the per-element loss; kinema's cached prefix and
    the RL core's flow loss give its per-sample mean (LeRobot's reduction="none" over every padded dimension)."""
    policy = load()
    x0 = reference["train_actions"][..., : policy.config.action_dim]
    stats = policy.stats["action"]
    batch = {**observation(reference), "action": x0 * stats["std"] + stats["mean"], "t": reference["train_time"],
             "noise": reference["noise"]}  # fmt: skip
    torch.testing.assert_close(policy.flow_loss(batch), reference["train_losses"].mean(dim=(1, 2)), **TOLERANCE)


def test_a_kinema_batch_acts_through_the_protocol(reference):
    from test_smolvla import assert_a_kinema_batch_acts

    policy = load()
    assert policy.config.cameras == ("agentview", "wrist") and policy.config.num_steps == 5
    assert policy.config.hidden_dim == 64 + 32  # the prefix's pooled width beside the padded state
    assert_a_kinema_batch_acts(policy, padded_dim=32)
    # the critics see the state: the feature's tail is the normalised state
    state = torch.randn(2, 8)
    features = policy.features({**observation(reference), "observation.state": state})
    stats = policy.stats["observation.state"]
    torch.testing.assert_close(features[:, 64:72], (state - stats["mean"]) / (stats["std"] + 1e-8))


def test_the_state_reaches_the_actions_through_the_suffix(reference):
    """π0 reads the state in the expert's suffix, not the prefix: another state leaves the prefix's keys as they were
    and moves the chunk."""
    policy = load()
    batch = observation(reference)
    moved = {**batch, "observation.state": reference["state"] + 1.0}
    a, b = policy.encode(batch)[0], policy.encode(moved)[0]
    assert all(torch.equal(x, y) for x, y in zip(a.keys, b.keys, strict=True))
    chunk = policy.predict_action_chunk(batch, noise=reference["noise"])
    assert (policy.predict_action_chunk(moved, noise=reference["noise"]) - chunk).abs().max() > 1e-3


def test_expert_training_moves_the_expert_only(reference):
    policy = load()
    vlm_before = {k: v.clone() for k, v in policy.state_dict().items() if ".paligemma." in k}
    expert_before = policy.model.paligemma_with_expert.gemma_expert.model.layers[1].self_attn.k_proj.weight.clone()
    state_proj_before = policy.model.state_proj.weight.clone()
    train_steps(policy, reference, 3, lr=1e-3)
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in vlm_before.items())
    assert not torch.equal(expert_before, policy.model.paligemma_with_expert.gemma_expert.model.layers[1].self_attn.k_proj.weight)
    assert not torch.equal(state_proj_before, policy.model.state_proj.weight)  # the state is the expert's input in π0
    policy.set_trainable("vlm")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert any(".language_model.layers." in n for n in trainable) and not any(".vision_tower." in n for n in trainable)
    policy.set_trainable("all")
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    assert frozen == {"model.paligemma_with_expert.paligemma.lm_head.weight", "model.paligemma_with_expert.gemma_expert.lm_head.weight"}


def test_saved_by_kinema_loads_in_kinema_and_keeps_lerobots_files(tmp_path, reference):
    policy = load(camera_map={"front": "observation.images.agentview"})
    with torch.no_grad():
        policy.model.action_out_proj.bias.add_(0.1)
    policy.save_pretrained(tmp_path / "ckpt")
    for name in ("config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json", KINEMA_FILE,
                 "tokenizer/tokenizer.json"):  # fmt: skip
        assert (tmp_path / "ckpt" / name).is_file(), name
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == json.loads((CHECKPOINT / "config.json").read_text())
    # load_policy knows LeRobot's "type": "pi0"; the camera map and vision heads come from kinema's file
    again = load_policy(tmp_path / "ckpt").eval()
    assert isinstance(again, Pi0Policy) and again.config.cameras == ("front", "wrist") and again.config.vision_heads == 4
    batch = {**observation(reference), "observation.images.front": reference["image.agentview"]}
    torch.testing.assert_close(again.predict_action_chunk(batch, noise=reference["noise"]),
                               policy.predict_action_chunk(batch, noise=reference["noise"]))  # fmt: skip


def test_a_checkpoint_converted_from_openpi_loads_as_lerobot_loads_it(tmp_path, reference):
    """Keys without "model.", time_mlp_* for action_time_mlp_*, the embedding only as the tied lm_head, no expert
    lm_head: LeRobot's from_pretrained fixes these, and so does kinema's; the actions are the fixture's."""
    folder = tmp_path / "converted"
    shutil.copytree(CHECKPOINT, folder)
    weights = load_file(str(folder / "model.safetensors"))
    embedding = weights.pop("model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight")
    weights["model.paligemma_with_expert.paligemma.lm_head.weight"] = embedding  # tied, as openpi's are
    del weights["model.paligemma_with_expert.gemma_expert.lm_head.weight"]
    renamed = {k.removeprefix("model.").replace("action_time_mlp", "time_mlp"): v for k, v in weights.items()}
    save_file(renamed, str(folder / "model.safetensors"))
    policy = Pi0Policy.from_pretrained(folder).eval()
    torch.testing.assert_close(policy.predict_action_chunk(observation(reference), noise=reference["noise"]), reference["actions"], **TOLERANCE)


def test_a_tokenizer_named_by_path_is_read_there_and_never_written(tmp_path, reference):
    """A preprocessor whose tokenizer_name is an absolute path (a local PaliGemma tokenizer): kinema reads it there,
    and saving writes nothing outside the new folder (the tokenizer is LeRobot's to find where it named it)."""
    folder, tokenizer = tmp_path / "ckpt", tmp_path / "paligemma-tokenizer"
    shutil.copytree(CHECKPOINT, folder)
    shutil.move(folder / "tokenizer", tokenizer)
    pre = json.loads((folder / "policy_preprocessor.json").read_text())
    for step in pre["steps"]:
        if step["registry_name"] == "tokenizer_processor":
            step["config"]["tokenizer_name"] = str(tokenizer)
            step.pop("artifacts", None)
    (folder / "policy_preprocessor.json").write_text(json.dumps(pre))
    before = {f.name: f.stat().st_mtime_ns for f in tokenizer.iterdir()}
    policy = Pi0Policy.from_pretrained(folder).eval()
    torch.testing.assert_close(policy.predict_action_chunk(observation(reference), noise=reference["noise"]), reference["actions"], **TOLERANCE)
    policy.save_pretrained(tmp_path / "saved")
    assert {f.name: f.stat().st_mtime_ns for f in tokenizer.iterdir()} == before
    assert not (tmp_path / "saved" / "tokenizer").exists()
    assert Pi0Policy.from_pretrained(tmp_path / "saved").tokenize(["open"])[0].tolist() == policy.tokenize(["open"])[0].tolist()


def test_bad_input_is_named(tmp_path, reference):
    policy = load()
    batch = observation(reference)
    del batch["observation.images.wrist"]
    with pytest.raises(KeyError, match="observation.images.wrist.*camera_map"):
        policy.predict_action_chunk(batch)
    with pytest.raises(ValueError, match="observation.state has 5 values.*8"):
        policy.predict_action_chunk({**observation(reference), "observation.state": torch.randn(2, 5)})
    folder = tmp_path / "copy"
    shutil.copytree(CHECKPOINT, folder)
    shutil.rmtree(folder / "tokenizer")  # a checkpoint saved without its tokenizer, whose name is no local folder
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        Pi0Policy.from_pretrained(folder)
    assert torch.equal(Pi0Policy.from_pretrained(folder, tokenizer_path=str(CHECKPOINT / "tokenizer")).tokenize(["open"])[0],
                       policy.tokenize(["open"])[0])  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_relative_actions": True}))
    with pytest.raises(ValueError, match="use_relative_actions"):
        Pi0Policy.from_pretrained(folder, tokenizer_path=str(CHECKPOINT / "tokenizer"))
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.state_proj.bias"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*model.state_proj.bias"):
        Pi0Policy.from_pretrained(folder, tokenizer_path=str(CHECKPOINT / "tokenizer"))
    with pytest.raises(ValueError, match="image_resolution must be square"):
        Pi0Config(image_resolution=(32, 48))


def test_lora_on_the_vlm_trains_adapters_and_saves_them_merged_in_lerobots_layout(tmp_path, reference):
    policy = load(trainable="lora", lora_rank=4, lora_alpha=8.0)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert any(".language_model." in n and "lora_" in n for n in trainable)
    assert not any(".paligemma." in n and "lora_" not in n for n in trainable)
    train_steps(policy, reference, 3)
    ours = policy.predict_action_chunk(observation(reference), noise=reference["noise"])
    policy.save_pretrained(tmp_path / "merged")
    saved = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert set(saved) == set(load_file(str(CHECKPOINT / "model.safetensors")))  # LeRobot's names, no adapters
    plain = load().eval()
    assert not torch.allclose(plain.predict_action_chunk(observation(reference), noise=reference["noise"]), ours)
    again = Pi0Policy.from_pretrained(tmp_path / "merged", trainable="expert").eval()
    torch.testing.assert_close(again.predict_action_chunk(observation(reference), noise=reference["noise"]), ours, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not LEROBOT_PYTHON, reason="set KINEMA_LEROBOT_PI0_PYTHON to a Python with LeRobot main (lerobot_pi0.py's venv)")
def test_post_trained_weights_act_the_same_under_lerobots_code(tmp_path, reference):
    """Weights trained by kinema (LoRA on the VLM, merged), and normalisation stats taken from a dataset, saved into
    LeRobot's files: LeRobot's own pi0 and processors act as kinema does, to 1e-5."""
    policy = load(trainable="lora", lora_rank=4)
    g = torch.Generator().manual_seed(3)
    policy.set_normalization({"observation.state": {"mean": torch.randn(8, generator=g), "std": torch.rand(8, generator=g) + 0.1},
                              "action": {"mean": torch.randn(7, generator=g), "std": torch.rand(7, generator=g) + 0.1}})  # fmt: skip
    train_steps(policy, reference, 5)
    ours = policy.predict_action_chunk(observation(reference), noise=reference["noise"])
    assert (ours - reference["actions"]).abs().max() > 1e-2  # training moved the actions: the comparison below can tell
    policy.save_pretrained(tmp_path / "exported")
    save_file({k: reference[k].contiguous() for k in ("image.agentview", "image.wrist", "state", "noise")}, str(tmp_path / "inputs.safetensors"))
    (tmp_path / "tasks.json").write_text(json.dumps(reference["tasks"]))
    subprocess.run([LEROBOT_PYTHON, str(FIXTURE / "lerobot_pi0.py"), "act", "--checkpoint", str(tmp_path / "exported"),
                    "--inputs", str(tmp_path / "inputs.safetensors"), "--tasks", str(tmp_path / "tasks.json"),
                    "--out", str(tmp_path / "theirs.safetensors")], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)  # fmt: skip
    torch.testing.assert_close(load_file(str(tmp_path / "theirs.safetensors"))["actions"], ours, atol=1e-5, rtol=1e-5)
