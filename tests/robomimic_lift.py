"""robosuite Lift demonstrations recorded in raw robosuite and written as robomimic writes them (robosuite extra).

The pipeline robomimic's datasets come from, step by step, without robomimic installed:
1. collection (robosuite's `scripts/collect_human_demonstrations.py` with its `DataCollectionWrapper`): a scripted
   expert stands in for the human; `robosuite.make("Lift")` with the BASIC composite controller (OSC_POSE on the arm,
   0.05 m / 0.5 rad per unit, delta input in the base frame), low-dim only. One model for all demos (`hard_reset=False`,
   model seed 0, as the adapter builds it), so the gripper's rate command, which robosuite's soft reset keeps, is zeroed
   at each reset as robosuite's default hard reset (a new model per demo) would. Per demo it keeps the flattened MuJoCo
   state before every action (`states`), the actions and `model_file = env.sim.model.get_xml()`; an episode ends 10
   steps after the task first succeeds (the script's hold count) and only successful ones are kept;
2. conversion (robomimic's `scripts/conversion/convert_robosuite.py`): `data` attrs `env_args` (JSON: env_name,
   env_version, type 1 = robosuite, env_kwargs) and `total`, `num_samples` per demo, and a 90/10 `mask/train`,
   `mask/valid` split;
3. observation extraction (robomimic's `scripts/dataset_states_to_obs.py`, `done_mode=2`): a second env with the
   cameras replays the states; at each step the simulator is set to `states[t]` (`set_state_from_flattened`, forward)
   and robomimic's `EnvRobosuite.get_observation` view is stored: camera images flipped upside down (`[::-1]`, robomimic
   flips robosuite's OpenGL frames, so its files hold right-side-up images), `object` = robosuite's `object-state`,
   every `robot0_*` observable but the proprio-state; `next_obs` is the next state's view (the last one from
   `env.step`), `rewards` the sparse reward of the next state, `dones` 1 on success or at the end.

Used by tests/test_robosuite_robomimic*.py; run it to write a file by hand:
    python tests/robomimic_lift.py --demos 20 --out lift.hdf5
"""

from __future__ import annotations

import argparse
import json
import os
from copy import deepcopy
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import h5py
import numpy as np
import robosuite
from robosuite.controllers import load_composite_controller_config

CAMERAS = ["agentview", "robot0_eye_in_hand"]
HOLD = 10  # collect_human_demonstrations.py: steps kept after the first successful one
HORIZON = 150  # the adapter's Lift horizon


def env_kwargs(cameras: bool, image_size: int = 84, model_seed: int = 0) -> dict:
    """robosuite.make arguments as robomimic records them in env_args (collection's config plus the extraction
    env's camera settings). `seed` fixes robosuite's model-build randomness (Lift's cube size), as the adapter's
    `model_seed` does, so that the adapter builds the same model."""
    return {
        "robots": ["Panda"],
        "controller_configs": load_composite_controller_config(controller="BASIC", robot="Panda"),
        "has_renderer": False, "has_offscreen_renderer": cameras, "ignore_done": True, "use_object_obs": True,
        "use_camera_obs": cameras, "camera_depths": False, "camera_names": CAMERAS if cameras else [],
        "camera_heights": image_size, "camera_widths": image_size, "reward_shaping": False, "control_freq": 20,
        "hard_reset": False, "seed": model_seed,
    }  # fmt: skip


def make_env(cameras: bool, image_size: int = 84):
    kwargs = env_kwargs(cameras, image_size)
    if not cameras:
        kwargs.pop("camera_names")
    return robosuite.make("Lift", **kwargs)


def expert_action(obs: dict, memory: dict) -> np.ndarray:
    """Above the cube, down to it, close, lift: world-frame deltas (the base is not rotated in Lift), 0.05 m/unit."""
    ee, cube = np.asarray(obs["robot0_eef_pos"]), np.asarray(obs["cube_pos"])
    phase = memory.setdefault("phase", 0)
    memory["t"] = memory.get("t", 0) + 1
    grip = -1.0
    if phase == 0:
        goal = cube + [0, 0, 0.06]
        if np.linalg.norm(goal - ee) < 0.01:
            memory["phase"], memory["since"] = 1, memory["t"]
    if memory["phase"] == 1:
        goal = cube + [0, 0, -0.005]
        if np.linalg.norm(goal - ee) < 0.008 or memory["t"] - memory["since"] > 30:
            memory["phase"], memory["since"], memory["grasp"] = 2, memory["t"], cube.copy()
    if memory["phase"] >= 2:
        grip = 1.0
        closing = memory["t"] - memory["since"] < 8
        goal = memory["grasp"] + ([0, 0, -0.005] if closing else [0, 0, 0.15])
    action = np.zeros(7)
    action[:3] = np.clip((goal - ee) / 0.02, -1, 1)
    action[6] = grip
    return action


def collect(n: int, seed: int = 0, max_tries: int | None = None) -> list[dict]:
    """n successful demos: states (before each action), actions, model_file, as the collection script keeps them."""
    env = make_env(cameras=False)
    env.rng.bit_generator.state = np.random.default_rng(seed).bit_generator.state  # the layouts
    demos, tries = [], 0
    try:
        while len(demos) < n:
            tries += 1
            if max_tries is not None and tries > max_tries:
                raise RuntimeError(f"the scripted Lift expert solved {len(demos)} of {tries - 1} episodes")
            gripper = env.robots[0].gripper["right"]
            gripper.current_action = np.zeros(gripper.dof)  # see the module docstring: as a hard reset would
            obs = env.reset()
            xml = env.sim.model.get_xml()
            memory: dict = {}
            states, actions, hold = [], [], -1
            for _ in range(HORIZON + HOLD):
                if hold == 0:
                    break
                states.append(env.sim.get_state().flatten())
                action = expert_action(obs, memory)
                actions.append(action)
                obs, _, _, _ = env.step(action)
                if env._check_success():
                    hold = hold - 1 if hold > 0 else HOLD
                else:
                    hold = -1
            if hold == 0:
                demos.append({"states": np.array(states), "actions": np.array(actions), "model_file": xml})
    finally:
        env.close()
    return demos


def robomimic_view(raw: dict) -> dict:
    """robomimic's EnvRobosuite.get_observation on robosuite's observation dict (robosuite >= 1.2)."""
    out = {}
    for key, value in raw.items():
        if key.endswith("_image"):
            out[key] = value[::-1].copy()  # robomimic: "by default images from mujoco are flipped in height"
    if "object-state" in raw:
        out["object"] = np.array(raw["object-state"])
    for key, value in raw.items():
        if key.startswith("robot0_") and key not in out and not key.endswith("proprio-state"):
            out[key] = np.array(value)
    return out


def extract(env, demo: dict) -> dict:
    """dataset_states_to_obs.extract_trajectory with done_mode=2."""
    if env.sim.model.get_xml() != demo["model_file"]:
        env.reset()
        env.reset_from_xml_string(env.edit_model_xml(demo["model_file"]))
        env.sim.reset()

    def reset_to(state):
        env.sim.set_state_from_flattened(state)
        env.sim.forward()
        return robomimic_view(env._get_observations(force_update=True))

    states, actions = demo["states"], demo["actions"]
    obs = reset_to(states[0])
    traj = {"obs": [], "next_obs": [], "rewards": [], "dones": []}
    for t in range(1, len(states) + 1):
        if t == len(states):
            next_obs = robomimic_view(env.step(actions[t - 1])[0])
        else:
            next_obs = reset_to(states[t])
        traj["obs"].append(obs)
        traj["next_obs"].append(next_obs)
        traj["rewards"].append(env.reward())
        traj["dones"].append(int(t == len(states) or env._check_success()))
        obs = deepcopy(next_obs)
    for key in ("obs", "next_obs"):
        traj[key] = {k: np.array([o[k] for o in traj[key]]) for k in traj[key][0]}
    return traj


def write(path: str | Path, demos: list[dict], image_size: int = 84) -> Path:
    """The file robomimic's conversion and observation extraction leave behind."""
    path = Path(path)
    env = make_env(cameras=True, image_size=image_size)
    try:
        with h5py.File(path, "w") as f:
            data = f.create_group("data")
            total = 0
            for i, demo in enumerate(demos):
                traj = extract(env, demo)
                group = data.create_group(f"demo_{i}")
                group.create_dataset("actions", data=demo["actions"])
                group.create_dataset("states", data=demo["states"])
                group.create_dataset("rewards", data=np.array(traj["rewards"]))
                group.create_dataset("dones", data=np.array(traj["dones"]))
                for key in traj["obs"]:
                    group.create_dataset(f"obs/{key}", data=traj["obs"][key])
                    group.create_dataset(f"next_obs/{key}", data=traj["next_obs"][key])
                group.attrs["model_file"] = demo["model_file"]
                group.attrs["num_samples"] = len(demo["actions"])
                total += len(demo["actions"])
            data.attrs["total"] = total
            data.attrs["env_args"] = json.dumps({
                "env_name": "Lift", "env_version": robosuite.__version__, "type": 1,
                "env_kwargs": env_kwargs(True, image_size),
            }, indent=4)  # fmt: skip
            names = [f"demo_{i}" for i in range(len(demos))]
            valid = max(1, round(0.1 * len(names))) if len(names) > 1 else 0
            order = np.random.default_rng(0).permutation(len(names))
            mask = f.create_group("mask")
            mask.create_dataset("valid", data=np.array(sorted(names[i] for i in order[:valid]), dtype="S"))
            mask.create_dataset("train", data=np.array(sorted(names[i] for i in order[valid:]), dtype="S"))
    finally:
        env.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demos", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=84)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    demos = collect(args.demos, args.seed)
    write(args.out, demos, args.image_size)
    lengths = [len(d["actions"]) for d in demos]
    print(json.dumps({"demos": len(demos), "frames": int(sum(lengths)), "lengths": lengths, "file": args.out}))


if __name__ == "__main__":
    main()
