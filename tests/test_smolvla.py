"""kinema's SmolVLA port against LeRobot's own code.

tests/fixtures/smolvla holds a tiny SmolVLA built, saved and run by lerobot 0.4.4 (`lerobot_smolvla.py make-fixture`
in LeRobot's venv: transformers 4.57): its folder as LeRobot writes it, and reference.safetensors with fixed inputs,
noise, tokens, the action chunk, the velocity field at four flow times and the training loss. The port must
reproduce them; what kinema saves after training must act the same under LeRobot's code (with
KINEMA_LEROBOT_PYTHON set, as .ci/run sets it).
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

from diffusion_rl.protocol import FlowPolicy
from policies import load_policy
from policies.smolvla import SmolVLAConfig, SmolVLAPolicy
from policies.smolvla.configuration_smolvla import KINEMA_FILE

torch.set_num_threads(1)
FIXTURE = Path(__file__).parent / "fixtures" / "smolvla"
CHECKPOINT, VLM = FIXTURE / "tiny-smolvla", FIXTURE / "tiny-smolvlm"
LEROBOT_PYTHON = os.environ.get("KINEMA_LEROBOT_PYTHON", "")
TOLERANCE = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def reference() -> dict:
    return {**load_file(str(FIXTURE / "reference.safetensors")), "tasks": json.loads((FIXTURE / "tasks.json").read_text())}


def train_steps(policy: SmolVLAPolicy, reference: dict, steps: int, lr: float = 1e-2) -> None:
    """A few Adam steps of the flow loss on the fixture's observation and random actions; leaves it in eval mode."""
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=lr)
    batch = {**observation(reference), "action": torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(7))}
    policy.train()
    for _ in range(steps):
        opt.zero_grad()
        policy.flow_loss(batch).mean().backward()
        opt.step()
    policy.eval()


def load(**kw) -> SmolVLAPolicy:
    return SmolVLAPolicy.from_pretrained(CHECKPOINT, vlm_path=str(VLM), **kw).eval()


def observation(ref: dict) -> dict:
    return {"observation.images.agentview": ref["image.agentview"], "observation.images.wrist": ref["image.wrist"],
            "observation.state": ref["state"], "task": ref["tasks"]}  # fmt: skip


def test_port_reproduces_lerobot_smolvla(reference):
    policy = load()
    tokens, mask = policy.tokenize(reference["tasks"])
    assert torch.equal(tokens, reference["tokens"]) and torch.equal(mask.long(), reference["token_mask"])
    batch = observation(reference)
    torch.testing.assert_close(policy.predict_action_chunk(batch, noise=reference["noise"]), reference["actions"], **TOLERANCE)
    prefix = policy.encode(batch)[0]
    for x_t, t, v in zip(reference["x_t"], reference["times"], reference["velocity"], strict=True):
        torch.testing.assert_close(policy.model.velocity(prefix, x_t, t.expand(2)), v, **TOLERANCE)


def test_flow_loss_is_lerobots_per_sample_loss_and_weights_it(reference):
    policy = load()
    x0 = reference["train_actions"][..., : policy.config.action_dim]
    stats = policy.stats["action"]
    batch = {**observation(reference), "action": x0 * stats["std"] + stats["mean"], "t": reference["train_time"],
             "noise": reference["noise"]}  # fmt: skip
    expected = reference["train_losses"].mean(dim=(1, 2))  # LeRobot's forward(reduction="none")
    loss = policy.flow_loss(batch)
    assert loss.shape == (2,)
    torch.testing.assert_close(loss, expected, **TOLERANCE)
    torch.testing.assert_close(policy.flow_loss(batch, weights=torch.tensor([2.0, 0.0])), expected * torch.tensor([2.0, 0.0]), **TOLERANCE)
    pad = torch.tensor([[False, False, True, True]] * 2)  # padded steps leave the mean, as the VLA's do
    torch.testing.assert_close(policy.flow_loss({**batch, "action_is_pad": pad}), reference["train_losses"][:, :2].mean(dim=(1, 2)), **TOLERANCE)


def test_a_kinema_batch_acts_through_the_protocol(reference):
    policy = load()
    assert policy.config.cameras == ("agentview", "wrist") and policy.config.hidden_dim == 32
    assert_a_kinema_batch_acts(policy, padded_dim=16)


def assert_a_kinema_batch_acts(policy, *, padded_dim: int) -> None:
    """A LeRobot flow VLA as kinema's runners and the RL core use it: kinema's uint8 HWC frames (48 px, converted and
    resized with padding as LeRobot does), features for the critics, deterministic chunks from given noise, SDE
    chunks whose recorded steps score their own log-probabilities, and select_action on one observation."""
    assert isinstance(policy, FlowPolicy)
    frames = {f"observation.images.{c}": torch.randint(0, 256, (3, 48, 48, 3), dtype=torch.uint8) for c in ("agentview", "wrist")}
    batch = {**frames, "observation.state": torch.randn(3, 8), "task": ["open the top drawer"] * 3}
    assert policy.features(batch).shape == (3, policy.config.hidden_dim)
    noise = torch.randn(3, 4, 7)  # kinema's runners draw noise over the action's own dims
    chunk = policy.predict_action_chunk(batch, noise=noise)
    assert chunk.shape == (3, 4, 7)
    torch.testing.assert_close(chunk, policy.predict_action_chunk(batch, noise=noise))
    sde_chunk, record = policy.sample_chunk_sde(batch, noise_level=0.5)
    assert sde_chunk.shape == (3, 4, 7) and record["x_t"].shape == (3, policy.config.num_steps, 4, padded_dim)
    step = policy.sde_log_prob({**batch, "x_t": record["x_t"][:, 0], "t": record["t"][0].expand(3),
                                "t_next": record["t_next"][0].expand(3), "x_next": record["x_next"][:, 0]}, noise_level=0.5)  # fmt: skip
    torch.testing.assert_close(step.log_prob, record["log_prob"][:, 0], atol=1e-3, rtol=1e-4)
    obs = {k: (v[0].numpy() if torch.is_tensor(v) else v[0]) for k, v in batch.items()}
    assert policy.select_action(obs).shape == (7,)


def test_expert_training_moves_the_expert_only(reference):
    policy = load()
    vlm_before = {k: v.clone() for k, v in policy.state_dict().items() if ".vlm." in k}
    expert_before = policy.model.vlm_with_expert.lm_expert.layers[1].self_attn.k_proj.weight.clone()
    train_steps(policy, reference, 3, lr=1e-3)
    assert all(torch.equal(v, policy.state_dict()[k]) for k, v in vlm_before.items())
    assert not torch.equal(expert_before, policy.model.vlm_with_expert.lm_expert.layers[1].self_attn.k_proj.weight)
    policy.set_trainable("vlm")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert any(".text_model.layers." in n for n in trainable) and not any(".vision_model." in n for n in trainable)
    policy.set_trainable("all")
    assert {n for n, p in policy.named_parameters() if not p.requires_grad} == {"model.vlm_with_expert.vlm.lm_head.weight"}


def test_saved_by_kinema_loads_in_kinema_and_keeps_lerobots_files(tmp_path, reference):
    policy = load(camera_map={"front": "observation.images.agentview"})
    with torch.no_grad():
        policy.model.action_out_proj.bias.add_(0.1)
    policy.save_pretrained(tmp_path / "ckpt")
    for name in ("config.json", "model.safetensors", "policy_preprocessor.json", "policy_postprocessor.json", KINEMA_FILE):
        assert (tmp_path / "ckpt" / name).is_file(), name
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text()) == json.loads((CHECKPOINT / "config.json").read_text())
    # load_policy knows LeRobot's "type": "smolvla"; the VLM folder and camera map come from kinema's file
    again = load_policy(tmp_path / "ckpt").eval()
    assert isinstance(again, SmolVLAPolicy) and again.config.cameras == ("front", "wrist")
    batch = {**observation(reference), "observation.images.front": reference["image.agentview"]}
    torch.testing.assert_close(again.predict_action_chunk(batch, noise=reference["noise"]),
                               policy.predict_action_chunk(batch, noise=reference["noise"]))  # fmt: skip


def test_bad_input_is_named(tmp_path, reference):
    policy = load()
    batch = observation(reference)
    del batch["observation.images.wrist"]
    with pytest.raises(KeyError, match="observation.images.wrist.*camera_map"):
        policy.predict_action_chunk(batch)
    with pytest.raises(ValueError, match="observation.state has 5 values.*8"):
        policy.predict_action_chunk({**observation(reference), "observation.state": torch.randn(2, 5)})
    with pytest.raises(FileNotFoundError, match="vlm_path"):
        SmolVLAPolicy.from_pretrained(CHECKPOINT)  # its vlm_model_name is no folder here, nor in a local cache
    shutil.copytree(CHECKPOINT, tmp_path / "aloha")
    config = json.loads((tmp_path / "aloha" / "config.json").read_text())
    (tmp_path / "aloha" / "config.json").write_text(json.dumps({**config, "adapt_to_pi_aloha": True}))
    with pytest.raises(ValueError, match="adapt_to_pi_aloha"):
        SmolVLAPolicy.from_pretrained(tmp_path / "aloha", vlm_path=str(VLM))
    with pytest.raises(ValueError, match="camera_map names.*observation.images.top"):
        SmolVLAConfig(camera_map={"agentview": "observation.images.top"})


@pytest.mark.skipif(not LEROBOT_PYTHON, reason="set KINEMA_LEROBOT_PYTHON to a Python with lerobot 0.4.4 and transformers 4.57 (.ci/run builds one)")
def test_post_trained_weights_act_the_same_under_lerobots_code(tmp_path, reference):
    """Weights trained by kinema, and normalisation stats taken from a dataset (`policy.normalization dataset`), saved
    into LeRobot's files: LeRobot's own SmolVLA and processors act as kinema does, to 1e-5."""
    policy = load()
    g = torch.Generator().manual_seed(3)
    policy.set_normalization({"observation.state": {"mean": torch.randn(8, generator=g), "std": torch.rand(8, generator=g) + 0.1},
                              "action": {"mean": torch.randn(7, generator=g), "std": torch.rand(7, generator=g) + 0.1}})  # fmt: skip
    train_steps(policy, reference, 5)
    before = load().predict_action_chunk(observation(reference), noise=reference["noise"])
    ours = policy.predict_action_chunk(observation(reference), noise=reference["noise"])
    assert (ours - before).abs().max() > 1e-2  # training moved the actions: the comparison below can tell
    policy.save_pretrained(tmp_path / "exported", vlm_model_name=str(VLM.resolve()))
    save_file({k: reference[k].contiguous() for k in ("image.agentview", "image.wrist", "state", "noise")}, str(tmp_path / "inputs.safetensors"))
    (tmp_path / "tasks.json").write_text(json.dumps(reference["tasks"]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([LEROBOT_PYTHON, str(FIXTURE / "lerobot_smolvla.py"), "act", "--checkpoint", str(tmp_path / "exported"),
                    "--inputs", str(tmp_path / "inputs.safetensors"), "--tasks", str(tmp_path / "tasks.json"),
                    "--out", str(tmp_path / "theirs.safetensors")], check=True, env=env, timeout=300)  # fmt: skip
    torch.testing.assert_close(load_file(str(tmp_path / "theirs.safetensors"))["actions"], ours, atol=1e-5, rtol=1e-5)


def test_lora_on_the_vlm_trains_adapters_and_saves_them_merged_in_lerobots_layout(tmp_path, reference):
    policy = load(trainable="lora", lora_rank=4, lora_alpha=8.0)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert any(".text_model." in n and "lora_" in n for n in trainable)
    assert not any(".vlm." in n and "lora_" not in n for n in trainable)  # the VLM's own weights stay frozen
    train_steps(policy, reference, 3)
    ours = policy.predict_action_chunk(observation(reference), noise=reference["noise"])
    policy.save_pretrained(tmp_path / "ckpt")
    saved, original = load_file(str(tmp_path / "ckpt" / "model.safetensors")), load_file(str(CHECKPOINT / "model.safetensors"))
    assert set(saved) == set(original)  # LeRobot's names: the adapters merged in
    q = "model.vlm_with_expert.vlm.model.text_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(saved[q], original[q])
    assert all(torch.equal(saved[k], original[k]) for k in original if ".vision_model." in k)
    again = SmolVLAPolicy.from_pretrained(tmp_path / "ckpt").eval()  # kinema's file: trainable lora, fresh adapters at zero
    assert again.config.trainable == "lora"
    torch.testing.assert_close(again.predict_action_chunk(observation(reference), noise=reference["noise"]), ours, atol=1e-5, rtol=1e-5)
