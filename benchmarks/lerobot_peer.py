"""LeRobot's own ACT and Diffusion Policy on a kinema demonstration folder: the peer arms of benchmarks/imitation.py.

Runs in LeRobot's venv, not kinema's (lerobot 0.4.4 pins torch < 2.11; kinema's pins do not fit beside it), and imports
nothing of kinema's. What a LeRobot user runs, piece by piece as `lerobot-train` wires it: `LeRobotDataset` on the
folder (kinema writes LeRobotDataset v3), the policy's config with its own optimizer and scheduler presets, its
pre/post-processors (normalisation from the dataset's stats), `policy.forward` for the loss, `select_action` to act.

    python lerobot_peer.py train --policy act --dataset RUN/demos --out DIR --steps 2000 --batch-size 64 \
        [--budget-cpu-minutes M --budget-out DIR2] [--set chunk_size=20 ...]
    python lerobot_peer.py serve --checkpoint DIR       # acts for kinema's evaluation over stdin/stdout

No backbone weights are downloaded (none can be): the ResNet-18 encoders start from scratch.

ACT and DP take no language. The instruction becomes `observation.environment_state`, a fixed text feature: a 64-wide
signed bag of hashed words (md5 of each lower-cased word picks a slot and a sign; L2-normalised), which both policies
read as an environment-state token (ACT) or global conditioning (DP), unnormalised. A paraphrase with unseen words
gives a vector the policy never saw; that is the point of the held-out splits.

`serve` speaks length-prefixed pickles: {"cmd": "reset", "envs": [i, ...]} resets those envs' action queues;
{"cmd": "act", "obs": {key: (B, ...) array, "task": [str]}} answers {"actions": (B, action_dim)}, env i acting through
`select_action` with its own queues (a shallow copy of the policy per env: the weights shared, the queues its own).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import pickle
import re
import shutil
import struct
import sys
import time
from pathlib import Path
from typing import Any

INSTRUCTION_DIM = 64
ENV_STATE = "observation.environment_state"
PEER_FILE = "peer.json"


def instruction_feature(text: str) -> list[float]:
    """The instruction as a fixed vector: signed hashed bag of words, L2-normalised (zeros for no words)."""
    v = [0.0] * INSTRUCTION_DIM
    for word in re.findall(r"[a-z]+", text.lower()):
        h = int.from_bytes(hashlib.md5(word.encode()).digest()[:4], "little")
        v[h % INSTRUCTION_DIM] += 1.0 if (h >> 16) & 1 else -1.0
    norm = sum(x * x for x in v) ** 0.5
    return [x / norm for x in v] if norm else v


def _torch():
    import torch

    return torch


def _pyav_video_reader() -> None:
    """LeRobot 0.4.4 decodes with torchcodec (which needs a system FFmpeg; none here) or torchvision's PyAV
    `VideoReader`, which torchvision 0.25 removed. Where it is missing, stand in torchvision 0.24's behaviour: seek
    to the key frame before t, then yield every frame with its pts."""
    import av
    import torchvision.io

    if hasattr(torchvision.io, "VideoReader"):
        return
    torch = _torch()

    class VideoReader:
        def __init__(self, path: str, stream: str = "video") -> None:
            self.container = av.open(str(path))
            self.stream = self.container.streams.video[0]

        def seek(self, t: float, keyframes_only: bool = True) -> "VideoReader":
            self.container.seek(int(t / self.stream.time_base), stream=self.stream, backward=True)
            return self

        def __iter__(self):
            for frame in self.container.decode(self.stream):
                yield {"data": torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1),
                       "pts": float(frame.pts * self.stream.time_base)}  # fmt: skip

    torchvision.io.VideoReader = VideoReader
    torchvision.set_video_backend = lambda backend: None


def build_config(policy: str, meta: Any, overrides: list[str]) -> Any:
    """The policy's config, as LeRobot's defaults have it, on the dataset's cameras and state plus the instruction
    feature; no pretrained backbone; `overrides` key=value (JSON values) on top."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.datasets.utils import dataset_to_policy_features
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig

    features = dataset_to_policy_features(meta.features)
    inputs = {k: f for k, f in features.items() if f.type in (FeatureType.VISUAL, FeatureType.STATE)}
    inputs[ENV_STATE] = PolicyFeature(type=FeatureType.ENV, shape=(INSTRUCTION_DIM,))
    outputs = {k: f for k, f in features.items() if f.type is FeatureType.ACTION}
    if policy == "act":
        cfg = ACTConfig(device="cpu", pretrained_backbone_weights=None)
    elif policy == "diffusion":
        cfg = DiffusionConfig(device="cpu", pretrained_backbone_weights=None)
        side = min(f.shape[1] for f in inputs.values() if f.type is FeatureType.VISUAL)
        cfg.crop_shape = (int(side * 0.9), int(side * 0.9))  # DP's random crop (84 of 96 in its Push-T config)
    else:
        raise SystemExit(f"--policy must be act or diffusion; got {policy!r}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not hasattr(cfg, key):
            raise SystemExit(f"--set {item!r}: expected key=value with a field of {type(cfg).__name__}")
        parsed = json.loads(value)
        setattr(cfg, key, tuple(parsed) if isinstance(parsed, list) else parsed)
    cfg.input_features, cfg.output_features = inputs, outputs
    cfg.__post_init__()  # re-derive what depends on the overridden fields, and validate them
    return cfg


def _with_instructions(batch: dict[str, Any]) -> dict[str, Any]:
    torch = _torch()
    feature = torch.tensor([instruction_feature(t) for t in batch["task"]], dtype=torch.float32)
    state = batch.get("observation.state")
    if state is not None and state.ndim == 3:  # observation history (DP's n_obs_steps): the same instruction each step
        feature = feature[:, None].expand(-1, state.shape[1], -1)
    batch[ENV_STATE] = feature
    return batch


def _save(policy: Any, pre: Any, post: Any, out: Path, record: dict[str, Any]) -> None:
    """The checkpoint as LeRobot saves one (model, config, processors) plus peer.json; written beside, then renamed."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp)
    pre.save_pretrained(tmp)
    post.save_pretrained(tmp)
    (tmp / PEER_FILE).write_text(json.dumps(record, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def train(args: argparse.Namespace) -> None:
    torch = _torch()
    from lerobot.datasets.factory import resolve_delta_timestamps
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from lerobot.datasets.sampler import EpisodeAwareSampler
    from lerobot.datasets.utils import cycle
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    _pyav_video_reader()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started_cpu, started_wall = time.process_time(), time.monotonic()
    meta = dataset_meta(args.dataset)
    cfg = build_config(args.policy, meta, args.set)
    dataset = LeRobotDataset("kinema/demos", root=args.dataset, delta_timestamps=resolve_delta_timestamps(cfg, meta),
                             video_backend="pyav")  # fmt: skip
    stats = {k: v for k, v in meta.stats.items() if k in {**cfg.input_features, **cfg.output_features}}
    pre, post = make_pre_post_processors(cfg, dataset_stats=stats)
    policy = get_policy_class(cfg.type)(config=cfg)
    optimizer = cfg.get_optimizer_preset().build(policy.get_optim_params())
    scheduler_preset = cfg.get_scheduler_preset()
    scheduler = scheduler_preset.build(optimizer, args.steps) if scheduler_preset is not None else None
    clip = cfg.get_optimizer_preset().grad_clip_norm
    if hasattr(cfg, "drop_n_last_frames"):  # as lerobot-train samples for DP
        sampler = EpisodeAwareSampler(dataset.meta.episodes["dataset_from_index"], dataset.meta.episodes["dataset_to_index"],
                                      drop_n_last_frames=cfg.drop_n_last_frames, shuffle=True)  # fmt: skip
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0)
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=0)
    batches = cycle(loader)
    n_params = sum(p.numel() for p in policy.parameters())
    record = {"policy": args.policy, "parameters": n_params, "batch_size": args.batch_size, "dataset": str(args.dataset),
              "episodes": meta.total_episodes, "seed": args.seed, "threads": args.threads,
              "instruction_feature": f"{ENV_STATE}: {INSTRUCTION_DIM}-wide signed hashed bag of words"}  # fmt: skip
    budget_s = args.budget_cpu_minutes * 60 if args.budget_cpu_minutes else None

    def save(out: Path, steps: int) -> None:
        cpu, wall = time.process_time() - started_cpu, time.monotonic() - started_wall
        _save(policy, pre, post, out, {**record, "steps": steps, "cpu_minutes": round(cpu / 60, 2), "wall_minutes": round(wall / 60, 2)})

    policy.train()
    losses = []
    for step in range(1, args.steps + 1):
        batch = pre(_with_instructions(next(batches)))
        loss, _ = policy.forward(batch)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        cpu = time.process_time() - started_cpu
        if step % 50 == 0 or step == args.steps:
            print(json.dumps({"step": step, "loss": sum(losses[-50:]) / len(losses[-50:]), "cpu_minutes": round(cpu / 60, 2)}), flush=True)
        if budget_s is not None and cpu >= budget_s:
            save(Path(args.budget_out), step)
            budget_s = None
    if budget_s is not None:  # the budget was never reached: the equal-CPU arm is the whole run
        save(Path(args.budget_out), args.steps)
    save(Path(args.out), args.steps)


class Peer:
    """A saved peer acting per env through its own `select_action` queues."""

    def __init__(self, checkpoint: Path) -> None:
        torch = _torch()
        from lerobot.configs.policies import PreTrainedConfig
        from lerobot.policies.factory import get_policy_class, make_pre_post_processors

        torch.set_num_threads(1)
        cfg = PreTrainedConfig.from_pretrained(checkpoint)
        cfg.device = "cpu"
        self.policy = get_policy_class(cfg.type).from_pretrained(checkpoint, config=cfg)
        self.policy.eval()
        self.pre, self.post = make_pre_post_processors(cfg, pretrained_path=str(checkpoint))
        self.envs: dict[int, Any] = {}

    def reset(self, envs: list[int]) -> None:
        for i in envs:
            self.envs[i] = copy.copy(self.policy)  # shares the weights; reset() gives it queues of its own
            self.envs[i].reset()

    def act(self, obs: dict[str, Any]) -> Any:
        import numpy as np

        torch = _torch()
        rows = []
        for i in range(len(obs["task"])):
            if i not in self.envs:
                self.reset([i])
            with torch.no_grad():
                action = self.envs[i].select_action(self.inputs(obs, i))
            rows.append(self.post(action).numpy()[0])
        return np.stack(rows).astype(np.float32)

    def inputs(self, obs: dict[str, Any], i: int) -> dict[str, Any]:
        """Env `i` of a kinema observation batch, checked against the checkpoint's input features and preprocessed."""
        item = observation_item(obs, i)
        for key, feature in self.policy.config.input_features.items():
            if key == ENV_STATE:
                continue
            if key not in item:
                raise ValueError(f"the observation has no {key!r}, which this checkpoint was trained on; it has {sorted(item)}")
            if tuple(item[key].shape[1:]) != tuple(feature.shape):
                raise ValueError(f"{key}: shape {tuple(item[key].shape[1:])}, expected {tuple(feature.shape)} as in the "
                                 "demos the checkpoint was trained on (evaluate at the demos' image size)")  # fmt: skip
        return self.pre(_with_instructions(item))


def observation_item(obs: dict[str, Any], i: int) -> dict[str, Any]:
    """Env `i` of a kinema observation batch as the LeRobot batch of one that its dataset gives in training: images
    (H, W, 3) uint8 -> (1, 3, H, W) float in [0, 1], state float32, the instruction as `task`."""
    import numpy as np

    torch = _torch()
    item: dict[str, Any] = {"task": [obs["task"][i]]}
    for key, value in obs.items():
        if key.startswith("observation.images."):
            item[key] = torch.from_numpy(np.ascontiguousarray(value[i])).permute(2, 0, 1)[None].float() / 255.0
        elif key.startswith("observation."):
            item[key] = torch.from_numpy(np.asarray(value[i], np.float32))[None]
    return item


def check_inputs(args: argparse.Namespace) -> None:
    """What the peer sees of the dataset's frame `--index` in training and of a live observation (an .npz of a
    kinema observation batch of one) when acting, both through the checkpoint's preprocessor: written to --out
    (.npz: train/<key>, live/<key>). The pipeline check in tests/test_imitation_peers.py compares them."""
    import numpy as np

    torch = _torch()
    from lerobot.datasets.factory import resolve_delta_timestamps
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    _pyav_video_reader()
    peer = Peer(Path(args.checkpoint))
    cfg = peer.policy.config
    dataset = LeRobotDataset("kinema/demos", root=args.dataset, delta_timestamps=resolve_delta_timestamps(cfg, dataset_meta(args.dataset)),
                             video_backend="pyav")  # fmt: skip
    train_batch = peer.pre(_with_instructions(torch.utils.data.default_collate([dataset[args.index]])))
    live = dict(np.load(args.observation, allow_pickle=True))
    live["task"] = list(live["task"])
    live_batch = peer.inputs(live, 0)
    out = {}
    for side, batch in (("train", train_batch), ("live", live_batch)):
        for key in (*cfg.input_features, "task"):
            value = batch[key]
            out[f"{side}/{key}"] = np.asarray(value) if key == "task" else value.detach().numpy()
    np.savez(args.out, **out)


def dataset_meta(root: str | Path) -> Any:
    from lerobot.datasets.lerobot_dataset import LeRobotDatasetMetadata

    return LeRobotDatasetMetadata("kinema/demos", root=root)


def _read(stream: Any) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))


def _write(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def serve(args: argparse.Namespace) -> None:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything printed goes to stderr; stdout carries the answers only
    peer = Peer(Path(args.checkpoint))
    _write(out, {"ready": json.loads((Path(args.checkpoint) / PEER_FILE).read_text())})
    while (request := _read(sys.stdin.buffer)) is not None:
        if request["cmd"] == "reset":
            peer.reset(request["envs"])
            _write(out, {"ok": True})
        elif request["cmd"] == "act":
            try:
                _write(out, {"actions": peer.act(request["obs"])})
            except ValueError as err:  # bad input: said to the caller, the server stays up
                _write(out, {"error": str(err)})
        else:
            _write(out, {"error": f"unknown command {request['cmd']!r}; expected reset or act"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train")
    t.add_argument("--policy", required=True, choices=("act", "diffusion"))
    t.add_argument("--dataset", required=True, type=Path)
    t.add_argument("--out", required=True, type=Path)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=int(os.environ.get("KINEMA_PEER_THREADS", "2")))
    t.add_argument("--budget-cpu-minutes", type=float, default=None, help="also save the checkpoint this much CPU in")
    t.add_argument("--budget-out", type=Path, default=None)
    t.add_argument("--set", action="append", default=[], help="config field=JSON value, e.g. chunk_size=20")
    s = sub.add_parser("serve")
    s.add_argument("--checkpoint", required=True)
    c = sub.add_parser("check-inputs")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--dataset", required=True)
    c.add_argument("--index", type=int, default=0)
    c.add_argument("--observation", required=True, help=".npz of a kinema observation batch of one")
    c.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.command == "train":
        if (args.budget_cpu_minutes is None) != (args.budget_out is None):
            raise SystemExit("--budget-cpu-minutes and --budget-out go together")
        train(args)
    elif args.command == "serve":
        serve(args)
    else:
        check_inputs(args)


if __name__ == "__main__":
    main()
