"""Forward kinematics and damped-least-squares IK on a robot's MJCF, for policies that act in end-effector space.

A policy trained in sim acts with EE deltas (7,) = translation (3) * pos_scale metres, axis-angle rotation (3) *
rot_scale radians (world frame), gripper (1) in [-1, 1], and observes `observation.state` (8,) = EE position,
EE quaternion wxyz (sign nearer the hand pointing down), gripper opening in [0, 1]. This module turns joint positions into that
state and those actions into joint position targets, so the same policy drives a joint-position robot unchanged.

The conventions deliberately reproduce `sim/env.py` (`ee_state_vector`, POS_SCALE/ROT_SCALE) and `sim/arm.py`
(`ArmController.joint_targets`): one linearisation per tick, a null-space pull toward home, clipping to the joint
limits. `robot/` may not import `sim/` (a real arm runs the bridge without the simulator), so the few lines are
repeated here; tests/test_robot_node.py pins them against the simulator, so a change on one side fails a test
instead of silently detuning deployed policies.
"""

from __future__ import annotations

import threading
from pathlib import Path

import mujoco
import numpy as np

from robot.config import RobotConfig


# sim/env.py's STATE_QUAT_REFERENCE (robot/ may not import sim/): the hand pointing down.
STATE_QUAT_REFERENCE = np.array([0.0, 1.0, 0.0, 0.0])


def quat_wxyz(mat: np.ndarray) -> np.ndarray:
    """Unit quaternion (w, x, y, z) of a rotation matrix, with the sign the simulator's state uses (q and -q are one
    rotation; the sign nearer the hand pointing down keeps the policy's input continuous where the tasks are worked)."""
    quat = np.zeros(4)
    mujoco.mju_mat2Quat(quat, np.asarray(mat, dtype=np.float64).reshape(-1))
    return -quat if quat @ STATE_QUAT_REFERENCE < 0 else quat


class Kinematics:
    """FK/IK of one arm. Thread-safe: each call works on this object's MjData under a lock."""

    def __init__(
        self,
        mjcf: str | Path,
        joint_names: list[str],
        *,
        ee_site: str = "ee",
        lower: np.ndarray | None = None,
        upper: np.ndarray | None = None,
        home: np.ndarray | None = None,
        damping: float = 1e-3,
        nullspace_gain: float = 0.2,
    ) -> None:
        self.model = mujoco.MjModel.from_xml_path(str(mjcf))
        self.data = mujoco.MjData(self.model)
        missing = [n for n in joint_names if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_JOINT, n) < 0]
        if missing:
            raise ValueError(f"MJCF {mjcf} has no joints {missing}; the robot config names {joint_names}")
        if mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_SITE, ee_site) < 0:
            raise ValueError(f"MJCF {mjcf} has no site {ee_site!r} (kinematics.ee_site)")
        ids = [self.model.joint(n).id for n in joint_names]
        self.n = len(joint_names)
        self.qpos_idx = np.array([self.model.jnt_qposadr[i] for i in ids])
        self.dof_idx = np.array([self.model.jnt_dofadr[i] for i in ids])
        self.site_id = self.model.site(ee_site).id
        self.lower = np.asarray(lower if lower is not None else self.model.jnt_range[ids, 0], np.float64)
        self.upper = np.asarray(upper if upper is not None else self.model.jnt_range[ids, 1], np.float64)
        self.home = np.asarray(home if home is not None else np.clip(np.zeros(self.n), self.lower, self.upper), np.float64)
        self.damping = float(damping)
        self.nullspace_gain = float(nullspace_gain)
        self._jacp = np.zeros((3, self.model.nv))
        self._jacr = np.zeros((3, self.model.nv))
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, robot: RobotConfig) -> Kinematics:
        k = robot.kinematics
        n = len(robot.joints)
        return cls(
            robot.mjcf_path(), robot.arm_joint_names, ee_site=k.ee_site, lower=robot.lower[:n], upper=robot.upper[:n],
            home=robot.home, damping=k.damping, nullspace_gain=k.nullspace_gain,
        )

    def _set(self, q: np.ndarray) -> None:
        q = np.asarray(q, np.float64)
        if q.shape != (self.n,):
            raise ValueError(f"expected {self.n} arm joint positions, got shape {q.shape}")
        self.data.qpos[self.qpos_idx] = q
        mujoco.mj_kinematics(self.model, self.data)
        mujoco.mj_comPos(self.model, self.data)  # mj_jacSite needs the com-based quantities

    def fk(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """End-effector position (3,) and rotation matrix (3, 3) at arm joint positions q."""
        with self._lock:
            self._set(q)
            return self.data.site_xpos[self.site_id].copy(), self.data.site_xmat[self.site_id].reshape(3, 3).copy()

    def ee_position(self, q: np.ndarray) -> np.ndarray:
        return self.fk(q)[0]

    def ee_state(self, q: np.ndarray, opening: float) -> np.ndarray:
        """`observation.state` (8,) float32: EE position, quaternion wxyz, gripper opening."""
        pos, mat = self.fk(q)
        return np.concatenate([pos, quat_wxyz(mat), [opening]]).astype(np.float32)

    def ik_step(self, q: np.ndarray, dpos: np.ndarray, drot: np.ndarray) -> np.ndarray:
        """Joint targets that move the EE by `dpos` (m, world) and rotate it by `drot` (rad, world axis-angle) from q.

        Non-finite inputs give non-finite targets (never a silent zero): the safety layer rejects them.
        """
        err = np.concatenate([np.asarray(dpos, np.float64).reshape(3), np.asarray(drot, np.float64).reshape(3)])
        with self._lock:
            self._set(q)
            mujoco.mj_jacSite(self.model, self.data, self._jacp, self._jacr, self.site_id)
            J = np.vstack([self._jacp[:, self.dof_idx], self._jacr[:, self.dof_idx]])
        q = np.asarray(q, np.float64)
        J_pinv = J.T @ np.linalg.solve(J @ J.T + self.damping * np.eye(6), np.eye(6))
        dq = J_pinv @ err + (np.eye(self.n) - J_pinv @ J) @ (self.nullspace_gain * (self.home - q))
        target = q + dq
        return np.where(np.isfinite(target), np.clip(target, self.lower, self.upper), np.nan)


class ActionMapper:
    """Policy actions -> command vectors (arm joint targets, then finger targets), per the robot config.

    `action_space="ee_delta"` (the sim-trained VLA): (7,) EE delta, through IK from the measured joints.
    `action_space="joint"`: (n_arm + 1,) absolute arm joint targets plus the gripper action.
    """

    # LeRobot feature names of `state()` and `to_action()`, as recorded deployment datasets declare them.
    STATE_NAMES = ("ee_x", "ee_y", "ee_z", "ee_qw", "ee_qx", "ee_qy", "ee_qz", "gripper_opening")
    ACTION_NAMES = ("dx", "dy", "dz", "drx", "dry", "drz", "gripper")

    def __init__(self, robot: RobotConfig, kinematics: Kinematics | None = None) -> None:
        self.robot = robot
        self.n_arm = len(robot.joints)
        self._kinematics = kinematics

    @property
    def kinematics(self) -> Kinematics:
        if self._kinematics is None:
            self._kinematics = Kinematics.from_config(self.robot)
        return self._kinematics

    def action_dim(self, action_space: str) -> int:
        return 7 if action_space == "ee_delta" else self.n_arm + 1

    def to_command(self, action: np.ndarray, arm_q: np.ndarray, action_space: str = "ee_delta") -> np.ndarray:
        action = np.asarray(action, np.float64).reshape(-1)
        expected = self.action_dim(action_space)
        if action.shape != (expected,):
            raise ValueError(f"{action_space} action must have shape ({expected},); got {action.shape}")
        if action_space == "ee_delta":
            # Clip like sim/env.py validate_action; NaN survives np.clip and is caught by the safety layer.
            a = np.clip(action, -1.0, 1.0)
            k = self.robot.kinematics
            arm = self.kinematics.ik_step(arm_q, a[:3] * k.pos_scale, a[3:6] * k.rot_scale)
        elif action_space == "joint":
            arm = action[: self.n_arm]
        else:
            raise ValueError(f"unknown action_space {action_space!r}; expected 'ee_delta' or 'joint'")
        return np.concatenate([arm, self.robot.gripper_targets(action[-1])])

    def to_action(self, command: np.ndarray, command_q: np.ndarray) -> np.ndarray:
        """The EE-delta action (7,) that a sent command amounts to from the measured positions: the inverse of
        `to_command` (exact up to the one-step IK linearisation). Recorded deployment steps use it, so that human and
        policy steps land in the action space the policy trains in."""
        command, q = np.asarray(command, np.float64), np.asarray(command_q, np.float64)
        k = self.robot.kinematics
        pos0, mat0 = self.kinematics.fk(q[: self.n_arm])
        pos1, mat1 = self.kinematics.fk(command[: self.n_arm])
        quat = np.zeros(4)
        mujoco.mju_mat2Quat(quat, (mat1 @ mat0.T).ravel())
        drot = np.zeros(3)
        mujoco.mju_quat2Vel(drot, quat, 1.0)
        g = self.robot.gripper
        grip = 1.0 - 2.0 * (float(np.mean(command[self.n_arm :])) - g.closed) / (g.open - g.closed) if g.joints else -1.0
        action = np.concatenate([(pos1 - pos0) / k.pos_scale, drot / k.rot_scale, [grip]])
        return np.clip(action, -1.0, 1.0).astype(np.float32)

    def state(self, command_q: np.ndarray) -> np.ndarray:
        """`observation.state` (8,) from measured positions of the command joints (arm, then fingers)."""
        q = np.asarray(command_q, np.float64)
        return self.kinematics.ee_state(q[: self.n_arm], self.robot.gripper_opening(q[self.n_arm :]))

    def ee_position(self, command_q: np.ndarray) -> np.ndarray:
        return self.kinematics.ee_position(np.asarray(command_q, np.float64)[: self.n_arm])
