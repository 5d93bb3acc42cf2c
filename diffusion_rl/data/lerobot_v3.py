"""Episodes on disk as LeRobotDataset v3 (numpy, pyarrow and PyAV only: no torch, no lerobot).

Layout and schema follow huggingface/lerobot (main branch), so LeRobot's loader can open our datasets:
- `src/lerobot/datasets/utils.py`: path templates, `DatasetInfo` fields, chunk/file size defaults;
- `src/lerobot/utils/constants.py`: `DEFAULT_FEATURES`;
- `src/lerobot/datasets/feature_utils.py`: how features map to parquet columns (shape (1,) -> scalar column);
- `src/lerobot/datasets/dataset_metadata.py`, `dataset_writer.py`: episodes metadata columns, tasks.parquet,
  `videos/<key>/from_timestamp`/`to_timestamp` (episodes concatenated in one mp4);
- `src/lerobot/datasets/compute_stats.py`: per-episode `stats/<key>/<stat>` and their aggregation;
- `src/lerobot/datasets/video_utils.py`: `video.*` info keys; `io_utils.py`: `data/*/*.parquet` is globbed.
The stats' shapes and arrow types follow LeRobot 0.4.4 exactly (see the stats section), so that LeRobot's own writer
can append to our datasets and we to its: each tool pools the other's per-episode stats and reads the other's
meta/episodes files. Like LeRobot, every append session writes its episode rows to a meta/episodes file of its own;
earlier files (ours or LeRobot's) are never rewritten, except to drop rows of an interrupted commit and by
`upgrade_dataset`, which migrates datasets written with kinema's earlier per-element stats.

Safety: meta/info.json is the commit record and is written last (temp file + os.replace). Data and video files are
written under temporary names (`*.kinema-tmp`, which LeRobot's `*.parquet` glob ignores) and renamed only at commit.
Readers trust only the first `total_episodes` episodes in info.json. A writer opened in append mode removes files an
interrupted session left behind. Kinema-specific facts (per-step shapes, the stats layout) live in meta/kinema.json,
which also marks a folder as ours, so an unfinished kinema dataset can be recognised and is never confused with
somebody else's folder.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

import av
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from diffusion_rl.data.episode import (FORMAT_VERSION, IMAGE_PREFIX, PRIVILEGED_PREFIX, SEGMENT_NAMES, STATE_KEY,
                                       Episode, ExecutedBy)

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: writers are not guarded against each other
    fcntl = None  # type: ignore[assignment]

CODEBASE_VERSION = "v3.0"
INFO_PATH = "meta/info.json"
STATS_PATH = "meta/stats.json"
TASKS_PATH = "meta/tasks.parquet"
EPISODES_PATH = "meta/episodes/chunk-000/file-000.parquet"  # the first; each append session adds the next
EPISODES_DIR_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
KINEMA_PATH = "meta/kinema.json"
KINEMA_EPISODES_PATH = "meta/kinema_episodes.parquet"  # per-episode facts, in datasets LeRobot created (EXTRA_FIELDS)
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
DEFAULT_FEATURES: dict[str, dict[str, Any]] = {
    "timestamp": {"dtype": "float32", "shape": [1], "names": None},
    "frame_index": {"dtype": "int64", "shape": [1], "names": None},
    "episode_index": {"dtype": "int64", "shape": [1], "names": None},
    "index": {"dtype": "int64", "shape": [1], "names": None},
    "task_index": {"dtype": "int64", "shape": [1], "names": None},
}
QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}
_TMP = ".kinema-tmp"
# 90 kHz is the MPEG clock: divisible by common control rates, and fine enough (11 us) that irregular timestamps of
# real recordings survive as frame times within LeRobot's 1e-4 s lookup tolerance.
_TIME_BASE = Fraction(1, 90000)
_IMAGE_STATS_MAX_PIXELS = 20_000_000
Features = dict[str, dict[str, Any]]
Stats = dict[str, dict[str, np.ndarray]]


class IncompleteDatasetError(FileNotFoundError):
    """The folder holds a dataset whose write never finished (no meta/info.json)."""


@dataclass(frozen=True)
class VideoEncoding:
    """How camera streams are encoded. yuv420p H.264 decodes everywhere (torchcodec, PyAV, browsers).

    With crf=15, smooth 96x96 images come back within ~2 grey levels on average (max ~15). yuv420p halves chroma
    resolution, so pixels at sharp saturated colour edges can be off by ~110 whatever the crf; pix_fmt="yuv444p" cuts
    such errors ~4x (mean) at the cost of files that some hardware decoders and browsers do not play.
    gop=2 matches LeRobot's default, so that its random-access decoder seeks cheaply.
    """

    codec: str = "libx264"
    crf: int = 15
    gop: int = 2
    preset: str = "medium"
    pix_fmt: str = "yuv420p"
    threads: int = 1
    # libx264 only. Its macroblock-tree rate control is not deterministic within a process (the same frames encode to
    # different videos), so training on the decoded frames would not be reproducible; without it, encoding is
    # (benchmarks/RESULTS.md, "Runs are reproducible again").
    x264_params: str = "mbtree=0"

    def extra_options(self) -> dict[str, str]:
        return {"x264-params": self.x264_params} if self.codec == "libx264" and self.x264_params else {}

    def info(self, height: int, width: int, fps: float) -> dict[str, Any]:
        return {  # the `video.*` keys LeRobot records for each camera feature
            "video.height": height, "video.width": width, "video.codec": av.codec.Codec(self.codec, "w").canonical_name,
            "video.pix_fmt": self.pix_fmt, "video.fps": _json_fps(fps), "video.channels": 3, "video.g": self.gop,
            "video.crf": self.crf, "video.preset": self.preset, "video.fast_decode": 0, "video.video_backend": "pyav",
            "video.extra_options": self.extra_options(), "is_depth_map": False, "has_audio": False,
        }


@dataclass
class DatasetMeta:
    """What a reader knows without touching data files."""

    root: Path
    info: dict[str, Any]
    tasks: list[str]
    episodes: list[dict[str, Any]]  # one row per committed episode, without the stats/ columns
    is_kinema: bool

    @property
    def fps(self) -> float:
        return float(self.info["fps"])

    @property
    def camera_keys(self) -> list[str]:
        return [k for k, f in self.info["features"].items() if f["dtype"] == "video"]

    @property
    def total_frames(self) -> int:
        return int(self.info["total_frames"])


# ----------------------------------------------------------------------------------------------------------- helpers
def _json_fps(fps: float) -> int | float:
    return int(fps) if float(fps).is_integer() else float(fps)  # LeRobot types fps as int


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + _TMP)


def _fsync(path: Path) -> None:
    """Flush a file or folder to disk, so that a rename after it never exposes unwritten bytes after a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, payload: pa.Table | Any) -> None:
    """A parquet table or a JSON object, written to a temp name and renamed: readers see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(payload, pa.Table):
        pq.write_table(payload, _tmp(path))
    else:
        _tmp(path).write_text(json.dumps(payload, indent=4) + "\n")
    _fsync(_tmp(path))
    os.replace(_tmp(path), path)


def _load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _classify(root: Path) -> Literal["missing", "empty", "kinema", "kinema_incomplete", "lerobot", "foreign"]:
    if not root.exists():
        return "missing"
    if not root.is_dir():
        return "foreign"
    if not any(root.iterdir()):
        return "empty"
    if (root / INFO_PATH).is_file():
        return "kinema" if (root / KINEMA_PATH).is_file() else "lerobot"
    return "kinema_incomplete" if (root / KINEMA_PATH).is_file() else "foreign"


def load_info(root: str | Path) -> dict[str, Any]:
    """meta/info.json of a complete dataset; refuses folders whose write never finished."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no dataset at {root}: the folder does not exist")
    if not (root / INFO_PATH).is_file():
        raise IncompleteDatasetError(
            f"incomplete dataset: {root} has no {INFO_PATH}; its write was interrupted before it finished "
            f"(or it is not a LeRobot dataset). Reopen it with mode='a' or overwrite=True to start again.")
    info = _load_json(root / INFO_PATH)
    if info.get("codebase_version") != CODEBASE_VERSION:
        raise ValueError(f"{root / INFO_PATH}: codebase_version {info.get('codebase_version')!r} is not supported; "
                         f"expected {CODEBASE_VERSION!r} (LeRobotDataset v3)")
    return info


def _arrow_type(dtype: str, shape: Sequence[int]) -> pa.DataType:
    t = pa.from_numpy_dtype(np.dtype(dtype))
    if list(shape) == [1]:  # LeRobot stores shape-(1,) features as plain scalars (datasets.Value)
        return t
    for d in reversed(shape):  # what `datasets` writes for List(length=d) / Array2D
        t = pa.list_(t, d)
    return t


def _to_arrow(values: np.ndarray, dtype: str, shape: Sequence[int]) -> pa.Array:
    arr: pa.Array = pa.array(np.ascontiguousarray(values, dtype=np.dtype(dtype)).reshape(-1))
    for d in (reversed(shape) if list(shape) != [1] else ()):
        arr = pa.FixedSizeListArray.from_arrays(arr, d)
    return arr


def _from_arrow(column: pa.ChunkedArray, step_shape: Sequence[int]) -> np.ndarray:
    arr = column.combine_chunks()
    n = len(arr)
    while pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type):
        arr = arr.flatten()  # honours slice offsets, unlike .values
    return arr.to_numpy(zero_copy_only=False).reshape((n, *step_shape))


# ------------------------------------------------------------------------------------------------------------- stats
# The stats convention is LeRobot 0.4.4's (`compute_stats.compute_episode_stats` / `get_feature_stats`,
# `aggregate_stats`; the metadata writer `LeRobotDatasetMetadata._flush_metadata_buffer` infers the arrow types):
# - a camera: per-channel stats in [0, 1] of shape (3, 1, 1); every stat a list<list<list<double>>>;
# - any other feature: every axis but the last is reduced, so a scalar gives shape (1,), a vector (D,) and a feature
#   of shape (..., D) gives (D,); `min`/`max` keep the feature's kind (list<int64> for ints, list<bool> for bools,
#   list<double> for floats); mean, std and the quantiles are list<double>;
# - `count` (list<int64>, shape (1,)) is the number of frames, also for multi-dimensional features;
# - pooled over episodes: count-weighted mean and variance, exact min/max, count-weighted mean of the quantiles.
STATS_LAYOUT = "lerobot-0.4"  # recorded in meta/kinema.json; earlier kinema datasets have none (per-element stats)
_STAT_NAMES = ("min", "max", "mean", "std", *QUANTILES, "count")


def _native_kind(dtype: str) -> str:
    kind = np.dtype(dtype).kind
    return "bool" if kind == "b" else "int" if kind in "iu" else "float"


def _stats_arrow_type(feature: Mapping[str, Any], stat: str) -> pa.DataType:
    if stat == "count":
        return pa.list_(pa.int64())
    if feature["dtype"] in ("video", "image"):
        return pa.list_(pa.list_(pa.list_(pa.float64())))
    if stat in ("min", "max"):
        return pa.list_({"bool": pa.bool_(), "int": pa.int64(), "float": pa.float64()}[_native_kind(feature["dtype"])])
    return pa.list_(pa.float64())


def _array_stats(values: np.ndarray, dtype: str, shape: Sequence[int]) -> dict[str, np.ndarray]:
    """Per-episode stats of a non-camera feature, reduced over frames and every axis but the last (LeRobot's way)."""
    values = np.asarray(values)
    rows = values.astype(np.dtype(dtype), copy=False).reshape(-1, int(shape[-1]))
    x = rows.astype(np.float64)
    quant = np.quantile(x, list(QUANTILES.values()), axis=0)
    stats = {"min": rows.min(0), "max": rows.max(0), "mean": x.mean(0), "std": x.std(0),
             "count": np.array([len(values)], dtype=np.int64)}
    return stats | {k: quant[i] for i, k in enumerate(QUANTILES)}


def _image_stats(frames: np.ndarray) -> dict[str, np.ndarray]:
    """Per-channel stats in [0, 1] of shape (3, 1, 1), as LeRobot stores them for cameras.

    uint8 pixels give exact statistics from a 256-bin histogram, much cheaper than sorting for quantiles. Long episodes
    of large frames are subsampled evenly, as LeRobot does; `count` is the number of frames used.
    """
    t, h, w, _ = frames.shape
    if t * h * w > _IMAGE_STATS_MAX_PIXELS:
        frames = frames[np.linspace(0, t - 1, max(1, _IMAGE_STATS_MAX_PIXELS // (h * w))).round().astype(int)]
    flat = frames.reshape(-1, 3)
    hist = np.stack([np.bincount(flat[:, c], minlength=256) for c in range(3)]).astype(np.float64)
    levels, n = np.arange(256) / 255.0, hist.sum(1)
    mean = hist @ levels / n
    cdf, seen = np.cumsum(hist, 1) / n[:, None], hist > 0
    stats = {"min": levels[seen.argmax(1)], "max": levels[255 - seen[:, ::-1].argmax(1)], "mean": mean,
             "std": np.sqrt(np.maximum(hist @ levels**2 / n - mean**2, 0.0))}
    stats |= {k: levels[[np.searchsorted(cdf[c], q - 1e-12) for c in range(3)]] for k, q in QUANTILES.items()}
    return {k: v.reshape(3, 1, 1) for k, v in stats.items()} | {"count": np.array([len(frames)], dtype=np.int64)}


def _aggregate_stats(per_episode: Sequence[Mapping[str, Mapping[str, np.ndarray]]]) -> Stats:
    """Pooled mean/variance weighted by count; exact min/max (in the feature's kind); quantiles as the count-weighted
    mean of the per-episode quantiles, as LeRobot 0.4.4 pools them."""
    out: Stats = {}
    for key in dict.fromkeys(k for s in per_episode for k in s):
        items = [s[key] for s in per_episode if key in s]
        counts = np.array([float(np.ravel(s["count"])[0]) for s in items])
        w = (counts / counts.sum()).reshape((-1,) + (1,) * np.ndim(items[0]["mean"]))
        means = np.stack([np.asarray(s["mean"], dtype=np.float64) for s in items])
        mean = (w * means).sum(0)
        stds = np.stack([np.asarray(s["std"], dtype=np.float64) for s in items])
        var = (w * (stds**2 + (means - mean) ** 2)).sum(0)
        out[key] = {"min": np.min(np.stack([s["min"] for s in items]), 0),
                    "max": np.max(np.stack([s["max"] for s in items]), 0),
                    "mean": mean, "std": np.sqrt(var), "count": np.array([int(counts.sum())], dtype=np.int64)}
        for q in QUANTILES:
            if all(q in s for s in items):
                out[key][q] = (w * np.stack([np.asarray(s[q], dtype=np.float64) for s in items])).sum(0)
    return out


def _stats_from_row(row: Mapping[str, Any]) -> Stats:
    """Per-episode stats from a meta/episodes row; min/max keep their stored kind (int, bool or float)."""
    stats: Stats = {}
    for col, value in row.items():
        if col.startswith("stats/") and value is not None:
            key, stat = col[len("stats/"):].rsplit("/", 1)
            arr = np.asarray(value)
            stats.setdefault(key, {})[stat] = arr.astype(np.int64 if stat == "count" else arr.dtype if stat in (
                "min", "max") else np.float64)
    return stats


def _stats_to_json(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, dict[str, Any]]:
    return {k: {s: np.asarray(v).tolist() for s, v in st.items()} for k, st in stats.items()}


def _stats_layout_ok(features: Features, stats: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether stats (of one episode, or pooled) have LeRobot's shapes: (3, 1, 1) for cameras, (last dim,) else."""
    for key, st in stats.items():
        f = features.get(key)
        if f is None:
            continue
        want = (3, 1, 1) if f["dtype"] in ("video", "image") else (int(f["shape"][-1]),)
        if any(np.shape(v) != want for s, v in st.items() if s != "count"):
            return False
    return True


def _reduce_legacy_stats(features: Features, stats: Mapping[str, Mapping[str, Any]]) -> Stats:
    """Stats of a kinema dataset written before STATS_LAYOUT (per element, shape (..., D)) in LeRobot's shape (D,).

    Every element of a feature has the same count, so min, max, mean and std reduce exactly; a quantile becomes the
    mean of the per-element quantiles (LeRobot's pooling rule for quantiles), an approximation. Rewriting the stats
    from the data (`upgrade_dataset`) is exact.
    """
    out: Stats = {}
    for key, st in stats.items():
        arrays = {s: np.asarray(v, dtype=np.int64 if s == "count" else np.float64) for s, v in st.items()}
        f = features.get(key)
        if f is None or f["dtype"] in ("video", "image") or "mean" not in arrays:
            out[key] = arrays
            continue
        d = int(f["shape"][-1])
        flat = {s: v.reshape(-1, d) for s, v in arrays.items() if s != "count"}
        mean = flat["mean"].mean(0)
        red = {"min": flat["min"].min(0), "max": flat["max"].max(0), "mean": mean,
               "std": np.sqrt((flat["std"] ** 2 + (flat["mean"] - mean) ** 2).mean(0))}
        red |= {q: flat[q].mean(0) for q in QUANTILES if q in flat}
        out[key] = red | {"count": arrays["count"].reshape(1)}
    return out


# ---------------------------------------------------------------------------------------- episode <-> feature columns
def _step_columns(ep: Episode) -> dict[str, np.ndarray]:
    """Every per-frame array of an episode except cameras and LeRobot's default columns, in info.json order."""
    done = np.zeros(len(ep), dtype=bool)
    done[-1:] = True
    others = sorted(k for k in ep.observations if not k.startswith(IMAGE_PREFIX) and k != STATE_KEY)
    return {STATE_KEY: ep.observations[STATE_KEY], **{k: ep.observations[k] for k in others}, "action": ep.action,
            "next.reward": ep.reward, "next.done": done, "success": ep.success,
            "intervention": np.asarray(ep.executed_by) == ExecutedBy.HUMAN, "segment": ep.segment,
            **{k: ep.privileged[k] for k in sorted(ep.privileged)}}  # type: ignore[dict-item]


def _default_names(key: str, step: Sequence[int]) -> list[str] | None:
    leaf = {"next.reward": "reward", "next.done": "done"}.get(key, key.rsplit(".", 1)[-1])
    if len(step) == 0:
        return [leaf]
    return [f"{leaf}_{i}" for i in range(step[0])] if len(step) == 1 else None


def _infer_features(ep: Episode, fps: float, video: VideoEncoding,
                    names: Mapping[str, Sequence[str]] | None) -> tuple[Features, dict[str, list[int]]]:
    features: Features = {}
    for cam in ep.camera_keys:
        h, w = ep.observations[cam].shape[1:3]
        features[cam] = {"dtype": "video", "shape": [h, w, 3], "names": ["height", "width", "channels"],
                         "info": video.info(h, w, fps)}
    step_shapes = {key: list(arr.shape[1:]) for key, arr in _step_columns(ep).items()}
    for key, arr in _step_columns(ep).items():
        step = step_shapes[key]
        features[key] = {"dtype": str(arr.dtype), "shape": step or [1], "names": _default_names(key, step)}
    for key, key_names in (names or {}).items():
        shape = features.get(key, {}).get("shape")
        if shape is None or features[key]["dtype"] == "video" or len(shape) != 1 or len(key_names) != shape[0]:
            raise ValueError(f"names for {key!r}: expected one name per dimension of a 1-D per-step feature "
                             f"(shape {shape}); got {len(key_names)} names")
        features[key]["names"] = list(key_names)
    return features | copy.deepcopy(DEFAULT_FEATURES), step_shapes


# kinema's per-episode facts. They are columns of meta/episodes where the dataset's first meta/episodes file has them
# (datasets kinema created); in a dataset LeRobot created they go to KINEMA_EPISODES_PATH instead, because LeRobot's
# loader (`datasets`) casts every meta/episodes file to the columns of the first and refuses columns it lacks.
EXTRA_FIELDS: dict[str, pa.DataType] = {
    "outcome": pa.bool_(), "task_id": pa.string(), "seed": pa.int64(), "policy_version": pa.string(),
    "complete": pa.bool_(), "steps_to_success": pa.int64(), "intervened": pa.bool_()}


def _extras_schema() -> pa.Schema:
    return pa.schema([("episode_index", pa.int64()), *EXTRA_FIELDS.items()])


def _episodes_schema(features: Features, extras: bool = True) -> pa.Schema:
    i64, f64 = pa.int64(), pa.float64()
    fields: list[tuple[str, pa.DataType]] = [
        ("episode_index", i64), ("tasks", pa.list_(pa.string())), ("length", i64), ("data/chunk_index", i64),
        ("data/file_index", i64), ("dataset_from_index", i64), ("dataset_to_index", i64)]
    for key in (k for k, f in features.items() if f["dtype"] == "video"):
        fields += [(f"videos/{key}/chunk_index", i64), (f"videos/{key}/file_index", i64),
                   (f"videos/{key}/from_timestamp", f64), (f"videos/{key}/to_timestamp", f64)]
    fields += [("meta/episodes/chunk_index", i64), ("meta/episodes/file_index", i64)]
    fields += list(EXTRA_FIELDS.items()) if extras else []
    for key, f in features.items():
        fields += [(f"stats/{key}/{stat}", _stats_arrow_type(f, stat)) for stat in _STAT_NAMES]
    return pa.schema(fields)


def _tasks_table(tasks: Sequence[str]) -> pa.Table:
    # pandas metadata makes `task` the index, which is what LeRobot's `pd.read_parquet` + `tasks.loc[task]` expect.
    column = {"field_name": None, "metadata": None}
    pandas_meta = {
        "index_columns": ["task"],
        "column_indexes": [{"name": None, "field_name": None, "pandas_type": "unicode", "numpy_type": "object",
                            "metadata": {"encoding": "UTF-8"}}],
        "columns": [column | {"name": "task_index", "field_name": "task_index", "pandas_type": "int64",
                              "numpy_type": "int64"},
                    column | {"name": "task", "field_name": "task", "pandas_type": "unicode", "numpy_type": "object"}],
        "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.3"}
    schema = pa.schema([("task_index", pa.int64()), ("task", pa.string())],
                       metadata={b"pandas": json.dumps(pandas_meta).encode()})
    return pa.table({"task_index": list(range(len(tasks))), "task": list(tasks)}, schema=schema)


def _read_tasks(root: Path) -> list[str]:
    if not (root / TASKS_PATH).is_file():
        return []
    table = pq.read_table(root / TASKS_PATH)
    name = "task"
    if name not in table.column_names:  # a task index that pandas wrote without a name
        meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
        name = (meta.get("index_columns") or ["__index_level_0__"])[0]
    by_index = dict(zip(table.column("task_index").to_pylist(), table.column(name).to_pylist(), strict=True))
    return [by_index[i] for i in sorted(by_index)]


def _read_episode_rows(root: Path, total: int, with_stats: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in sorted((root / "meta/episodes").glob("*/*.parquet")):
        cols = [c for c in pq.read_schema(path).names if with_stats or not c.startswith("stats/")]
        rows += [r for r in pq.read_table(path, columns=cols).to_pylist() if r["episode_index"] < total]
    rows.sort(key=lambda r: r["episode_index"])
    if [r["episode_index"] for r in rows] != list(range(total)):
        raise ValueError(f"dataset {root} is corrupt: meta/episodes does not hold episodes 0..{total - 1}")
    for extra in _read_extras(root, total):
        rows[extra["episode_index"]] |= extra
    return rows


def _read_extras(root: Path, total: int) -> list[dict[str, Any]]:
    """kinema's per-episode facts kept beside meta/episodes (see EXTRA_FIELDS); committed episodes only."""
    path = root / KINEMA_EPISODES_PATH
    if not path.is_file():
        return []
    return [r for r in pq.read_table(path).to_pylist() if r["episode_index"] < total]


def _step_shapes_for(root: Path, features: Features) -> dict[str, list[int]]:
    shapes = dict(_load_json(root / KINEMA_PATH).get("step_shapes", {})) if (root / KINEMA_PATH).is_file() else {}
    for key, f in features.items():
        if key not in shapes and f["dtype"] not in ("video", "image"):
            # A foreign dataset: shape (1,) is a scalar column, except for the (T, D) arrays of the Episode contract.
            shapes[key] = [] if list(f["shape"]) == [1] and key not in (STATE_KEY, "action") else list(f["shape"])
    return shapes


def _kinema_json(step_shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """meta/kinema.json. `step_shapes` holds the Episode's own per-step arrays only (LeRobot's default columns have
    fixed shapes), so the file is the same whether a dataset was written in one session or appended to."""
    return {"format": "kinema.episodes", "format_version": FORMAT_VERSION, "stats_layout": STATS_LAYOUT,
            "step_shapes": {k: list(v) for k, v in step_shapes.items() if k not in DEFAULT_FEATURES},
            "segment_names": list(SEGMENT_NAMES), "executed_by_names": [e.name.lower() for e in ExecutedBy]}


def _episode_files(root: Path) -> list[Path]:
    return sorted((root / "meta/episodes").glob("*/*.parquet"))


def _file_counter(path: Path, chunks_size: int) -> int:
    """chunk * chunks_size + file of a `chunk-XXX/file-YYY.*` path (LeRobot moves to the next chunk at chunks_size)."""
    chunk, file = int(path.parent.name.split("-")[-1]), int(path.name.split(".")[0].split("-")[-1])
    return chunk * chunks_size + file


# -------------------------------------------------------------------------------------------------------------- video
class _VideoFile:
    """One mp4 being written; episodes go in back to back, as LeRobot v3 concatenates them."""

    def __init__(self, final: Path, fps: float, enc: VideoEncoding, height: int, width: int) -> None:
        self.final, self.tmp, self.fps, self.end = final, _tmp(final), fps, 0.0
        final.parent.mkdir(parents=True, exist_ok=True)
        self.container = av.open(str(self.tmp), mode="w", format="mp4")
        # No B-frames: presentation order == decode order, so frame times are exactly the pts we set.
        options = {"crf": str(enc.crf), "g": str(enc.gop), "bf": "0", "preset": enc.preset, "threads": str(enc.threads),
                   **enc.extra_options()}
        self.stream = self.container.add_stream(enc.codec, rate=Fraction(fps).limit_denominator(1001), options=options)
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, enc.pix_fmt
        self.stream.time_base = _TIME_BASE
        self.stream.codec_context.time_base = _TIME_BASE  # else pts get rounded to 1/fps: irregular stamps collide

    def add(self, frames: np.ndarray, timestamps: np.ndarray) -> tuple[float, float]:
        """Frame t sits at from_timestamp + timestamp[t], which is where LeRobot looks it up."""
        start = self.end
        for img, ts in zip(frames, timestamps, strict=True):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(img), format="rgb24")
            frame.pts, frame.time_base = round((start + float(ts)) / _TIME_BASE), _TIME_BASE
            for packet in self.stream.encode(frame):
                self.container.mux(packet)
        self.end = start + float(timestamps[-1]) + 1.0 / self.fps
        return start, self.end

    def close(self) -> None:
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()


def _decode_window(path: Path, start: float, stop: float, fps: float) -> np.ndarray:
    """Frames whose time lies in [start, stop), shifted half a frame early to absorb rounding of pts."""
    lo, hi = start - 0.5 / fps, stop - 0.5 / fps
    frames = []
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.codec_context.thread_count = 1
        if start > 0:
            container.seek(int(lo / stream.time_base), stream=stream, backward=True)
        for frame in container.decode(stream):
            t = float(frame.pts * stream.time_base)
            if t >= hi:
                break
            if t >= lo:
                frames.append(frame.to_ndarray(format="rgb24"))
    if not frames:
        raise ValueError(f"video {path} has no frames in [{start:.4f}, {stop:.4f}) s")
    return np.stack(frames)


# ------------------------------------------------------------------------------------------------------------- writer
class _FileSet:
    """The data parquet and the per-camera mp4s of one file index, under temp names; they roll over together."""

    def __init__(self, root: Path, counter: int, chunks_size: int, features: Features, fps: float,
                 enc: VideoEncoding) -> None:
        self.chunk, self.file = divmod(counter, chunks_size)
        idx = {"chunk_index": self.chunk, "file_index": self.file}
        self.data = root / DATA_PATH.format(**idx)
        self.data.parent.mkdir(parents=True, exist_ok=True)
        schema = pa.schema([(k, _arrow_type(f["dtype"], f["shape"])) for k, f in features.items()
                            if f["dtype"] != "video"])
        self.writer, self.data_mb = pq.ParquetWriter(_tmp(self.data), schema), 0.0
        self.videos = {k: _VideoFile(root / VIDEO_PATH.format(video_key=k, **idx), fps, enc, *f["shape"][:2])
                       for k, f in features.items() if f["dtype"] == "video"}

    def full(self, data_mb: float, video_mb: float) -> bool:
        return self.data_mb >= data_mb or any(v.tmp.stat().st_size / 2**20 >= video_mb for v in self.videos.values())

    def close(self) -> list[tuple[Path, Path]]:
        self.writer.close()
        for v in self.videos.values():
            v.close()
        done = [(_tmp(self.data), self.data)] + [(v.tmp, v.final) for v in self.videos.values()]
        for tmp, _ in done:
            _fsync(tmp)
        return done

    def discard(self) -> None:
        for closer in [self.writer.close, *(v.container.close for v in self.videos.values())]:
            with contextlib.suppress(Exception):  # already broken; the files go anyway
                closer()
        for path in [_tmp(self.data), *(v.tmp for v in self.videos.values())]:
            path.unlink(missing_ok=True)


class LeRobotDatasetWriter:
    """Writes Episodes as a LeRobotDataset v3; a context manager.

    mode="w" creates a dataset (refusing an existing one unless overwrite=True); mode="a" appends to a kinema or
    LeRobot dataset whose features match the episodes' (or creates it). Episodes become durable at `commit()` or
    `close()`; an exception inside the `with` block, or a killed process, discards the uncommitted ones and leaves the
    last committed state (or, for a dataset never committed, a folder that readers reject as incomplete). Every commit
    writes new file indices: existing data and video files are never rewritten. Features are inferred from the first
    episode; `names` sets LeRobot's per-dimension names (e.g. joint names for `observation.state` and `action`).
    `source`, a JSON-able record of where this session's episodes came from (an importer's conventions, say), is
    appended to meta/kinema.json's `sources` list.
    """

    def __init__(self, root: str | Path, *, fps: float | None = None, mode: Literal["w", "a"] = "w",
                 overwrite: bool = False, robot_type: str = "kinema_panda",
                 names: Mapping[str, Sequence[str]] | None = None, video: VideoEncoding = VideoEncoding(),
                 chunks_size: int = 1000, data_files_size_in_mb: float = 100,
                 video_files_size_in_mb: float = 200, source: Mapping[str, Any] | None = None) -> None:
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a'; got {mode!r}")
        self.root = Path(root)
        kind = _classify(self.root)
        if kind == "foreign":
            raise FileExistsError(
                f"refusing to write a dataset at {self.root}: it exists and is not empty, but is not a LeRobot or "
                f"kinema dataset (expected {INFO_PATH} or {KINEMA_PATH}). Nothing in it was changed.")
        if kind in ("kinema", "kinema_incomplete", "lerobot") and mode == "w" and not overwrite:
            raise FileExistsError(f"{self.root} already holds a dataset; pass overwrite=True to replace it, "
                                  f"or mode='a' to append")
        self._fps, self._video, self._names, self._robot_type = fps, video, names, robot_type
        self._sizes = {"chunks_size": chunks_size, "data_files_size_in_mb": data_files_size_in_mb,
                       "video_files_size_in_mb": video_files_size_in_mb}
        self._features: Features | None = None
        self._step_shapes: dict[str, list[int]] = {}
        self._rows: list[dict[str, Any]] = []  # committed episodes (episodes-table rows)
        self._session_rows: list[dict[str, Any]] = []  # the committed ones in this session's meta/episodes file
        self._meta_counter = 0  # this session's meta/episodes file: chunk * chunks_size + file
        self._row_extras = True  # EXTRA_FIELDS as meta/episodes columns (else in KINEMA_EPISODES_PATH)
        self._extra_info: dict[str, Any] = {}  # info.json keys kinema does not write itself, kept as found
        self._kinema_extra: dict[str, Any] = {}  # meta/kinema.json keys beyond _kinema_json's, kept as found
        self._source = None if source is None else json.loads(json.dumps(dict(source)))
        self._stats: Stats = {}  # aggregate over committed episodes
        self._new_rows: list[dict[str, Any]] = []
        self._new_stats: list[Stats] = []
        self._tasks: dict[str, int] = {}
        self._n_committed_tasks = self._frames = self._next_counter = 0
        self._files: _FileSet | None = None
        self._pending: list[tuple[Path, Path]] = []  # closed files still under temp names: (temp, final)
        self._dirty = self._closed = False
        self._lock_fd: int | None = None
        existing = mode == "a" and kind in ("kinema", "lerobot")
        self._fresh, self._made_root = not existing, kind == "missing"
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            if existing:
                _upgrade_locked(self.root)  # a kinema dataset of an earlier stats layout: migrate its metadata first
                self._load_existing()
            else:
                for sub in ("data", "videos", "meta", "images"):  # only a recognised dataset gets here
                    shutil.rmtree(self.root / sub, ignore_errors=True)
                _atomic_write(self.root / KINEMA_PATH, self._kinema_json())
        except BaseException:
            self._closed = True  # nothing to abort: keep __del__ away from a half-built writer
            self._unlock()
            raise

    @classmethod
    def open_append(cls, root: str | Path, **kwargs: Any) -> LeRobotDatasetWriter:
        """Append to a kinema or LeRobot dataset (creating it if absent); also repairs what an interrupted session
        left, and migrates the metadata of a kinema dataset written with an earlier stats layout (`upgrade_dataset`)."""
        return cls(root, mode="a", **kwargs)

    @property
    def num_episodes(self) -> int:
        return len(self._rows) + len(self._new_rows)

    @property
    def features(self) -> Features | None:
        return copy.deepcopy(self._features)

    def add_episode(self, ep: Episode) -> int:
        """Validate and write one episode; returns its episode_index. Bad input raises ValueError and writes nothing."""
        if self._closed:
            raise RuntimeError(f"writer for {self.root} is closed")
        if not isinstance(ep, Episode):
            raise TypeError(f"add_episode expects an Episode; got {type(ep).__name__}")
        if len(ep) == 0:
            raise ValueError("episode has no steps; LeRobot datasets cannot hold empty episodes")
        if self._features is None:  # the first episode defines the features; adopt them only once it validates
            fps = float(self._fps if self._fps is not None else ep.fps)
            features, step_shapes = _infer_features(ep, fps, self._video, self._names)
            self._validate(ep, features, fps)
            self._fps, self._features, self._step_shapes = fps, features, step_shapes
        else:
            self._validate(ep, self._features, float(self._fps))  # type: ignore[arg-type]
        try:
            self._write(ep)
        except BaseException:
            self.abort()  # a half-written episode may sit in the open files
            raise
        return self.num_episodes - 1

    def commit(self) -> None:
        """Make every episode added so far durable: finish the open files and write the metadata, info.json last."""
        if self._closed:
            raise RuntimeError(f"writer for {self.root} is closed")
        if self._files is not None:
            self._pending += self._files.close()
            self._files = None
        if self._features is None or not (self._new_rows or self._dirty):
            return
        rows, session = self._rows + self._new_rows, self._session_rows + self._new_rows
        stats = _aggregate_stats(([self._stats] if self._stats else []) + self._new_stats)
        frames = self._frames + sum(r["length"] for r in self._new_rows)
        for tmp, final in self._pending:  # data first: metadata never points at a file that is not there
            os.replace(tmp, final)
        self._write_meta(rows, session, list(self._tasks), stats, with_source=bool(self._new_rows))
        _atomic_write(self.root / INFO_PATH, self._info(len(rows), frames, len(self._tasks)))  # the commit point
        if self._new_rows and self._source is not None:  # recorded once per session
            self._kinema_extra["sources"] = [*self._kinema_extra.get("sources", []), self._source]
            self._source = None
        self._rows, self._session_rows, self._new_rows, self._new_stats, self._pending = rows, session, [], [], []
        self._stats, self._frames, self._n_committed_tasks, self._dirty = stats, frames, len(self._tasks), False
        with contextlib.suppress(OSError):  # folders cannot be opened for fsync on some systems (Windows)
            _fsync(self.root / "meta")

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._unlock()
        self._forget_if_unused()

    finalize = close

    def abort(self) -> None:
        """Drop uncommitted episodes; the dataset stays as of the last commit."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._files is not None:
                self._files.discard()
            for tmp, final in self._pending:  # uncommitted: info.json does not count them
                tmp.unlink(missing_ok=True)
                final.unlink(missing_ok=True)
            if self._rows and self._pending:  # a failed commit may have rewritten the metadata already
                self._write_meta(self._rows, self._session_rows, list(self._tasks)[: self._n_committed_tasks],
                                 self._stats)
        except Exception:
            pass  # best effort: the next append session repairs the rest
        finally:
            self._unlock()
        self._forget_if_unused()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # an abandoned writer counts as interrupted: drop temp files, unlock
            self.abort()

    def __enter__(self) -> LeRobotDatasetWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close() if exc_type is None else self.abort()

    # ------------------------------------------------------------------------------------------------ internals
    def _forget_if_unused(self) -> None:
        # A new dataset that never accepted an episode has no features to describe: leave the folder as we found it.
        if self._fresh and self._features is None:
            (self.root / KINEMA_PATH).unlink(missing_ok=True)
            for folder in [self.root / "meta"] + ([self.root] if self._made_root else []):
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()

    def _lock(self) -> None:
        # flock on the folder itself: no lock file to leave behind, and the kernel releases it if we are killed.
        if fcntl is not None:
            self._lock_fd = os.open(self.root, os.O_RDONLY)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._unlock()
                raise RuntimeError(f"{self.root} is being written by another writer (process)") from None

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    _info_keys = ("codebase_version", "robot_type", "total_episodes", "total_frames", "total_tasks", "chunks_size",
                  "data_files_size_in_mb", "video_files_size_in_mb", "fps", "splits", "data_path", "video_path",
                  "features")

    def _kinema_json(self, with_source: bool = False) -> dict[str, Any]:
        extra = dict(self._kinema_extra)
        if with_source and self._source is not None:
            extra["sources"] = [*extra.get("sources", []), self._source]
        return extra | _kinema_json(self._step_shapes)

    def _info(self, episodes: int, frames: int, tasks: int) -> dict[str, Any]:
        assert self._features is not None and self._fps is not None
        has_video = any(f["dtype"] == "video" for f in self._features.values())
        return self._extra_info | {
            "codebase_version": CODEBASE_VERSION, "robot_type": self._robot_type, "total_episodes": episodes,
            "total_frames": frames, "total_tasks": tasks, **self._sizes, "fps": _json_fps(self._fps),
            "splits": {"train": f"0:{episodes}"}, "data_path": DATA_PATH,
            "video_path": VIDEO_PATH if has_video else None, "features": self._features}

    def _load_existing(self) -> None:
        info = load_info(self.root)
        if self._fps is not None and abs(float(self._fps) - float(info["fps"])) > 1e-9:
            raise ValueError(f"fps: the dataset at {self.root} has fps={info['fps']}, got fps={self._fps}")
        for key, f in info["features"].items():
            if f["dtype"] == "image":
                raise ValueError(f"cannot append to {self.root}: feature {key!r} stores images in parquet, which "
                                 f"kinema does not write; expected 'video'")
        for key, ours in (("data_path", DATA_PATH), ("video_path", VIDEO_PATH)):
            if info.get(key) not in (None, ours):
                raise ValueError(f"cannot append to {self.root}: its {key} is {info[key]!r}; kinema writes {ours!r}")
        self._fps, self._robot_type = float(info["fps"]), info.get("robot_type") or self._robot_type
        self._sizes = {k: info.get(k, v) for k, v in self._sizes.items()}
        self._extra_info = {k: v for k, v in info.items() if k not in self._info_keys}
        self._features = info["features"]
        self._step_shapes = _step_shapes_for(self.root, info["features"])
        if (self.root / KINEMA_PATH).is_file():
            standard = _kinema_json({})
            self._kinema_extra = {k: v for k, v in _load_json(self.root / KINEMA_PATH).items() if k not in standard}
        total, chunks = int(info["total_episodes"]), int(self._sizes["chunks_size"])
        # meta/episodes files: committed rows only. A file an interrupted commit left is rewritten without its
        # uncommitted rows (or removed), so that LeRobot, which reads every row, sees what kinema sees.
        episode_files, meta_counters, repaired = [], [-1], False
        for path in _episode_files(self.root):
            table = pq.read_table(path)
            keep = pc.less(table.column("episode_index"), total)
            if pc.all(keep).as_py():
                episode_files.append(table)
                meta_counters.append(_file_counter(path, chunks))
            elif pc.any(keep).as_py():
                episode_files.append(table.filter(keep))
                meta_counters.append(_file_counter(path, chunks))
                _atomic_write(path, episode_files[-1])
                repaired = True
            else:
                path.unlink()
                repaired = True
        self._rows = sorted((r for t in episode_files for r in t.to_pylist()), key=lambda r: r["episode_index"])
        if [r["episode_index"] for r in self._rows] != list(range(total)):
            raise ValueError(f"dataset {self.root} is corrupt: meta/episodes does not hold episodes 0..{total - 1}")
        for extra in _read_extras(self.root, total):
            self._rows[extra["episode_index"]] |= extra
        self._row_extras = not episode_files or set(EXTRA_FIELDS) <= set(episode_files[0].column_names)
        self._meta_counter = max(meta_counters) + 1  # a new meta/episodes file per session, as LeRobot does
        tasks = _read_tasks(self.root)
        self._tasks = {t: i for i, t in enumerate(tasks[: info["total_tasks"]])}
        self._n_committed_tasks, self._frames = len(self._tasks), int(info["total_frames"])
        try:
            self._stats = _aggregate_stats([_stats_from_row(r) for r in self._rows]) if self._rows else {}
        except ValueError as err:  # np.stack of stats of different shapes
            raise ValueError(f"cannot append to {self.root}: the per-episode stats in meta/episodes do not share "
                             f"one layout ({err})") from None
        # Remove what an interrupted session left: temp files, and files that no committed episode references.
        keep, counters = set(), [-1]
        for r in self._rows:
            refs = [("data", r["data/chunk_index"], r["data/file_index"])]
            refs += [(k, r[f"videos/{k}/chunk_index"], r[f"videos/{k}/file_index"]) for k in info["features"]
                     if r.get(f"videos/{k}/chunk_index") is not None]
            for key, c, f in refs:
                path = DATA_PATH if key == "data" else VIDEO_PATH
                keep.add(self.root / path.format(video_key=key, chunk_index=c, file_index=f))
                counters.append(c * chunks + f)
        stale = list(self.root.rglob(f"*{_TMP}"))
        stale += [p for p in [*self.root.glob("data/*/*.parquet"), *self.root.glob("videos/*/*/*.mp4")]
                  if p not in keep]
        for p in stale:
            p.unlink(missing_ok=True)
        on_disk = _load_json(self.root / STATS_PATH) if (self.root / STATS_PATH).is_file() else {}
        count = on_disk.get("index", {}).get("count")
        self._dirty = (bool(stale) or repaired or len(tasks) != len(self._tasks)
                       or (count is not None and int(np.ravel(count)[0]) != self._frames))
        self._next_counter = max(counters) + 1

    def _validate(self, ep: Episode, features: Features, fps: float) -> None:
        if abs(float(ep.fps) - fps) > 1e-6:
            raise ValueError(f"Episode.fps: the dataset at {self.root} records at {fps} Hz; got {ep.fps}")
        got: dict[str, tuple[str, list[int]]] = {}
        for cam in ep.camera_keys:
            h, w, _ = ep.observations[cam].shape[1:]
            if h % 2 or w % 2:
                raise ValueError(f"{cam}: yuv420p video needs even height and width; got {h}x{w}")
            got[cam] = ("video", [h, w, 3])
        got |= {key: (str(arr.dtype), list(arr.shape[1:]) or [1]) for key, arr in _step_columns(ep).items()}
        expected = {k: (f["dtype"], list(f["shape"])) for k, f in features.items() if k not in DEFAULT_FEATURES}
        for key in expected.keys() - got.keys():
            raise ValueError(f"episode lacks feature {key!r}: the dataset expects {expected[key][0]} of per-step "
                             f"shape {expected[key][1]}")
        for key in got.keys() - expected.keys():
            raise ValueError(f"episode has feature {key!r} ({got[key][0]} {got[key][1]}) that the dataset lacks")
        for key, (dtype, shape) in expected.items():
            if got[key] != (dtype, shape):
                raise ValueError(f"feature {key!r}: expected {dtype} of per-step shape {shape}, "
                                 f"got {got[key][0]} of per-step shape {got[key][1]}")
        ts = np.asarray(ep.timestamp, dtype=np.float64)
        if not np.all(np.isfinite(ts)) or ts[0] < 0 or np.any(np.diff(np.round(ts / float(_TIME_BASE))) <= 0):
            raise ValueError("timestamp: expected finite, non-negative seconds that increase at every step")

    def _write(self, ep: Episode) -> None:
        assert self._features is not None and self._fps is not None
        if self._files is not None and self._files.full(self._sizes["data_files_size_in_mb"],
                                                        self._sizes["video_files_size_in_mb"]):
            self._pending += self._files.close()
            self._files = None
        if self._files is None:
            self._files = _FileSet(self.root, self._next_counter, self._sizes["chunks_size"], self._features,
                                   self._fps, self._video)
            self._next_counter += 1
        files = self._files
        n, index, start = len(ep), self.num_episodes, self._frames + sum(r["length"] for r in self._new_rows)
        task_index = self._tasks.get(ep.task, len(self._tasks))
        values = {**_step_columns(ep), "timestamp": ep.timestamp, "frame_index": np.arange(n),
                  "episode_index": np.full(n, index), "index": np.arange(start, start + n),
                  "task_index": np.full(n, task_index)}
        table = pa.Table.from_arrays(
            [_to_arrow(values[k], f["dtype"], f["shape"]) for k, f in self._features.items() if f["dtype"] != "video"],
            schema=files.writer.schema)
        files.writer.write_table(table)  # one row group per episode, as LeRobot writes them
        files.data_mb += table.nbytes / 2**20
        row: dict[str, Any] = {
            "episode_index": index, "tasks": [ep.task], "length": n, "data/chunk_index": files.chunk,
            "data/file_index": files.file, "dataset_from_index": start, "dataset_to_index": start + n}
        stats: Stats = {}
        for key, f in self._features.items():
            if f["dtype"] == "video":
                frm, to = files.videos[key].add(ep.observations[key], ep.timestamp)
                row |= {f"videos/{key}/chunk_index": files.chunk, f"videos/{key}/file_index": files.file,
                        f"videos/{key}/from_timestamp": frm, f"videos/{key}/to_timestamp": to}
                stats[key] = _image_stats(ep.observations[key])
            else:
                stats[key] = _array_stats(np.asarray(values[key]), f["dtype"], f["shape"])
        meta_chunk, meta_file = divmod(self._meta_counter, int(self._sizes["chunks_size"]))
        row |= {"meta/episodes/chunk_index": meta_chunk, "meta/episodes/file_index": meta_file,
                "outcome": bool(ep.outcome),
                "task_id": ep.task_id, "seed": None if ep.seed is None else int(ep.seed),
                "policy_version": ep.policy_version, "complete": bool(ep.complete),
                "steps_to_success": ep.steps_to_success, "intervened": ep.intervened}
        row |= {f"stats/{k}/{s}": v.tolist() for k, st in stats.items() for s, v in st.items()}
        self._tasks.setdefault(ep.task, task_index)
        self._new_rows.append(row)
        self._new_stats.append(stats)

    def _write_meta(self, rows: list[dict[str, Any]], session_rows: list[dict[str, Any]], tasks: list[str],
                    stats: Stats, with_source: bool = False) -> None:
        """The metadata of a commit. Episode rows go to this session's own meta/episodes file (earlier files, which
        may be LeRobot's, are never rewritten); its rows are `session_rows`, and no rows means no file."""
        assert self._features is not None
        _atomic_write(self.root / KINEMA_PATH, self._kinema_json(with_source))
        if not self._row_extras:
            extras = [r for r in rows if "outcome" in r]
            _atomic_write(self.root / KINEMA_EPISODES_PATH, pa.Table.from_pylist(extras, schema=_extras_schema()))
        meta_chunk, meta_file = divmod(self._meta_counter, int(self._sizes["chunks_size"]))
        path = self.root / EPISODES_DIR_PATH.format(chunk_index=meta_chunk, file_index=meta_file)
        schema = _episodes_schema(self._features, extras=self._row_extras)
        if session_rows:
            _atomic_write(path, pa.Table.from_pylist(session_rows, schema=schema))
        else:
            path.unlink(missing_ok=True)
        _atomic_write(self.root / TASKS_PATH, _tasks_table(tasks))
        _atomic_write(self.root / STATS_PATH, _stats_to_json(stats))


# ------------------------------------------------------------------------------------------------------------- reader
class LeRobotDatasetReader:
    """Reads the committed episodes of a LeRobotDataset v3 (ours, or LeRobot's with video cameras) as Episodes."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        info = load_info(self.root)
        for key, f in info["features"].items():
            if f["dtype"] == "image":
                raise ValueError(f"feature {key!r}: images stored in parquet are not supported; expected 'video'")
        rows = _read_episode_rows(self.root, int(info["total_episodes"]), with_stats=False)
        self.meta = DatasetMeta(self.root, info, _read_tasks(self.root), rows, (self.root / KINEMA_PATH).is_file())
        self._step_shapes = _step_shapes_for(self.root, info["features"])
        self._cache: tuple[Path, pa.Table, dict[int, tuple[int, int]]] | None = None  # the last data file read

    def __len__(self) -> int:
        return len(self.meta.episodes)

    def __iter__(self) -> Iterator[Episode]:
        return (self.episode(i) for i in range(len(self)))

    def __getitem__(self, i: int) -> Episode:
        return self.episode(i)

    def _frames_of(self, row: Mapping[str, Any]) -> pa.Table:
        path = self.root / self.meta.info["data_path"].format(chunk_index=row["data/chunk_index"],
                                                               file_index=row["data/file_index"])
        if self._cache is None or self._cache[0] != path:
            table = pq.read_table(path)
            eps = table.column("episode_index").to_numpy()
            starts = np.flatnonzero(np.r_[True, eps[1:] != eps[:-1]])
            spans = {int(eps[a]): (int(a), int(b)) for a, b in zip(starts, np.r_[starts[1:], len(eps)], strict=True)}
            self._cache = (path, table, spans)
        _, table, spans = self._cache
        if row["episode_index"] not in spans:
            raise ValueError(f"dataset {self.root} is corrupt: {path} lacks episode {row['episode_index']}")
        a, b = spans[row["episode_index"]]
        return table.slice(a, b - a)

    def episode(self, i: int) -> Episode:
        if not 0 <= i < len(self):
            raise IndexError(f"episode {i} out of range: the dataset has {len(self)} episodes")
        row, info, fps = self.meta.episodes[i], self.meta.info, self.meta.fps
        table = self._frames_of(row)
        cols = {k: _from_arrow(table.column(k), self._step_shapes[k]) for k in table.column_names
                if k in self._step_shapes}
        observations = {k: v for k, v in cols.items() if k.startswith("observation.")}
        for key in self.meta.camera_keys:
            path = self.root / info["video_path"].format(video_key=key, chunk_index=row[f"videos/{key}/chunk_index"],
                                                         file_index=row[f"videos/{key}/file_index"])
            frames = _decode_window(path, row[f"videos/{key}/from_timestamp"], row[f"videos/{key}/to_timestamp"], fps)
            if len(frames) != row["length"]:
                raise ValueError(f"{path}: {len(frames)} frames for episode {i}, expected {row['length']}")
            observations[key] = frames
        task_index = int(cols["task_index"][0]) if "task_index" in cols else len(self.meta.tasks)
        task = self.meta.tasks[task_index] if task_index < len(self.meta.tasks) else (row.get("tasks") or [""])[0]
        success, intervention = cols.get("success", cols.get("next.success")), cols.get("intervention")
        return Episode(
            observations=observations, action=cols["action"], task=task,
            executed_by=None if intervention is None else intervention.astype(np.int8),
            segment=cols.get("segment"), timestamp=cols.get("timestamp"), reward=cols.get("next.reward"),
            success=None if success is None else success.astype(bool), outcome=row.get("outcome"),
            task_id=row.get("task_id") or "", seed=row.get("seed"), policy_version=row.get("policy_version") or "",
            fps=fps, complete=bool(row.get("complete", True)),
            privileged={k: v for k, v in cols.items() if k.startswith(PRIVILEGED_PREFIX)})


# ------------------------------------------------------------------------------------------------------ conveniences
def write_episodes(root: str | Path, episodes: Sequence[Episode], **kwargs: Any) -> Path:
    """Write episodes in one session (kwargs as for LeRobotDatasetWriter); returns the dataset root."""
    if not episodes:
        raise ValueError(f"no episodes to write to {root}")
    with LeRobotDatasetWriter(root, **kwargs) as writer:
        for ep in episodes:
            writer.add_episode(ep)
    return Path(root)


def read_episodes(root: str | Path, episodes: Sequence[int] | None = None) -> list[Episode]:
    reader = LeRobotDatasetReader(root)
    return [reader.episode(i) for i in (range(len(reader)) if episodes is None else episodes)]


def load_stats(root: str | Path) -> Stats:
    """Dataset statistics for normalisation: feature -> {mean, std, min, max, q01..q99: float32, count: int64}.

    Cameras have per-channel stats of shape (3, 1, 1) in [0, 1]. Stats are recomputed from the per-episode stats of the
    committed episodes when stats.json does not match info.json (a write interrupted between the two).
    """
    root = Path(root)
    info = load_info(root)
    features = info["features"]
    stats = _load_json(root / STATS_PATH) if (root / STATS_PATH).is_file() else None
    count = (stats or {}).get("index", {}).get("count")
    if stats is None or (count is not None and int(np.ravel(count)[0]) != int(info["total_frames"])):
        rows = _read_episode_rows(root, int(info["total_episodes"]), with_stats=True)
        per_episode = [_stats_from_row(r) for r in rows]
        per_episode = [st if _stats_layout_ok(features, st) else _reduce_legacy_stats(features, st)
                       for st in per_episode]
        stats = _aggregate_stats(per_episode) if rows else {}
    elif not _stats_layout_ok(features, stats):  # written before STATS_LAYOUT: per element
        stats = _reduce_legacy_stats(features, stats)
    return {k: {s: np.atleast_1d(np.asarray(v, dtype=np.int64 if s == "count" else np.float32)) for s, v in st.items()}
            for k, st in stats.items()}


# ------------------------------------------------------------------------------------------------------------ upgrade
@dataclass
class UpgradeReport:
    """What `upgrade_dataset` did: `rewritten` lists the files replaced (relative paths), empty when none was."""

    root: Path
    rewritten: list[str]
    episodes: int
    is_kinema: bool

    @property
    def changed(self) -> bool:
        return bool(self.rewritten)


def upgrade_dataset(root: str | Path) -> UpgradeReport:
    """Migrate a kinema dataset written before STATS_LAYOUT to LeRobot's stats convention (see the stats section).

    Per-episode stats of non-camera features are recomputed exactly from the data files (camera stats already had
    LeRobot's shape and are kept); meta/stats.json is pooled again; meta/kinema.json gets the canonical step shapes
    and `stats_layout`. Data and video files are never touched. All new contents are computed before anything is
    written; each file is then replaced atomically (temp file, fsync, rename), episodes files first and kinema.json
    last, as the marker that the upgrade finished. A crash in between leaves every file whole, either in the old or in
    the new layout, both of which kinema reads; running the upgrade again finishes it. Idempotent.
    """
    root = Path(root)
    info = load_info(root)
    is_kinema = (root / KINEMA_PATH).is_file()
    fd = None
    if fcntl is not None:
        fd = os.open(root, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RuntimeError(f"{root} is being written by another writer (process)") from None
    try:
        rewritten = _upgrade_locked(root)
    finally:
        if fd is not None:
            os.close(fd)
    return UpgradeReport(root, rewritten, int(info["total_episodes"]), is_kinema)


def _upgrade_locked(root: Path) -> list[str]:
    """upgrade_dataset without the lock (the writer holds it); returns the files rewritten."""
    if not (root / KINEMA_PATH).is_file() or not (root / INFO_PATH).is_file():
        return []  # LeRobot's own datasets follow its convention already; an incomplete one has nothing to migrate
    kinema = _load_json(root / KINEMA_PATH)
    if kinema.get("stats_layout") == STATS_LAYOUT:
        return []
    for path in root.rglob(f"*{_TMP}"):  # what an interrupted upgrade left
        path.unlink(missing_ok=True)
    info = load_info(root)
    features, total = info["features"], int(info["total_episodes"])
    payloads: list[tuple[Path, Any]] = []
    rows: list[dict[str, Any]] = []
    reader: LeRobotDatasetReader | None = None
    for path in _episode_files(root):
        table = pq.read_table(path)
        fields = []
        for field in table.schema:
            key, _, stat = field.name[len("stats/"):].rpartition("/")
            new_type = (_stats_arrow_type(features[key], stat) if field.name.startswith("stats/") and key in features
                        else field.type)
            fields.append(pa.field(field.name, new_type))
        file_rows = [r for r in table.to_pylist() if r["episode_index"] < total]
        schema = pa.schema(fields)
        if schema.equals(table.schema) and len(file_rows) == table.num_rows:
            rows += file_rows
            continue
        reader = reader or LeRobotDatasetReader(root)
        for row in file_rows:
            frames = reader._frames_of(reader.meta.episodes[row["episode_index"]])
            for key, f in features.items():
                if f["dtype"] in ("video", "image") or key not in frames.column_names:
                    continue
                values = _from_arrow(frames.column(key), [int(np.prod(f["shape"]))])
                row |= {f"stats/{key}/{s}": v.tolist() for s, v in _array_stats(values, f["dtype"], f["shape"]).items()}
        rows += file_rows
        payloads.append((path, pa.Table.from_pylist(file_rows, schema=schema)))
    rows.sort(key=lambda r: r["episode_index"])
    if [r["episode_index"] for r in rows] != list(range(total)):
        raise ValueError(f"dataset {root} is corrupt: meta/episodes does not hold episodes 0..{total - 1}")
    stats = _aggregate_stats([_stats_from_row(r) for r in rows]) if rows else {}
    payloads.append((root / STATS_PATH, _stats_to_json(stats)))
    standard = _kinema_json(_step_shapes_for(root, features))  # other keys (`sources`) are kept, as the writer does
    payloads.append((root / KINEMA_PATH, {k: v for k, v in kinema.items() if k not in standard} | standard))
    for path, payload in payloads:
        _atomic_write(path, payload)
    return [str(path.relative_to(root)) for path, _ in payloads]
