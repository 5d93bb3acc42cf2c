"""The peer arms of benchmarks/imitation.py: LeRobot's own ACT and Diffusion Policy, run from LeRobot's venv
(KINEMA_LEROBOT_PYTHON, with lerobot==0.4.4 and torchvision; `.ci/run` builds it; skipped without it), on a real kinema
demonstration folder.

- The pipeline check: what a peer sees of a demo's first frame in training (LeRobotDataset + its preprocessor) equals
  what it sees when kinema's evaluation resets the env at that demo's seed and sends the live observation (the serve
  path), up to the video codec; the instruction feature is the same vector on both sides; kinema's own reader decodes
  the same frame.
- A peer served to kinema's evaluation keeps each env's action queue apart: resetting one env does not disturb another.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
LEROBOT_PYTHON = os.environ.get("KINEMA_LEROBOT_PYTHON", "")
pytestmark = pytest.mark.skipif(not (LEROBOT_PYTHON and Path(LEROBOT_PYTHON).exists()),
                                reason="set KINEMA_LEROBOT_PYTHON to LeRobot's venv (benchmarks/imitation.py says how)")  # fmt: skip
sys.path.insert(0, str(REPO / "benchmarks"))

TINY = {
    "act": ["chunk_size=8", "n_action_steps=4", "dim_model=32", "n_heads=2", "dim_feedforward=64", "n_encoder_layers=1",
            "n_vae_encoder_layers=1", "latent_dim=8"],  # fmt: skip
}


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    from kinema.cli import main

    out = tmp_path_factory.mktemp("peers") / "demos"
    assert main(["sim", "collect", "--task", "drawer", "--episodes", "2", "--seed", "7", "--out", str(out), "--workers", "0",
                 "--image-size", "64"]) == 0
    return out


@pytest.fixture(scope="module")
def tiny_act(demos, tmp_path_factory):
    out = tmp_path_factory.mktemp("act") / "act"
    subprocess.run([LEROBOT_PYTHON, str(REPO / "benchmarks" / "lerobot_peer.py"), "train", "--policy", "act", "--dataset", str(demos),
                    "--out", str(out), "--steps", "2", "--batch-size", "4", "--threads", "1", *[f"--set={s}" for s in TINY["act"]]],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)  # fmt: skip
    return out


def test_a_peer_sees_a_demos_first_frame_in_training_as_it_sees_the_live_env_at_that_seed(demos, tiny_act, tmp_path):
    from diffusion_rl.data import LeRobotDatasetReader
    from lerobot_peer import ENV_STATE, instruction_feature
    from sim.rollout import make_vector

    episode = LeRobotDatasetReader(demos)[0]
    vector = make_vector("drawer", 1, image_size=64, instructions="train", objects="train")
    try:
        live, _ = vector.reset_at(0, episode.seed)
    finally:
        vector.close()
    assert live["task"][0] == episode.task
    np.savez(tmp_path / "obs.npz", **{k: (np.asarray(v) if k != "task" else np.asarray(v, dtype=object)) for k, v in live.items()})
    subprocess.run([LEROBOT_PYTHON, str(REPO / "benchmarks" / "lerobot_peer.py"), "check-inputs", "--checkpoint", str(tiny_act),
                    "--dataset", str(demos), "--index", "0", "--observation", str(tmp_path / "obs.npz"), "--out", str(tmp_path / "seen.npz")],
                   check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True)  # fmt: skip
    seen = dict(np.load(tmp_path / "seen.npz", allow_pickle=True))

    assert str(seen["train/task"][0]) == str(seen["live/task"][0]) == episode.task
    np.testing.assert_array_equal(seen["train/" + ENV_STATE], seen["live/" + ENV_STATE])
    np.testing.assert_allclose(seen["live/" + ENV_STATE][0], instruction_feature(episode.task), atol=1e-7)
    assert np.abs(seen["live/" + ENV_STATE]).sum() > 0  # the instruction's words reached the feature
    # State: the same numbers, normalised by the same statistics.
    np.testing.assert_allclose(seen["train/observation.state"], seen["live/observation.state"], atol=1e-5)
    for camera in ("agentview", "wrist"):
        key = f"observation.images.{camera}"
        train, live_seen = seen[f"train/{key}"], seen[f"live/{key}"]
        assert train.shape == live_seen.shape == (1, 3, 64, 64), (train.shape, live_seen.shape)
        # Normalised by the dataset's per-channel std: the codec's few levels stay small, far below what the same
        # view shifted by 4 pixels differs by.
        error = np.abs(train - live_seen).mean()
        assert error < 0.1 and error < 0.25 * np.abs(train - np.roll(live_seen, 4, axis=3)).mean(), (camera, error)
        # kinema's reader decodes the same frame the peer trained on.
        raw = episode.observations[key][0].astype(np.float32) / 255.0
        live_raw = live[key][0].astype(np.float32) / 255.0
        assert np.abs(raw - live_raw).mean() < 0.02


def test_a_served_peer_keeps_each_envs_action_queue_apart(demos, tiny_act):
    from imitation import PeerProcess
    from sim.rollout import make_vector

    vector = make_vector("drawer", 2, image_size=64, instructions="train", objects="train")
    try:
        obs = {k: v for k, v in vector.reset_at(0, 1_000_000)[0].items()}
        other = vector.reset_at(1, 1_000_001)[0]
    finally:
        vector.close()
    batch = {k: (np.stack([obs[k][0], other[k][1]]) if k != "task" else [obs[k][0], other[k][1]]) for k in obs}
    peer = PeerProcess(LEROBOT_PYTHON, tiny_act)
    try:
        assert peer.info["policy"] == "act" and peer.info["steps"] == 2
        first = peer(batch)
        assert first.shape == (2, 7) and np.isfinite(first).all()
        # ACT executes n_action_steps (4) of each chunk: steps 2-4 pop the same chunk's actions for both envs.
        rest = [peer(batch) for _ in range(3)]
        # Env 1 starts a new episode mid-chunk: its next action is the first of a fresh chunk for the same
        # observation (= `first`), while env 0 goes on popping its queue (its 5th action: a new chunk, = first too).
        peer.reset([1])
        again = peer(batch)
        np.testing.assert_allclose(again[1], first[1], atol=1e-5)
        peer.reset([1])
        partial = [peer(batch) for _ in range(2)]
        np.testing.assert_allclose(partial[0][1], first[1], atol=1e-5)
        np.testing.assert_allclose(partial[1][1], rest[0][1], atol=1e-5)
        # Env 0 was never reset: its queue ran on (actions 6, 7 of the episode = actions 2, 3 of its second chunk).
        np.testing.assert_allclose(partial[0][0], rest[0][0], atol=1e-5)
        np.testing.assert_allclose(partial[1][0], rest[1][0], atol=1e-5)
        # Frames of another size than the demos' are refused by name, not resized behind the user's back.
        with pytest.raises(RuntimeError, match=r"observation.images.agentview: shape \(3, 32, 32\), expected \(3, 64, 64\)"):
            peer({**batch, "observation.images.agentview": batch["observation.images.agentview"][:, ::2, ::2]})
    finally:
        peer.close()
