"""One loader for how a checkpoint acts (`kinema.train.acting.load_acting`), used by kinema eval, sim and deploy: the
method named in its method.pt decides; a checkpoint without one acts as the plain policy at its noise scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_train_pa_rl_dsrl import act, obs
from test_train_ppo import tiny_policy

from kinema.robot_policies import load_policy as deploy_policy
from kinema.sim_commands import acting_policy
from kinema.train.acting import load_acting
from kinema.train.evaluate import ChunkPolicy
from policies.checkpoint import METHOD_FILE


def test_a_checkpoint_without_method_pt_acts_as_the_plain_policy_at_the_noise_scale_its_run_evaluated_with(tmp_path):
    policy = tiny_policy().eval()
    policy.config.inference_noise_scale = 0.0
    policy.save_pretrained(str(tmp_path / "ckpt"))
    loaded = load_acting(tmp_path / "ckpt")
    assert (loaded.method, loaded.noise_scale, loaded.selection) == ("", 0.0, None)
    assert loaded.acting.description == "policy, initial noise scaled by 0"
    batch, seeds = obs(2), [5, 6]
    np.testing.assert_allclose(act(loaded.acting.make(), batch, seeds), act(ChunkPolicy(policy, noise_scale=0.0), batch, seeds), atol=1e-6)
    tensors = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}
    zero = policy.predict_action_chunk(tensors, noise=torch.zeros(2, policy.config.chunk_size, 7)).numpy()
    np.testing.assert_allclose(deploy_policy(str(tmp_path / "ckpt")).predict_action_chunk(batch), zero, atol=1e-6)
    np.testing.assert_allclose(acting_policy(str(tmp_path / "ckpt"))(batch), zero[:, : policy.config.n_action_steps], atol=1e-6)
    assert load_acting(tmp_path / "ckpt", noise_scale=1.0).acting.description == "policy"
    with pytest.raises(ValueError, match="--select needs a value for the chunks.*has no method.pt"):
        load_acting(tmp_path / "ckpt", select=3)


def test_a_method_pt_of_a_method_this_kinema_does_not_know_is_refused_naming_the_known_ones(tmp_path):
    tiny_policy().save_pretrained(str(tmp_path / "ckpt"))
    torch.save({"name": "teleport", "state": {}}, tmp_path / "ckpt" / METHOD_FILE)
    with pytest.raises(ValueError, match=r"method.pt was saved by the method 'teleport', which this kinema does not know; known: awr, dsrl"):
        load_acting(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="method 'teleport'"):
        deploy_policy(str(tmp_path / "ckpt"))


def test_each_policy_type_declares_what_it_can_do_and_implements_what_it_declares():
    """Trainers and commands ask a policy's declared capabilities (policies.acting.ChunkedActing), never hasattr: each
    registered type declares exactly the optional methods it has."""
    from dataclasses import fields

    from policies import POLICY_TYPES, policy_classes

    methods = {"plans": "plan", "predicts_frames": "predicted_future_images", "learns_from_experience": "experience_loss"}
    declared = {}
    for policy_type in POLICY_TYPES:
        config_class, policy_class = policy_classes(policy_type)
        for flag, method in methods.items():
            assert getattr(policy_class, flag) == hasattr(policy_class, method), (policy_type, flag)
        assert policy_class.scales_initial_noise == ("inference_noise_scale" in {f.name for f in fields(config_class)})
        declared[policy_type] = {flag for flag in [*methods, "scales_initial_noise"] if getattr(policy_class, flag)}
    assert declared == {"vla": {"scales_initial_noise"}, "video": {"plans", "predicts_frames", "learns_from_experience"},
                        "smolvla": {"scales_initial_noise"}, "pi0": {"scales_initial_noise"}}
