"""`kinema dataset import robomimic`: a synthetic robomimic file (robosuite is not installed here) made from a small
MuJoCo arm, imported and read back with kinema's reader.

The robot's state is computed the way kinema's robosuite adapter computes it (sim/robosuite_adapter.py: the grip site
in the robot-base frame via `ee_state_vector`, the opening from the finger joints' ranges), from MuJoCo's own
kinematics; robomimic's observations are made the way robosuite makes them (grip-site position and `right_hand` body
quaternion in the world frame, xyzw). The importer, which only parses the stored MJCF, must land on the adapter's
numbers.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import mujoco
import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from diffusion_rl.data import LeRobotDatasetReader, read_episodes  # noqa: E402
from kinema import dataset_commands  # noqa: E402
from kinema.cli import main  # noqa: E402
from sim.env import ee_state_vector  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# A Panda-like chain with robosuite's names: the base turned 90 deg about z (so frames matter), the gripper mounted on
# the hand turned by -90 deg about z as robosuite's Panda gripper is, and two slide fingers of range 0.04 m.
MJCF = """
<mujoco model="base">
  <worldbody>
    <body name="table" pos="0 0 0.8"><geom type="box" size="0.4 0.4 0.02"/></body>
    <body name="robot0_base" pos="-0.56 0.1 0.912" quat="0.7071068 0 0 0.7071068">
      <geom type="cylinder" size="0.06 0.05"/>
      <body name="robot0_link1" pos="0 0 0.333">
        <joint name="robot0_joint1" type="hinge" axis="0 0 1"/>
        <geom type="capsule" size="0.04" fromto="0 0 0 0 0 0.2"/>
        <body name="robot0_link2" pos="0 0 0.2" quat="0.9238795 0.3826834 0 0">
          <joint name="robot0_joint2" type="hinge" axis="0 1 0"/>
          <geom type="capsule" size="0.04" fromto="0 0 0 0.3 0 0"/>
          <body name="robot0_right_hand" pos="0.3 0 0" quat="0 1 0 0">
            <joint name="robot0_joint3" type="hinge" axis="0 0 1"/>
            <geom type="box" size="0.03 0.03 0.03"/>
            <body name="gripper0_right_gripper" pos="0 0 0" quat="0.707107 0 0 -0.707107">
              <site name="gripper0_ft_frame" pos="0 0 0"/>
              <body name="gripper0_eef" pos="0 0 0.097">
                <site name="gripper0_grip_site" pos="0 0 0" size="0.01"/>
              </body>
              <body name="gripper0_leftfinger" pos="0 0 0.05">
                <joint name="gripper0_finger_joint1" type="slide" axis="0 1 0" range="0.0 0.04"/>
                <geom type="box" size="0.01 0.01 0.02"/>
              </body>
              <body name="gripper0_rightfinger" pos="0 0 0.05">
                <joint name="gripper0_finger_joint2" type="slide" axis="0 1 0" range="-0.04 0.0"/>
                <geom type="box" size="0.01 0.01 0.02"/>
              </body>
            </body>
          </body>
        </body>
      </body>
    </body>
  </worldbody>
</mujoco>
"""
OSC_POSE_14 = {"type": "OSC_POSE", "input_max": 1, "input_min": -1, "output_max": [0.05, 0.05, 0.05, 0.5, 0.5, 0.5],
               "output_min": [-0.05, -0.05, -0.05, -0.5, -0.5, -0.5], "control_delta": True}
LENGTHS = {"demo_0": 5, "demo_2": 7, "demo_10": 6}  # demo_10 must come after demo_2
IMAGE = 84


def simulate(seed: int, t: int) -> dict[str, np.ndarray]:
    """robomimic's observations of a random motion, and what kinema's adapter would have observed."""
    model = mujoco.MjModel.from_xml_string(MJCF)
    data = mujoco.MjData(model)
    rng = np.random.default_rng(seed)
    base = model.body("robot0_base").id
    site = model.site("gripper0_grip_site").id
    hand = model.body("robot0_right_hand").id
    fingers = [model.joint(f"gripper0_finger_joint{i}").qposadr[0] for i in (1, 2)]
    span = float(np.sum(model.jnt_range[[model.joint(f"gripper0_finger_joint{i}").id for i in (1, 2)], 1]
                        - model.jnt_range[[model.joint(f"gripper0_finger_joint{i}").id for i in (1, 2)], 0]))
    out: dict[str, list] = {k: [] for k in ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos", "state")}
    for _ in range(t):
        data.qpos[:3] = rng.uniform(-2.5, 2.5, 3)
        width = rng.uniform(0, 0.04)
        data.qpos[fingers] = [width, -width]
        mujoco.mj_forward(model, data)
        # robosuite: eef_pos = grip site (world); eef_quat = right_hand body (world, xyzw)
        out["robot0_eef_pos"].append(data.site_xpos[site].copy())
        out["robot0_eef_quat"].append(data.xquat[hand][[1, 2, 3, 0]].copy())
        out["robot0_gripper_qpos"].append(data.qpos[fingers].copy())
        # kinema's adapter: base frame, grip site, opening = sum |q| / span
        b_pos, b_mat = data.xpos[base], data.xmat[base].reshape(3, 3)
        ee_pos = b_mat.T @ (data.site_xpos[site] - b_pos)
        ee_mat = b_mat.T @ data.site_xmat[site].reshape(3, 3)
        opening = float(np.clip(np.abs(data.qpos[fingers]).sum() / span, 0.0, 1.0))
        out["state"].append(ee_state_vector(ee_pos, ee_mat, opening))
    arrays = {k: np.asarray(v) for k, v in out.items()}
    arrays["base_mat"] = data.xmat[base].reshape(3, 3).copy()
    return arrays


def images(t: int, seed: int) -> np.ndarray:
    """Top half dark, bottom half bright (a table below), as robomimic stores them: right side up (its
    EnvRobosuite.get_observation flips robosuite's upside-down "opengl" frames)."""
    img = np.full((t, IMAGE, IMAGE, 3), 200, np.uint8)
    img[:, : IMAGE // 2] = 40
    img[..., 1] += np.uint8(seed)
    return img


def write_robomimic(path: Path, *, env_name: str = "Lift", controller: dict | None = OSC_POSE_14,
                    model_file: bool = True) -> dict[str, dict[str, np.ndarray]]:
    demos = {}
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        kwargs = {"control_freq": 20, "has_renderer": False}
        if controller is not None:
            kwargs["controller_configs"] = controller
        data.attrs["env_args"] = json.dumps({"env_name": env_name, "type": 1, "env_kwargs": kwargs})
        for i, (name, t) in enumerate(LENGTHS.items()):
            sim = simulate(i, t)
            rng = np.random.default_rng(100 + i)
            demo = data.create_group(name)
            demo.attrs["num_samples"] = t
            if model_file:
                demo.attrs["model_file"] = MJCF
            actions = rng.uniform(-1, 1, (t, 7))
            demo.create_dataset("actions", data=actions)
            rewards = np.zeros(t)
            if i == 0:
                rewards[-2:] = 1.0  # solved two steps before the end
            demo.create_dataset("rewards", data=rewards)
            demo.create_dataset("dones", data=(rewards > 0).astype(np.int64))
            obs = demo.create_group("obs")
            for key in ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"):
                obs.create_dataset(key, data=sim[key])
            obs.create_dataset("agentview_image", data=images(t, i))
            obs.create_dataset("robot0_eye_in_hand_image", data=images(t, i + 5))
            obs.create_dataset("object", data=rng.normal(size=(t, 10)))
            demos[name] = sim | {"actions": actions, "rewards": rewards}
        mask = f.create_group("mask")
        mask.create_dataset("train", data=np.array([b"demo_0", b"demo_10"]))
    return demos


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("robomimic")
    demos = write_robomimic(root / "lift.hdf5")
    result = dataset_commands.import_robomimic(root / "lift.hdf5", root / "ds")
    return demos, result, read_episodes(root / "ds"), root


def test_episode_count_lengths_order_and_instruction(imported):
    demos, result, episodes, root = imported
    assert result.episodes == 3 and [len(e) for e in episodes] == list(LENGTHS.values()) == [5, 7, 6]
    assert result.frames == 18
    assert all(e.task == "lift the red cube" for e in episodes)  # the adapter's Lift instruction, from env_args
    assert all(e.task_id == "robosuite/Lift" and e.policy_version == "demo" for e in episodes)
    assert LeRobotDatasetReader(root / "ds").meta.fps == 20.0


def test_key_mapping(imported):
    _, result, episodes, _ = imported
    ep = episodes[0]
    assert sorted(ep.observations) == ["observation.images.agentview", "observation.images.wrist", "observation.state"]
    assert ep.observations["observation.state"].shape == (5, 8) and ep.action.shape == (5, 7)
    assert ep.observations["observation.images.agentview"].shape == (5, IMAGE, IMAGE, 3)
    assert sorted(ep.privileged) == ["privileged.object"] and ep.privileged["privileged.object"].shape == (5, 10)
    assert result.cameras == ["observation.images.agentview", "observation.images.wrist"]


def test_state_is_what_the_adapter_observes(imported):
    """Position in the (rotated) base frame, the grip site's quaternion as wxyz on the hand-down side (x >= 0 near it), the opening in [0, 1]."""
    demos, _, episodes, _ = imported
    for sim, ep in zip(demos.values(), episodes, strict=True):
        state = ep.observations["observation.state"]
        np.testing.assert_allclose(state, sim["state"], atol=2e-5)
        assert (state[:, 3:7] @ np.array([0.0, 1.0, 0.0, 0.0]) >= 0).all()  # sim.env.STATE_QUAT_REFERENCE's side
        np.testing.assert_allclose(np.linalg.norm(state[:, 3:7], axis=1), 1.0, atol=1e-5)
        assert ((state[:, 7] >= 0) & (state[:, 7] <= 1)).all() and state[:, 7].std() > 0.05


def test_quaternion_convention_is_not_a_plain_copy(imported):
    """robomimic's eef_quat is xyzw of the hand body in the world frame: a copy, a reorder alone, or a reorder without
    the hand-to-grip-site mount and base rotation would all be wrong."""
    demos, _, episodes, _ = imported
    sim, ep = demos["demo_0"], episodes[0]
    q = ep.observations["observation.state"][:, 3:7]
    raw = sim["robot0_eef_quat"]
    wxyz = raw[:, [3, 0, 1, 2]] * np.sign(raw[:, [3]])
    assert np.abs(q - raw).max() > 0.1 and np.abs(q - wxyz).max() > 0.1
    # The base is turned 90 deg about z in the world: the position is not the world position minus the base either.
    naive = sim["robot0_eef_pos"] - [-0.56, 0.1, 0.912]
    assert np.abs(ep.observations["observation.state"][:, :3] - naive).max() > 0.1


def test_gripper_opening(imported):
    demos, _, episodes, _ = imported
    for sim, ep in zip(demos.values(), episodes, strict=True):
        expected = np.abs(sim["robot0_gripper_qpos"]).sum(1) / 0.08
        np.testing.assert_allclose(ep.observations["observation.state"][:, 7], expected, atol=1e-6)


def test_actions_are_rescaled_to_the_adapter(imported):
    """0.05 m per unit (robomimic) -> 0.12 m per unit (adapter); 0.5 rad stays 0.5 rad; the gripper is unchanged.
    The deltas are turned from world axes (robosuite <= 1.4's OSC) into the base axes of the adapter."""
    demos, result, episodes, root = imported
    assert result.actions == "rescaled" and result.dataset_action_scale == (0.12, 0.5)
    for sim, ep in zip(demos.values(), episodes, strict=True):
        a, r = sim["actions"], sim["base_mat"]
        np.testing.assert_allclose(ep.action[:, :3], a[:, :3] @ r * (0.05 / 0.12), atol=1e-6)
        np.testing.assert_allclose(ep.action[:, 3:6], a[:, 3:6] @ r, atol=1e-6)
        np.testing.assert_allclose(ep.action[:, 6], a[:, 6], atol=1e-7)
        # The same motion: metres commanded per step agree.
        np.testing.assert_allclose(np.linalg.norm(ep.action[:, :3], axis=1) * 0.12,
                                   np.linalg.norm(a[:, :3], axis=1) * 0.05, rtol=1e-5)
    source = json.loads((root / "ds/meta/kinema.json").read_text())["sources"]
    assert len(source) == 1 and source[0]["actions"] == "rescaled"
    assert source[0]["action_scale"] == [0.12, 0.5] and source[0]["source_action_scale"] == [0.05, 0.5]
    assert "successes by construction" in source[0]["success"]


def test_success_flags(imported):
    _, _, episodes, _ = imported
    assert all(e.outcome for e in episodes)
    assert episodes[0].success.tolist() == [False, False, False, True, True]  # from the sparse rewards
    assert episodes[1].success.tolist() == [False] * 6 + [True]  # no reward recorded: solved at the end
    assert [e.steps_to_success for e in episodes] == [4, 7, 6]


def test_images_are_kept_right_side_up_and_flipped_on_request(imported, tmp_path):
    """robomimic's files already hold right-side-up images (tests/test_robosuite_robomimic.py checks this against
    robosuite); --flip-images is for files of raw, upside-down robosuite frames."""
    _, _, episodes, root = imported
    img = episodes[0].observations["observation.images.agentview"].astype(int)
    assert img[:, : IMAGE // 2 - 4].mean() < 60 and img[:, IMAGE // 2 + 4:].mean() > 180
    dataset_commands.import_robomimic(root / "lift.hdf5", tmp_path / "flipped", flip_images=True, max_episodes=1)
    flipped = read_episodes(tmp_path / "flipped")[0].observations["observation.images.agentview"].astype(int)
    assert flipped[:, : IMAGE // 2 - 4].mean() > 180 and flipped[:, IMAGE // 2 + 4:].mean() < 60
    assert np.abs(flipped - img[:, ::-1]).mean() < 2.0  # the same frames, upside down (video coding aside)


def test_actions_kept_record_the_scale_for_the_env(tmp_path):
    write_robomimic(tmp_path / "f.hdf5")
    result = dataset_commands.import_robomimic(tmp_path / "f.hdf5", tmp_path / "ds", actions="keep",
                                               filter_key="train", instruction="pick up the cube")
    episodes = read_episodes(tmp_path / "ds")
    assert [len(e) for e in episodes] == [5, 6] and episodes[0].task == "pick up the cube"
    assert result.dataset_action_scale == (0.05, 0.5)
    with h5py.File(tmp_path / "f.hdf5") as f:
        raw = f["data/demo_0/actions"][()]
    r = simulate(0, 5)["base_mat"]
    np.testing.assert_allclose(episodes[0].action[:, :3], raw[:, :3] @ r, atol=1e-6)  # frame only, no rescaling
    record = json.loads((tmp_path / "ds/meta/kinema.json").read_text())["sources"][0]
    assert record["actions"] == "kept" and record["action_scale"] == [0.05, 0.5]
    assert "action_scale=(0.05, 0.5)" in record["action_scale_note"]


def test_the_cli_says_what_it_decided(tmp_path, capsys):
    write_robomimic(tmp_path / "f.hdf5", env_name="PickPlaceCan", controller=None)
    assert main(["dataset", "import", "robomimic", str(tmp_path / "f.hdf5"), "--out", str(tmp_path / "ds"),
                 "--max-episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "imported 2 robomimic demos" in out and "'put the can in the other bin'" in out
    assert "actions rescaled" in out and "0.05 m / 0.5 rad" in out and "0.12 m / 0.5 rad" in out
    assert "successes by construction" in out and "outcome=True" in out
    assert len(read_episodes(tmp_path / "ds")) == 2


@pytest.mark.parametrize("case, message", [
    ("no-data", r"no group 'data'.*has: other"),
    ("no-demos", r"no demo_N groups"),
    ("no-actions", r"data/demo_0 lacks 'actions'"),
    ("no-quat", r"data/demo_0/obs lacks 'robot0_eef_quat'.*observation.state"),
    ("bad-actions", r"data/demo_0/actions: expected \(T, 7\)"),
    ("no-model", r"data/demo_0 has no model_file.*--base-pos"),
    ("absolute", r"absolute poses"),
    ("not-hdf5", r"not an HDF5 file"),
])
def test_clear_errors_for_files_that_are_not_robomimic(tmp_path, capsys, case, message):
    path = tmp_path / "f.hdf5"
    if case == "not-hdf5":
        path.write_text("hello")
    elif case in ("no-model", "absolute"):
        write_robomimic(path, model_file=case != "no-model",
                        controller=OSC_POSE_14 | {"control_delta": False} if case == "absolute" else OSC_POSE_14)
    else:
        with h5py.File(path, "w") as f:
            if case == "no-data":
                f.create_group("other")
            else:
                data = f.create_group("data")
                demo = data.create_group("demo_0") if case != "no-demos" else data.create_group("mask_like")
                demo = None if case == "no-demos" else demo
                if demo is not None:
                    if case != "no-actions":
                        demo.create_dataset("actions", data=np.zeros((3, 7 if case != "bad-actions" else 4)))
                    obs = demo.create_group("obs")
                    for key in ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos"):
                        if not (case == "no-quat" and key == "robot0_eef_quat"):
                            obs.create_dataset(key, data=np.zeros((3, 4 if key == "robot0_eef_quat" else 3 if
                                                                   key == "robot0_eef_pos" else 2)))
    with pytest.raises(ValueError, match=message):
        dataset_commands.import_robomimic(path, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()  # nothing half-written
    assert main(["dataset", "import", "robomimic", str(path), "--out", str(tmp_path / "ds")]) == 2
    assert "kinema: error:" in capsys.readouterr().err


def test_base_pos_stands_in_for_a_missing_model_file(tmp_path):
    demos = write_robomimic(tmp_path / "f.hdf5", model_file=False)
    dataset_commands.import_robomimic(tmp_path / "f.hdf5", tmp_path / "ds", base_pos=(-0.56, 0.1, 0.912))
    ep = read_episodes(tmp_path / "ds")[0]
    # Without the MJCF the base is taken unrotated: positions are world minus base.
    np.testing.assert_allclose(ep.observations["observation.state"][:, :3],
                               demos["demo_0"]["robot0_eef_pos"] - [-0.56, 0.1, 0.912], atol=1e-5)


def test_the_action_scale_matches_the_adapter_source():
    """sim/robosuite_adapter.py needs robosuite to import; read its ACTION_SCALE from the source instead."""
    tree = ast.parse((REPO / "sim/robosuite_adapter.py").read_text())
    values = [ast.literal_eval(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "ACTION_SCALE" for t in node.targets)]
    assert values == [dataset_commands.ADAPTER_ACTION_SCALE]
