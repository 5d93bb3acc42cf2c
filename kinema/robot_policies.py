"""Policies for `kinema deploy`: a checkpoint, or a scripted policy by name. Sim-aware ones live here (kinema may
import both `sim` and `robot`; `robot` may not import `sim`).

    --policy runs/drawer/checkpoints/final         a policy checkpoint folder (policies.load_policy, any registered type)
    --policy scripted:zero                         EE delta 0, gripper open: holds still (the latency benchmark's)
    --policy scripted:nan                          NaN actions (the safety layer must hold)
    --policy scripted:replay:task=drawer:seed=0    the sim's scripted expert, replayed (see ExpertReplayPolicy)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from robot.policy_node import HOLD_STILL, ConstantPolicy

SCRIPTED = ("zero", "nan", "replay")


class ExpertReplayPolicy:
    """The sim's scripted expert, run on a local copy of the same task and seed, replayed over the wire as joint targets.

    The expert needs privileged state (object poses) that a robot does not publish, so it cannot run closed loop
    through the bridge. The simulator is deterministic under position control, though: the local rollout's joint
    targets, streamed at the control rate to a sim robot reset to the same seed, reproduce the episode. The replay
    is indexed by the batch's `timestamp` (seconds since the episode began). A node with asynchronous inference
    executes a chunk from its index 1 (its action 0 is planned for the tick that requested it), so the first action
    of an episode runs one tick late; `lag_ticks=1` shifts the replay by that tick so that target k runs k ticks after
    the first. Synchronously (the node's default for a policy this fast) a chunk runs from index 0: `lag_ticks=0`.

    `reset()` starts the next episode: seeds seed, seed + 1, ... as `kinema sim-robot` does on each "reset".
    """

    action_space = "joint"

    def __init__(self, task: str, seed: int = 0, *, control_hz: float = 20.0, chunk_size: int = 8, n_action_steps: int = 4, lag_ticks: int = 0) -> None:
        self.task, self.first_seed = task, int(seed)
        self.control_hz, self.chunk_size, self.n_action_steps, self.lag_ticks = control_hz, chunk_size, n_action_steps, lag_ticks
        self.episode = -1
        self.targets = np.zeros((0, 8))
        self.expert_success = False
        self.instruction = ""

    def reset(self) -> None:
        self.episode += 1
        self.targets, self.expert_success, self.instruction = expert_joint_targets(self.task, self.first_seed + self.episode)

    def predict_action_chunk(self, batch: dict[str, Any]) -> np.ndarray:
        if self.episode < 0:
            self.reset()
        t = float(np.asarray(batch["timestamp"]).reshape(-1)[0])
        start = int(round(t * self.control_hz)) - self.lag_ticks
        idx = np.clip(np.arange(start, start + self.chunk_size), 0, len(self.targets) - 1)
        return self.targets[idx][None].astype(np.float32)


def expert_joint_targets(task: str, seed: int) -> tuple[np.ndarray, bool, str]:
    """Roll the scripted expert out in sim: per control step, the arm's joint targets and the gripper action,
    (steps, 8); whether it succeeded; the instruction. After success the last target is held, gripper open."""
    import sim.tasks
    from sim.experts import make_expert

    env = sim.tasks.make(task, cameras=())
    try:
        env.reset(seed=seed)
        expert = make_expert(env, seed=seed)
        rows, success = [], False
        for _ in range(env.config.horizon):
            action = expert()
            _, _, terminated, truncated, _ = env.step(action)
            rows.append(np.concatenate([env.data.ctrl[env.arm.act_idx], [float(action[6])]]))
            if terminated or truncated:
                success = bool(terminated)
                break
        rows.append(np.concatenate([rows[-1][:7], [-1.0]]))
        return np.stack(rows), success, env.task
    finally:
        env.close()


def load_policy(spec: str, *, control_hz: float = 20.0, noise_scale: float | None = None, inference: str = "auto") -> Any:
    """A policy from `--policy`: `scripted:<name>[:key=value...]`, or a policy checkpoint folder (any registered type).
    `noise_scale` replaces a VLA checkpoint's `inference_noise_scale` (None: keep the one its training run evaluated with);
    `inference` is the node's (the expert replay's default lag follows it)."""
    if noise_scale is not None and spec.startswith("scripted:"):
        raise ValueError(f"--noise-scale scales a VLA's initial flow noise; {spec} is a scripted policy")
    if spec.startswith("scripted:"):
        name, *opts = spec[len("scripted:") :].split(":")
        options: dict[str, str] = {}
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep:
                raise ValueError(f"--policy {spec}: option {opt!r} must be key=value")
            options[key] = value
        if name == "zero":
            return ConstantPolicy(HOLD_STILL)
        if name == "nan":
            return ConstantPolicy(float("nan"))
        if name == "replay":
            unknown = set(options) - {"task", "seed", "lag"}
            if unknown or "task" not in options:
                raise ValueError(f"--policy {spec}: replay takes task=<name> (required), seed=<int>, lag=<ticks>; got {sorted(options)}")
            from sim.tasks import task_class

            task_class(options["task"])  # an unknown task lists the valid ones
            numbers = {}
            for key, default in (("seed", 0), ("lag", 1 if inference == "async" else 0)):
                try:
                    numbers[key] = int(options.get(key, default))
                except ValueError:
                    raise ValueError(f"--policy {spec}: {key} must be an integer; got {options[key]!r}") from None
            return ExpertReplayPolicy(options["task"], numbers["seed"], control_hz=control_hz, lag_ticks=numbers["lag"])
        raise ValueError(f"--policy {spec}: unknown scripted policy {name!r}; valid: {', '.join(SCRIPTED)}")
    path = Path(spec)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--policy {spec}: not a checkpoint folder (no config.json) and not scripted:<{'|'.join(SCRIPTED)}>")
    import torch

    from kinema.train.acting import load_acting
    from policies.checkpoint import checkpoint_fingerprint

    # One thread: inference shares the CPU with the control loop and the transport (measured: more threads are
    # slower under contention).
    torch.set_num_threads(1)
    return CheckpointPolicy(load_acting(path, noise_scale=noise_scale), fingerprint=checkpoint_fingerprint(path))


class CheckpointPolicy:
    """A checkpoint acting on the robot as its method defines (`kinema.train.acting.load_acting`: a dsrl checkpoint
    steered by its noise actor, a residual one with its correction, a video policy planning as it keeps), behind the
    policy node's interface: `reset()`, `predict_action_chunk(batch) -> (B, chunk_size, action_dim)`, `config`;
    `fingerprint` says which weights act (policies.checkpoint.checkpoint_fingerprint)."""

    def __init__(self, loaded: Any, *, fingerprint: str = "") -> None:
        self.policy, self.description, self.fingerprint = loaded.policy, loaded.default.description, fingerprint
        self.config = self.policy.config
        if self.policy.scales_initial_noise:  # what the policy's own sampler draws at (select_action)
            self.config.inference_noise_scale = loaded.noise_scale
        self.runner = loaded.default.make()
        self.policy.eval()

    def reset(self) -> None:
        self.policy.reset()

    def predict_action_chunk(self, batch: dict[str, Any]) -> np.ndarray:
        import torch

        tensors = {k: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for k, v in batch.items()}
        with torch.no_grad():
            return self.runner.sample(tensors).cpu().numpy()


def export_sim_panda_mjcf(path: str | Path | None = None) -> Path:
    """Write the sim arm's MJCF (sim/arm.py) for the robot config's FK/IK; default assets/robots/sim_panda.xml."""
    from kinema.paths import assets_dir
    from sim.arm import arm_xml

    out = Path(path) if path is not None else assets_dir() / "robots" / "sim_panda.xml"
    xml = (
        "<!-- The sim arm (sim/arm.py arm_xml) for FK/IK in the policy node: the same kinematic chain, joint ranges and\n"
        "     end-effector site as the MuJoCo tasks, so that FK here equals the simulator's exactly. Regenerate with\n"
        '     `python -c "from kinema.robot_policies import export_sim_panda_mjcf; export_sim_panda_mjcf()"`;\n'
        "     tests/test_robot_node.py checks FK against the sim. -->\n"
        '<mujoco model="sim_panda">\n  <compiler angle="radian" autolimits="true"/>\n'
        f"  <worldbody>{arm_xml()}\n  </worldbody>\n</mujoco>\n"
    )
    tmp = out.with_suffix(".xml.tmp")
    tmp.write_text(xml)
    tmp.replace(out)
    return out
