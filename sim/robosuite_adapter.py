"""robosuite tasks (Lift, Stack, PickPlace*, Door; Panda arm) behind kinema's gymnasium interface.

Optional extra: `pip install -e ".[robosuite]"` (robosuite==1.5.2, which needs mujoco<=3.9.0, so it lives in its own
venv next to a mujoco 4.x one). Importing `sim` never imports this module; importing this module without robosuite
raises an ImportError that says how to install it.

Same contract as `sim.env.TabletopEnv`:
- observation dict: `observation.images.agentview`, `observation.images.wrist` (uint8 HWC, 96x96 default, right side
  up), `observation.state` float32 (8,) = EE position (3, m, robot-base frame), EE quaternion wxyz (4, sign nearer the hand pointing down, base
  frame), gripper opening in [0, 1] (1); `task` = instruction string;
- action Box(-1, 1, (7,)) = EE translation delta (3, base frame), rotation delta (3, axis-angle, base frame), gripper
  (+1 closes, -1 opens), mapped onto robosuite's OSC_POSE controller (delta input, base frame) at 20 Hz;
- sparse reward 1 on the step robosuite's own `_check_success()` is true, which terminates; truncation at `horizon`;
- `info["is_success"]`, `info["progress"]` (robosuite's shaped reward, normalised, < 1 unless solved) and
  `info["privileged"]`: robosuite's object-state observables as `privileged.<name>` (world frame, robosuite's
  conventions: quaternions xyzw), plus `privileged.target_pos` (and `privileged.goal_pos` where the task has one) in
  the same base frame as `observation.state`, and `privileged.base_pos` (robot base, world frame).

Differences from kinema's own tasks worth knowing:
- robosuite's Panda gripper is *rate*-controlled: the sign of the gripper action moves the fingers a step toward
  closed/open each control step (0 holds). kinema's gripper action is a position target (0 = half open). The sign
  convention (+1 closes) is the same, so saturated +-1 commands behave alike.
- OSC is a compliant torque controller: per 50 ms step the hand covers only ~22% of the commanded delta, where kinema's
  IK position control covers ~65% of its 0.04 m. `action_scale` = (metres, radians) per unit action, the OSC output
  limits. The default translation limit, 0.12 m, is calibrated so |a| = 1 moves the hand ~2.5 cm per step, as in
  kinema's tasks (measured over 10 steps of +x from the start pose). Rotation keeps robosuite's 0.5 rad: OSC
  orientation tracking gives ~0.06 rad/step there (kinema: ~0.12) and larger limits mostly add translation drift.
- Rendering is slower than kinema's primitive-geom arm: robosuite renders the Panda's meshes. Measured on 2 shared CPU
  cores, 1 thread, 2x96^2 cameras: ~35-42 env steps/s (robosuite's own settings: ~9.5), against ~350 for kinema's
  pick_place in the same venv; state-only ~240 against ~1,300. Passing robosuite's `render_collision_mesh=True,
  render_visual_mesh=False` renders the coarse collision meshes instead (~120 steps/s, flat colours).
- The agentview camera is robosuite's: it faces the robot from across the table (kinema's looks over its shoulder).
- Several envs in one process work (each call makes its env's GL context current; robosuite itself does not).

Call `make_robosuite(name, **kwargs)`; `ROBOSUITE_TASKS` lists the names. To route these through `sim.tasks.make`
without importing robosuite there, dispatch lazily, e.g. `if name.startswith("robosuite/"): from
sim.robosuite_adapter import make_robosuite; return make_robosuite(name, **kwargs)` (the prefix is accepted).
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import contextlib
import difflib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

INSTALL_HINT = 'pip install -e ".[robosuite]"'
ROBOSUITE_VERSION = "1.5.2"
MAX_MUJOCO = (3, 9, 0)


@contextlib.contextmanager
def _quiet_robosuite() -> Iterator[None]:
    """Drop robosuite's INFO/WARNING chatter (missing private macros, robosuite_models, mink, controller file paths)
    while importing and building; errors still come through. robosuite logs to the "robosuite_logs" logger."""
    logger = logging.getLogger("robosuite_logs")
    drop_below_error = lambda record: record.levelno >= logging.ERROR  # noqa: E731
    logger.addFilter(drop_below_error)
    try:
        yield
    finally:
        logger.removeFilter(drop_below_error)


try:
    import mujoco
except ImportError as exc:  # pragma: no cover - mujoco is a core dependency
    raise ImportError(f"sim.robosuite_adapter needs mujoco<=3.9.0 and robosuite=={ROBOSUITE_VERSION}: {INSTALL_HINT}") from exc

_mujoco_version = tuple(int(p) for p in mujoco.__version__.split(".")[:3] if p.isdigit())
if _mujoco_version > MAX_MUJOCO:
    raise ImportError(
        f"sim.robosuite_adapter: robosuite {ROBOSUITE_VERSION} works only with mujoco<=3.9.0, but mujoco "
        f"{mujoco.__version__} is installed. Use a separate venv with the extra: {INSTALL_HINT} "
        "(it pins robosuite==1.5.2 and mujoco==3.9.0)."
    )

with _quiet_robosuite():
    try:
        import robosuite
        import robosuite.macros as rs_macros
        from robosuite.controllers import load_composite_controller_config
        from robosuite.utils.mjcf_utils import IMAGE_CONVENTION_MAPPING
    except ImportError as exc:
        raise ImportError(
            f"sim.robosuite_adapter needs the robosuite extra (robosuite=={ROBOSUITE_VERSION}, mujoco==3.9.0), "
            f"which is not installed or failed to import ({exc}). Install it with: {INSTALL_HINT}"
        ) from exc

if not robosuite.__version__.startswith("1.5."):
    raise ImportError(
        f"sim.robosuite_adapter is written against robosuite {ROBOSUITE_VERSION}; found {robosuite.__version__}. "
        f"Install the pinned extra: {INSTALL_HINT}"
    )

from sim.env import CAMERAS, CONTROL_HZ, Instructions, ee_state_vector, policy_spaces, validate_action  # noqa: E402

# kinema camera name -> robosuite camera name; any other name is passed through (frontview, birdview, sideview, ...).
CAMERA_ALIASES: dict[str, str] = {"agentview": "agentview", "wrist": "robot0_eye_in_hand"}
ROBOSUITE_CAMERAS = ("frontview", "birdview", "agentview", "sideview", "robot0_robotview", "robot0_eye_in_hand")
VIDEO_CAMERA = "frontview"
ACTION_SCALE = (0.12, 0.5)  # OSC output limits per unit action (m, rad); see the module docstring
VIDEO_HW = (240, 320)

# robosuite renders upside down in its default ("opengl") image convention; we flip unless the user's
# robosuite macros already switched to the "opencv" convention.
_FLIP_IMAGES = IMAGE_CONVENTION_MAPPING[rs_macros.IMAGE_CONVENTION] == 1


@dataclass(frozen=True)
class RobosuiteTask:
    """One robosuite task as kinema exposes it."""

    env_name: str  # robosuite environment class
    instructions: Instructions
    horizon: int  # control steps (20 Hz)
    target: str  # what `privileged.target_pos` tracks: a robosuite body name, or "handle" (Door)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    fmt: dict[str, str] = field(default_factory=dict)  # fills the instruction templates


def _pick_place(obj: str, body: str) -> RobosuiteTask:
    return RobosuiteTask(
        env_name=f"PickPlace{obj.capitalize()}",
        instructions=Instructions(
            train=(
                "put the {object} in the other bin",
                "pick up the {object} and place it in the right bin",
                "move the {object} from the left bin to the right bin",
            ),
            heldout=(
                "transfer the {object} into the second bin",
                "could you drop the {object} into the bin on the right",
                "take the {object} out of its bin and put it in the other one",
            ),
        ),
        horizon=300,
        target=body,
        fmt={"object": {"can": "can", "milk": "milk carton", "bread": "bread", "cereal": "cereal box"}[obj]},
    )


ROBOSUITE_TASKS: dict[str, RobosuiteTask] = {
    "Lift": RobosuiteTask(
        env_name="Lift",
        instructions=Instructions(
            train=("lift the {object}", "pick up the {object}", "raise the {object} off the table"),
            heldout=("hoist the {object} into the air", "could you grab the {object} and hold it up", "get the {object} up off the table"),
        ),
        horizon=150,
        target="cube_main",
        fmt={"object": "red cube"},
    ),
    "Stack": RobosuiteTask(
        env_name="Stack",
        instructions=Instructions(
            train=(
                "stack the {top} on the {bottom}",
                "put the {top} on top of the {bottom}",
                "place the {top} onto the {bottom}",
            ),
            heldout=(
                "set the {top} down on the {bottom}",
                "could you build a tower with the {top} above the {bottom}",
                "pile the {top} onto the {bottom}",
            ),
        ),
        horizon=250,
        target="cubeA_main",
        fmt={"top": "red cube", "bottom": "green cube"},
    ),
    "PickPlaceCan": _pick_place("can", "Can_main"),
    "PickPlaceMilk": _pick_place("milk", "Milk_main"),
    "PickPlaceBread": _pick_place("bread", "Bread_main"),
    "PickPlaceCereal": _pick_place("cereal", "Cereal_main"),
    "Door": RobosuiteTask(
        env_name="Door",
        instructions=Instructions(
            train=("open the door", "pull the door open", "swing the door open"),
            heldout=("could you get the door open", "grab the handle and open the door", "make the door stand open"),
        ),
        horizon=200,
        target="handle",
    ),
}

# Arguments the adapter owns; anything else in **robosuite_kwargs goes to robosuite.make unchanged.
_OWNED_KWARGS = {
    "robots", "controller_configs", "has_renderer", "has_offscreen_renderer", "use_camera_obs", "use_object_obs",
    "camera_names", "camera_heights", "camera_widths", "camera_depths", "hard_reset", "ignore_done", "horizon",
    "control_freq", "reward_shaping", "reward_scale", "seed", "renderer",
}  # fmt: skip


@dataclass(frozen=True)
class RobosuiteConfig:
    horizon: int


class RobosuiteEnv(gym.Env):
    """A robosuite task with kinema's observation/action contract (see the module docstring)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": int(CONTROL_HZ)}

    def __init__(
        self,
        name: str,
        *,
        image_size: int | tuple[int, int] = 96,
        cameras: tuple[str, ...] = CAMERAS,
        instructions: str = "train",
        horizon: int | None = None,
        action_scale: tuple[float, float] = ACTION_SCALE,
        model_seed: int = 0,
        shadows: bool = False,  # robosuite's shadows and reflections
        antialias: bool = False,  # robosuite's 4x MSAA
        render_mode: str | None = None,
        **robosuite_kwargs: Any,
    ) -> None:
        self.task_spec = ROBOSUITE_TASKS[name]
        self.name = name
        if instructions == "ablated":  # one object per task: no other target the instruction could have named
            from sim.tasks.external import SplitNotApplicable

            raise SplitNotApplicable(f"{name} has one target: an instruction naming none is not applicable")
        if instructions not in ("train", "heldout"):
            raise ValueError(f"instructions must be 'train' or 'heldout'; got {instructions!r}")
        owned = sorted(set(robosuite_kwargs) & _OWNED_KWARGS)
        if owned:
            raise ValueError(f"{name}: {owned} are set by the adapter; use its own arguments (image_size, cameras, horizon, ...)")
        self.instruction_split = instructions
        self.image_hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.cameras = tuple(cameras)
        self.rs_cameras = tuple(CAMERA_ALIASES.get(c, c) for c in self.cameras)
        horizon = self.task_spec.horizon if horizon is None else int(horizon)
        if horizon <= 0:
            raise ValueError(f"{name}: horizon must be positive; got {horizon}")
        self.config = RobosuiteConfig(horizon=horizon)
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"{name}: render_mode must be None or 'rgb_array'; got {render_mode!r}")
        self.render_mode = render_mode

        pos_scale, rot_scale = (float(v) for v in action_scale)
        if not (pos_scale > 0 and rot_scale > 0):
            raise ValueError(f"{name}: action_scale must be two positive numbers (metres, radians); got {action_scale}")
        with _quiet_robosuite():
            controller = load_composite_controller_config(controller=None, robot="Panda")
        arm = controller["body_parts"]["right"]
        if arm["type"] != "OSC_POSE" or arm["input_type"] != "delta" or arm["input_ref_frame"] != "base":
            raise RuntimeError(f"robosuite's default Panda controller changed: {arm}; the adapter expects delta OSC_POSE in the base frame")
        arm["output_max"] = [pos_scale] * 3 + [rot_scale] * 3
        arm["output_min"] = [-pos_scale] * 3 + [-rot_scale] * 3

        h, w = self.image_hw
        with _quiet_robosuite():
            try:
                self._env = robosuite.make(
                    self.task_spec.env_name,
                    robots="Panda",
                    controller_configs=controller,
                    has_renderer=False,
                    has_offscreen_renderer=bool(self.cameras) or render_mode == "rgb_array",
                    use_camera_obs=bool(self.cameras),
                    use_object_obs=True,
                    camera_names=list(self.rs_cameras) or "agentview",
                    camera_heights=h,
                    camera_widths=w,
                    renderer="mujoco",  # no on-screen viewer
                    hard_reset=False,  # a hard reset rebuilds the model and the render context every episode
                    ignore_done=True,  # the horizon is ours
                    horizon=10**9,
                    control_freq=int(CONTROL_HZ),
                    reward_shaping=True,  # only for info["progress"]; the reward we return is sparse
                    reward_scale=1.0,
                    seed=model_seed,  # fixes what robosuite randomises when building the model (e.g. cube sizes)
                    **self.task_spec.env_kwargs,
                    **robosuite_kwargs,
                )
            except ValueError as exc:
                if "_image is invalid" in str(exc):  # robosuite's error for a camera name the model lacks
                    raise ValueError(
                        f"{name}: unknown camera in {self.cameras}; valid: {', '.join(CAMERA_ALIASES)} (kinema names) "
                        f"or robosuite's {', '.join(ROBOSUITE_CAMERAS)}"
                    ) from exc
                raise
        self._robot = self._env.robots[0]
        self._sim = self._env.sim
        self._model = self._sim.model._model
        self._data = self._sim.data._data
        self._eef_site = self._robot.eef_site_id["right"]
        self._gripper = self._robot.gripper["right"]
        self._finger_qpos = np.asarray(self._robot._ref_gripper_joint_pos_indexes["right"])
        finger_ranges = self._model.jnt_range[[self._model.jnt_qposadr.tolist().index(i) for i in self._finger_qpos]]
        self._finger_span = float(np.sum(finger_ranges[:, 1] - finger_ranges[:, 0]))
        self._base_body = self._model.body(self._robot.robot_model.root_body).id
        self._target_body = -1 if self.task_spec.target == "handle" else self._model.body(self.task_spec.target).id
        self._configure_rendering(shadows=shadows, antialias=antialias)

        self.observation_space, self.action_space = policy_spaces(self.cameras, (h, w))
        self.task = ""
        self.steps = 0
        self._rs_obs: dict[str, Any] = {}
        self._shaped = 0.0

    # ----- rendering -----------------------------------------------------------------------------------------------
    def _configure_rendering(self, *, shadows: bool, antialias: bool) -> None:
        """CPU-friendly offscreen rendering. robosuite 1.5.2 renders through `sim._render_context_offscreen`
        (an `MjRenderContext`): its `MjrContext` is created from the model's `<visual>` settings (robosuite's
        models ask for 4x MSAA, 4096^2 shadow maps, a 640x480 buffer) and its `MjvScene` flags switch shadows and
        reflections. We shrink the buffer to the camera size, turn MSAA off, and rebuild the MjrContext."""
        ctx = self._sim._render_context_offscreen
        if ctx is None:
            return
        vis = self._model.vis
        if not antialias:
            vis.quality.offsamples = 0
        if not shadows:
            vis.quality.shadowsize = 0
        h, w = self.image_hw
        vis.global_.offwidth, vis.global_.offheight = w, h  # robosuite grows it on demand (e.g. for render())
        ctx.gl_ctx.make_current()
        ctx.con.free()
        ctx._set_mujoco_context_and_buffers()
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = int(shadows)
        ctx.scn.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = int(shadows)

    def _make_current(self) -> None:
        """robosuite renders into whichever GL context is current and never makes its own current before a render,
        so with several envs in one process every env but the last built would read another env's framebuffer
        (garbage images). Every adapter call that may render makes this env's context current first."""
        ctx = self._sim._render_context_offscreen
        if ctx is not None:
            ctx.gl_ctx.make_current()

    def _image(self, img: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(img[::-1]) if _FLIP_IMAGES else img

    def render(self) -> np.ndarray:
        """A frontview frame (240x320, right side up) for videos, independent of the policy's cameras."""
        if self._sim._render_context_offscreen is None:
            raise RuntimeError(f"{self.name}: render() needs an offscreen renderer: build with render_mode='rgb_array' or with cameras")
        self._make_current()
        frame = self._sim.render(width=VIDEO_HW[1], height=VIDEO_HW[0], camera_name=VIDEO_CAMERA)
        return self._image(frame)

    # ----- gymnasium API -------------------------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        # robosuite draws every layout (placement samplers, robot init noise) from `env.rng`, a Generator that its
        # samplers hold by reference: reseed it in place from gymnasium's np_random.
        rs_seed = int(self.np_random.integers(2**63))
        self._env.rng.bit_generator.state = np.random.default_rng(rs_seed).bit_generator.state
        # The Panda gripper's rate controller keeps its command across soft resets; a fresh env starts at 0.
        self._gripper.current_action = np.zeros(self._gripper.dof)
        self._make_current()
        self._rs_obs = self._env.reset()
        templates = getattr(self.task_spec.instructions, self.instruction_split)
        self.task = templates[int(self.np_random.integers(len(templates)))].format(**self.task_spec.fmt)
        self.steps = 0
        self._shaped = float(self._env.reward(None))
        success = self.is_success()
        return self._observation(), self._info(success)

    def step(self, action: Any):
        action = self.validate_action(action)
        self._make_current()
        self._rs_obs, self._shaped, _, _ = self._env.step(action)
        self.steps += 1
        success = self.is_success()
        truncated = (not success) and self.steps >= self.config.horizon
        return self._observation(), float(success), success, truncated, self._info(success)

    def validate_action(self, action: Any) -> np.ndarray:
        return validate_action(action, self.name)

    def close(self) -> None:
        env = getattr(self, "_env", None)
        if env is not None:
            env.close()
            self._env = None

    # ----- state access (same names as TabletopEnv, for monitors and experts) ---------------------------------------
    def is_success(self) -> bool:
        return bool(self._env._check_success())

    def progress(self, success: bool | None = None) -> float:
        """robosuite's shaped reward (normalised to [0, 1] by reward_scale=1), kept below 1 until the task's own check
        passes. Door's shaped reward ignores the hinge unless the door is latched, so the hinge angle is added there."""
        if self.is_success() if success is None else success:
            return 1.0
        value = self._shaped
        if self.task_spec.env_name == "Door":
            hinge = float(self._data.qpos[self._env.hinge_qpos_addr])
            value += 0.7 * float(np.clip(hinge / 0.3, 0.0, 1.0))
        return float(np.clip(value, 0.0, 0.99))

    def base_pose(self) -> tuple[np.ndarray, np.ndarray]:
        return self._data.xpos[self._base_body].copy(), self._data.xmat[self._base_body].reshape(3, 3).copy()

    def to_base(self, world_pos: np.ndarray) -> np.ndarray:
        pos, rot = self.base_pose()
        return rot.T @ (np.asarray(world_pos, dtype=np.float64) - pos)

    def ee_pos(self) -> np.ndarray:
        """End-effector position in the robot base frame (the frame of the action and of observation.state)."""
        return self.to_base(self._data.site_xpos[self._eef_site])

    def ee_mat(self) -> np.ndarray:
        _, rot = self.base_pose()
        return rot.T @ self._data.site_xmat[self._eef_site].reshape(3, 3)

    def ee_yaw(self) -> float:
        mat = self.ee_mat()
        return float(np.arctan2(mat[1, 1], mat[0, 1]))

    def gripper_opening(self) -> float:
        return float(np.clip(np.abs(self._data.qpos[self._finger_qpos]).sum() / self._finger_span, 0.0, 1.0))

    def state_vector(self) -> np.ndarray:
        return ee_state_vector(self.ee_pos(), self.ee_mat(), self.gripper_opening())

    def get_state(self) -> np.ndarray:
        """Physics state plus the gripper's rate-controller command, for exact rewinds within an episode."""
        size = mujoco.mj_stateSize(self._model, mujoco.mjtState.mjSTATE_INTEGRATION)
        state = np.empty(size)
        mujoco.mj_getState(self._model, self._data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
        return np.concatenate([state, np.asarray(self._gripper.current_action, dtype=np.float64)])

    def set_state(self, state: np.ndarray) -> None:
        n = mujoco.mj_stateSize(self._model, mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_setState(self._model, self._data, np.asarray(state[:n]), mujoco.mjtState.mjSTATE_INTEGRATION)
        self._gripper.current_action = np.array(state[n:], dtype=np.float64)
        self._sim.forward()
        self._refresh_controllers(episode_start=False)
        self._make_current()
        self._rs_obs = self._env._get_observations(force_update=True)
        self._shaped = float(self._env.reward(None))

    def set_robosuite_state(self, flat: np.ndarray, *, episode_start: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """Set the simulator to a state as robosuite flattens it (`sim.get_state().flatten()`: time, qpos, qvel; the
        `states` robosuite's data collection and robomimic's files store) and return the observation and info there.

        Controller state is not in that vector. The controllers always re-read the arm's kinematics (after a reset
        they would act on the reset pose). `episode_start=True` (a demo's `states[0]`) also resets them as robosuite's
        reset does at that pose: OSC's nullspace posture is the episode's first joint configuration and the gripper's
        rate command 0, so replaying the demo's actions from there follows the demo."""
        flat = np.asarray(flat, dtype=np.float64)
        expected = 1 + self._model.nq + self._model.nv
        if flat.shape != (expected,):
            raise ValueError(f"{self.name}: a flattened robosuite state of this model has shape ({expected},) (time, "
                             f"qpos, qvel); got {flat.shape}")
        self._sim.set_state_from_flattened(flat)
        self._sim.forward()
        self._refresh_controllers(episode_start=episode_start)
        self._make_current()
        self._rs_obs = self._env._get_observations(force_update=True)
        self._shaped = float(self._env.reward(None))
        success = self.is_success()
        return self._observation(), self._info(success)

    def _refresh_controllers(self, *, episode_start: bool) -> None:
        composite = self._robot.composite_controller
        for controller in composite.part_controllers.values():
            controller.update(force=True)
            if episode_start:
                controller.update_initial_joints(np.array(controller.joint_pos))
        if episode_start:
            self._gripper.current_action = np.zeros(self._gripper.dof)
            composite.update_state()
            composite.reset()

    def privileged(self) -> dict[str, np.ndarray]:
        priv: dict[str, np.ndarray] = {}
        for obs_name, observable in self._env._observables.items():
            if observable.modality == "object" and observable.is_enabled() and observable.is_active():
                priv[f"privileged.{obs_name}"] = np.atleast_1d(np.asarray(self._rs_obs[obs_name], np.float32))
        if "object-state" in self._rs_obs:
            priv["privileged.object_state"] = np.asarray(self._rs_obs["object-state"], np.float32)
        if self._target_body >= 0:
            target = self._data.xpos[self._target_body]
        else:  # Door: the handle site
            target = self._data.site_xpos[self._env.door_handle_site_id]
        priv["privileged.target_pos"] = self.to_base(target).astype(np.float32)
        goal = self._goal_world()
        if goal is not None:
            priv["privileged.goal_pos"] = self.to_base(goal).astype(np.float32)
        priv["privileged.base_pos"] = self.base_pose()[0].astype(np.float32)
        return priv

    def _goal_world(self) -> np.ndarray | None:
        env = self._env
        if self.task_spec.env_name == "Stack":
            return self._data.xpos[env.cubeB_body_id].copy()  # place cubeA on top of cubeB
        if self.task_spec.env_name.startswith("PickPlace"):
            return env.target_bin_placements[env.object_id].copy()
        return None

    def _observation(self) -> dict[str, Any]:
        obs: dict[str, Any] = {
            f"observation.images.{cam}": self._image(self._rs_obs[f"{rs_cam}_image"])
            for cam, rs_cam in zip(self.cameras, self.rs_cameras)
        }
        obs["observation.state"] = self.state_vector()
        obs["task"] = self.task
        return obs

    def _info(self, success: bool) -> dict[str, Any]:
        return {"is_success": bool(success), "privileged": self.privileged(), "progress": self.progress(success)}

    @property
    def robosuite_env(self) -> Any:
        """The wrapped robosuite environment (for inspection; stepping it directly bypasses the adapter)."""
        return self._env


def resolve_name(name: str) -> str:
    """Accepts robosuite's names ("Lift", "PickPlaceCan", ...), optionally prefixed "robosuite/"."""
    bare = name.split("/", 1)[1] if name.startswith("robosuite/") else name
    if bare not in ROBOSUITE_TASKS:
        close = difflib.get_close_matches(bare, ROBOSUITE_TASKS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown robosuite task {name!r}; valid robosuite tasks: {', '.join(ROBOSUITE_TASKS)}.{hint}")
    return bare


def make_robosuite(name: str, **kwargs: Any) -> RobosuiteEnv:
    """Build a robosuite task behind kinema's gymnasium interface.

    Keyword arguments: image_size (96), cameras (("agentview", "wrist"); other robosuite camera names pass
    through), instructions ("train" | "heldout"), horizon (task default), action_scale ((0.12 m, 0.5 rad) per unit
    action: the OSC output limits), model_seed (0: fixes robosuite's model-build randomness), shadows/antialias
    (False), render_mode; anything else goes to `robosuite.make` (e.g. `use_latch=True` for Door).
    """
    return RobosuiteEnv(resolve_name(name), **kwargs)


__all__ = ["ROBOSUITE_TASKS", "RobosuiteEnv", "RobosuiteTask", "make_robosuite", "resolve_name", "INSTALL_HINT"]
