"""LeRobotDataset v3 storage of Episodes: round trip, LeRobot schema, append, and safety (foreign folders, crashes)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusion_rl.data import (
    Episode,
    ExecutedBy,
    IncompleteDatasetError,
    LeRobotDatasetReader,
    LeRobotDatasetWriter,
    Segment,
    load_stats,
    read_episodes,
    write_episodes,
)
from diffusion_rl.data import lerobot_v3

REPO = Path(__file__).resolve().parents[1]
CAMS = ("observation.images.front", "observation.images.wrist")
# Measured on these smooth test images with the default encoding (libx264, yuv420p, crf 15, mb-tree off): mean abs
# error 1.5, max 8 grey levels (48x64); 1.6 and 10 at 96x96. The bounds leave margin for other libx264 builds.
IMAGE_MAE, IMAGE_MAX = 3.0, 40


def smooth_video(t: int, h: int, w: int, seed: int) -> np.ndarray:
    """Moving gradients: structured content that a video codec keeps (noise would not survive any lossy codec)."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(60, 190, 3)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    k = np.arange(t, dtype=np.float32)[:, None, None]
    img = np.stack(
        [base[0] + 50 * np.sin((x + 2 * k) / 15), base[1] + 50 * np.cos(y / 12 + k / 10) + 0 * x,
         base[2] + 40 * np.sin((x + y) / 20 + k / 30)], -1)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_episode(seed: int, t: int = 30, *, cams: tuple[str, ...] = CAMS, hw: tuple[int, int] = (48, 64),
                 state_dim: int = 7, human: bool = True, **kwargs) -> Episode:
    rng = np.random.default_rng(seed)
    executed_by = np.zeros(t, np.int8)
    segment = np.full(t, Segment.PROGRESS, np.int8)
    if human:
        executed_by[t // 3: t // 2] = ExecutedBy.HUMAN
        segment[t // 3: t // 2] = Segment.HUMAN
        segment[t // 2: t // 2 + 3] = Segment.RECOVERY
        segment[2:4] = Segment.IDLE
        segment[4:5] = Segment.FAILURE_INDUCING
    success = np.zeros(t, bool)
    if seed % 2 == 0:
        success[-5:] = True
    obs = {"observation.state": rng.normal(size=(t, state_dim)).astype(np.float32)}
    for i, cam in enumerate(cams):
        obs[cam] = smooth_video(t, *hw, seed=100 * seed + i)
    fields = dict(
        observations=obs, action=rng.normal(size=(t, 4)).astype(np.float32), task=f"put cube {seed % 2} on plate",
        executed_by=executed_by, segment=segment, reward=success.astype(np.float32), success=success,
        task_id="pick_place", seed=seed if seed % 3 else None, policy_version=f"round-{seed}",
        privileged={"privileged.cube_pose": rng.normal(size=(t, 3, 7)), "privileged.contact": rng.normal(size=t),
                    "privileged.target": rng.normal(size=(t, 3))},
    )
    fields.update(kwargs)
    return Episode(**fields)


def assert_same_episode(a: Episode, b: Episode) -> None:
    assert sorted(a.observations) == sorted(b.observations)
    for key, value in a.observations.items():
        got = b.observations[key]
        assert got.shape == value.shape and got.dtype == value.dtype, key
        if key.startswith("observation.images."):
            err = np.abs(got.astype(np.int16) - value.astype(np.int16))
            assert err.mean() < IMAGE_MAE and err.max() < IMAGE_MAX, (key, err.mean(), err.max())
        else:
            np.testing.assert_array_equal(got, value, err_msg=key)
    for name in ("action", "executed_by", "segment", "timestamp", "reward", "success"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert sorted(a.privileged) == sorted(b.privileged)
    for key, value in a.privileged.items():
        assert b.privileged[key].shape == value.shape, key
        np.testing.assert_array_equal(b.privileged[key], value, err_msg=key)
    for name in ("task", "outcome", "task_id", "seed", "policy_version", "fps", "complete"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.meta() == b.meta()


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def episode_rows(root: Path) -> list[dict]:
    """Every row of every meta/episodes file (each append session writes its own file, as LeRobot does)."""
    return [r for p in sorted(root.glob("meta/episodes/*/*.parquet")) for r in pq.read_table(p).to_pylist()]


def stray_files(root: Path) -> list[str]:
    """Files LeRobot would see but no committed episode references, and leftover temp files."""
    info = json.loads((root / "meta/info.json").read_text())
    rows = episode_rows(root)
    keep = {root / info["data_path"].format(chunk_index=r["data/chunk_index"], file_index=r["data/file_index"])
            for r in rows}
    for key, feat in info["features"].items():
        if feat["dtype"] == "video":
            keep |= {root / info["video_path"].format(video_key=key, chunk_index=r[f"videos/{key}/chunk_index"],
                                                      file_index=r[f"videos/{key}/file_index"]) for r in rows}
    files = [*root.glob("data/*/*.parquet"), *root.glob("videos/*/*/*.mp4")]
    return sorted(str(p) for p in files if p not in keep) + sorted(str(p) for p in root.rglob("*.kinema-tmp"))


@pytest.fixture(scope="module")
def episodes() -> list[Episode]:
    eps = [make_episode(s) for s in range(4)]
    eps[1].complete = False
    eps[3].outcome = True  # a human label that disagrees with the per-step success flags
    return eps


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, episodes) -> Path:
    return write_episodes(tmp_path_factory.mktemp("ds") / "ds", episodes)


# ------------------------------------------------------------------------------------------------------ round trip
def test_round_trip_restores_every_field(dataset, episodes):
    back = read_episodes(dataset)
    assert len(back) == len(episodes)
    for a, b in zip(episodes, back, strict=True):
        assert_same_episode(a, b)
    assert [e.complete for e in back] == [True, False, True, True]
    assert back[3].outcome is True and not back[3].success.any()
    assert back[0].seed is None and back[1].seed == 1
    assert back[0].intervened and back[0].segments()[1][2] == ExecutedBy.HUMAN


def test_select_takes_every_per_step_field_alike_and_keeps_the_episode_fields(episodes):
    ep = episodes[0]
    keep = np.arange(len(ep)) % 3 != 1
    part = ep.select(keep)
    assert len(part) == keep.sum()
    for key, value in ep.observations.items():
        np.testing.assert_array_equal(part.observations[key], value[keep])
    for name in ("action", "executed_by", "segment", "timestamp", "reward", "success"):
        np.testing.assert_array_equal(getattr(part, name), getattr(ep, name)[keep])
    for key, value in ep.privileged.items():
        np.testing.assert_array_equal(part.privileged[key], value[keep])
    assert (part.outcome, part.seed, part.task, part.complete) == (ep.outcome, ep.seed, ep.task, ep.complete)
    np.testing.assert_array_equal(ep.select(slice(1, 3)).action, ep.action[1:3])


def test_reader_api(dataset, episodes):
    reader = LeRobotDatasetReader(dataset)
    assert len(reader) == 4 and reader.meta.total_frames == 4 * 30
    assert reader.meta.camera_keys == list(CAMS) and reader.meta.fps == 20.0 and reader.meta.is_kinema
    assert reader.meta.tasks == ["put cube 0 on plate", "put cube 1 on plate"]
    assert [r["outcome"] for r in reader.meta.episodes] == [True, False, True, True]
    assert [r["complete"] for r in reader.meta.episodes] == [True, False, True, True]
    assert [r["steps_to_success"] for r in reader.meta.episodes] == [26, None, 26, None]
    assert_same_episode(episodes[3], reader.episode(3))
    assert_same_episode(episodes[1], reader[1])
    assert sum(1 for _ in reader) == 4
    assert [e.seed for e in read_episodes(dataset, episodes=[3, 1])] == [episodes[3].seed, episodes[1].seed]
    with pytest.raises(IndexError):
        reader.episode(4)


def test_the_data_package_does_not_load_torch():
    code = "import sys, diffusion_rl.data; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------ LeRobot schema
def test_info_json_follows_lerobot_v3(dataset):
    info = json.loads((dataset / "meta/info.json").read_text())
    for key in ("codebase_version", "robot_type", "total_episodes", "total_frames", "total_tasks", "chunks_size",
                "data_files_size_in_mb", "video_files_size_in_mb", "fps", "splits", "data_path", "video_path",
                "features"):
        assert key in info, key
    assert info["codebase_version"] == "v3.0"
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (4, 120, 2)
    assert info["fps"] == 20 and isinstance(info["fps"], int)
    assert info["splits"] == {"train": "0:4"}
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["video_path"] == "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
    assert (info["chunks_size"], info["data_files_size_in_mb"], info["video_files_size_in_mb"]) == (1000, 100, 200)
    feats = info["features"]
    assert list(feats)[-5:] == ["timestamp", "frame_index", "episode_index", "index", "task_index"]
    assert feats["timestamp"] == {"dtype": "float32", "shape": [1], "names": None}
    for key in ("frame_index", "episode_index", "index", "task_index"):
        assert feats[key] == {"dtype": "int64", "shape": [1], "names": None}
    assert feats["observation.state"]["dtype"] == "float32" and feats["observation.state"]["shape"] == [7]
    assert feats["action"]["shape"] == [4] and len(feats["action"]["names"]) == 4
    assert feats["next.reward"]["dtype"] == "float32" and feats["next.done"]["dtype"] == "bool"
    assert feats["success"] == {"dtype": "bool", "shape": [1], "names": ["success"]}
    assert feats["intervention"]["dtype"] == "bool" and feats["segment"]["dtype"] == "int8"
    assert feats["privileged.cube_pose"]["shape"] == [3, 7] and feats["privileged.contact"]["shape"] == [1]
    for cam in CAMS:
        f = feats[cam]
        assert f["dtype"] == "video" and f["shape"] == [48, 64, 3] and f["names"] == ["height", "width", "channels"]
        assert f["info"]["video.codec"] == "h264" and f["info"]["video.pix_fmt"] == "yuv420p"
        assert (f["info"]["video.height"], f["info"]["video.width"], f["info"]["video.fps"]) == (48, 64, 20)
        assert f["info"]["has_audio"] is False and f["info"]["is_depth_map"] is False


def test_files_and_metadata_tables_follow_lerobot_v3(dataset):
    files = sorted(str(p.relative_to(dataset)) for p in dataset.rglob("*") if p.is_file())
    assert files == [
        "data/chunk-000/file-000.parquet", "meta/episodes/chunk-000/file-000.parquet", "meta/info.json",
        "meta/kinema.json", "meta/stats.json", "meta/tasks.parquet",
        "videos/observation.images.front/chunk-000/file-000.mp4",
        "videos/observation.images.wrist/chunk-000/file-000.mp4",
    ]
    tasks = pq.read_table(dataset / "meta/tasks.parquet")
    assert tasks.column("task").to_pylist() == ["put cube 0 on plate", "put cube 1 on plate"]
    assert tasks.column("task_index").to_pylist() == [0, 1]
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["task"]  # pandas: task is the index

    data = pq.read_table(dataset / "data/chunk-000/file-000.parquet")
    assert pq.ParquetFile(dataset / "data/chunk-000/file-000.parquet").num_row_groups == 4  # one per episode
    assert data.column("index").to_pylist() == list(range(120))
    assert data.column("episode_index").to_pylist() == [i for i in range(4) for _ in range(30)]
    assert data.column("frame_index").to_pylist() == list(range(30)) * 4
    assert data.column("task_index").to_pylist() == [i % 2 for i in range(4) for _ in range(30)]
    assert data.column("next.done").to_pylist() == ([False] * 29 + [True]) * 4
    assert not any(c.startswith("observation.images") for c in data.column_names)
    state_type = data.schema.field("observation.state").type  # what `datasets` writes for List(float32, length=7)
    assert pa.types.is_fixed_size_list(state_type) and state_type.list_size == 7
    assert state_type.value_type == pa.float32() and data.schema.field("segment").type == pa.int8()

    rows = pq.read_table(dataset / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [r["episode_index"] for r in rows] == [0, 1, 2, 3]
    assert [(r["dataset_from_index"], r["dataset_to_index"]) for r in rows] == [(0, 30), (30, 60), (60, 90), (90, 120)]
    assert all(r["data/chunk_index"] == 0 and r["data/file_index"] == 0 and r["length"] == 30 for r in rows)
    assert all(r["meta/episodes/chunk_index"] == 0 and r["meta/episodes/file_index"] == 0 for r in rows)
    assert rows[1]["tasks"] == ["put cube 1 on plate"]
    for cam in CAMS:  # episodes are concatenated in one video per camera, each 30 frames = 1.5 s long
        starts = [r[f"videos/{cam}/from_timestamp"] for r in rows]
        ends = [r[f"videos/{cam}/to_timestamp"] for r in rows]
        np.testing.assert_allclose(starts, [0.0, 1.5, 3.0, 4.5])
        np.testing.assert_allclose(ends, [1.5, 3.0, 4.5, 6.0])
    assert np.asarray(rows[0]["stats/observation.images.front/mean"]).shape == (3, 1, 1)
    assert rows[0]["stats/action/count"] == [30]
    kinema = json.loads((dataset / "meta/kinema.json").read_text())
    assert kinema["segment_names"] == ["progress", "idle", "failure_inducing", "recovery", "human"]
    assert kinema["step_shapes"]["privileged.contact"] == []


def test_stats_match_the_data(dataset, episodes):
    stats = load_stats(dataset)
    actions = np.concatenate([e.action for e in episodes]).astype(np.float64)
    np.testing.assert_allclose(stats["action"]["mean"], actions.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["action"]["std"], actions.std(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["action"]["min"], actions.min(0), rtol=1e-6)
    np.testing.assert_allclose(stats["action"]["max"], actions.max(0), rtol=1e-6)
    assert stats["action"]["count"].tolist() == [120] and stats["action"]["mean"].dtype == np.float32
    # LeRobot's convention: every axis but the last is reduced, so a (3, 7) feature has stats of shape (7,).
    poses = np.concatenate([e.privileged["privileged.cube_pose"] for e in episodes]).reshape(-1, 7).astype(np.float64)
    assert stats["privileged.cube_pose"]["mean"].shape == (7,) and stats["privileged.cube_pose"]["count"] == [120]
    np.testing.assert_allclose(stats["privileged.cube_pose"]["mean"], poses.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["privileged.cube_pose"]["std"], poses.std(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["privileged.cube_pose"]["max"], poses.max(0), rtol=1e-6)
    assert stats["intervention"]["mean"][0] == pytest.approx(5 / 30)  # steps 10..14 of each episode are human
    for cam in CAMS:
        pixels = np.concatenate([e.observations[cam] for e in episodes]).reshape(-1, 3) / 255.0
        s = stats[cam]
        assert s["mean"].shape == (3, 1, 1) and s["std"].shape == (3, 1, 1) and s["q50"].shape == (3, 1, 1)
        np.testing.assert_allclose(s["mean"].ravel(), pixels.mean(0), atol=1e-6)
        np.testing.assert_allclose(s["std"].ravel(), pixels.std(0), atol=1e-6)
        np.testing.assert_allclose(s["min"].ravel(), pixels.min(0), atol=1e-6)
        np.testing.assert_allclose(s["max"].ravel(), pixels.max(0), atol=1e-6)
        assert (s["q01"] >= 0).all() and (s["q01"] <= s["q50"]).all() and (s["q50"] <= s["q99"]).all()
        assert s["count"].tolist() == [120]


# ------------------------------------------------------------------------------------------------------------ append
def test_append_in_two_sessions(tmp_path):
    root = tmp_path / "ds"
    first = [make_episode(s) for s in range(2)]
    write_episodes(root, first)
    before = tree_digest(root / "data") | tree_digest(root / "videos")
    second = [make_episode(s, t=25, task="a new task") for s in range(2, 4)]
    with LeRobotDatasetWriter.open_append(root) as writer:
        assert writer.num_episodes == 2
        assert [writer.add_episode(e) for e in second] == [2, 3]
    back = read_episodes(root)
    for a, b in zip(first + second, back, strict=True):
        assert_same_episode(a, b)
    after = tree_digest(root / "data") | tree_digest(root / "videos")
    assert all(after[k] == v for k, v in before.items())  # existing files were not rewritten
    assert "chunk-000/file-001.parquet" in after  # the session got a new file index
    info = json.loads((root / "meta/info.json").read_text())
    assert (info["total_episodes"], info["total_frames"], info["total_tasks"]) == (4, 110, 3)
    assert LeRobotDatasetReader(root).meta.tasks[-1] == "a new task"
    assert load_stats(root)["index"]["count"].tolist() == [110]
    assert stray_files(root) == []


def test_commit_makes_episodes_durable_and_files_roll_over(tmp_path):
    root = tmp_path / "ds"
    eps = [make_episode(s, t=12, cams=CAMS[:1]) for s in range(5)]
    writer = LeRobotDatasetWriter(root, fps=20, chunks_size=2, data_files_size_in_mb=1e-6)
    writer.add_episode(eps[0])
    writer.add_episode(eps[1])
    writer.commit()
    assert len(read_episodes(root)) == 2
    for e in eps[2:]:
        writer.add_episode(e)
    writer.close()
    for a, b in zip(eps, read_episodes(root), strict=True):
        assert_same_episode(a, b)
    rows = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(r["data/chunk_index"], r["data/file_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
    assert (root / "videos" / CAMS[0] / "chunk-002/file-000.mp4").is_file()
    assert stray_files(root) == []


def test_irregular_timestamps_survive_and_match_video_frame_times(tmp_path):
    import av

    rng = np.random.default_rng(0)
    eps = [make_episode(s, t=20, timestamp=np.cumsum(np.r_[0.013, rng.uniform(0.035, 0.065, 19)])) for s in range(2)]
    root = write_episodes(tmp_path / "ds", eps)
    for a, b in zip(eps, read_episodes(root), strict=True):
        assert_same_episode(a, b)
    row = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()[1]
    with av.open(str(root / "videos" / CAMS[0] / "chunk-000/file-000.mp4")) as container:
        stream = container.streams.video[0]
        times = np.array([float(f.pts * stream.time_base) for f in container.decode(stream)])
    queries = row[f"videos/{CAMS[0]}/from_timestamp"] + eps[1].timestamp.astype(np.float64)
    # LeRobot looks frames up at from_timestamp + timestamp with a 1e-4 s tolerance.
    assert np.abs(times[20:] - queries).max() < 1e-4


def test_reads_and_appends_to_a_lerobot_dataset_without_kinema_metadata(tmp_path, episodes):
    root = write_episodes(tmp_path / "ds", episodes[:2])
    (root / "meta/kinema.json").unlink()
    for a, b in zip(episodes[:2], read_episodes(root), strict=True):
        assert_same_episode(a, b)
    before = tree_digest(root / "data") | tree_digest(root / "meta/episodes")
    with LeRobotDatasetWriter(root, mode="a") as writer:
        writer.add_episode(episodes[2])
    for a, b in zip(episodes[:3], read_episodes(root), strict=True):
        assert_same_episode(a, b)
    after = tree_digest(root / "data") | tree_digest(root / "meta/episodes")
    assert all(after[k] == v for k, v in before.items())  # LeRobot's files are never rewritten
    assert "chunk-000/file-001.parquet" in after and stray_files(root) == []
    # An episode that does not fit the dataset's features is refused, naming the feature.
    with pytest.raises(ValueError, match=r"'observation.state'.*\[7\].*\[5\]"), \
            LeRobotDatasetWriter(root, mode="a") as writer:
        writer.add_episode(make_episode(9, state_dim=5))
    assert len(read_episodes(root)) == 3


# ------------------------------------------------------------------------------------------------------------ safety
def test_refuses_a_foreign_non_empty_directory_and_touches_nothing(tmp_path):
    root = tmp_path / "mine"
    (root / "data").mkdir(parents=True)
    (root / "notes.txt").write_text("precious")
    (root / "data" / "results.csv").write_text("1,2,3")
    before = tree_digest(root)
    for kwargs in ({}, {"overwrite": True}, {"mode": "a"}):
        with pytest.raises(FileExistsError, match=re.escape(str(root))) as err:
            LeRobotDatasetWriter(root, **kwargs)
        assert "not a LeRobot or kinema dataset" in str(err.value)
        with pytest.raises(FileExistsError):
            write_episodes(root, [make_episode(0, t=5)], **kwargs)
    assert tree_digest(root) == before
    assert sorted(p.name for p in root.rglob("*")) == ["data", "notes.txt", "results.csv"]
    with pytest.raises(IncompleteDatasetError, match="incomplete dataset"):
        LeRobotDatasetReader(root)


def test_existing_dataset_is_replaced_only_with_overwrite(tmp_path):
    root = write_episodes(tmp_path / "ds", [make_episode(0, t=5)])
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_episodes(root, [make_episode(1, t=6)])
    assert len(read_episodes(root)) == 1
    (root / "README.md").write_text("kept")
    write_episodes(root, [make_episode(1, t=6), make_episode(2, t=7)], overwrite=True)
    assert [len(e) for e in read_episodes(root)] == [6, 7]
    assert (root / "README.md").read_text() == "kept"


def test_an_empty_existing_directory_is_fine(tmp_path):
    write_episodes(tmp_path, [make_episode(0, t=5)])
    assert len(read_episodes(tmp_path)) == 1


def test_feature_mismatch_names_the_key_and_leaves_the_writer_usable(tmp_path):
    root = tmp_path / "ds"
    with LeRobotDatasetWriter(root) as writer:
        writer.add_episode(make_episode(0, t=8))
        with pytest.raises(ValueError, match=r"'observation.state'.*\[7\].*\[6\]"):
            writer.add_episode(make_episode(1, t=8, state_dim=6))
        with pytest.raises(ValueError, match=r"observation\.images\.wrist"):
            writer.add_episode(make_episode(2, t=8, cams=CAMS[:1]))
        with pytest.raises(ValueError, match=r"'observation.images.front'.*\[48, 64, 3\].*\[32, 64, 3\]"):
            writer.add_episode(make_episode(3, t=8, hw=(32, 64)))
        with pytest.raises(ValueError, match=r"privileged\.extra"):
            ep = make_episode(4, t=8)
            ep.privileged["privileged.extra"] = np.zeros((8, 2), np.float32)
            writer.add_episode(ep)
        with pytest.raises(ValueError, match="fps"):
            writer.add_episode(make_episode(5, t=8, fps=30.0))
        with pytest.raises(ValueError, match="timestamp"):
            writer.add_episode(make_episode(6, t=8, timestamp=np.r_[0.0, 0.2, 0.1, np.arange(3, 8) / 10]))
        with pytest.raises(ValueError, match="no steps"):
            writer.add_episode(make_episode(7, t=0, cams=()))
        writer.add_episode(make_episode(8, t=9))
    assert [len(e) for e in read_episodes(root)] == [8, 9]


def test_a_rejected_first_episode_does_not_define_the_features(tmp_path):
    root = tmp_path / "ds"
    with LeRobotDatasetWriter(root) as writer:
        with pytest.raises(ValueError, match="even height and width"):
            writer.add_episode(make_episode(0, t=5, hw=(33, 64)))
        writer.add_episode(make_episode(1, t=5, state_dim=3))
    assert read_episodes(root)[0].observations["observation.state"].shape == (5, 3)


def test_names_are_written_and_checked(tmp_path):
    root = write_episodes(tmp_path / "ds", [make_episode(0, t=5)], names={"action": ["x", "y", "z", "grip"]})
    assert json.loads((root / "meta/info.json").read_text())["features"]["action"]["names"] == ["x", "y", "z", "grip"]
    with pytest.raises(ValueError, match="names for 'action'"):
        write_episodes(tmp_path / "other", [make_episode(0, t=5)], names={"action": ["x"]})
    assert not (tmp_path / "other").exists()


def test_nothing_is_left_behind_without_episodes(tmp_path):
    with pytest.raises(ValueError, match="no episodes"):
        write_episodes(tmp_path / "ds", [])
    with LeRobotDatasetWriter(tmp_path / "ds"):
        pass
    assert not (tmp_path / "ds").exists()


def test_yuv444p_keeps_sharp_colour_edges(tmp_path):
    frames = np.full((10, 32, 32, 3), 128, np.uint8)
    for t in range(10):
        frames[t, 5 + t:15 + t, 3 + t:13 + t] = [230, 20, 40]  # a saturated block moving by odd offsets
    ep = Episode(observations={"observation.state": np.zeros((10, 2)), "observation.images.front": frames},
                 action=np.zeros((10, 2)), task="edges")
    errors = {}
    for pix_fmt in ("yuv420p", "yuv444p"):
        root = write_episodes(tmp_path / pix_fmt, [ep], video=lerobot_v3.VideoEncoding(pix_fmt=pix_fmt))
        errors[pix_fmt] = np.abs(read_episodes(root)[0].observations["observation.images.front"].astype(int) - frames)
    # Measured: yuv420p mean 2.4, max 113, 1818 values off by > 10 (chroma is halved, smearing colour over edges);
    # yuv444p mean 0.6, max 42, 201 values off by > 10 (what is left is codec ringing at crf 15).
    e420, e444 = errors["yuv420p"], errors["yuv444p"]
    assert e420.max() > 80 and e444.max() < e420.max() / 2
    assert e444.mean() < e420.mean() / 3 and (e444 > 10).sum() < (e420 > 10).sum() / 5


def test_a_second_writer_is_refused_while_one_is_open(tmp_path):
    root = tmp_path / "ds"
    with LeRobotDatasetWriter(root) as writer:
        writer.add_episode(make_episode(0, t=5))
        with pytest.raises(RuntimeError, match="another writer"):
            LeRobotDatasetWriter(root, mode="a")
    with LeRobotDatasetWriter(root, mode="a") as writer:
        writer.add_episode(make_episode(1, t=5))
    assert len(read_episodes(root)) == 2


def test_exception_inside_the_context_keeps_the_previous_state(tmp_path):
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyError), LeRobotDatasetWriter(fresh) as writer:
        writer.add_episode(make_episode(0, t=6))
        raise KeyError("boom")
    with pytest.raises(IncompleteDatasetError, match="incomplete dataset"):
        read_episodes(fresh)
    assert list(fresh.rglob("*.parquet")) == [] and list(fresh.rglob("*.kinema-tmp")) == []

    root = write_episodes(tmp_path / "ds", [make_episode(s, t=6) for s in range(2)])
    before = tree_digest(root)
    with pytest.raises(KeyError), LeRobotDatasetWriter.open_append(root) as writer:
        writer.add_episode(make_episode(5, t=6))
        raise KeyError("boom")
    assert tree_digest(root) == before


def test_an_abandoned_writer_leaves_the_committed_state(tmp_path):
    root = write_episodes(tmp_path / "ds", [make_episode(s, t=6) for s in range(2)])
    writer = LeRobotDatasetWriter.open_append(root)
    writer.add_episode(make_episode(5, t=6))
    assert list(root.rglob("*.kinema-tmp"))  # work in progress is only in temp files
    assert len(read_episodes(root)) == 2
    del writer
    assert len(read_episodes(root)) == 2 and list(root.rglob("*.kinema-tmp")) == []


def test_a_failure_at_the_commit_point_keeps_the_previous_dataset(tmp_path, monkeypatch):
    old = [make_episode(s, t=6) for s in range(2)]
    root = write_episodes(tmp_path / "ds", old)
    old_stats = load_stats(root)
    real = lerobot_v3._atomic_write

    def crash_on_info(path, payload):
        if path.name == "info.json":
            raise OSError("disk full")
        real(path, payload)

    monkeypatch.setattr(lerobot_v3, "_atomic_write", crash_on_info)
    with pytest.raises(OSError, match="disk full"), LeRobotDatasetWriter.open_append(root) as writer:
        writer.add_episode(make_episode(7, t=6, task="never committed"))
    monkeypatch.undo()
    for a, b in zip(old, read_episodes(root), strict=True):
        assert_same_episode(a, b)
    assert len(read_episodes(root)) == 2
    np.testing.assert_array_equal(load_stats(root)["action"]["mean"], old_stats["action"]["mean"])
    assert stray_files(root) == []
    assert "never committed" not in LeRobotDatasetReader(root).meta.tasks


# ------------------------------------------------------------------------------------------- killed processes (real)
CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from diffusion_rl.data import Episode, LeRobotDatasetWriter

    root, mode, kill_at = sys.argv[1], sys.argv[2], sys.argv[3]
    armed = False
    real_replace = os.replace
    def replace(src, dst):  # die just before the rename of one particular file of the commit
        if armed and str(dst).endswith(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)
    os.replace = replace
    writer = LeRobotDatasetWriter(root, mode=mode)
    for i in range(100):
        t = 10
        img = np.full((t, 32, 32, 3), 40 + i, np.uint8)
        writer.add_episode(Episode(observations={"observation.state": np.zeros((t, 7), np.float32),
                                                 "observation.images.front": img, "observation.images.wrist": img},
                                   action=np.zeros((t, 4), np.float32), task="child",
                                   privileged={"privileged.cube_pose": np.zeros((t, 3, 7))}))
        print("added", i, flush=True)
        if kill_at and i == 2:
            armed = True
            writer.close()
""")


def run_child(root: Path, mode: str, kill_at: str = "", kill_after: int | None = None) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), mode, kill_at],
                            stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    if kill_after is not None:
        for line in proc.stdout:
            if line.strip() == f"added {kill_after}":
                proc.send_signal(signal.SIGKILL)
                break
    proc.wait(timeout=120)
    return proc.returncode


def small_dataset(root: Path) -> list[Episode]:
    eps = [make_episode(s, t=10, hw=(32, 32), state_dim=7,
                        privileged={"privileged.cube_pose": np.ones((10, 3, 7), np.float32)}) for s in range(2)]
    write_episodes(root, eps)
    return eps


def test_killed_during_a_first_write_leaves_an_incomplete_dataset(tmp_path):
    root = tmp_path / "ds"
    assert run_child(root, "w", kill_after=2) == -signal.SIGKILL
    with pytest.raises(IncompleteDatasetError, match="incomplete dataset"):
        LeRobotDatasetReader(root)
    with LeRobotDatasetWriter(root, mode="a") as writer:  # an append session starts it afresh
        writer.add_episode(make_episode(0, t=10, hw=(32, 32)))
    assert len(read_episodes(root)) == 1 and stray_files(root) == []


# Every rename of a commit, in the order the writer makes them; info.json is the commit point. An append session
# writes its rows to a meta/episodes file of its own.
COMMIT_RENAMES = ["data/chunk-000/file-001.parquet", "videos/observation.images.wrist/chunk-000/file-001.mp4",
                  "meta/kinema.json", "meta/episodes/chunk-000/file-001.parquet", "meta/tasks.parquet",
                  "meta/stats.json", "meta/info.json"]


@pytest.mark.parametrize("kill_at", ["", *COMMIT_RENAMES], ids=["while-adding", *COMMIT_RENAMES])
def test_killed_during_an_append_keeps_the_previous_dataset(tmp_path, kill_at):
    root = tmp_path / "ds"
    old = small_dataset(root)
    assert run_child(root, "a", kill_at=kill_at, kill_after=None if kill_at else 2) == -signal.SIGKILL
    back = read_episodes(root)
    assert len(back) == 2
    for a, b in zip(old, back, strict=True):
        assert_same_episode(a, b)
    assert load_stats(root)["index"]["count"].tolist() == [20]
    # Opening for append removes what the killed session left, so LeRobot's loader sees a consistent dataset too.
    LeRobotDatasetWriter.open_append(root).close()
    assert stray_files(root) == []
    assert len(episode_rows(root)) == 2  # LeRobot reads every row: the uncommitted one is gone
    assert LeRobotDatasetReader(root).meta.tasks == ["put cube 0 on plate", "put cube 1 on plate"]
    assert json.loads((root / "meta/stats.json").read_text())["index"]["count"] == [20]
    with LeRobotDatasetWriter.open_append(root) as writer:
        writer.add_episode(make_episode(9, t=10, hw=(32, 32),
                                        privileged={"privileged.cube_pose": np.ones((10, 3, 7), np.float32)}))
    back = read_episodes(root)
    assert len(back) == 3 and stray_files(root) == []
    assert [r["episode_index"] for r in episode_rows(root)] == [0, 1, 2]
    assert LeRobotDatasetReader(root).meta.tasks == ["put cube 0 on plate", "put cube 1 on plate"]
