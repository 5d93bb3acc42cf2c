"""The robosuite adapter (optional extra): kinema's observation/action contract on robosuite's Lift, Stack, PickPlace
and Door. Skipped, with the reason, where the extra is not installed (robosuite 1.5.2 needs mujoco<=3.9.0, so it
lives in its own venv)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# `sim` first: it sets MUJOCO_GL=egl, which mujoco reads once, on its first import. Importing robosuite first would
# import mujoco with MUJOCO_GL unset, and every later mujoco.Renderer in this process (kinema's tasks) would use GLFW.
import sim

pytest.importorskip("robosuite", reason="robosuite extra not installed: pip install -e '.[robosuite]'")

from sim.robosuite_adapter import INSTALL_HINT, ROBOSUITE_TASKS, make_robosuite, resolve_name  # noqa: E402

REQUIRED = ("Lift", "Stack", "PickPlaceCan", "Door")
KEYS = {"observation.images.agentview", "observation.images.wrist", "observation.state", "task"}


@pytest.fixture(scope="module")
def envs():
    """One env per task, shared by the tests of this module (building one takes ~1.5 s)."""
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = make_robosuite(name)
        return built[name]

    yield get
    for env in built.values():
        env.close()


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_sim_package_never_imports_robosuite():
    # Runtime: the core sim modules (sim.monitor/rollout need pyarrow via diffusion_rl, checked statically below).
    out = _run(
        "import sys\n"
        "import sim, sim.env, sim.arm, sim.tasks, sim.experts, sim.vector\n"
        "print('robosuite' in sys.modules, sorted(sim.tasks.TASKS))"
    )
    assert out.returncode == 0, out.stderr
    loaded, tasks = out.stdout.split(" ", 1)
    assert loaded == "False"
    assert not any(name in tasks for name in ROBOSUITE_TASKS)
    # Static: no module of the sim package but the adapter imports robosuite or the adapter at module level
    # (sim.tasks.make imports the adapter lazily, only for robosuite/<Task> names).
    package = Path(sim.__file__).parent
    for path in package.rglob("*.py"):
        if path.name == "robosuite_adapter.py":
            continue
        imports = re.findall(r"^(?:from|import)\s+([\w.]+)", path.read_text(), flags=re.M)
        assert not [m for m in imports if m.startswith("robosuite") or m.endswith("robosuite_adapter")], path


def test_missing_robosuite_raises_import_error_with_install_command():
    out = _run(
        "import sys\n"
        "sys.modules['robosuite'] = None  # as if not installed\n"
        "try:\n"
        "    import sim.robosuite_adapter\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    assert out.returncode == 0, out.stderr
    assert INSTALL_HINT in out.stdout and 'pip install -e ".[robosuite]"' in out.stdout


def test_unknown_name_lists_valid_names_and_owned_kwargs_are_refused():
    with pytest.raises(ValueError) as err:
        make_robosuite("Lfit")
    for name in REQUIRED:
        assert name in str(err.value)
    assert "Did you mean 'Lift'" in str(err.value)
    assert resolve_name("robosuite/PickPlaceCan") == "PickPlaceCan"  # the prefix sim.tasks.make may dispatch on
    with pytest.raises(ValueError, match="camera_names"):
        make_robosuite("Lift", camera_names=["frontview"])
    with pytest.raises(ValueError, match=r"unknown camera in \('nope',\); valid: agentview, wrist"):
        make_robosuite("Lift", cameras=("nope",))


def test_registry_has_the_required_tasks_with_instruction_templates():
    for name in REQUIRED:
        spec = ROBOSUITE_TASKS[name]
        assert len(spec.instructions.train) >= 3 and len(spec.instructions.heldout) >= 3
        assert not set(spec.instructions.train) & set(spec.instructions.heldout)


@pytest.mark.parametrize("task", REQUIRED)
def test_reset_step_interface(envs, task):
    env = envs(task)
    obs, info = env.reset(seed=0)
    assert set(obs) == KEYS
    for cam in ("agentview", "wrist"):
        img = obs[f"observation.images.{cam}"]
        assert img.dtype == np.uint8 and img.shape == (96, 96, 3)
        assert img.flags["C_CONTIGUOUS"]
        assert img.std() > 5, f"{cam} image of {task} is blank"
    state = obs["observation.state"]
    assert state.dtype == np.float32 and state.shape == (8,)
    assert abs(np.linalg.norm(state[3:7]) - 1) < 1e-4 and state[4] >= 0  # unit quaternion, the hand-down side
    assert 0.0 <= state[7] <= 1.0
    assert env.observation_space.contains(obs)
    assert obs["task"] in [t.format(**ROBOSUITE_TASKS[task].fmt) for t in ROBOSUITE_TASKS[task].instructions.train]
    assert env.action_space.shape == (7,)
    assert info["is_success"] is False and 0.0 <= info["progress"] < 1.0
    priv = info["privileged"]
    assert priv and all(k.startswith("privileged.") for k in priv)
    assert all(v.dtype == np.float32 for v in priv.values())
    assert priv["privileged.target_pos"].shape == (3,) and "privileged.object_state" in priv
    assert not any(k.startswith("privileged") for k in obs)
    for _ in range(3):
        obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        assert set(obs) == KEYS and np.isfinite(obs["observation.state"]).all()
        assert reward == float(info["is_success"]) and 0.0 <= info["progress"] <= 1.0


@pytest.mark.parametrize("task", REQUIRED)
def test_images_are_robosuites_frames_flipped_right_side_up(envs, task):
    env = envs(task)
    obs, _ = env.reset(seed=1)
    sim = env.robosuite_env.sim
    for cam, rs_cam in (("agentview", "agentview"), ("wrist", "robot0_eye_in_hand")):
        raw = sim.render(width=96, height=96, camera_name=rs_cam)  # robosuite's own (OpenGL, bottom-up) frame
        np.testing.assert_array_equal(obs[f"observation.images.{cam}"], raw[::-1])
        assert not np.array_equal(raw, raw[::-1])


def test_kinema_and_robosuite_envs_render_side_by_side(envs):
    """robosuite never makes its GL context current before rendering; the adapter does, so interleaving works."""
    from sim.tasks import make

    kinema = make("pick_place", image_size=32)
    first = kinema.reset(seed=0)[0]["observation.images.agentview"]
    rs = envs("Lift")
    obs, _ = rs.reset(seed=1)
    again = kinema.reset(seed=0)[0]["observation.images.agentview"]
    obs_again, _ = rs.reset(seed=1)
    kinema.close()
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(obs["observation.images.agentview"], obs_again["observation.images.agentview"])


def test_lift_agentview_is_right_side_up():
    """The table fills the bottom of agentview, and the red cube appears where the camera model projects it."""
    env = make_robosuite("Lift", cameras=("agentview",), image_size=96)
    obs, info = env.reset(seed=0)
    img = obs["observation.images.agentview"].astype(int)
    assert img[-24:].mean() > img[:24].mean() + 50  # white table below, wall and robot above
    model, data = env.robosuite_env.sim.model._model, env.robosuite_env.sim.data._data
    cam = model.camera("agentview").id
    p = data.cam_xmat[cam].reshape(3, 3).T @ (info["privileged"]["privileged.cube_pos"] - data.cam_xpos[cam])
    f = 48 / np.tan(np.deg2rad(model.cam_fovy[cam]) / 2)
    row = 48 - f * p[1] / -p[2] - 0.5  # image row 0 at the top
    red = (img[..., 0] > 50) & (img[..., 0] > 2 * img[..., 1]) & (img[..., 0] > 2 * img[..., 2])
    assert red.sum() > 20
    centroid = np.nonzero(red)[0].mean()
    assert abs(centroid - row) < 1.5 and abs(centroid - (95 - row)) > 3
    assert env.render().shape == (240, 320, 3)
    env.close()


@pytest.mark.parametrize("task", REQUIRED)
def test_bad_actions_raise_and_leave_state_unchanged(envs, task):
    env = envs(task)
    env.reset(seed=2)
    before = env.get_state()
    with pytest.raises(ValueError, match=r"shape \(7,\).*got shape \(6,\)"):
        env.step(np.zeros(6))
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros((1, 7)))
    bad = np.zeros(7)
    bad[2] = np.nan
    with pytest.raises(ValueError, match=r"NaN or inf at indices \[2\]"):
        env.step(bad)
    bad[2], bad[5] = 0.0, np.inf
    with pytest.raises(ValueError, match=r"NaN or inf at indices \[5\]"):
        env.step(bad)
    np.testing.assert_array_equal(env.get_state(), before)
    assert env.steps == 0


def _trajectory(env, seed: int, steps: int = 6):
    obs, info = env.reset(seed=seed)
    rng = np.random.default_rng(seed)
    states, images = [obs["observation.state"]], [obs["observation.images.agentview"]]
    for _ in range(steps):
        action = rng.uniform(-1, 1, 7)
        action[6] = 1.0  # close: exercises the gripper's rate controller, whose command must not leak across resets
        obs, *_ = env.step(action)
        states.append(obs["observation.state"])
        images.append(obs["observation.images.agentview"])
    return obs["task"], info["privileged"]["privileged.target_pos"], np.stack(states), np.stack(images)


@pytest.mark.parametrize("task", REQUIRED)
def test_seeded_episodes_are_reproducible(envs, task):
    env = envs(task)
    a = _trajectory(env, 3)
    b = _trajectory(env, 4)
    c = _trajectory(env, 3)  # same seed again, after an episode with another seed
    assert a[0] == c[0]
    for x, y in zip(a[1:], c[1:]):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[1], b[1])  # another seed, another layout


def test_seeded_episodes_match_across_instances(envs):
    other = make_robosuite("Lift")
    a, b = _trajectory(envs("Lift"), 7), _trajectory(other, 7)
    other.close()
    assert a[0] == b[0]
    for x, y in zip(a[1:], b[1:]):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("task", REQUIRED)
def test_is_success_is_the_tasks_own_check(envs, task, monkeypatch):
    env = envs(task)
    env.reset(seed=0)
    assert not env.robosuite_env._check_success()
    obs, reward, terminated, truncated, info = env.step(np.zeros(7))
    assert (reward, terminated, info["is_success"]) == (0.0, False, False)
    monkeypatch.setattr(env.robosuite_env, "_check_success", lambda: True)
    obs, reward, terminated, truncated, info = env.step(np.zeros(7))
    assert (reward, terminated, truncated, info["is_success"], info["progress"]) == (1.0, True, False, True, 1.0)


def test_horizon_truncates():
    env = make_robosuite("Door", cameras=(), horizon=3)
    env.reset(seed=0)
    flags = [env.step(np.zeros(7))[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    env.close()


def test_scripted_lift_succeeds_by_robosuites_check_and_gripper_sign_matches_kinema():
    """A scripted grasp-and-lift from privileged cube position (base frame, like observation.state): +1 closes."""
    env = make_robosuite("Lift", cameras=(), instructions="heldout")
    obs, info = env.reset(seed=0)
    assert obs["task"] in [t.format(object="red cube") for t in ROBOSUITE_TASKS["Lift"].instructions.heldout]
    phase, closing, openings = 0, 0, []
    for _ in range(env.config.horizon):
        ee, cube = obs["observation.state"][:3], info["privileged"]["privileged.target_pos"]
        grip = -1.0
        if phase == 0:
            goal = cube + [0, 0, 0.06]
            phase = 1 if np.linalg.norm(goal - ee) < 0.01 else 0
        if phase == 1:
            goal = cube + [0, 0, -0.005]
            phase = 2 if np.linalg.norm(goal - ee) < 0.008 else 1
        if phase >= 2:
            grip, closing = 1.0, closing + 1
            goal = cube + ([0, 0, -0.005] if closing <= 8 else [0, 0, 0.15])
            openings.append(obs["observation.state"][7])
        action = np.zeros(7)
        action[:3] = np.clip((goal - ee) / 0.04, -1, 1)
        action[6] = grip
        was_lifted = env.robosuite_env._check_success()
        obs, reward, terminated, truncated, info = env.step(action)
        assert info["is_success"] == env.robosuite_env._check_success()
        if terminated:
            break
    assert info["is_success"] and reward == 1.0 and not was_lifted
    cube_z = info["privileged"]["privileged.cube_pos"][2]
    assert cube_z > env.robosuite_env.model.mujoco_arena.table_offset[2] + 0.04  # Lift's own criterion
    assert openings[0] > openings[-1] + 0.2  # +1 closed the gripper on the cube
    env.close()


def test_sim_tasks_make_routes_robosuite_names():
    from sim.tasks import make

    env = make("robosuite/Lift", image_size=32)
    try:
        obs, info = env.reset(seed=0)
        assert obs["observation.images.agentview"].shape == (32, 32, 3)
        assert info["is_success"] is False
    finally:
        env.close()
