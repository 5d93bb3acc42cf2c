"""A 7-DoF Panda-like arm with a parallel gripper, built from primitive geoms, and its end-effector IK.

The kinematic chain follows the Franka Panda's published joint frames and limits, so poses and workspaces transfer
intuitively, but every visual is a capsule, box or cylinder: rendering stays cheap (no meshes, no shadows, no
anti-aliasing), which is what makes camera-based RL affordable on a CPU.
"""

from __future__ import annotations

import mujoco
import numpy as np

# Panda joint limits (rad), in chain order.
JOINT_LIMITS = np.array(
    [
        [-2.8973, 2.8973],
        [-1.7628, 1.7628],
        [-2.8973, 2.8973],
        [-3.0718, -0.0698],
        [-2.8973, 2.8973],
        [-0.0175, 3.7525],
        [-2.8973, 2.8973],
    ]
)
HOME_QPOS = np.array([0.0, -0.3, 0.0, -2.2, 0.0, 1.9, 0.785398])
FINGER_OPEN = 0.04  # metres per finger
JOINT_NAMES = tuple(f"joint{i}" for i in range(1, 8))
FINGER_JOINT_NAMES = ("finger_joint1", "finger_joint2")

_LINK_RGBA = "0.92 0.92 0.95 1"
_JOINT_RGBA = "0.25 0.25 0.28 1"


def arm_xml(base_pos: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> str:
    """The arm's `<body>` tree, to be placed inside a worldbody."""
    bx, by, bz = base_pos
    cap = f'type="capsule" rgba="{_LINK_RGBA}" contype="0" conaffinity="0"'
    dark = f'type="cylinder" rgba="{_JOINT_RGBA}" contype="0" conaffinity="0"'
    lim = JOINT_LIMITS
    return f"""
    <body name="link0" pos="{bx} {by} {bz}">
      <geom {dark} size="0.07 0.04" pos="0 0 0.04"/>
      <body name="link1" pos="0 0 0.333" gravcomp="1">
        <joint name="joint1" axis="0 0 1" range="{lim[0, 0]} {lim[0, 1]}"/>
        <geom {cap} size="0.055" fromto="0 0 -0.28 0 0 -0.05"/>
        <body name="link2" quat="0.7071068 -0.7071068 0 0" gravcomp="1">
          <joint name="joint2" axis="0 0 1" range="{lim[1, 0]} {lim[1, 1]}"/>
          <geom {dark} size="0.06 0.06"/>
          <body name="link3" pos="0 -0.316 0" quat="0.7071068 0.7071068 0 0" gravcomp="1">
            <joint name="joint3" axis="0 0 1" range="{lim[2, 0]} {lim[2, 1]}"/>
            <geom {cap} size="0.05" fromto="0 0 -0.25 0 0 -0.05"/>
            <body name="link4" pos="0.0825 0 0" quat="0.7071068 0.7071068 0 0" gravcomp="1">
              <joint name="joint4" axis="0 0 1" range="{lim[3, 0]} {lim[3, 1]}"/>
              <geom {dark} size="0.055 0.06"/>
              <body name="link5" pos="-0.0825 0.384 0" quat="0.7071068 -0.7071068 0 0" gravcomp="1">
                <joint name="joint5" axis="0 0 1" range="{lim[4, 0]} {lim[4, 1]}"/>
                <geom {cap} size="0.045" fromto="0 0 -0.26 0 0 -0.03"/>
                <body name="link6" quat="0.7071068 0.7071068 0 0" gravcomp="1">
                  <joint name="joint6" axis="0 0 1" range="{lim[5, 0]} {lim[5, 1]}"/>
                  <geom {dark} size="0.05 0.05"/>
                  <body name="link7" pos="0.088 0 0" quat="0.7071068 0.7071068 0 0" gravcomp="1">
                    <joint name="joint7" axis="0 0 1" range="{lim[6, 0]} {lim[6, 1]}"/>
                    <geom {cap} size="0.04" fromto="0 0 0 0 0 0.08"/>
                    <body name="hand" pos="0 0 0.107" quat="0.9238795 0 0 -0.3826834" gravcomp="1">
                      <geom type="box" size="0.025 0.1 0.025" pos="0 0 0.03" rgba="{_LINK_RGBA}" contype="0" conaffinity="0"/>
                      <camera name="wrist" pos="0.07 0 0.02" xyaxes="0 1 0 0.8 0 0.6" fovy="75"/>
                      <site name="ee" pos="0 0 0.1034" size="0.005" rgba="1 0 0 0"/>
                      <body name="left_finger" pos="0 0 0.0584" gravcomp="1">
                        <joint name="finger_joint1" type="slide" axis="0 1 0" range="0 {FINGER_OPEN}" damping="10" armature="0.1"/>
                        <geom type="box" size="0.018 0.006 0.025" pos="0 0.012 0.027" rgba="{_JOINT_RGBA}"
                              friction="1.5 0.05 0.001" condim="4" solref="0.01 1" priority="1"/>
                      </body>
                      <body name="right_finger" pos="0 0 0.0584" gravcomp="1">
                        <joint name="finger_joint2" type="slide" axis="0 -1 0" range="0 {FINGER_OPEN}" damping="10" armature="0.1"/>
                        <geom type="box" size="0.018 0.006 0.025" pos="0 -0.012 0.027" rgba="{_JOINT_RGBA}"
                              friction="1.5 0.05 0.001" condim="4" solref="0.01 1" priority="1"/>
                      </body>
                    </body>
                  </body>
                </body>
              </body>
            </body>
          </body>
        </body>
      </body>
    </body>"""


# Joint targets pass through a first-order filter (an actuator activation), as a real arm's trajectory interpolator
# does between control ticks: a raw step in the target every 50 ms jerks the hand and flings grasped objects.
TARGET_FILTER_S = 0.02


def arm_actuators_xml() -> str:
    """Joint position actuators: the policy never commands torques, only joint targets reached through IK."""
    kp = [6000, 6000, 4500, 4500, 2400, 1800, 1200]
    lines = [
        f'<position name="act_{n}" joint="{n}" kp="{k}" kv="{2 * np.sqrt(k):.1f}" ctrlrange="{lo} {hi}" timeconst="{TARGET_FILTER_S}"/>'
        for n, k, (lo, hi) in zip(JOINT_NAMES, kp, JOINT_LIMITS)
    ]
    for n in FINGER_JOINT_NAMES:
        lines.append(f'<position name="act_{n}" joint="{n}" kp="1000" kv="30" ctrlrange="0 {FINGER_OPEN}" forcerange="-40 40"/>')
    return "\n    ".join(lines)


class ArmController:
    """Turns end-effector delta actions into joint position targets with damped least-squares IK.

    One linearisation per control step is enough at the action scales used (a few cm and a few degrees per step);
    a null-space term pulls the redundant joint toward the home posture so the arm never drifts into odd configurations.
    """

    def __init__(self, model: mujoco.MjModel, *, damping: float = 1e-3, nullspace_gain: float = 0.2) -> None:
        self.model = model
        self.damping = damping
        self.nullspace_gain = nullspace_gain
        self.site_id = model.site("ee").id
        self.qpos_idx = np.array([model.jnt_qposadr[model.joint(n).id] for n in JOINT_NAMES])
        self.dof_idx = np.array([model.jnt_dofadr[model.joint(n).id] for n in JOINT_NAMES])
        self.finger_qpos_idx = np.array([model.jnt_qposadr[model.joint(n).id] for n in FINGER_JOINT_NAMES])
        self.act_idx = np.array([model.actuator(f"act_{n}").id for n in JOINT_NAMES])
        self.finger_act_idx = np.array([model.actuator(f"act_{n}").id for n in FINGER_JOINT_NAMES])
        self._jacp = np.zeros((3, model.nv))
        self._jacr = np.zeros((3, model.nv))

    def ee_pos(self, data: mujoco.MjData) -> np.ndarray:
        return data.site_xpos[self.site_id].copy()

    def ee_mat(self, data: mujoco.MjData) -> np.ndarray:
        return data.site_xmat[self.site_id].reshape(3, 3).copy()

    def gripper_width(self, data: mujoco.MjData) -> float:
        return float(data.qpos[self.finger_qpos_idx].sum())

    def set_home(self, data: mujoco.MjData, qpos: np.ndarray | None = None) -> None:
        q = HOME_QPOS if qpos is None else qpos
        data.qpos[self.qpos_idx] = q
        data.qpos[self.finger_qpos_idx] = FINGER_OPEN
        data.ctrl[self.act_idx] = q
        data.act[self.model.actuator_actadr[self.act_idx]] = q
        data.ctrl[self.finger_act_idx] = FINGER_OPEN

    def joint_targets(self, data: mujoco.MjData, dpos: np.ndarray, drot: np.ndarray) -> np.ndarray:
        """Joint targets that move the end effector by `dpos` (m, world) and rotate it by `drot` (rad, world axis-angle)."""
        mujoco.mj_jacSite(self.model, data, self._jacp, self._jacr, self.site_id)
        J = np.vstack([self._jacp[:, self.dof_idx], self._jacr[:, self.dof_idx]])
        err = np.concatenate([dpos, drot])
        JJt = J @ J.T + self.damping * np.eye(6)
        J_pinv = J.T @ np.linalg.solve(JJt, np.eye(6))
        q = data.qpos[self.qpos_idx]
        dq = J_pinv @ err
        dq += (np.eye(7) - J_pinv @ J) @ (self.nullspace_gain * (HOME_QPOS - q))
        return np.clip(q + dq, JOINT_LIMITS[:, 0], JOINT_LIMITS[:, 1])

    def apply(self, data: mujoco.MjData, dpos: np.ndarray, drot: np.ndarray, gripper: float) -> None:
        """Write actuator targets. `gripper` in [-1, 1]: -1 fully open, +1 fully closed (robosuite's convention)."""
        data.ctrl[self.act_idx] = self.joint_targets(data, dpos, drot)
        data.ctrl[self.finger_act_idx] = FINGER_OPEN * (1.0 - gripper) / 2.0
