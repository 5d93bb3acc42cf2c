"""Evaluation that can be compared: an episode's sampling noise comes from its seed, so the same checkpoint scores
the same on the same seeds whatever the process layout, and two checkpoints on the same seeds are paired."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from test_train_ppo import tiny_policy

from kinema import common
from kinema.train.evaluate import evaluate, paired_difference

torch.set_num_threads(1)


def run(policy, **kwargs):
    result, episodes = evaluate(policy, "push", episodes=4, image_size=32, task_config={"horizon": 12, "num_distractors": 0}, **kwargs)
    return result, {ep.seed: ep.action for ep in episodes}


@pytest.mark.slow
def test_the_same_checkpoint_plays_the_same_episodes_in_process_in_workers_and_in_other_batches():
    policy = tiny_policy().eval()
    inproc, inproc_actions = run(policy, num_envs=2, num_workers=0)
    workers, worker_actions = run(policy, num_envs=2, num_workers=2)
    assert inproc.seeds == workers.seeds == sorted(inproc_actions) and inproc.outcomes == workers.outcomes
    for seed, actions in inproc_actions.items():
        np.testing.assert_array_equal(actions, worker_actions[seed])
    # Another batch size: each episode still starts every chunk from its own noise. Batched matrix products round
    # differently in the last bits, and the closed loop carries that on: equal to 1e-3 over these 12 steps.
    other, other_actions = run(policy, num_envs=3, num_workers=0)
    assert other.outcomes == inproc.outcomes
    for seed, actions in inproc_actions.items():
        np.testing.assert_allclose(actions, other_actions[seed], atol=1e-3)
    # The noise is the seed's: without it, two evaluations would differ. Another policy draws the same noise, so a
    # changed output comes from the weights alone.
    torch.manual_seed(123)
    again, again_actions = run(policy, num_envs=2, num_workers=0)
    for seed, actions in inproc_actions.items():
        np.testing.assert_array_equal(actions, again_actions[seed])


def test_chunks_are_computed_only_for_the_envs_that_take_them():
    """`collect` says which envs take a chunk from a call (step None: midway through one, or idle): the runner
    computes theirs alone, each as in the whole batch, from its own seed's noise, with its SDE record kept by env."""
    from test_train_pa_rl_dsrl import obs

    from kinema.train.evaluate import ChunkPolicy

    policy = tiny_policy().eval()
    batch, seeds = obs(4), [5, 6, 7, 8]
    whole = ChunkPolicy(policy)
    whole.about_to_act(seeds, [3, 3, 3, 3])
    every = whole.chunks(batch)
    runner = ChunkPolicy(policy)
    runner.about_to_act(seeds, [None, 3, None, 3])
    some = runner.chunks(batch)
    assert (some[[0, 2]] == 0).all()
    np.testing.assert_allclose(some[[1, 3]], every[[1, 3]], atol=1e-5)
    sde = ChunkPolicy(policy, sde_noise=0.5)
    sde.about_to_act(seeds, [None, None, 3, None])
    chunk = sde.chunks(batch)
    sde.chunk_taken(2, episode=0, step=3)
    record = sde.records[(0, 3)]
    assert record["obs"]["task"] == batch["task"][2]
    np.testing.assert_array_equal(record["obs"]["observation.state"].numpy(), batch["observation.state"][2])
    np.testing.assert_allclose(record["x_next"][-1].clamp(-1, 1).numpy(), chunk[2], atol=1e-6)  # the chunk it took


def test_paired_difference_is_per_seed_on_the_seeds_both_evaluations_ran():
    a = {"train/seeds": [1, 2, 3, 4], "train/outcomes": [0, 0, 1, 1]}
    b = {"train/seeds": [2, 3, 4, 5], "train/outcomes": [1, 1, 1, 0]}  # seed 5 is not in a, seed 1 not in b
    mean, se, n = paired_difference(a, b, "train")
    d = np.array([1, 0, 0])  # seeds 2, 3, 4
    assert n == 3 and mean == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / math.sqrt(3))
    # Paired on the same episodes, a uniform lift has no spread: the unpaired s.e. would be ~0.35 here.
    same = {"train/seeds": [1, 2, 3, 4], "train/outcomes": [1, 1, 1, 1]}
    assert paired_difference({"train/seeds": [1, 2, 3, 4], "train/outcomes": [0, 0, 0, 0]}, same, "train")[:2] == (1.0, 0.0)
    assert paired_difference(a, {"heldout_objects/seeds": [1]}, "train") is None


def test_noise_scale_zero_starts_every_chunk_from_zero_noise_and_one_is_the_sampled_policy():
    """`eval.noise_scale` / `kinema eval --noise-scale`: the episode's noise times the scale; 0 gives the same chunk for
    an observation whatever the episode's seed (deterministic), the chunk of zero noise."""
    from test_train_pa_rl_dsrl import act, obs

    from kinema.train.config import EvalConfig, TrainConfig, VideoPolicyOptions
    from kinema.train.evaluate import ChunkPolicy

    policy = tiny_policy().eval()
    batch = obs(2)
    sampled = act(ChunkPolicy(policy), batch, [5, 6])
    np.testing.assert_array_equal(act(ChunkPolicy(policy, noise_scale=1.0), batch, [5, 6]), sampled)
    zero = act(ChunkPolicy(policy, noise_scale=0.0), batch, [5, 6])
    np.testing.assert_array_equal(act(ChunkPolicy(policy, noise_scale=0.0), batch, [7, 8]), zero)  # the seed no longer matters
    with torch.no_grad():
        expected = policy.predict_action_chunk({k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()},
                                               noise=torch.zeros(2, policy.config.chunk_size, 7))  # fmt: skip
    np.testing.assert_allclose(zero, expected[:, : policy.config.n_action_steps].numpy(), atol=1e-6)
    assert not np.allclose(zero, sampled)
    half = act(ChunkPolicy(policy, noise_scale=0.5), batch, [5, 6])
    assert not np.allclose(half, zero) and not np.allclose(half, sampled)
    with pytest.raises(ValueError, match="noise_scale must be >= 0"):
        ChunkPolicy(policy, noise_scale=-1.0)
    with pytest.raises(ValueError, match="eval.noise_scale scales the VLA's initial flow noise"):
        TrainConfig(policy=VideoPolicyOptions(), eval=EvalConfig(noise_scale=0.0))


def test_a_checkpoints_inference_noise_scale_is_how_it_acts_alone_and_deploy_can_replace_it(tmp_path):
    """`VLAConfig.inference_noise_scale` (what `kinema train` writes from eval.noise_scale) scales the noise
    predict_action_chunk draws for itself (deploy, select_action); runners pass their own noise and ignore it."""
    import json

    from test_train_pa_rl_dsrl import act, obs

    from kinema.robot_policies import load_policy
    from kinema.train.evaluate import ChunkPolicy

    policy = tiny_policy().eval()
    batch = obs(2)
    tensors = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}
    sampled = act(ChunkPolicy(policy), batch, [5, 6])
    policy.config.inference_noise_scale = 0.0
    zero = policy.predict_action_chunk(tensors, noise=torch.zeros(2, policy.config.chunk_size, 7))
    torch.testing.assert_close(policy.predict_action_chunk(tensors), zero)  # deterministic: the zero-noise chunk
    np.testing.assert_array_equal(act(ChunkPolicy(policy), batch, [5, 6]), sampled)  # evaluations unaffected
    policy.save_pretrained(str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["inference_noise_scale"] == 0.0
    assert load_policy(str(tmp_path / "ckpt")).config.inference_noise_scale == 0.0
    deployed = load_policy(str(tmp_path / "ckpt"), noise_scale=1.0)
    assert deployed.config.inference_noise_scale == 1.0
    assert not torch.allclose(torch.as_tensor(deployed.predict_action_chunk(tensors)), zero)  # numpy, as the node takes
    with pytest.raises(ValueError, match="--noise-scale must be >= 0"):
        load_policy(str(tmp_path / "ckpt"), noise_scale=-0.5)
    with pytest.raises(ValueError, match="scripted:zero is a scripted policy"):
        load_policy("scripted:zero", noise_scale=0.0)
    # A checkpoint written before the field existed samples, as it always did.
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    del config["inference_noise_scale"]
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    assert load_policy(str(tmp_path / "ckpt")).config.inference_noise_scale == 1.0


def test_rollout_noise_scale_zero_makes_the_rounds_rollouts_act_from_zero_noise(tmp_path):
    """`rl.rollout_noise_scale 0`: a round's rollouts start every chunk from zero noise. Round 1 acts with the SFT
    weights, so each rollout's first actions are the SFT checkpoint's zero-noise chunk for its first observation
    (sampled noise, the default, would give other actions)."""
    from method_regression import LEAST_EVALUATION, TINY
    from rich.console import Console

    from diffusion_rl.data.lerobot_v3 import read_episodes
    from kinema.train.config import TrainConfig
    from kinema.train.workflow import train
    from policies import load_policy

    def run(*args: str) -> None:
        quiet = Console(file=open(os.devnull, "w"))
        train(common.load_config(None, [*TINY, *LEAST_EVALUATION, *args], config_class=TrainConfig), console=quiet)

    sft = tmp_path / "sft"
    run("--rl.method", "none", "--out", str(sft))
    run("--rl.method", "habc", "--rl.habc.critic_steps", "2", "--rl.rollout_noise_scale", "0", "--init_policy",
        str(sft / "checkpoints" / "sft"), "--dataset", str(sft / "demos"), "--out", str(tmp_path / "habc"))  # fmt: skip
    policy = load_policy(sft / "checkpoints" / "sft").eval()
    episodes = read_episodes(tmp_path / "habc" / "rollouts" / "round-001")
    assert len(episodes) == 4
    for ep in episodes:
        batch = {k: torch.from_numpy(np.array(v[:1])) for k, v in ep.observations.items()} | {"task": [ep.task]}
        with torch.no_grad():
            chunk = policy.predict_action_chunk(batch, noise=torch.zeros(1, policy.config.chunk_size, ep.action.shape[1]))
        n = policy.config.n_action_steps
        # within batch-of-4 against batch-of-1 float differences (~0.01); a sampled chunk differs by ~0.5
        np.testing.assert_allclose(ep.action[:n], chunk[0, :n].clamp(-1, 1).numpy(), atol=0.03)
    for method in ("dsrl", "flow_ppo"):
        with pytest.raises(ValueError, match=f"rl.method {method}.*rl.rollout_noise_scale must be 1"):
            common.load_config(None, ["--rl.method", method, "--rl.rollout_noise_scale", "0.5"], config_class=TrainConfig)
    with pytest.raises(ValueError, match="rl.rollout_noise_scale scales the VLA's initial flow noise"):
        common.load_config(None, ["--rl.rollout_noise_scale", "-1"], config_class=TrainConfig)


def test_plan_ahead_runs_each_chunk_from_index_1_as_the_policy_node_does():
    """`rl.rollout_plan_ahead`: a chunk planned at tick s runs its actions 1..n at ticks s+1..s+n, while tick s runs
    the last of the chunk before (the node's schedule); an episode's first chunk starts at index 0."""
    from kinema.train.evaluate import PlanAheadChunkPolicy
    from sim.rollout import collect, make_vector

    class Recording(PlanAheadChunkPolicy):
        def sample(self, batch):
            chunks = super().sample(batch)
            planned.append(chunks[0].numpy().copy())
            return chunks

    planned: list[np.ndarray] = []
    policy = tiny_policy().eval()  # chunks of 4, n_action_steps 2
    vector = make_vector("push", 1, num_workers=0, image_size=32, config={"horizon": 12, "num_distractors": 0})
    try:
        (episode,) = collect(vector, Recording(policy), [5], task_id="push")
    finally:
        vector.close()
    expected = [planned[0][0], planned[0][1]]
    for before, chunk in zip(planned, planned[1:]):
        expected += [before[2], chunk[1]]
    np.testing.assert_array_equal(episode.action, np.stack(expected)[: len(episode)])
    assert len(episode) == 12 and len(planned) == 6
    with pytest.raises(ValueError, match="chunk_size 4 must exceed n_action_steps 4"):
        PlanAheadChunkPolicy(policy, n_action_steps=4)


def test_plan_ahead_is_refused_where_a_method_acts_with_a_runner_of_its_own_or_a_robot_runs_the_rounds():
    from kinema.train.config import TrainConfig

    def load(*args):
        return common.load_config(None, ["--rl.rollout_plan_ahead", "true", *args], config_class=TrainConfig)

    assert load("--rl.method", "habc").rl.rollout_plan_ahead
    with pytest.raises(ValueError, match="rl.method 'dsrl' acts with a runner of its own"):
        load("--rl.method", "dsrl")
    with pytest.raises(ValueError, match="a robot's rounds already run through the node"):
        load("--robot.config", "sim_panda")
