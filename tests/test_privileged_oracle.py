"""benchmarks/privileged_oracle.py: the oracle arm's policy reads the true target and goal positions, in training
and at every decision in a real MuJoCo episode; demos without them are refused. (What it measured is in
benchmarks/RESULTS.md.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "privileged_oracle.py"
sys.path.insert(0, str(BENCH.parent))
from privileged_oracle import ARMS, PRIVILEGED, at_image_size, evaluate, train  # noqa: E402


def test_the_oracle_reads_the_true_positions_in_training_and_in_the_episode():
    from sim.rollout import collect_demos

    torch.set_num_threads(1)
    demos = at_image_size(collect_demos("pick_place", 2), 64)
    state = demos[0].observations["observation.state"].copy()
    plain, oracle = train(demos, privileged=ARMS["plain"], steps=2, seed=0), train(demos, privileged=ARMS["oracle"], steps=2, seed=0)
    assert plain.config.state_dim == state.shape[1] and oracle.config.state_dim == state.shape[1] + 6
    np.testing.assert_array_equal(demos[0].observations["observation.state"], state)  # the demos are left as they were
    # the oracle's state normalisation covers the appended positions: their mean is the demos' mean position
    positions = np.concatenate([np.concatenate([ep.privileged[k] for k in PRIVILEGED], 1) for ep in demos])
    np.testing.assert_allclose(oracle.state_mean[-6:].numpy(), positions.mean(0), atol=1e-5)
    result = evaluate(oracle, "pick_place", 1, privileged=ARMS["oracle"])
    assert set(result) == {"success", "wrong_target"} and 0 <= result["success"] <= 1


def test_the_pixel_oracle_reads_the_agentview_pixel_labels_at_every_decision():
    """--arms pixel_oracle: the state gains the target's and the goal's agentview pixel positions (what a perfect
    locator gives), in training and at each decision of the episode, where they equal the simulator's labels."""
    from kinema.train.evaluate import EVAL_SEED_OFFSET
    from sim.rollout import collect_demos, make_env

    torch.set_num_threads(1)
    demos = at_image_size(collect_demos("pick_place", 2), 64)
    keys = ARMS["pixel_oracle"]
    policy = train(demos, privileged=keys, steps=2, seed=0)
    assert policy.config.state_dim == demos[0].observations["observation.state"].shape[1] + 4
    pixels = np.concatenate([np.concatenate([ep.privileged[k] for k in keys], 1) for ep in demos])
    np.testing.assert_allclose(policy.state_mean[-4:].numpy(), pixels.mean(0), atol=1e-5)
    seen = []
    act = policy.predict_action_chunk
    policy.predict_action_chunk = lambda batch, **kw: seen.append(batch["observation.state"][0, -4:].numpy()) or act(batch, **kw)
    evaluate(policy, "pick_place", 1, privileged=keys)
    env = make_env("pick_place", image_size=64)
    _, info = env.reset(seed=EVAL_SEED_OFFSET)
    np.testing.assert_allclose(seen[0], np.concatenate([info["privileged"][k] for k in keys]), atol=1e-6)
    assert len(seen) > 1  # a decision every chunk, each with the labels appended
    env.close()


def test_demos_without_privileged_positions_are_refused(tmp_path):
    from diffusion_rl.data.lerobot_v3 import write_episodes
    from sim.rollout import collect_demos

    demos = collect_demos("pick_place", 1)
    for ep in demos:
        ep.privileged = {}
    write_episodes(tmp_path / "demos", demos)
    run = subprocess.run([sys.executable, str(BENCH), "--demos", str(tmp_path / "demos"), "--steps", "1", "--episodes", "1"],
                         capture_output=True, text=True, env={**os.environ, "MUJOCO_GL": "egl"})  # fmt: skip
    assert run.returncode != 0 and "hold no ['privileged.target_pos', 'privileged.goal_pos']" in run.stderr, run.stderr[-2000:]
