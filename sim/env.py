"""The tabletop environment base: arm, table, cameras, action handling and observations.

A task subclass adds its objects (`task_xml`), samples a layout and an instruction on reset (`sample_episode`),
and defines success (`is_success`) and privileged state (`privileged`). Everything the policy may see is in the
observation; everything a scripted expert or monitor may additionally use is in `info["privileged"]`.
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import dataclasses
import itertools
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym
import mujoco
import numpy as np

from sim.arm import FINGER_OPEN, ArmController, arm_actuators_xml, arm_xml

CONTROL_HZ = 20.0
PHYSICS_TIMESTEP = 0.002
SUBSTEPS = int(round(1.0 / (CONTROL_HZ * PHYSICS_TIMESTEP)))  # 25 physics steps per control step
# The cameras every sim task renders unless told otherwise: what scripted demos and rollouts record.
CAMERAS: tuple[str, ...] = ("agentview", "wrist")
POS_SCALE = 0.04  # metres per control step at |action| = 1
ROT_SCALE = 0.25  # radians per control step at |action| = 1
TABLE_TOP = 0.0
PARK_Z = -0.79  # parked (unused) objects rest on the floor under the table, out of every camera's view

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.85, 0.12, 0.12),
    "green": (0.15, 0.7, 0.2),
    "blue": (0.15, 0.3, 0.9),
    "yellow": (0.95, 0.85, 0.1),
    "purple": (0.55, 0.2, 0.75),
    "orange": (1.0, 0.5, 0.05),
    "white": (0.95, 0.95, 0.95),
    "black": (0.1, 0.1, 0.1),
}


@dataclass
class TaskConfig:
    """Difficulty and variation of a task. Every task module's `default_config()` returns one of these."""

    horizon: int = 150  # control steps (20 Hz) before truncation
    num_distractors: int = 1  # objects present that the instruction does not name
    x_range: tuple[float, float] = (0.42, 0.62)  # layout range (m) in front of the arm base
    y_range: tuple[float, float] = (-0.2, 0.2)
    min_separation: float = 0.1  # minimum xy distance between object centres (m)
    colors: tuple[str, ...] = ("red", "green", "blue", "yellow", "purple", "orange")
    yaw_range: float = 0.4  # objects' random yaw, +- radians

    def __post_init__(self) -> None:
        unknown = [c for c in self.colors if c not in COLORS]
        if unknown:
            raise ValueError(f"TaskConfig.colors has unknown colours {unknown}; valid: {sorted(COLORS)}")
        if self.horizon <= 0:
            raise ValueError(f"TaskConfig.horizon must be positive; got {self.horizon}")
        if self.num_distractors < 0:
            raise ValueError(f"TaskConfig.num_distractors must be >= 0; got {self.num_distractors}")
        if len(set(self.colors)) < 2:
            raise ValueError(f"TaskConfig.colors needs at least 2 distinct colours (targets and goals differ); got {self.colors}")
        for name in ("x_range", "y_range"):
            lo, hi = getattr(self, name)
            if not lo <= hi:
                raise ValueError(f"TaskConfig.{name} must be (low, high) with low <= high; got {(lo, hi)}")

    def replace(self, **changes: Any) -> TaskConfig:
        return dataclasses.replace(self, **changes)


def policy_spaces(cameras: tuple[str, ...], image_hw: tuple[int, int]) -> tuple[gym.spaces.Dict, gym.spaces.Box]:
    """The observation and action spaces every kinema task shares (ours and adapted ones)."""
    h, w = image_hw
    spaces: dict[str, gym.Space] = {
        f"observation.images.{cam}": gym.spaces.Box(0, 255, (h, w, 3), np.uint8) for cam in cameras
    }
    spaces["observation.state"] = gym.spaces.Box(-np.inf, np.inf, (8,), np.float32)
    spaces["task"] = gym.spaces.Text(max_length=256, charset=string.printable)
    return gym.spaces.Dict(spaces), gym.spaces.Box(-1.0, 1.0, (7,), np.float32)


# The state's quaternion takes the sign on this side of the hand pointing down (home), where the tasks are worked:
# the sign that makes w >= 0 flips x between +1 and -1 as the hand tilts through w = 0, right at that pose.
STATE_QUAT_REFERENCE = np.array([0.0, 1.0, 0.0, 0.0])


def ee_state_vector(pos: np.ndarray, mat: np.ndarray, opening: float) -> np.ndarray:
    """`observation.state` (8,): end-effector position, quaternion wxyz, gripper opening in [0, 1]."""
    quat = np.zeros(4)
    mujoco.mju_mat2Quat(quat, np.asarray(mat, dtype=np.float64).reshape(-1))
    if quat @ STATE_QUAT_REFERENCE < 0:  # q and -q are one rotation: the sign nearer the hand pointing down
        quat = -quat
    return np.concatenate([pos, quat, [opening]]).astype(np.float32)


def validate_action(action: Any, task: str) -> np.ndarray:
    """Reject malformed actions before anything in the simulation changes; clip the rest to [-1, 1]."""
    action = np.asarray(action, dtype=np.float64)
    if action.shape != (7,):
        raise ValueError(
            f"{task}: action must have shape (7,) = EE translation (3), rotation (3), gripper (1); got shape {action.shape}"
        )
    if not np.isfinite(action).all():
        raise ValueError(f"{task}: action contains NaN or inf at indices {np.flatnonzero(~np.isfinite(action)).tolist()}")
    return np.clip(action, -1.0, 1.0)


@dataclass
class Instructions:
    """Instruction templates: training templates, plus held-out paraphrases for generalisation tests."""

    train: tuple[str, ...]
    heldout: tuple[str, ...]


# The instruction splits: training templates, held-out paraphrases, and "ablated": the training templates with every
# word that names a target replaced by a nonsense word, so that the instruction no longer says which target (success
# should fall to chance: the policy cannot know which drawer, object or plate).
INSTRUCTION_SPLITS = ("train", "heldout", "ablated")
NONSENSE_WORDS = ("dax", "wug", "blicket", "toma", "fep", "zorb")


def ablate(names: dict[str, str]) -> dict[str, str]:
    """`names` (template field -> the words naming a target) with each word replaced by a nonsense word, the same
    whatever the target, so that nothing in the instruction tells two episodes' targets apart."""
    words = iter(NONSENSE_WORDS * 4)
    return {field: " ".join(next(words) for _ in value.split()) for field, value in names.items()}


def look_at(pos: tuple[float, float, float], target: tuple[float, float, float]) -> str:
    """MJCF `xyaxes` for a camera at `pos` looking at `target` with the world z axis up in the image."""
    forward = np.subtract(target, pos, dtype=float)
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, [0.0, 0.0, 1.0])
    right /= np.linalg.norm(right)
    up = np.cross(right, forward)
    return " ".join(f"{v:.4f}" for v in (*right, *up))


# agentview looks from behind the arm's shoulder, so drawer fronts (which face the arm) stay visible;
# overview (for videos) looks from the side.
AGENTVIEW = ((0.0, -0.5, 0.65), (0.58, 0.02, 0.02))
OVERVIEW = ((0.55, -1.05, 0.75), (0.5, 0.0, 0.05))


def scene_xml(task_bodies: str, *, assets: str = "", actuators: str = "") -> str:
    return f"""
<mujoco model="kinema_tabletop">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{PHYSICS_TIMESTEP}" integrator="implicitfast" cone="elliptic" impratio="10">
    <flag multiccd="enable"/>
  </option>
  <visual>
    <quality shadowsize="0" offsamples="0"/>
    <headlight ambient="0.45 0.45 0.45" diffuse="0.5 0.5 0.5" specular="0 0 0"/>
    <global offwidth="640" offheight="480"/>
  </visual>
  <default>
    <geom solref="0.005 1" friction="1 0.005 0.0001"/>
  </default>
  <asset>
    <texture name="grid" type="2d" builtin="checker" rgb1="0.82 0.78 0.7" rgb2="0.78 0.74 0.66" width="64" height="64"/>
    <material name="table" texture="grid" texrepeat="6 6"/>
    {assets}
  </asset>
  <worldbody>
    <light pos="0.4 0 1.5" dir="0 0 -1" castshadow="false" diffuse="0.5 0.5 0.5"/>
    <geom name="floor" type="plane" size="3 3 0.1" pos="0 0 -0.8" rgba="0.3 0.3 0.32 1"/>
    <geom name="table" type="box" size="0.45 0.55 0.4" pos="0.5 0 -0.4" material="table"/>
    <camera name="agentview" pos="{' '.join(map(str, AGENTVIEW[0]))}" xyaxes="{look_at(*AGENTVIEW)}" fovy="52"/>
    <camera name="overview" pos="{' '.join(map(str, OVERVIEW[0]))}" xyaxes="{look_at(*OVERVIEW)}" fovy="55"/>
    {arm_xml()}
    {task_bodies}
  </worldbody>
  <actuator>
    {arm_actuators_xml()}
    {actuators}
  </actuator>
</mujoco>"""


class TabletopEnv(gym.Env):
    """Base class of kinema's MuJoCo tasks.

    Observation (dict): `observation.images.<camera>` uint8 (H, W, 3) for each camera, `observation.state` float32 (8,)
    = end-effector position (3), end-effector quaternion wxyz (4), gripper opening in [0, 1] (1); `task` = instruction.
    Action: Box(-1, 1, (7,)) = end-effector translation delta (3), rotation delta (3, axis-angle), gripper (+1 closes).
    Reward: 1 on the step the task is solved (which terminates the episode), else 0. `info["is_success"]`.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": int(CONTROL_HZ)}
    name: ClassVar[str] = ""
    instructions: ClassVar[Instructions]
    max_distractors: ClassVar[int] = 0  # what the task's object pool can hold

    def __init__(
        self,
        config: TaskConfig | None = None,
        *,
        image_size: int | tuple[int, int] = 96,
        cameras: tuple[str, ...] = CAMERAS,
        instructions: str = "train",
        objects: str = "train",
        render_mode: str | None = None,
    ) -> None:
        self.config = config if config is not None else self.default_config()
        if self.config.num_distractors > self.max_distractors:
            raise ValueError(
                f"{self.name}: num_distractors={self.config.num_distractors} exceeds the {self.max_distractors} "
                "this task's object pool holds"
            )
        if instructions not in INSTRUCTION_SPLITS:
            raise ValueError(f"instructions must be one of {INSTRUCTION_SPLITS}; got {instructions!r}")
        if objects not in ("train", "heldout"):
            raise ValueError(f"objects must be 'train' or 'heldout'; got {objects!r}")
        self.instruction_split = instructions
        self.object_split = objects
        self.image_hw = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.cameras = tuple(cameras)
        self.render_mode = render_mode

        self.model = mujoco.MjModel.from_xml_string(self.build_xml())
        self.data = mujoco.MjData(self.model)
        for cam in self.cameras:
            if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_CAMERA, cam) < 0:
                raise ValueError(f"unknown camera {cam!r}; valid: agentview, wrist, overview")
        self.arm = ArmController(self.model)
        self._left_finger = self.model.body("left_finger").id
        self._right_finger = self.model.body("right_finger").id
        self._renderer: mujoco.Renderer | None = None
        self._video_renderer: mujoco.Renderer | None = None
        self._episode_model: tuple[np.ndarray, np.ndarray] | None = None  # what sample_episode may change, as built
        self.task = ""
        self.target_names: dict[str, tuple[str, ...]] = {}  # template field -> every way this episode can name it
        self.steps = 0
        # False: observations carry no camera frames (state and instruction only). Rendering is most of a step's
        # cost; a vector env clears it for steps after which no policy reads the frames (sim.vector `observe`).
        self.render_images = True
        self.bind()

        self.observation_space, self.action_space = policy_spaces(self.cameras, self.image_hw)

    # ----- what a task defines -------------------------------------------------------------------------------------
    @classmethod
    def default_config(cls) -> TaskConfig:
        return TaskConfig()

    def task_xml(self) -> str:
        raise NotImplementedError

    def bind(self) -> None:
        """Look up the task's ids in the compiled model."""

    def sample_episode(self, rng: np.random.Generator) -> str:
        """Place objects and colours for a new episode (model/data already reset); return the instruction."""
        raise NotImplementedError

    def instruction(self, rng: np.random.Generator, **names: str) -> str:
        """A template of the episode's instruction split, filled with the words naming its targets (`names`: the
        template's fields); the "ablated" split fills the training templates with nonsense words instead. Each split
        draws the same random numbers, so a seed's scene is the same in every split (evaluations pair by seed)."""
        templates = self.instructions.heldout if self.instruction_split == "heldout" else self.instructions.train
        template = templates[rng.integers(len(templates))]
        self.target_names = {field: (value,) for field, value in names.items()}
        return template.format(**(ablate(names) if self.instruction_split == "ablated" else names))

    def equivalent_instructions(self) -> list[str]:
        """Every training-template instruction that names this episode's targets (each template with each way of
        naming each target, `target_names`): what a demonstration of this episode equally demonstrates."""
        fields = list(self.target_names)
        return [template.format(**dict(zip(fields, words))) for template in self.instructions.train
                for words in itertools.product(*(self.target_names[f] for f in fields))]  # fmt: skip

    def target_reached(self) -> bool:
        """What the instruction names is done (the named drawer open, the named object on the named plate)."""
        raise NotImplementedError

    def wrong_target(self) -> bool:
        """An outcome the instruction did not ask for (the other drawer open, another object on the plate): RL finds
        every such loophole in a lenient test, so it fails the episode however the named target stands."""
        return False

    def is_success(self) -> bool:
        return self.target_reached() and not self.wrong_target()

    def privileged(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def progress(self) -> float:
        """Task progress in [0, 1] from privileged state (1 = solved). Used by monitors and segment labelling."""
        raise NotImplementedError

    # ----- gymnasium API -------------------------------------------------------------------------------------------
    def build_xml(self) -> str:
        return scene_xml(self.task_xml())

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        mujoco.mj_resetData(self.model, self.data)
        # An episode is its seed's alone: colours and placements an earlier episode gave objects this one leaves
        # unused (an idle slot, visible to the wrist camera) go back to the built model's.
        if self._episode_model is None:
            self._episode_model = (self.model.geom_rgba.copy(), self.model.body_pos.copy())
        self.model.geom_rgba[:], self.model.body_pos[:] = self._episode_model
        self.arm.set_home(self.data)
        self.task = self.sample_episode(self.np_random)
        mujoco.mj_forward(self.model, self.data)
        # Let objects settle on the table before the first observation.
        mujoco.mj_step(self.model, self.data, nstep=10)
        self.steps = 0
        return self._observation(), self._info(False)

    def step(self, action: np.ndarray):
        if not self.task:
            raise RuntimeError(f"{self.name}: call reset() before step()")
        action = self.validate_action(action)
        self.arm.apply(self.data, action[:3] * POS_SCALE, action[3:6] * ROT_SCALE, float(action[6]))
        mujoco.mj_step(self.model, self.data, nstep=SUBSTEPS)
        self.steps += 1
        success = self.is_success()
        truncated = (not success) and self.steps >= self.config.horizon
        return self._observation(), float(success), success, truncated, self._info(success)

    def validate_action(self, action: Any) -> np.ndarray:
        return validate_action(action, self.name)

    def render(self) -> np.ndarray:
        """An overview frame (for videos), independent of the policy's cameras."""
        if self._video_renderer is None:
            self._video_renderer = mujoco.Renderer(self.model, 240, 320)
        self._video_renderer.update_scene(self.data, camera="overview")
        return self._video_renderer.render()

    def close(self) -> None:
        for r in (self._renderer, self._video_renderer):
            if r is not None:
                r.close()
        self._renderer = self._video_renderer = None

    # ----- state access shared by tasks, experts and monitors ------------------------------------------------------
    def ee_pos(self) -> np.ndarray:
        return self.arm.ee_pos(self.data)

    def ee_yaw(self) -> float:
        mat = self.arm.ee_mat(self.data)
        return float(np.arctan2(mat[1, 1], mat[0, 1]))  # direction of the finger axis (hand y) in the table plane

    def gripper_opening(self) -> float:
        return self.arm.gripper_width(self.data) / (2 * FINGER_OPEN)

    def state_vector(self) -> np.ndarray:
        return ee_state_vector(self.ee_pos(), self.data.site_xmat[self.arm.site_id], self.gripper_opening())

    def get_state(self) -> np.ndarray:
        """Full physics state, for exact rewinds by a simulated human."""
        size = mujoco.mj_stateSize(self.model, mujoco.mjtState.mjSTATE_INTEGRATION)
        state = np.empty(size)
        mujoco.mj_getState(self.model, self.data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
        return state

    def set_state(self, state: np.ndarray) -> None:
        mujoco.mj_setState(self.model, self.data, state, mujoco.mjtState.mjSTATE_INTEGRATION)
        mujoco.mj_forward(self.model, self.data)

    def _observation(self) -> dict[str, Any]:
        obs: dict[str, Any] = {}
        if self.cameras and self.render_images:
            if self._renderer is None:
                self._renderer = mujoco.Renderer(self.model, *self.image_hw)
            for cam in self.cameras:
                self._renderer.update_scene(self.data, camera=cam)
                obs[f"observation.images.{cam}"] = self._renderer.render()
        obs["observation.state"] = self.state_vector()
        obs["task"] = self.task
        return obs

    def _info(self, success: bool) -> dict[str, Any]:
        return {"is_success": bool(success), "wrong_target": self.wrong_target(), "privileged": self.privileged_with_pixels(),
                "progress": self.progress()}

    def privileged_with_pixels(self) -> dict[str, np.ndarray]:
        """`privileged()` and where the named target (and the goal, where the task has a place as goal: `goal_pos`)
        appears in each policy camera's image, `privileged.target_pixels.<camera>` (2,) (`image_positions`): the
        labels that teach a policy to find what the instruction names. One key per camera, so that they travel with
        the camera's name through a dataset."""
        privileged = self.privileged()
        if self.cameras and "privileged.target_pos" in privileged:
            points = [privileged["privileged.target_pos"]] + ([np.asarray(self.goal_pos())] if hasattr(self, "goal_pos") else [])
            pixels = self.image_positions(np.stack(points))
            for i, cam in enumerate(self.cameras):
                for j, role in enumerate(("target", "goal")[: len(points)]):
                    privileged[f"privileged.{role}_pixels.{cam}"] = pixels[i, j]
        return privileged

    def image_positions(self, points: np.ndarray) -> np.ndarray:
        """World points (N, 3) in each policy camera's image: (cameras, N, 2) as (x, y) in [-1, 1], the encoders'
        convention (-1 the left column and the top row); a point behind a camera is at (2, 2), out of view."""
        h, w = self.image_hw
        out = np.full((len(self.cameras), len(points), 2), 2.0, np.float32)
        for i, cam in enumerate(self.cameras):
            cid = self.model.camera(cam).id
            local = (np.asarray(points) - self.data.cam_xpos[cid]) @ self.data.cam_xmat[cid].reshape(3, 3)
            ahead = local[:, 2] < 0  # a MuJoCo camera looks along its -z
            focal = 1 / np.tan(np.deg2rad(self.model.cam_fovy[cid]) / 2)  # fovy is vertical; pixels are square
            xy = focal * local[:, :2] / -local[:, 2:3] * np.array([h / w, -1.0])
            out[i, ahead] = xy[ahead]
        return out

    # ----- helpers for task subclasses -----------------------------------------------------------------------------
    def sample_layout(self, rng: np.random.Generator, n: int, *, radius: float | None = None) -> np.ndarray:
        """n non-overlapping xy positions inside the configured layout ranges."""
        cfg = self.config
        sep = cfg.min_separation if radius is None else radius
        for _ in range(1000):
            xy = np.stack([rng.uniform(*cfg.x_range, n), rng.uniform(*cfg.y_range, n)], axis=1)
            d = np.linalg.norm(xy[:, None] - xy[None], axis=-1) + np.eye(n) * 1e9
            if d.min() >= sep:
                return xy
        raise ValueError(
            f"{self.name}: cannot place {n} objects {sep} m apart in x {cfg.x_range}, y {cfg.y_range}; "
            "widen the ranges or reduce num_distractors"
        )

    def set_free_body(self, body: str, pos: np.ndarray, yaw: float = 0.0) -> None:
        jnt = self.model.body(body).jntadr[0]
        adr = self.model.jnt_qposadr[jnt]
        self.data.qpos[adr : adr + 3] = pos
        self.data.qpos[adr + 3 : adr + 7] = [np.cos(yaw / 2), 0, 0, np.sin(yaw / 2)]
        self.data.qvel[self.model.jnt_dofadr[jnt] : self.model.jnt_dofadr[jnt] + 6] = 0

    def body_pos(self, body: str) -> np.ndarray:
        return self.data.xpos[self.model.body(body).id].copy()

    def body_yaw(self, body: str) -> float:
        mat = self.data.xmat[self.model.body(body).id].reshape(3, 3)
        return float(np.arctan2(mat[1, 0], mat[0, 0]))

    def set_color(self, geom: str, color: str) -> None:
        self.model.geom_rgba[self.model.geom(geom).id, :3] = COLORS[color]

    def carry_progress(self, obj: np.ndarray, place: np.ndarray, rest_z: float) -> float:
        """Progress of a pick-and-place style task: reach (0-0.4), carry toward the place pose (0.5-0.95), done (1)."""
        if self.is_success():
            return 1.0
        if np.linalg.norm(obj - place) < 0.02:
            return 0.95  # placed, not yet released
        lifted = obj[2] > rest_z + 0.015 and all(self.finger_contacts(self.target.body))
        if not lifted:
            return 0.4 * float(np.clip(1 - np.linalg.norm(self.ee_pos() - obj) / 0.4, 0, 1))
        return 0.5 + 0.45 * float(np.clip(1 - np.linalg.norm(obj - place) / 0.4, 0, 1))

    def finger_contacts(self, body: str) -> tuple[bool, bool]:
        """Whether the left and right finger pads touch `body`."""
        ncon = self.data.ncon
        if ncon == 0:
            return False, False
        # Vectorised over the contact list: a Python loop over contacts dominated the env's own step cost.
        geoms = np.stack([self.data.contact.geom1[:ncon], self.data.contact.geom2[:ncon]])
        bodies = self.model.geom_bodyid[geoms]
        touches = (bodies == self.model.body(body).id).any(axis=0)
        if not touches.any():
            return False, False
        involved = bodies[:, touches]
        return bool((involved == self._left_finger).any()), bool((involved == self._right_finger).any())
