"""`kinema dataset ...`: migrate datasets to the current layout, and import other tools' demonstrations.

- `kinema dataset upgrade DIR` rewrites the metadata of a kinema dataset written before the LeRobot stats convention
  (`diffusion_rl.data.upgrade_dataset`: atomic per file, data and videos untouched, idempotent).
- `kinema dataset import robomimic FILE.hdf5 --out DIR` converts robomimic demonstrations into Episodes laid out as
  kinema's robosuite adapter (`sim/robosuite_adapter.py`) produces them, so a policy trained on them runs in
  `robosuite/<env>` tasks unchanged:
  - cameras: `agentview_image` -> `observation.images.agentview`, `robot0_eye_in_hand_image` ->
    `observation.images.wrist`, kept as stored: robomimic's files hold them right side up, as the adapter observes them
    (robosuite renders upside down in its default "opengl" convention; robomimic's `EnvRobosuite.get_observation`
    flips every camera image when it extracts observations, as the adapter does). `--flip-images` is for files whose
    images are upside down (robosuite's raw frames saved without robomimic's flip);
  - `observation.state` (8,) = `ee_state_vector(position, rotation, opening)`, the adapter's own function: the grip
    site's position in the robot-base frame, its orientation as a wxyz quaternion in the base frame (the sign nearer the hand pointing down, `sim.env.STATE_QUAT_REFERENCE`), and
    the gripper opening in [0, 1]. robomimic's `robot0_eef_pos` is the grip site in the world frame, but
    `robot0_eef_quat` (xyzw, world) is the orientation of the `right_hand` *body* (robosuite <= 1.5 reads it there),
    which differs from the grip site's by the gripper's mounting rotation; `robot0_gripper_qpos` are the finger joints'
    positions, and the opening is sum(|q|) / sum(joint ranges), as the adapter computes it. The robot base pose, the
    hand-to-site rotation and the finger ranges are read from the MJCF each robomimic demo stores (`model_file`);
  - `action` (7,): robomimic's OSC_POSE deltas (by default 0.05 m and 0.5 rad per unit action) rescaled to the
    adapter's (0.12 m, 0.5 rad), so the same motion gets the same command (`--actions rescale`, the default); or kept
    as recorded (`--actions keep`), with the scale the env must then use (`make_robosuite(..., action_scale=...)`)
    recorded in meta/kinema.json. The gripper (+1 closes) is the same in both;
  - every demo is a success: robomimic keeps only demonstrations that solved the task, so each episode gets
    outcome=True, with its per-step success flags from the demo's sparse rewards (else its last step).
  What the import decided is printed and recorded in meta/kinema.json under `sources`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# kinema's robosuite adapter: `ACTION_SCALE` in sim/robosuite_adapter.py (which needs robosuite to import; a test
# checks that the two agree).
ADAPTER_ACTION_SCALE = (0.12, 0.5)
ROBOMIMIC_ACTION_SCALE = (0.05, 0.5)  # robosuite's default OSC_POSE output limits, which robomimic's datasets use
CAMERA_KEYS = {"agentview_image": "observation.images.agentview",
               "robot0_eye_in_hand_image": "observation.images.wrist"}
STATE_KEYS = ("robot0_eef_pos", "robot0_eef_quat", "robot0_gripper_qpos")
# robosuite's Panda gripper mount: the grip site is the right_hand body turned by -90 deg about z (wxyz). Used only when
# a file has no MJCF to read it from.
PANDA_HAND_TO_SITE = (np.sqrt(0.5), 0.0, 0.0, -np.sqrt(0.5))
PANDA_FINGER_SPAN = 0.08  # two finger joints of range 0.04 m each
# The first training instruction of the adapter's task (sim/robosuite_adapter.py), per robosuite env name.
INSTRUCTIONS = {
    "Lift": "lift the red cube", "Stack": "stack the red cube on the green cube", "Door": "open the door",
    "PickPlaceCan": "put the can in the other bin", "PickPlaceMilk": "put the milk carton in the other bin",
    "PickPlaceBread": "put the bread in the other bin", "PickPlaceCereal": "put the cereal box in the other bin",
    "NutAssemblySquare": "put the square nut on the square peg",
    "NutAssemblyRound": "put the round nut on the round peg",
    "ToolHang": "hang the tool on the hook", "TwoArmTransport": "transport the hammer to the other bin",
}
DEMO_VERSION = "demo"  # what diffusion_rl.batching counts as a demonstration


# ------------------------------------------------------------------------------------------------ quaternion helpers
def _quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton product of wxyz quaternions (broadcasting)."""
    aw, ax, ay, az = np.moveaxis(np.asarray(a, dtype=np.float64), -1, 0)
    bw, bx, by, bz = np.moveaxis(np.asarray(b, dtype=np.float64), -1, 0)
    return np.stack([aw * bw - ax * bx - ay * by - az * bz, aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx, aw * bz + ax * by - ay * bx + az * bw], -1)


def _quat_conj(q: np.ndarray) -> np.ndarray:
    return np.asarray(q, dtype=np.float64) * np.array([1.0, -1.0, -1.0, -1.0])


def _quat_to_mat(q: np.ndarray) -> np.ndarray:
    q = np.asarray(q, dtype=np.float64)
    w, x, y, z = np.moveaxis(q / np.linalg.norm(q, axis=-1, keepdims=True), -1, 0)
    return np.stack([
        np.stack([1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)], -1),
        np.stack([2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)], -1),
        np.stack([2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)], -1)], -2)


# ------------------------------------------------------------------------------------------------------- MJCF frames
@dataclass
class RobotFrames:
    """What the import needs from a robosuite model: base pose (world), hand-to-grip-site rotation, finger span."""

    base_pos: np.ndarray
    base_quat: np.ndarray  # wxyz
    hand_to_site: np.ndarray  # wxyz
    finger_span: float
    origin: str  # where these came from, for the record


def _local_frame(el: ET.Element, where: str) -> tuple[np.ndarray, np.ndarray]:
    for attr in ("euler", "axisangle", "xyaxes", "zaxis"):
        if attr in el.attrib:
            raise ValueError(f"{where}: {el.tag} {el.get('name')!r} sets its orientation with {attr!r}; the importer "
                             f"reads pos/quat only. Pass --base-pos to give the robot base position instead.")
    pos = np.array([float(v) for v in el.get("pos", "0 0 0").split()])
    quat = np.array([float(v) for v in el.get("quat", "1 0 0 0").split()])
    return pos, quat / np.linalg.norm(quat)


def robot_frames_from_mjcf(xml: str, where: str, base_body: str = "robot0_base",
                           hand_body: str = "robot0_right_hand") -> RobotFrames:
    """Compose the MJCF's pos/quat down to the base body, the hand body and its grip site (the site whose name ends
    in `grip_site`, as robosuite names it); the finger span is the sum of the ranges of the hand subtree's joints."""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as err:
        raise ValueError(f"{where}: model_file is not valid MJCF XML ({err})") from None
    world = root.find("worldbody")
    if world is None:
        raise ValueError(f"{where}: model_file has no <worldbody>")
    frames: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    parents: dict[str, list[ET.Element]] = {}

    def walk(el: ET.Element, pos: np.ndarray, quat: np.ndarray, chain: list[ET.Element]) -> None:
        for child in el:
            if child.tag not in ("body", "site"):
                continue
            lp, lq = _local_frame(child, where)
            wp, wq = pos + _quat_to_mat(quat) @ lp, _quat_mul(quat, lq)
            if child.get("name"):
                frames[child.get("name")] = (wp, wq)
                parents[child.get("name")] = chain + [child]
            if child.tag == "body":
                walk(child, wp, wq, chain + [child])

    walk(world, np.zeros(3), np.array([1.0, 0.0, 0.0, 0.0]), [])
    for name in (base_body, hand_body):
        if name not in frames:
            raise ValueError(f"{where}: model_file has no body {name!r} (bodies: "
                             f"{', '.join(sorted(k for k in frames if k.startswith('robot0_')))[:300]})")
    hand_el = parents[hand_body][-1]
    sites = [s for s in hand_el.iter("site") if (s.get("name") or "").endswith("grip_site")]
    if not sites:
        raise ValueError(f"{where}: model_file has no site named *grip_site under body {hand_body!r}")
    site = sites[0].get("name")
    # The grip site must be rigidly attached to the hand: no joint between them.
    for el in parents[site][len(parents[hand_body]):-1]:
        if el.find("joint") is not None or el.find("freejoint") is not None:
            raise ValueError(f"{where}: a joint in body {el.get('name')!r} moves {site!r} relative to {hand_body!r}")
    hand_to_site = _quat_mul(_quat_conj(frames[hand_body][1]), frames[site][1])
    ranges = [j.get("range") for j in hand_el.iter("joint")]
    span = sum(abs(float(b) - float(a)) for a, b in (r.split() for r in ranges if r))
    return RobotFrames(frames[base_body][0], frames[base_body][1], hand_to_site,
                       span if span > 0 else PANDA_FINGER_SPAN, f"MJCF ({base_body}, {hand_body}, {site})")


# --------------------------------------------------------------------------------------------------------- importer
@dataclass
class RobomimicImport:
    """What `import_robomimic` did: the numbers and the conventions it chose, as printed and recorded."""

    out: Path
    env_name: str
    instruction: str
    episodes: int
    frames: int
    lengths: list[int]
    cameras: list[str]
    actions: str  # "rescaled" or "kept"
    source_action_scale: tuple[float, float]
    dataset_action_scale: tuple[float, float]
    clipped_actions: int
    frames_origin: str
    record: dict[str, Any] = field(default_factory=dict)


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise ValueError('importing robomimic files needs h5py: pip install -e ".[robomimic]"') from None
    return h5py


def _env_args(data: Any, path: Path) -> dict[str, Any]:
    raw = data.attrs.get("env_args")
    if raw is None:
        return {}
    try:
        return json.loads(raw if isinstance(raw, str) else raw.decode())
    except (ValueError, AttributeError) as err:
        raise ValueError(f"{path}: data.attrs['env_args'] is not JSON ({err})") from None


def _arm_controller(env_args: dict[str, Any]) -> dict[str, Any]:
    cfg = (env_args.get("env_kwargs") or {}).get("controller_configs") or {}
    if "body_parts" in cfg:  # robosuite 1.5's composite controller
        cfg = (cfg["body_parts"] or {}).get("right") or {}
    return cfg


def _source_scale(controller: dict[str, Any], path: Path) -> tuple[tuple[float, float], str, str]:
    """(metres, radians) per unit action, the delta reference frame, and where they came from."""
    if not controller:
        return ROBOMIMIC_ACTION_SCALE, "world", "robosuite's default OSC_POSE limits (the file records no controller)"
    kind = controller.get("type")
    if kind not in (None, "OSC_POSE"):
        raise ValueError(f"{path}: the demos were recorded with controller {kind!r}; the importer maps OSC_POSE "
                         f"actions (7: translation, rotation, gripper) onto the adapter's")
    if controller.get("control_delta") is False or controller.get("input_type") == "absolute":
        raise ValueError(f"{path}: the demos' OSC_POSE actions are absolute poses; the adapter takes deltas")
    out = controller.get("output_max")
    if out is None:
        scale = ROBOMIMIC_ACTION_SCALE
    else:
        out = np.abs(np.asarray(out, dtype=np.float64).reshape(-1))
        if out.size != 6:
            raise ValueError(f"{path}: controller output_max has {out.size} values; OSC_POSE expects 6")
        scale = (float(out[:3].max()), float(out[3:].max()))
    return scale, str(controller.get("input_ref_frame", "world")), "the file's controller config (output_max)"


def _demo_names(data: Any, f: Any, path: Path, filter_key: str | None) -> list[str]:
    names = [k for k in data.keys() if re.fullmatch(r"demo_\d+", k)]
    if not names:
        raise ValueError(f"{path}: not robomimic layout: group 'data' has no demo_N groups (it has: "
                         f"{', '.join(sorted(data.keys())[:10]) or 'nothing'})")
    if filter_key is not None:
        if "mask" not in f or filter_key not in f["mask"]:
            keys = sorted(f["mask"].keys()) if "mask" in f else []
            raise ValueError(f"{path}: no filter key {filter_key!r} under 'mask' (available: {keys or 'none'})")
        wanted = {v.decode() if isinstance(v, bytes) else str(v) for v in f["mask"][filter_key][()]}
        names = [n for n in names if n in wanted]
    return sorted(names, key=lambda n: int(n.split("_")[1]))


def _read_demo(demo: Any, name: str, path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    where = f"{path}: data/{name}"
    missing = [k for k in ("actions", "obs") if k not in demo]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(repr(m) for m in missing)} (robomimic layout: "
                         f"data/demo_N/{{actions, obs/...}}; it has: {', '.join(sorted(demo.keys())) or 'nothing'})")
    obs = demo["obs"]
    missing = [k for k in STATE_KEYS if k not in obs]
    if missing:
        raise ValueError(f"{where}/obs lacks {', '.join(repr(m) for m in missing)}, needed for observation.state "
                         f"(it has: {', '.join(sorted(obs.keys()))})")
    actions = np.asarray(demo["actions"][()], dtype=np.float64)
    if actions.ndim != 2 or actions.shape[1] != 7:
        raise ValueError(f"{where}/actions: expected (T, 7) OSC_POSE actions (translation 3, rotation 3, gripper 1); "
                         f"got shape {actions.shape}")
    arrays = {k: np.asarray(obs[k][()]) for k in (*STATE_KEYS, *CAMERA_KEYS, "object") if k in obs}
    for key in ("rewards", "dones"):
        if key in demo:
            arrays[key] = np.asarray(demo[key][()])
    for key, value in arrays.items():
        if len(value) != len(actions):
            raise ValueError(f"{where}: {key} has {len(value)} steps, actions has {len(actions)}")
    shapes = {"robot0_eef_pos": 3, "robot0_eef_quat": 4}
    for key, width in shapes.items():
        if arrays[key].shape[1:] != (width,):
            raise ValueError(f"{where}/obs/{key}: expected shape (T, {width}); got {arrays[key].shape}")
    for key in CAMERA_KEYS:
        if key in arrays and (arrays[key].ndim != 4 or arrays[key].shape[-1] != 3):
            raise ValueError(f"{where}/obs/{key}: expected uint8 images (T, H, W, 3); got {arrays[key].shape}")
    return actions, arrays


def import_robomimic(path: str | Path, out: str | Path, *, instruction: str | None = None, actions: str = "rescale",
                     overwrite: bool = False, base_pos: tuple[float, float, float] | None = None,
                     flip_images: bool = False, image_size: int | None = None, filter_key: str | None = None,
                     max_episodes: int | None = None, fps: float | None = None,
                     on_episode: Any = None) -> RobomimicImport:
    """Convert a robomimic HDF5 file to a kinema dataset (see the module docstring); returns what it did."""
    from diffusion_rl.data import Episode, LeRobotDatasetWriter
    from sim.env import ee_state_vector

    if actions not in ("rescale", "keep"):
        raise ValueError(f"actions must be 'rescale' or 'keep'; got {actions!r}")
    h5py = _h5py()
    path, out = Path(path), Path(out)
    if not path.is_file():
        raise FileNotFoundError(f"no robomimic file at {path}")
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise ValueError(f"{path}: not an HDF5 file ({err})") from None
    with f:
        if "data" not in f:
            has = ", ".join(sorted(f.keys())) or "nothing"
            raise ValueError(f"{path}: not robomimic layout: no group 'data' (robomimic files hold "
                             f"data/demo_N/{{actions, obs/...}}; this one has: {has})")
        data = f["data"]
        env_args = _env_args(data, path)
        env_name = str(env_args.get("env_name") or "robomimic")
        task = instruction or INSTRUCTIONS.get(env_name) or " ".join(
            w.lower() for w in re.findall(r"[A-Z][a-z]*|[a-z]+|\d+", env_name))
        if not task.strip():
            raise ValueError("--instruction: expected a non-empty instruction")
        controller = _arm_controller(env_args)
        source_scale, ref_frame, scale_origin = _source_scale(controller, path)
        control_hz = float(fps or (env_args.get("env_kwargs") or {}).get("control_freq") or 20.0)
        names = _demo_names(data, f, path, filter_key)[: max_episodes]
        if not names:
            raise ValueError(f"{path}: no demos to import (filter key {filter_key!r})")
        target_scale = ADAPTER_ACTION_SCALE if actions == "rescale" else source_scale
        factor = np.array([source_scale[0] / target_scale[0]] * 3 + [source_scale[1] / target_scale[1]] * 3 + [1.0])
        frames_cache: dict[str, RobotFrames] = {}
        record = {
            "format": "robomimic", "file": path.name, "env_name": env_name, "env": f"robosuite/{env_name}",
            "instruction": task, "demos": len(names), "filter_key": filter_key,
            "actions": "rescaled" if actions == "rescale" else "kept",
            "source_action_scale": list(source_scale), "action_scale": list(target_scale),
            "action_scale_note": (f"actions rescaled from the recording's {source_scale[0]} m / {source_scale[1]} rad "
                                  f"per unit action to the adapter's default {target_scale[0]} m / "
                                  f"{target_scale[1]} rad"
                                  if actions == "rescale" else
                                  f"actions kept as recorded: build the env with action_scale={tuple(source_scale)}"),
            "source_action_scale_from": scale_origin, "success": "robomimic demos are successes by construction: "
            "every episode has outcome=True",
            "images": "flipped vertically (--flip-images)" if flip_images else "as stored (robomimic writes them right "
                      "side up)",
            "quaternion": "robot0_eef_quat (right_hand body, xyzw, world) turned to the grip site; base frame, wxyz, "
                          "the sign nearer the hand pointing down",
        }
        writer = LeRobotDatasetWriter(out, fps=control_hz, overwrite=overwrite, robot_type="panda",
                                      mode="a" if not overwrite and out.is_dir() and any(out.iterdir()) else "w",
                                      source=record)
        lengths, clipped, cameras, frames_origin = [], 0, [], ""
        with writer:
            for name in names:
                demo = data[name]
                act, arr = _read_demo(demo, name, path)
                where = f"{path}: data/{name}"
                if base_pos is not None:
                    frames = RobotFrames(np.asarray(base_pos, dtype=np.float64), np.array([1.0, 0, 0, 0]),
                                         np.asarray(PANDA_HAND_TO_SITE), PANDA_FINGER_SPAN,
                                         "--base-pos, Panda gripper defaults")
                else:
                    xml = demo.attrs.get("model_file")
                    if xml is None:
                        raise ValueError(f"{where} has no model_file attribute (the MJCF robomimic stores per demo), "
                                         f"so the robot base pose is unknown: pass --base-pos X Y Z (the robot base in "
                                         f"world coordinates)")
                    xml = xml if isinstance(xml, str) else xml.decode()
                    if xml not in frames_cache:
                        frames_cache[xml] = robot_frames_from_mjcf(xml, where)
                    frames = frames_cache[xml]
                frames_origin = frames.origin
                r_base = _quat_to_mat(frames.base_quat)
                pos = (np.asarray(arr["robot0_eef_pos"], np.float64) - frames.base_pos) @ r_base  # R^T (p - b)
                q_hand = np.asarray(arr["robot0_eef_quat"], np.float64)[:, [3, 0, 1, 2]]  # xyzw -> wxyz
                q_site = _quat_mul(_quat_conj(frames.base_quat), _quat_mul(q_hand, frames.hand_to_site))
                mats = _quat_to_mat(q_site)
                qpos = np.abs(np.asarray(arr["robot0_gripper_qpos"], np.float64)).reshape(len(act), -1)
                opening = np.clip(qpos.sum(1) / frames.finger_span, 0.0, 1.0)
                state = np.stack([ee_state_vector(p, m, o) for p, m, o in zip(pos, mats, opening, strict=True)])
                a = act.copy()
                if ref_frame == "world":  # deltas in world axes -> the adapter's base axes
                    a[:, :3], a[:, 3:6] = a[:, :3] @ r_base, a[:, 3:6] @ r_base
                a = a * factor
                clipped += int((np.abs(a) > 1.0).sum())
                a = np.clip(a, -1.0, 1.0)
                obs: dict[str, np.ndarray] = {"observation.state": state}
                for key, cam in CAMERA_KEYS.items():
                    if key in arr:
                        img = np.ascontiguousarray(arr[key][:, ::-1] if flip_images else arr[key]).astype(np.uint8)
                        if image_size is not None and img.shape[1:3] != (image_size, image_size):
                            import cv2

                            img = np.stack([cv2.resize(x, (image_size, image_size), interpolation=cv2.INTER_AREA)
                                            for x in img])
                        obs[cam] = img
                cameras = sorted(k for k in obs if k != "observation.state")
                rewards = np.asarray(arr.get("rewards", np.zeros(len(act))), dtype=np.float32).reshape(-1)
                success = rewards > 0
                if not success.any():
                    success[-1] = True  # robomimic keeps successful demos only: solved at the end at the latest
                privileged = {"privileged.object": arr["object"].reshape(len(act), -1)} if "object" in arr else {}
                writer.add_episode(Episode(
                    observations=obs, action=a.astype(np.float32), task=task, reward=success.astype(np.float32),
                    success=success, outcome=True, task_id=f"robosuite/{env_name}", policy_version=DEMO_VERSION,
                    fps=control_hz, privileged=privileged))
                lengths.append(len(act))
                if on_episode is not None:
                    on_episode(name, len(act), len(names))
    return RobomimicImport(out, env_name, task, len(lengths), int(sum(lengths)), lengths, cameras,
                           record["actions"], source_scale, target_scale, clipped, frames_origin, record)


# -------------------------------------------------------------------------------------------------------------- CLI
def add_dataset_commands(sub: argparse._SubParsersAction) -> None:
    from kinema.common import DefaultsHelpFormatter

    dataset = sub.add_parser("dataset", help="datasets: migrate to the current layout, import other tools' demos")
    dsub = dataset.add_subparsers(dest="dataset_command", metavar="COMMAND", required=True)
    upgrade = dsub.add_parser(
        "upgrade", help="migrate a kinema dataset's metadata to LeRobot's stats convention (atomic per file)",
        description="Rewrite the per-episode stats, meta/stats.json and meta/kinema.json of a kinema dataset written "
        "before kinema followed LeRobot 0.4.4's stats convention, so that LeRobot's writer can append to it. Data and "
        "video files are not touched; a crash leaves every file whole; running it again finishes the job.")
    upgrade.add_argument("dir", help="dataset folder")
    imp = dsub.add_parser("import", help="convert another tool's demonstrations into a kinema dataset")
    isub = imp.add_subparsers(dest="import_format", metavar="FORMAT", required=True)
    rm = isub.add_parser("robomimic", help="robomimic HDF5 (data/demo_N/{actions, obs/...})",
                         formatter_class=DefaultsHelpFormatter,
                         description="Convert robomimic demos to the layout of kinema's robosuite adapter "
                         "(robosuite/<env> tasks): cameras, observation.state in the robot-base frame, actions on the "
                         "adapter's scale. Every demo is a success (robomimic keeps only those).")
    rm.add_argument("file", help="robomimic .hdf5 file")
    rm.add_argument("--out", required=True, help="dataset folder: new, or a kinema dataset to extend")
    rm.add_argument("--instruction", default=None,
                    help="language instruction for every episode (default: from the env name in "
                    "data.attrs['env_args'])")
    rm.add_argument("--actions", choices=("rescale", "keep"), default="rescale",
                    help="rescale OSC_POSE deltas to the adapter's 0.12 m / 0.5 rad per unit, or keep them (and record "
                    "the scale the env must use)")
    rm.add_argument("--base-pos", type=float, nargs=3, default=None, metavar=("X", "Y", "Z"),
                    help="robot base position in world coordinates, for files without model_file "
                    "(default: from the MJCF)")
    rm.add_argument("--flip-images", action="store_true",
                    help="flip images vertically, for files holding robosuite's raw (upside-down) frames; robomimic's "
                    "own files hold them right side up")
    rm.add_argument("--image-size", type=int, default=None, help="resize cameras to this square size (default: keep)")
    rm.add_argument("--filter-key", default=None, help="import only the demos listed under mask/<key> (e.g. train)")
    rm.add_argument("--max-episodes", type=int, default=None, help="import at most this many demos")
    rm.add_argument("--overwrite", action="store_true", help="replace an existing dataset instead of extending it")


def run_dataset_command(args: argparse.Namespace) -> int:
    try:
        if args.dataset_command == "upgrade":
            return _upgrade(args)
        return _import_robomimic(args)
    except RuntimeError as err:  # another writer holds the dataset
        print(f"kinema: error: {err}", file=sys.stderr)
        return 2


def _upgrade(args: argparse.Namespace) -> int:
    from diffusion_rl.data import upgrade_dataset

    report = upgrade_dataset(args.dir)
    if report.changed:
        print(f"upgraded {report.root} ({report.episodes} episodes) to LeRobot's stats convention; rewrote: "
              + ", ".join(report.rewritten))
    elif report.is_kinema:
        print(f"{report.root} already follows the current layout; nothing to do")
    else:
        print(f"{report.root} is a LeRobot dataset not written by kinema: it follows LeRobot's convention; "
              "nothing to do")
    return 0


def _import_robomimic(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kinema.common import progress_bar

    console = Console(stderr=True)
    with progress_bar(console, transient=True) as bar:
        task = bar.add_task("importing demos", total=args.max_episodes, status="")
        result = import_robomimic(
            args.file, args.out, instruction=args.instruction, actions=args.actions, overwrite=args.overwrite,
            base_pos=args.base_pos, flip_images=args.flip_images, image_size=args.image_size,
            filter_key=args.filter_key, max_episodes=args.max_episodes,
            on_episode=lambda name, n, total: bar.update(task, advance=1, total=total, status=f"{name}: {n} steps"))
    r = result.record
    print(f"imported {result.episodes} robomimic demos ({result.frames} frames) of {result.env_name} into {result.out}")
    print(f"  instruction: {result.instruction!r}")
    print(f"  cameras: {', '.join(result.cameras) or 'none (low-dim file)'}; {r['images']}")
    print(f"  observation.state: grip-site position and wxyz quaternion (sign nearer the hand pointing down) in the robot-base frame, gripper "
          f"opening in [0, 1]; frames from {result.frames_origin}")
    print(f"  {r['action_scale_note']}"
          + (f"; {result.clipped_actions} values clipped to [-1, 1]" if result.clipped_actions else ""))
    print("  success: robomimic demos are successes by construction; every episode has outcome=True")
    print(f"  recorded in {result.out / 'meta/kinema.json'} under 'sources'")
    return 0
