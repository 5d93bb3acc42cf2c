"""`kinema dataset import robomimic` on a file made the way robomimic's datasets are made, from raw robosuite
(tests/robomimic_lift.py: a scripted Lift expert, robosuite's collection format, robomimic's observation extraction),
checked against kinema's robosuite adapter at the same simulator states and replayed through the adapter (robosuite
extra: skipped where it is not installed). Training on such a file: test_robosuite_robomimic_train.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import sim  # noqa: F401  (sets MUJOCO_GL=egl before robosuite imports mujoco; see test_robosuite_adapter.py)

pytest.importorskip("robosuite", reason="robosuite extra not installed: pip install -e '.[robosuite]'")
h5py = pytest.importorskip("h5py", reason="robomimic extra not installed: pip install -e '.[robomimic]'")

sys.path.insert(0, str(Path(__file__).parent))
import robomimic_lift

from diffusion_rl.data import read_episodes
from kinema.dataset_commands import (
    ADAPTER_ACTION_SCALE,
    ROBOMIMIC_ACTION_SCALE,
    import_robomimic,
)
from sim.robosuite_adapter import make_robosuite

CAMERAS = {"agentview": "agentview_image", "wrist": "robot0_eye_in_hand_image"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Two demos at robomimic's 84x84, imported with the defaults."""
    root = tmp_path_factory.mktemp("robomimic_lift")
    demos = robomimic_lift.collect(2, seed=0, max_tries=4)
    path = robomimic_lift.write(root / "lift.hdf5", demos)
    result = import_robomimic(path, root / "ds")
    with h5py.File(path, "r") as f:
        raw = {name: {"states": f[f"data/{name}/states"][()], "actions": f[f"data/{name}/actions"][()],
                      "rewards": f[f"data/{name}/rewards"][()],
                      **{k: f[f"data/{name}/obs/{k}"][()] for k in CAMERAS.values()}} for name in ("demo_0", "demo_1")}
    return path, raw, result, read_episodes(root / "ds")


def test_the_file_has_robomimics_layout(recorded):
    path, raw, result, episodes = recorded
    with h5py.File(path, "r") as f:
        data = f["data"]
        env_args = json.loads(data.attrs["env_args"])
        assert env_args["env_name"] == "Lift" and env_args["type"] == 1
        arm = env_args["env_kwargs"]["controller_configs"]["body_parts"]["right"]
        assert arm["type"] == "OSC_POSE" and arm["output_max"] == [0.05, 0.05, 0.05, 0.5, 0.5, 0.5]
        assert data.attrs["total"] == sum(len(d["actions"]) for d in raw.values())
        for name in ("demo_0", "demo_1"):
            demo = data[name]
            assert demo.attrs["num_samples"] == len(demo["actions"]) == len(demo["states"]) == len(demo["dones"])
            assert "<mujoco" in demo.attrs["model_file"]
            assert {"agentview_image", "robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "object"} <= set(
                demo["obs"])
            assert set(demo["obs"]) == set(demo["next_obs"]) and demo["obs/agentview_image"].shape[1:] == (84, 84, 3)
            assert demo["dones"][-1] == 1 and demo["rewards"][-1] == 1.0  # the collection stops 10 steps after success
        assert sorted([*f["mask/train"][()], *f["mask/valid"][()]]) == [b"demo_0", b"demo_1"]
    assert result.episodes == 2 and result.actions == "rescaled"
    assert result.source_action_scale == ROBOMIMIC_ACTION_SCALE
    assert all(ep.outcome and ep.task == "lift the red cube" for ep in episodes)


def test_imported_state_and_images_are_the_adapters_at_the_same_simulator_state(recorded):
    """observation.state: float32 rounding of the same numbers (|x| < 1.2 m: one ulp is 1.2e-7; the importer composes
    the MJCF's frames where the adapter reads MuJoCo's, which agree to ~1e-9), so 1e-5 is generous. Images: the
    adapter renders robosuite's default look when built with shadows and 4x MSAA (robosuite's `<visual>` settings,
    which the adapter turns off by default); a few edge pixels differ where MSAA resolves into a smaller buffer.
    After import the frames went through kinema's video coding (about 1.6 grey levels mean error)."""
    _, raw, _, episodes = recorded
    env = make_robosuite("Lift", image_size=84, shadows=True, antialias=True)
    try:
        env.reset(seed=0)
        for demo, ep in zip(raw.values(), episodes, strict=True):
            for t, flat in enumerate(demo["states"]):
                obs, _ = env.set_robosuite_state(flat)
                np.testing.assert_allclose(ep.observations["observation.state"][t], obs["observation.state"], atol=1e-5)
                for cam, key in CAMERAS.items():
                    ours = obs[f"observation.images.{cam}"].astype(int)
                    stored = np.abs(ours - demo[key][t].astype(int))  # robomimic's frame, before kinema's import
                    assert stored.mean() < 0.1 and (stored > 8).mean() < 1e-3, (cam, t, stored.mean())
                    kept = ep.observations[f"observation.images.{cam}"][t].astype(int)
                    imported, upside_down = np.abs(ours - kept).mean(), np.abs(ours[::-1] - kept).mean()
                    assert imported < 3.0 and upside_down > 2 * imported, (cam, t, imported, upside_down)
    finally:
        env.close()


def test_rescaled_actions_replay_the_demo_through_the_adapter(recorded):
    """From each demo's first state, the imported actions (0.12 m per unit) make the adapter's OSC do what robosuite's
    did at 0.05 m per unit: the simulator states follow the recorded ones and Lift succeeds on the same step. The
    observations lag robomimic's by one 2 ms physics substep (robosuite computes a step's observations before its last
    substep integrates; robomimic's are recomputed after setting each state), about 0.6 mm at the hand's speed."""
    _, raw, result, episodes = recorded
    env = make_robosuite("Lift", cameras=())
    try:
        with pytest.raises(ValueError, match=r"flattened robosuite state of this model has shape \(\d+,\)"):
            env.set_robosuite_state(np.zeros(5))
        for demo, ep in zip(raw.values(), episodes, strict=True):
            for actions, faithful in ((ep.action, True), (demo["actions"].astype(np.float32), False)):
                env.reset(seed=0)
                env.set_robosuite_state(demo["states"][0], episode_start=True)
                state_err, hand_err, solved = 0.0, 0.0, None
                for t, action in enumerate(actions):
                    obs, _, terminated, _, _ = env.step(action)
                    if t + 1 < len(actions):
                        flat = env.robosuite_env.sim.get_state().flatten()
                        state_err = max(state_err, float(np.abs(flat[1:] - demo["states"][t + 1][1:]).max()))
                        hand = obs["observation.state"][:3] - ep.observations["observation.state"][t + 1, :3]
                        hand_err = max(hand_err, float(np.abs(hand).max()))
                    if terminated and solved is None:
                        solved = t
                        break
                first_reward = int(np.argmax(demo["rewards"] > 0))
                if faithful:
                    assert state_err < 1e-4 and hand_err < 2e-3, (state_err, hand_err)
                    assert solved == first_reward
                else:  # the recorded 0.05 m actions on the adapter's 0.12 m scale: another trajectory
                    assert hand_err > 0.01
    finally:
        env.close()
    assert result.dataset_action_scale == ADAPTER_ACTION_SCALE
