"""Rollouts on Ray: a local cluster of 2 simulated nodes on 127.0.0.1 plays the same episodes as the local backend for
the same seeds, and a Ray actor killed mid-round loses no episode (its seeds re-run, the count reported)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch
from test_train_ppo import tiny_policy

from kinema.train.config import TrainConfig
from kinema.train.evaluate import ChunkPolicy
from kinema.train.methods.base import roll_out_policy
from kinema.train.ray_rollout import pin_to_loopback, ray_available

# As in every env worker (sim.vector, the Ray actors): llvmpipe rendering with one thread in this process too.
os.environ.setdefault("LP_NUM_THREADS", "1")
pytestmark = [pytest.mark.skipif(not ray_available(), reason="ray is not installed (pip install 'kinema[dist]')"),
              pytest.mark.timeout(180)]
torch.set_num_threads(1)

TASK_CONFIG = {"horizon": 10, "num_distractors": 0}


@pytest.fixture(scope="module")
def cluster():
    pin_to_loopback()
    import ray
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                           "include_dashboard": False, "object_store_memory": 80 * 2**20})  # fmt: skip
    nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=80 * 2**20)
    ray.init(address=nodes.address, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield nodes
    from kinema.train.ray_rollout import shutdown

    shutdown()
    ray.shutdown()
    nodes.shutdown()


def _config(backend: str, num_envs: int, workers: int, interventions: bool) -> TrainConfig:
    # With the simulated human: long enough for it to see the policy stall (MonitorConfig.stall_steps) and take over.
    task_config = {**TASK_CONFIG, "horizon": 40} if interventions else TASK_CONFIG
    cfg = TrainConfig(task="push", task_config=task_config, num_envs=num_envs, workers=workers)
    cfg.rl.interventions = interventions
    cfg.policy.image_size = 32
    cfg.rollout.backend = backend
    return cfg


def by_seed(episodes):
    return {ep.seed: ep for ep in episodes}


def assert_same_episodes(local, remote) -> None:
    a, b = by_seed(local), by_seed(remote)
    assert sorted(a) == sorted(b) and len(local) == len(remote)
    for seed in a:
        for key in a[seed].observations:
            np.testing.assert_array_equal(a[seed].observations[key], b[seed].observations[key], err_msg=f"{seed} {key}")
        np.testing.assert_array_equal(a[seed].action, b[seed].action)
        np.testing.assert_array_equal(a[seed].executed_by, b[seed].executed_by)
        np.testing.assert_array_equal(a[seed].reward, b[seed].reward)
        assert a[seed].outcome == b[seed].outcome and len(a[seed]) == len(b[seed])


@pytest.mark.parametrize("interventions", [False, True])
def test_ray_rollouts_equal_local_rollouts_for_the_same_seeds(cluster, interventions):
    policy = tiny_policy().eval()
    seeds = [5, 6, 7, 8]
    # One env per batch on both sides: the same batch shape, so the same arithmetic to the last bit.
    local = roll_out_policy(ChunkPolicy(policy), _config("local", 1, 0, interventions), seeds, 1)
    record: dict = {}
    remote = roll_out_policy(ChunkPolicy(policy), _config("ray", 2, 2, interventions), seeds, 1, record=record)
    assert_same_episodes(local, remote)
    weight_bytes = sum(v.numel() * v.element_size() for v in policy.state_dict().values())
    # The policy travels whole (torch.save of the module): its weights and little else.
    assert record["rollout/reran"] == 0 and weight_bytes < record["rollout/broadcast_bytes"] < weight_bytes + 2**16
    if interventions:
        assert any((ep.executed_by != 0).any() for ep in remote)  # the simulated human did act
        return
    # New weights go out with the next round: the actors act with them, not with the ones they loaded first.
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    local2 = roll_out_policy(ChunkPolicy(policy), _config("local", 1, 0, interventions), seeds, 2)
    remote2 = roll_out_policy(ChunkPolicy(policy), _config("ray", 2, 2, interventions), seeds, 2)
    assert_same_episodes(local2, remote2)
    assert not all(np.array_equal(by_seed(local)[s].action, by_seed(local2)[s].action) for s in seeds)


def test_an_actor_killed_mid_round_loses_no_episode_and_the_round_reports_the_rerun(cluster):
    from kinema.train.ray_rollout import pool_for

    policy = tiny_policy().eval()
    seeds = list(range(20, 28))
    cfg = _config("ray", 2, 2, False)
    pool = pool_for(cfg, dict(image_size=32, config=TASK_CONFIG), policy, len(seeds))  # the pool the round will use
    pids = pool.pids()  # asked before the round: an actor answers only between its tasks
    killed: list[int] = []

    def kill_a_busy_actor(episode) -> None:  # as the first episodes come back, the other actor is mid-task
        if not killed and pool.busy_slots():
            killed.append(pids[pool.busy_slots()[0]])
            os.kill(killed[0], signal.SIGKILL)

    record, lines = {}, []
    episodes = roll_out_policy(ChunkPolicy(policy), cfg, seeds, 3, on_episode=kill_a_busy_actor, record=record, log=lines.append)
    assert killed and record["rollout/reran"] >= 1
    assert any(f"{record['rollout/reran']} episode(s) re-ran" in line for line in lines)
    local = roll_out_policy(ChunkPolicy(policy), _config("local", 1, 0, False), seeds, 3)
    assert_same_episodes(local, episodes)  # every seed once, played as locally
    assert killed[0] not in pool.pids() and len(pool.pids()) == 2  # the dead actor was replaced


def test_a_smolvla_acts_on_ray_as_locally_with_the_normalisation_its_state_dict_leaves_out(cluster):
    """A SmolVLA's normalisation stats are kept out of its state dict (LeRobot's model.safetensors holds none): the
    actors get the policy whole, so they act with the run's stats, not the checkpoint's."""
    from pathlib import Path

    from policies.smolvla import SmolVLAPolicy

    fixture = Path(__file__).parent / "fixtures" / "smolvla"
    policy = SmolVLAPolicy.from_pretrained(fixture / "tiny-smolvla", vlm_path=str(fixture / "tiny-smolvlm")).eval()
    policy.set_normalization({"observation.state": {"mean": np.full(8, 0.3), "std": np.full(8, 0.5)},
                              "action": {"mean": np.full(7, 0.1), "std": np.full(7, 2.0)}})  # fmt: skip
    assert not any("mean" in k for k in policy.state_dict())
    seeds = [5, 6]
    local = roll_out_policy(ChunkPolicy(policy), _config("local", 1, 0, False), seeds, 1)
    remote = roll_out_policy(ChunkPolicy(policy), _config("ray", 2, 2, False), seeds, 1)
    assert_same_episodes(local, remote)
