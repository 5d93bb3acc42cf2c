"""kinema's datasets and LeRobot's writer: the stats convention, `meta/kinema.json`, upgrading older datasets, and
round trips through LeRobot's own code.

The convention is LeRobot 0.4.4's (the version the `lerobot-dataset` 0.4.4 package ships as `ledataset`), read from its
source: `datasets/compute_stats.py` (`compute_episode_stats`: cameras -> per-channel (3, 1, 1) in [0, 1]; any other
feature -> `get_feature_stats(axis=0, keepdims=data.ndim == 1)`, whose `RunningQuantileStats.update` reshapes the
batch to (-1, last dim), so every axis but the last is reduced, `min`/`max` keep the data's dtype, `count` is the
number of frames; `aggregate_stats` pools quantiles as a count-weighted mean), and `datasets/lerobot_dataset.py`
(`LeRobotDatasetMetadata._flush_metadata_buffer` writes `meta/episodes` with `pa.Table.from_pydict` of `.tolist()`
values, so the arrow types are what pyarrow infers: list<double> for floats, list<int64> for ints, list<bool> for
bools, list<list<list<double>>> for cameras; `datasets` then casts every meta/episodes file to the first file's
columns). The tests below pin that convention without LeRobot installed.

The round-trip tests at the end run LeRobot's own `LeRobotDataset` in a Python of its own, given as
KINEMA_LEROBOT_PYTHON (skipped without it). `lerobot-dataset` 0.4.4 does not install beside kinema's pins (it would
downgrade numpy, av, huggingface-hub, packaging and others), so it lives in a throwaway venv:

    python3.11 -m venv /tmp/lerobot-venv
    /tmp/lerobot-venv/bin/pip install lerobot-dataset==0.4.4 torch==2.13.0
    KINEMA_LEROBOT_PYTHON=/tmp/lerobot-venv/bin/python pytest tests/test_dataset_lerobot.py

(`.ci/run` builds that venv, with torch 2.14.1, torchvision and lerobot 0.4.4 for the peer policies of
tests/test_imitation_peers.py, and runs the whole suite with KINEMA_LEROBOT_PYTHON set.)

torchvision is not needed: LeRobot 0.4.4 decodes video with torchcodec or torchvision's `VideoReader`, which
torchvision >= 0.25 removed (and the PyPI builds of both need CUDA torch), so the LeRobot-side script stands in a PyAV
`VideoReader` with torchvision 0.24's behaviour when torchvision cannot be imported; everything else is LeRobot's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusion_rl.data import (Episode, LeRobotDatasetReader, LeRobotDatasetWriter, load_stats, read_episodes,
                               upgrade_dataset, write_episodes)
from diffusion_rl.data import lerobot_v3
from kinema.cli import main
from test_dataset import CAMS, assert_same_episode, episode_rows, make_episode, stray_files, tree_digest

QUANTILE_KEYS = ("q01", "q10", "q50", "q90", "q99")
STAT_KEYS = ("min", "max", "mean", "std", *QUANTILE_KEYS, "count")


def small(seed: int, t: int = 12, **kwargs) -> Episode:
    """Every feature kind: 2 cameras, vectors, a (3, 7) feature, scalars (float, bool, int8)."""
    return make_episode(seed, t=t, hw=(32, 32), **kwargs)


@pytest.fixture(scope="module")
def eps() -> list[Episode]:
    return [small(s, t=10 + s) for s in range(3)]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory, eps) -> Path:
    return write_episodes(tmp_path_factory.mktemp("fresh") / "ds", eps)


def stats_columns(root: Path) -> dict[str, pa.Field]:
    fields = {}
    for path in sorted(root.glob("meta/episodes/*/*.parquet")):
        fields |= {f.name: f for f in pq.read_schema(path) if f.name.startswith("stats/")}
    return fields


# ------------------------------------------------------------------------------------------ LeRobot 0.4.4's convention
def lerobot_rule(values: np.ndarray) -> dict[str, np.ndarray]:
    """What LeRobot 0.4.4 computes for a non-camera feature: rows of the last dimension (exact quantiles aside)."""
    rows = values.reshape(len(values), -1) if values.ndim == 1 else values.reshape(-1, values.shape[-1])
    rows = rows.reshape(-1, 1) if values.ndim == 1 else rows
    return {"min": rows.min(0), "max": rows.max(0), "mean": rows.astype(np.float64).mean(0),
            "std": rows.astype(np.float64).std(0), "count": np.array([len(values)])}


def test_per_episode_stats_have_lerobots_shapes_and_arrow_types(fresh, eps):
    fields = stats_columns(fresh)
    info = json.loads((fresh / "meta/info.json").read_text())
    scalars = ("privileged.contact", "next.reward", "next.done", "success", "intervention", "segment", "timestamp",
               "frame_index", "episode_index", "index", "task_index")
    expected_shape = {"observation.state": (7,), "action": (4,), "privileged.cube_pose": (7,), "privileged.target": (3,)}
    expected_shape |= {k: (1,) for k in scalars} | {c: (3, 1, 1) for c in CAMS}
    assert set(expected_shape) == set(info["features"])
    rows = episode_rows(fresh)
    for key, shape in expected_shape.items():
        kind = info["features"][key]["dtype"]
        for stat in STAT_KEYS:
            field = fields[f"stats/{key}/{stat}"]
            value = np.asarray(rows[0][f"stats/{key}/{stat}"])
            if stat == "count":
                assert field.type == pa.list_(pa.int64()) and value.tolist() == [10], key
                continue
            assert value.shape == shape, (key, stat)
            if kind == "video":
                want = pa.list_(pa.list_(pa.list_(pa.float64())))
            elif stat in ("min", "max") and kind == "bool":
                want = pa.list_(pa.bool_())
            elif stat in ("min", "max") and kind in ("int8", "int64"):
                want = pa.list_(pa.int64())
            else:
                want = pa.list_(pa.float64())
            assert field.type == want, (key, stat, field.type)


def test_per_episode_stats_values_follow_lerobots_reduction(fresh, eps):
    rows = episode_rows(fresh)
    for row, ep in zip(rows, eps, strict=True):
        cols = lerobot_v3._step_columns(ep)
        for key in ("observation.state", "privileged.cube_pose", "privileged.contact", "segment", "success"):
            want = lerobot_rule(np.asarray(cols[key]))
            for stat, value in want.items():
                got = np.asarray(row[f"stats/{key}/{stat}"])
                np.testing.assert_allclose(got.astype(np.float64), value.astype(np.float64), rtol=1e-6, atol=1e-7,
                                           err_msg=f"{key}/{stat}")
        # min/max keep the feature's kind: bool stays bool, int8 segment labels stay ints
        assert isinstance(row["stats/success/max"][0], bool) and isinstance(row["stats/segment/max"][0], int)
        assert row["stats/next.done/max"] == [True] and row["stats/frame_index/max"] == [len(ep) - 1]


def test_stats_json_pools_like_lerobot(fresh, eps):
    stats = json.loads((fresh / "meta/stats.json").read_text())
    assert np.shape(stats["privileged.cube_pose"]["mean"]) == (7,) and stats["privileged.cube_pose"]["count"] == [33]
    assert stats["next.done"]["min"] == [False] and stats["next.done"]["max"] == [True]  # JSON booleans
    assert stats["segment"]["min"] == [0] and stats["segment"]["max"] == [4]  # JSON ints
    assert np.shape(stats[CAMS[0]]["q50"]) == (3, 1, 1)
    rows = episode_rows(fresh)
    counts = np.array([r["stats/action/count"][0] for r in rows], dtype=np.float64)
    for q in QUANTILE_KEYS:  # aggregate_stats: count-weighted mean of the per-episode quantiles
        per_episode = np.array([r[f"stats/action/{q}"] for r in rows])
        np.testing.assert_allclose(stats["action"][q], (counts[:, None] * per_episode).sum(0) / counts.sum(), rtol=1e-9)
    pooled = np.concatenate([e.privileged["privileged.cube_pose"] for e in eps]).reshape(-1, 7).astype(np.float64)
    np.testing.assert_allclose(stats["privileged.cube_pose"]["std"], pooled.std(0), rtol=1e-6)


def test_lerobots_own_aggregation_accepts_our_stats(fresh):
    """LeRobot's save_episode does `aggregate_stats([stats.json, new episode stats])`, which np.stacks them: every
    feature's stats must have the shape LeRobot's compute_episode_stats gives a new episode (issue 1's ValueError)."""
    stats = load_stats(fresh)
    new_episode = {k: lerobot_rule(np.zeros((5, 3, 7))) for k in ("privileged.cube_pose",)}
    for key, st in new_episode.items():
        for stat in ("min", "max", "mean", "std"):
            np.stack([stats[key][stat], st[stat]])  # raises on mismatched shapes


# ------------------------------------------------------------------------------------------------------- kinema.json
def test_kinema_json_is_the_same_written_in_one_go_or_appended(tmp_path, eps):
    one_go = write_episodes(tmp_path / "one", eps)
    appended = write_episodes(tmp_path / "two", eps[:1])
    with LeRobotDatasetWriter.open_append(appended) as writer:
        writer.add_episode(eps[1])
    with LeRobotDatasetWriter.open_append(appended) as writer:
        writer.add_episode(eps[2])
    a, b = (json.loads((r / "meta/kinema.json").read_text()) for r in (one_go, appended))
    assert a == b and (one_go / "meta/kinema.json").read_bytes() == (appended / "meta/kinema.json").read_bytes()
    assert not set(a["step_shapes"]) & set(lerobot_v3.DEFAULT_FEATURES)
    assert a["stats_layout"] == lerobot_v3.STATS_LAYOUT
    assert json.loads((one_go / "meta/stats.json").read_text())["index"] == \
        json.loads((appended / "meta/stats.json").read_text())["index"]


def test_appended_sessions_get_their_own_meta_episodes_file(tmp_path, eps):
    root = write_episodes(tmp_path / "ds", eps[:1])
    with LeRobotDatasetWriter.open_append(root) as writer:
        writer.add_episode(eps[1])
        writer.commit()
        writer.add_episode(eps[2])
    files = sorted(str(p.relative_to(root)) for p in root.glob("meta/episodes/*/*.parquet"))
    assert files == ["meta/episodes/chunk-000/file-000.parquet", "meta/episodes/chunk-000/file-001.parquet"]
    assert [(r["meta/episodes/chunk_index"], r["meta/episodes/file_index"]) for r in episode_rows(root)] == \
        [(0, 0), (0, 1), (0, 1)]
    for a, b in zip(eps, read_episodes(root), strict=True):
        assert_same_episode(a, b)


# ----------------------------------------------------------------------------------------------- older datasets
def legacy_layout(root: Path) -> None:
    """Turn a dataset into what kinema wrote before it followed LeRobot's stats convention (main at d2c2b2a):
    per-element stats (a (3, 7) feature had (3, 7) stats), every stat a float (min/max of ints and bools too),
    quantiles pooled as an envelope, and no `stats_layout` in kinema.json."""
    info = json.loads((root / "meta/info.json").read_text())
    reader = LeRobotDatasetReader(root)
    path = root / "meta/episodes/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    per_episode = []
    for row in rows:
        frames = reader._frames_of(reader.meta.episodes[row["episode_index"]])
        st = {}
        for key, f in info["features"].items():
            if f["dtype"] == "video":
                st[key] = {s: np.asarray(row[f"stats/{key}/{s}"], dtype=np.float64) for s in STAT_KEYS}
                continue
            x = lerobot_v3._from_arrow(frames.column(key), f["shape"]).astype(np.float64)
            quant = np.quantile(x, [0.01, 0.1, 0.5, 0.9, 0.99], axis=0)
            st[key] = {"min": x.min(0), "max": x.max(0), "mean": x.mean(0), "std": x.std(0),
                       "count": np.array([len(x)])} | {q: quant[i] for i, q in enumerate(QUANTILE_KEYS)}
            row |= {f"stats/{key}/{s}": np.asarray(v).tolist() for s, v in st[key].items()}
        per_episode.append(st)
    fields = []
    for field in table.schema:
        if field.name.startswith("stats/") and not field.name.endswith("/count"):
            key = field.name[len("stats/"):].rsplit("/", 1)[0]
            depth = 3 if info["features"][key]["dtype"] == "video" else len(info["features"][key]["shape"])
            t = pa.float64()
            for _ in range(depth):
                t = pa.list_(t)
            field = pa.field(field.name, t)
        fields.append(field)
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema(fields)), path)
    pooled = {}
    for key in per_episode[0]:
        items = [s[key] for s in per_episode]
        counts = np.array([float(s["count"][0]) for s in items])
        w = (counts / counts.sum()).reshape((-1,) + (1,) * np.ndim(items[0]["mean"]))
        means = np.stack([s["mean"] for s in items])
        mean = (w * means).sum(0)
        var = (w * (np.stack([s["std"] for s in items]) ** 2 + (means - mean) ** 2)).sum(0)
        pooled[key] = {"min": np.min([s["min"] for s in items], 0), "max": np.max([s["max"] for s in items], 0),
                       "mean": mean, "std": np.sqrt(var), "count": np.array([int(counts.sum())])}
        for q in QUANTILE_KEYS:
            pooled[key][q] = (np.min if q <= "q50" else np.max)([s[q] for s in items], 0)
    (root / "meta/stats.json").write_text(json.dumps(
        {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in pooled.items()}, indent=4))
    kinema = json.loads((root / "meta/kinema.json").read_text())
    kinema.pop("stats_layout")
    kinema["step_shapes"] |= {"timestamp": [], "frame_index": [], "episode_index": [], "index": [], "task_index": []}
    (root / "meta/kinema.json").write_text(json.dumps(kinema, indent=4))


@pytest.fixture
def legacy(tmp_path, eps) -> Path:
    root = write_episodes(tmp_path / "legacy", eps)
    legacy_layout(root)
    return root


def test_a_legacy_dataset_still_reads(legacy, eps):
    assert np.shape(json.loads((legacy / "meta/stats.json").read_text())["privileged.cube_pose"]["mean"]) == (3, 7)
    for a, b in zip(eps, read_episodes(legacy), strict=True):
        assert_same_episode(a, b)
    stats = load_stats(legacy)  # per-element stats reduced to LeRobot's shapes on the fly (exact but for quantiles)
    pooled = np.concatenate([e.privileged["privileged.cube_pose"] for e in eps]).reshape(-1, 7).astype(np.float64)
    assert stats["privileged.cube_pose"]["mean"].shape == (7,)
    np.testing.assert_allclose(stats["privileged.cube_pose"]["mean"], pooled.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["privileged.cube_pose"]["std"], pooled.std(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["privileged.cube_pose"]["min"], pooled.min(0), rtol=1e-6)


def test_upgrade_gives_what_a_fresh_write_gives(legacy, fresh):
    before = tree_digest(legacy / "data") | tree_digest(legacy / "videos")
    report = upgrade_dataset(legacy)
    assert report.changed and report.episodes == 3
    assert report.rewritten == ["meta/episodes/chunk-000/file-000.parquet", "meta/stats.json", "meta/kinema.json"]
    assert (tree_digest(legacy / "data") | tree_digest(legacy / "videos")) == before  # data and videos untouched
    assert (legacy / "meta/kinema.json").read_bytes() == (fresh / "meta/kinema.json").read_bytes()
    new, ref = pq.read_table(legacy / lerobot_v3.EPISODES_PATH), pq.read_table(fresh / lerobot_v3.EPISODES_PATH)
    assert new.schema.equals(ref.schema)
    for name in ref.column_names:
        a, b = new.column(name).to_pylist(), ref.column(name).to_pylist()
        if name.startswith("stats/"):
            np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=1e-12,
                                       err_msg=name)
        else:
            assert a == b, name
    got = json.loads((legacy / "meta/stats.json").read_text())
    want = json.loads((fresh / "meta/stats.json").read_text())
    assert got.keys() == want.keys()
    for key in want:
        for stat in want[key]:
            np.testing.assert_allclose(got[key][stat], want[key][stat], rtol=1e-12, err_msg=f"{key}/{stat}")
    assert not upgrade_dataset(legacy).changed  # idempotent
    assert stray_files(legacy) == []


@pytest.mark.parametrize("crash_at", range(4))
def test_an_interrupted_upgrade_leaves_a_readable_dataset_and_finishes_when_rerun(legacy, fresh, eps, monkeypatch,
                                                                                  crash_at):
    """crash_at 0..2: the process dies before the k-th file's rename (after its temp file was written); 3: while the
    temp file of the first file is being written. Every file is then whole, old or new, and both read."""
    real_replace, calls = os.replace, []

    def dying_replace(src, dst):
        calls.append(dst)
        if crash_at < 3 and len(calls) == crash_at + 1:
            raise OSError("killed")
        real_replace(src, dst)

    def dying_write(table, where, *args, **kwargs):
        raise OSError("killed while writing")

    monkeypatch.setattr(lerobot_v3.os, "replace", dying_replace)
    if crash_at == 3:
        monkeypatch.setattr(lerobot_v3.pq, "write_table", dying_write)
    with pytest.raises(OSError, match="killed"):
        upgrade_dataset(legacy)
    monkeypatch.undo()
    for a, b in zip(eps, read_episodes(legacy), strict=True):
        assert_same_episode(a, b)
    assert load_stats(legacy)["privileged.cube_pose"]["mean"].shape == (7,)
    assert "stats_layout" not in json.loads((legacy / "meta/kinema.json").read_text())  # marker written last
    assert upgrade_dataset(legacy).changed
    assert (legacy / "meta/kinema.json").read_bytes() == (fresh / "meta/kinema.json").read_bytes()
    assert list(legacy.rglob("*.kinema-tmp")) == []
    assert json.loads((legacy / "meta/stats.json").read_text())["index"] == \
        json.loads((fresh / "meta/stats.json").read_text())["index"]


def test_appending_to_a_legacy_dataset_upgrades_it_first(legacy, eps):
    extra = small(7)
    with LeRobotDatasetWriter.open_append(legacy) as writer:
        writer.add_episode(extra)
    for a, b in zip([*eps, extra], read_episodes(legacy), strict=True):
        assert_same_episode(a, b)
    assert all(np.shape(r["stats/privileged.cube_pose/mean"]) == (7,) for r in episode_rows(legacy))
    assert json.loads((legacy / "meta/kinema.json").read_text())["stats_layout"] == lerobot_v3.STATS_LAYOUT
    assert load_stats(legacy)["index"]["count"].tolist() == [sum(len(e) for e in [*eps, extra])]


def test_the_upgrade_command(legacy, capsys):
    assert main(["dataset", "upgrade", str(legacy)]) == 0
    assert "upgraded" in capsys.readouterr().out
    assert main(["dataset", "upgrade", str(legacy)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert main(["dataset", "upgrade", str(legacy / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------ round trips through LeRobot's own code
LEROBOT_PYTHON = os.environ.get("KINEMA_LEROBOT_PYTHON", "")
needs_lerobot = pytest.mark.skipif(not (LEROBOT_PYTHON and Path(LEROBOT_PYTHON).exists()),
                                   reason="set KINEMA_LEROBOT_PYTHON to a Python with lerobot-dataset==0.4.4 (see the "
                                   "module docstring)")

LEROBOT_SIDE = textwrap.dedent('''
    """LeRobot's side: LeRobot 0.4.4's own LeRobotDataset (package lerobot-dataset, module ledataset)."""
    import importlib.machinery, json, os, sys, types
    os.environ["HF_HUB_OFFLINE"] = "1"
    import av
    import numpy as np
    import torch

    def torchvision_shim():
        try:
            import torchvision.io
            if hasattr(torchvision.io, "VideoReader"):
                return
        except Exception:
            pass

        class VideoReader:  # torchvision 0.24's pyav reader: seek to the key frame before t, then every frame
            def __init__(self, path, stream="video"):
                self.container = av.open(str(path))
                self._stream = self.container.streams.video[0]

            def seek(self, t, keyframes_only=True):
                self.container.seek(int(t / self._stream.time_base), stream=self._stream, backward=True)
                return self

            def __iter__(self):
                for frame in self.container.decode(self._stream):
                    yield {"data": torch.from_numpy(frame.to_ndarray(format="rgb24")).permute(2, 0, 1),
                           "pts": float(frame.pts * self._stream.time_base)}

        mods = {n: types.ModuleType(n) for n in ("torchvision", "torchvision.io", "torchvision.transforms")}
        for n, m in mods.items():
            m.__spec__ = importlib.machinery.ModuleSpec(n, None)
        mods["torchvision"].io, mods["torchvision"].transforms = mods["torchvision.io"], mods["torchvision.transforms"]
        mods["torchvision"].set_video_backend = lambda backend: None
        mods["torchvision.io"].VideoReader = VideoReader
        sys.modules.update(mods)

    torchvision_shim()
    from ledataset.datasets.compute_stats import aggregate_stats
    from ledataset.datasets.lerobot_dataset import LeRobotDataset
    from ledataset.datasets.utils import load_nested_dataset

    DEFAULTS = ("timestamp", "frame_index", "episode_index", "index", "task_index")

    def add_episodes(ds, spec):
        for i in range(int(spec["n"])):
            ep = {k.split("/", 1)[1]: v for k, v in spec.items() if k.startswith(f"ep{i}/")}
            for t in range(len(ep["task"])):
                frame = {"task": str(ep["task"][t])}
                for key, f in ds.features.items():
                    if key not in DEFAULTS:
                        dtype = np.uint8 if f["dtype"] == "video" else f["dtype"]
                        frame[key] = np.asarray(ep[key][t], dtype=dtype).reshape(f["shape"])
                ds.add_frame(frame)
            ds.save_episode(parallel_encoding=False)

    def main(cmd, root, arg):
        if cmd == "create":
            spec = dict(np.load(arg))
            features = {k: f | {"shape": tuple(f["shape"])} for k, f in json.loads(str(spec.pop("features"))).items()}
            ds = LeRobotDataset.create("local/interop", fps=int(spec.pop("fps")), features=features, root=root,
                                       robot_type="lerobot_side", use_videos=True, video_backend="pyav")
            add_episodes(ds, spec)
            ds.finalize()
        elif cmd == "append":
            ds = LeRobotDataset("local/interop", root=root, video_backend="pyav")
            add_episodes(ds, dict(np.load(arg)))
            ds.finalize()
        elif cmd == "dump":
            ds = LeRobotDataset("local/interop", root=root, video_backend="pyav")
            items = [ds[i] for i in range(len(ds))]
            out = {}
            for key in items[0]:
                values = [item[key] for item in items]
                if key == "task":
                    out[key] = np.array(values)
                elif key in ds.meta.video_keys:  # float CHW in [0, 1] -> uint8 HWC
                    out[key] = np.stack([(v.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for v in values])
                else:
                    out[key] = np.stack([v.numpy() for v in values])
            episodes = load_nested_dataset(ds.root / "meta/episodes")  # every file, every column, stats included
            per_episode = [{} for _ in range(len(episodes))]
            for col in episodes.column_names:
                if col.startswith("stats/"):
                    key, stat = col[len("stats/"):].rsplit("/", 1)
                    for row, value in zip(per_episode, episodes[col]):
                        if value is not None:
                            row.setdefault(key, {})[stat] = np.asarray(value)
            pooled = aggregate_stats(per_episode)
            meta = {"num_episodes": ds.num_episodes, "num_frames": ds.num_frames, "tasks": list(ds.meta.tasks.index),
                    "lengths": [int(x) for x in episodes["length"]],
                    "columns": sorted(episodes.column_names),
                    "outcome": list(episodes["outcome"]) if "outcome" in episodes.column_names else None,
                    "pooled": {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in pooled.items()}}
            np.savez(arg, **out)
            with open(arg + ".json", "w") as fh:
                json.dump(meta, fh)

    # One process serves every call of a test module (its imports take seconds): a command per stdin line.
    for line in sys.stdin:
        try:
            main(*json.loads(line))
            print(json.dumps({"ok": True}), flush=True)
        except Exception:
            import traceback
            print(json.dumps({"ok": False, "error": traceback.format_exc()}), flush=True)
''')
_server: subprocess.Popen | None = None


def lerobot(tmp_path: Path, *args: str) -> None:
    """Run one command on LeRobot's side (create / append / dump), in the module's LeRobot process."""
    global _server
    if _server is None or _server.poll() is not None:
        script = tmp_path / "lerobot_side.py"
        script.write_text(LEROBOT_SIDE)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"OMP_NUM_THREADS": "1"}
        _server = subprocess.Popen([LEROBOT_PYTHON, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    _server.stdin.write(json.dumps(list(args)) + "\n")
    _server.stdin.flush()
    reply = ""
    while not reply.startswith("{"):  # LeRobot's own prints come first
        reply = _server.stdout.readline()
        assert reply, f"LeRobot's side exited ({_server.poll()}) during {args[0]}"
    answer = json.loads(reply)
    assert answer["ok"], answer["error"][-4000:]


@pytest.fixture(scope="module", autouse=True)
def _stop_lerobot_side():
    yield
    global _server
    if _server is not None:
        _server.stdin.close()
        _server.wait(timeout=60)
        _server = None


def lerobot_spec(episodes: list[Episode], path: Path, features: dict | None = None) -> str:
    """Episodes as LeRobot's add_frame takes them (LeRobot sets timestamps to frame_index / fps)."""
    spec: dict[str, np.ndarray] = {"n": np.array(len(episodes))}
    for i, ep in enumerate(episodes):
        spec |= {f"ep{i}/{k}": np.asarray(v) for k, v in lerobot_v3._step_columns(ep).items()}
        spec |= {f"ep{i}/{c}": ep.observations[c] for c in ep.camera_keys}
        spec[f"ep{i}/task"] = np.array([ep.task] * len(ep))
    if features is not None:
        spec |= {"features": np.array(json.dumps(features)), "fps": np.array(20)}
    np.savez(path, **spec)
    return str(path)


def lerobot_made(seed: int, t: int) -> Episode:
    """An episode as LeRobot records it: regular timestamps, and none of kinema's per-episode facts."""
    ep = small(seed, t=t, policy_version="", task_id="", task=f"lerobot task {seed}")
    ep.outcome, ep.seed = bool(ep.success.any()), None
    return ep


def check_lerobot_view(tmp_path: Path, root: Path, expected: list[Episode]) -> dict:
    """LeRobot's __getitem__ over every frame returns the expected episodes' values; returns its metadata view."""
    lerobot(tmp_path, "dump", str(root), str(tmp_path / "dump.npz"))
    dump, meta = np.load(tmp_path / "dump.npz"), json.loads((tmp_path / "dump.npz.json").read_text())
    assert meta["num_episodes"] == len(expected) and meta["lengths"] == [len(e) for e in expected]
    assert meta["num_frames"] == len(dump["index"]) == sum(len(e) for e in expected)
    start = 0
    for i, ep in enumerate(expected):
        sl = slice(start, start + len(ep))
        start += len(ep)
        assert (dump["episode_index"][sl] == i).all() and dump["frame_index"][sl].tolist() == list(range(len(ep)))
        assert dump["task"][sl].tolist() == [ep.task] * len(ep)
        np.testing.assert_allclose(dump["timestamp"][sl], ep.timestamp, atol=1e-6)
        for key, value in lerobot_v3._step_columns(ep).items():
            np.testing.assert_array_equal(dump[key][sl].reshape(value.shape), value, err_msg=f"episode {i} {key}")
        for cam in ep.camera_keys:
            err = np.abs(dump[cam][sl].astype(int) - ep.observations[cam].astype(int))
            assert err.mean() < 3.0 and err.max() < 60, (i, cam, err.mean(), err.max())
    stats = load_stats(root)
    for key in ("privileged.cube_pose", "action", "segment", "next.done"):
        for stat in ("min", "max", "mean", "std", "count"):  # LeRobot pools our stats as we do
            np.testing.assert_allclose(np.asarray(meta["pooled"][key][stat], dtype=np.float64),
                                       stats[key][stat].astype(np.float64), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{key}/{stat}")
    return meta


@pytest.mark.slow  # 15-40 s on 2 cores: LeRobot writes and decodes video; its process serves the module
@needs_lerobot
def test_lerobot_appends_to_a_kinema_dataset_and_both_read_everything(tmp_path):
    ours = [small(s, t=10 + s) for s in range(2)]
    root = write_episodes(tmp_path / "ds", ours)
    theirs = [lerobot_made(20, 9)]
    lerobot(tmp_path, "append", str(root), lerobot_spec(theirs, tmp_path / "theirs.npz"))
    for a, b in zip([*ours, *theirs], read_episodes(root), strict=True):  # kinema reads LeRobot's episode
        assert_same_episode(a, b)
    more = [small(5, t=8)]
    with LeRobotDatasetWriter.open_append(root) as writer:  # and appends after it
        writer.add_episode(more[0])
    everything = [*ours, *theirs, *more]
    meta = check_lerobot_view(tmp_path, root, everything)
    assert meta["outcome"] == [e.outcome for e in ours] + [None] + [more[0].outcome]  # kinema's facts reach LeRobot
    last = [lerobot_made(21, 7)]
    lerobot(tmp_path, "append", str(root), lerobot_spec(last, tmp_path / "last.npz"))  # LeRobot again, after kinema
    for a, b in zip([*everything, *last], read_episodes(root), strict=True):
        assert_same_episode(a, b)
    check_lerobot_view(tmp_path, root, [*everything, *last])
    assert stray_files(root) == []


@pytest.mark.slow  # 15-40 s on 2 cores: LeRobot writes and decodes video; its process serves the module
@needs_lerobot
def test_kinema_appends_to_a_lerobot_dataset_and_both_read_everything(tmp_path):
    theirs = [lerobot_made(30, 9), lerobot_made(31, 6)]
    features, _ = lerobot_v3._infer_features(theirs[0], 20, lerobot_v3.VideoEncoding(), None)
    features = {k: {n: v for n, v in f.items() if n != "info"} for k, f in features.items()
                if k not in lerobot_v3.DEFAULT_FEATURES}
    root = tmp_path / "ds"
    lerobot(tmp_path, "create", str(root), lerobot_spec(theirs, tmp_path / "theirs.npz", features))
    assert not (root / "meta/kinema.json").exists()
    for a, b in zip(theirs, read_episodes(root), strict=True):
        assert_same_episode(a, b)
    before = tree_digest(root / "data") | tree_digest(root / "videos") | tree_digest(root / "meta/episodes")
    ours = [small(6, t=11)]
    with LeRobotDatasetWriter.open_append(root) as writer:
        writer.add_episode(ours[0])
    after = tree_digest(root / "data") | tree_digest(root / "videos") | tree_digest(root / "meta/episodes")
    assert all(after[k] == v for k, v in before.items())  # LeRobot's files untouched
    for a, b in zip([*theirs, *ours], read_episodes(root), strict=True):  # kinema's facts kept beside meta/episodes
        assert_same_episode(a, b)
    meta = check_lerobot_view(tmp_path, root, [*theirs, *ours])
    assert "outcome" not in meta["columns"]  # LeRobot's first file sets the columns; ours go to kinema_episodes
    last = [lerobot_made(32, 5)]
    lerobot(tmp_path, "append", str(root), lerobot_spec(last, tmp_path / "last.npz"))
    for a, b in zip([*theirs, *ours, *last], read_episodes(root), strict=True):
        assert_same_episode(a, b)
    check_lerobot_view(tmp_path, root, [*theirs, *ours, *last])


@pytest.mark.slow  # 15-40 s on 2 cores: LeRobot writes and decodes video; its process serves the module
@needs_lerobot
def test_lerobot_appends_to_an_upgraded_legacy_dataset(tmp_path):
    ours = [small(s, t=9) for s in range(2)]
    root = write_episodes(tmp_path / "ds", ours)
    legacy_layout(root)
    assert main(["dataset", "upgrade", str(root)]) == 0
    theirs = [lerobot_made(40, 8)]
    lerobot(tmp_path, "append", str(root), lerobot_spec(theirs, tmp_path / "theirs.npz"))
    for a, b in zip([*ours, *theirs], read_episodes(root), strict=True):
        assert_same_episode(a, b)
    check_lerobot_view(tmp_path, root, [*ours, *theirs])
