"""The episode recorder: takeover labels, LeRobot and MCAP output, crash recovery, bad input, and the way back into
training. Everything runs over the in-process transport with synthetic publishers and a fake clock."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import cv2
import numpy as np
import pytest

from diffusion_rl.data import ExecutedBy, LeRobotDatasetReader, Segment, read_episodes
from robot import messages as M
from robot.mcap_ros2 import MSG_DEFINITIONS, McapRos2Writer, mcap_is_complete, read_mcap, schema_text
from robot import recorder as recorder_module
from robot.recorder import (
    CameraTopic, EpisodeRecorder, KeyControl, RecorderConfig, pending_spools, segments_from_takeovers,
)
from robot.transport.base import QOS_DEFAULT, QOS_LATCHED, QOS_SENSOR
from robot.transport.inproc import InprocBus, InprocTransport

REPO = Path(__file__).resolve().parents[1]
JOINTS = ["j0", "j1", "j2"]
H = W = 16
P, HU, FI = Segment.PROGRESS, Segment.HUMAN, Segment.FAILURE_INDUCING


def frame(i: int, cam: int = 0) -> np.ndarray:
    """A smooth image that changes with the step (video coding is lossy; smooth content survives it closely)."""
    y, x = np.mgrid[0:H, 0:W]
    k = i % 20
    img = np.stack([20 + 8 * x + 3 * k, 20 + 8 * y + 30 * cam, np.full_like(x, 60 + 5 * k)], -1)
    return img.astype(np.uint8)


def state(i: int) -> list[float]:
    return [0.01 * i, 0.5 - 0.02 * i, -0.1 * i]


def command(i: int) -> list[float]:
    return [0.01 * i + 0.1, 0.5, -0.1 * i - 0.05]


class Rig:
    """A recorder on its own in-process bus, the publishers of a fake robot, and a fake clock."""

    def __init__(self, out: Path, *, bus: InprocBus | None = None, failure_window: int = 3, **config) -> None:
        self.bus = bus or InprocBus()
        self.transport = InprocTransport(self.bus)
        cameras = config.pop("cameras", [CameraTopic("agentview", "/cam/agentview"),
                                         CameraTopic("wrist", "/cam/wrist")])
        self.config = RecorderConfig(joint_names=list(JOINTS), cameras=cameras, fps=10.0,
                                     failure_window=failure_window, **config)
        self.now = 100.0
        self.published: dict[str, list] = {}
        self.recorder = EpisodeRecorder(self.transport, self.config, out, clock=lambda: self.now)
        cfg = self.config
        command_type = M.Float64MultiArray if cfg.command_type == "forward_position" else M.JointTrajectory
        self.pubs = {cfg.state_topic: M.JointState, cfg.command_topic: command_type,
                     cfg.takeover_topic: M.Bool, cfg.episode_topic: M.String, cfg.instruction_topic: M.String}
        self.pubs.update({c.topic: (M.CompressedImage if c.compressed else M.Image) for c in cfg.cameras})
        if cfg.success_topic:
            self.pubs[cfg.success_topic] = M.Bool
        self.pubs = {t: self.transport.publisher(t, ty) for t, ty in self.pubs.items()}

    def publish(self, topic: str, msg) -> None:
        self.published.setdefault(topic, []).append(msg)
        self.pubs[topic].publish(msg)

    def event(self, name: str) -> None:
        self.publish(self.config.episode_topic, M.String(name))

    def inputs(self, i: int) -> None:
        cfg = self.config
        self.publish(cfg.state_topic, M.JointState(name=list(reversed(JOINTS)), position=state(i)[::-1]))
        for k, cam in enumerate(cfg.cameras):
            self.publish(cam.topic, M.Image.from_array(frame(i, k)))
        self.publish(cfg.command_topic, M.Float64MultiArray(data=command(i)))

    def step(self, i: int) -> int | None:
        self.now += 0.1
        self.inputs(i)
        return self.recorder.sample()

    def episode(self, takeovers: list[bool], end: str = "success", first: int = 0, task: str | None = None) -> None:
        if task is not None:
            self.publish(self.config.instruction_topic, M.String(task))
        self.event("start")
        for t, human in enumerate(takeovers):
            if human != self.recorder.takeover:
                self.publish(self.config.takeover_topic, M.Bool(human))
            assert self.step(first + t) == t
        self.event(end)


# ------------------------------------------------------------------------------------------------- segment labels
def test_segments_from_takeovers_follow_the_monitor_convention():
    H_, P_ = ExecutedBy.HUMAN, ExecutedBy.POLICY
    by = np.array([P_, P_, P_, P_, P_, H_, H_, P_, P_, H_, P_])
    seg = segments_from_takeovers(by, failure_window=3)
    # The 3 policy steps before each takeover are failure-inducing; the window before the second takeover holds only
    # 2 policy steps (7, 8) and a human step (6), which keeps its label.
    assert seg.tolist() == [P, P, FI, FI, FI, HU, HU, FI, FI, HU, P]
    assert segments_from_takeovers(np.array([H_, H_, P_]), 8).tolist() == [HU, HU, P]
    assert segments_from_takeovers(np.array([P_, H_]), 0).tolist() == [P, HU]
    assert segments_from_takeovers(np.array([P_, P_, H_]), 8).tolist() == [FI, FI, HU]


# ---------------------------------------------------------------------------------------------- (a) takeover toggles
def test_takeover_toggles_become_executed_by_and_segments_exactly(tmp_path):
    rig = Rig(tmp_path, failure_window=2)
    toggles = [False] * 4 + [True] * 3 + [False] * 2 + [True] + [False] * 3
    rig.episode(toggles, task="open the drawer")
    rig.recorder.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    assert ep.executed_by.tolist() == [int(h) for h in toggles]
    assert ep.segment.tolist() == [P, P, FI, FI, HU, HU, HU, FI, FI, HU, P, P, P]
    assert ep.segments() == [(0, 4, ExecutedBy.POLICY), (4, 7, ExecutedBy.HUMAN), (7, 9, ExecutedBy.POLICY),
                             (9, 10, ExecutedBy.HUMAN), (10, 13, ExecutedBy.POLICY)]
    assert ep.intervened and ep.outcome is True and ep.complete
    assert ep.task == "open the drawer" and ep.policy_version == "deployment"


# ------------------------------------------------------------------------------------------ (b) LeRobot read-back
def test_dataset_reads_back_with_shapes_dtypes_and_values(tmp_path):
    rig = Rig(tmp_path)
    rig.episode([False] * 6, end="success", task="pick the cube")
    rig.episode([False] * 4, end="failure", first=10)
    rig.episode([False] * 3, end="stop", first=20, task="push the block")
    rig.recorder.close()
    assert rig.recorder.rejections == {} and rig.recorder.errors == []
    reader = LeRobotDatasetReader(tmp_path / "dataset")
    info = reader.meta.info
    assert info["total_episodes"] == 3 and info["total_frames"] == 13 and info["fps"] == 10
    assert info["features"]["observation.state"]["names"] == JOINTS
    assert info["features"]["action"]["names"] == JOINTS
    assert info["features"]["observation.images.wrist"]["shape"] == [H, W, 3]
    eps = list(reader)
    assert [len(e) for e in eps] == [6, 4, 3]
    assert [e.outcome for e in eps] == [True, False, False]  # "stop" without a success topic: not a success
    assert [e.task for e in eps] == ["pick the cube", "pick the cube", "push the block"]
    for ep, first in zip(eps, (0, 10, 20), strict=True):
        steps = range(first, first + len(ep))
        st = ep.observations["observation.state"]
        assert st.dtype == np.float32 and st.shape == (len(ep), 3)
        # joint_states arrive in reverse order: matched by name, they come back in joint_names order
        np.testing.assert_array_equal(st, np.array([state(i) for i in steps], np.float32))
        assert ep.action.dtype == np.float32
        np.testing.assert_array_equal(ep.action, np.array([command(i) for i in steps], np.float32))
        np.testing.assert_allclose(ep.timestamp, np.arange(len(ep)) * 0.1, atol=1e-5)
        for k, cam in enumerate(("agentview", "wrist")):
            img = ep.observations[f"observation.images.{cam}"]
            assert img.dtype == np.uint8 and img.shape == (len(ep), H, W, 3)
            err = np.abs(img.astype(int) - np.stack([frame(i, k) for i in steps]).astype(int))
            assert err.mean() < 3.0, err.mean()
        assert ep.complete and (ep.executed_by == ExecutedBy.POLICY).all() and (ep.segment == P).all()


def test_success_topic_sets_steps_and_unlabelled_outcome(tmp_path):
    rig = Rig(tmp_path, success_topic="/robot/success", cameras=[])
    rig.event("start")
    for i in range(5):
        if i == 3:
            rig.publish("/robot/success", M.Bool(True))
        rig.step(i)
    rig.event("stop")
    rig.recorder.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    assert ep.success.tolist() == [False, False, False, True, True]
    assert ep.outcome is True and ep.steps_to_success == 4


# ----------------------------------------------------------------------------------------------------------- (c) MCAP
def test_mcap_holds_every_message_as_published(tmp_path):
    rig = Rig(tmp_path)
    rig.publish(rig.config.instruction_topic, M.String("stack the cubes"))
    rig.inputs(99)  # before the episode: the last of each is copied into the file, so that it stands alone
    before = {t: msgs[-1] for t, msgs in rig.published.items()}
    rig.published.clear()
    rig.episode([False, False, True, True, False], task=None)
    rig.recorder.close()
    (recorded,) = rig.recorder.episodes
    assert recorded.mcap == str(tmp_path / "mcap" / "episode_000000.mcap") and mcap_is_complete(recorded.mcap)
    got: dict[str, list] = {}
    times = []
    for topic, t_ns, msg in read_mcap(recorded.mcap):
        got.setdefault(topic, []).append(msg)
        times.append(t_ns)
    assert times == sorted(times)
    expected = {t: [m] for t, m in before.items()}
    for topic, msgs in rig.published.items():
        expected.setdefault(topic, []).extend(msgs)
    assert set(got) == set(expected)  # the takeover topic included
    for topic in expected:
        assert [repr(m) for m in got[topic]] == [repr(m) for m in expected[topic]], topic
    assert [m.data for m in got[rig.config.takeover_topic]] == [True, False]
    assert [m.data for m in got[rig.config.episode_topic]] == ["start", "success"]
    # The reference reader of mcap-ros2-support decodes the file too (ros2 profile, ros2msg schemas, CDR).
    with warnings.catch_warnings():  # the module warns, on first import, that its helper is deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        from mcap_ros2.reader import read_ros2_messages
    decoded = list(read_ros2_messages(recorded.mcap, topics=[rig.config.state_topic]))
    assert [m.ros_msg.position for m in decoded] == [list(j.position) for j in expected[rig.config.state_topic]]
    assert {m.schema.name for m in decoded} == {"sensor_msgs/msg/JointState"}
    assert decoded[0].channel.message_encoding == "cdr" and decoded[0].schema.encoding == "ros2msg"


def test_mcap_schemas_cover_every_message_type_and_parse_with_mcap_ros2(tmp_path):
    assert set(MSG_DEFINITIONS) == set(M.MESSAGE_TYPES)
    text = schema_text("std_msgs/msg/Float64MultiArray")
    assert "MSG: std_msgs/MultiArrayLayout" in text and "MSG: std_msgs/MultiArrayDimension" in text
    samples = [
        M.Time(3, 4), M.Duration(-1, 5), M.Header(M.Time(1, 2), "base"), M.Bool(True), M.String("hé"),
        M.MultiArrayDimension("x", 3, 1), M.MultiArrayLayout([M.MultiArrayDimension("x", 3, 1)], 2),
        M.Float64MultiArray(data=[1.5, -2.0]), M.JointState(name=["a"], position=[0.25], velocity=[1.0]),
        M.Image.from_array(frame(1)), M.CompressedImage(format="png", data=b"\x89PNG"),
        M.Joy(axes=[0.5, -1.0], buttons=[1, 0]),
        M.JointTrajectoryPoint(positions=[1.0, 2.0], time_from_start=M.Duration(0, 500)),
        M.JointTrajectory(joint_names=["a", "b"], points=[M.JointTrajectoryPoint(positions=[1.0, 2.0])]),
    ]
    assert {type(m).ros_type for m in samples} == set(M.MESSAGE_TYPES)
    writer = McapRos2Writer(tmp_path / "all.mcap")
    for k, msg in enumerate(samples):
        writer.write(f"/t{k}", msg, log_time_ns=1_000 + k)
    assert not mcap_is_complete(writer.partial) and not writer.path.exists()  # open: no footer, no final name
    writer.finish()
    back = [m for _, _, m in read_mcap(writer.path)]
    assert [repr(m) for m in back] == [repr(m) for m in samples]


# --------------------------------------------------------------------------------------------------- (d) kill -9
CHILD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_robot_recorder import Rig
rig = Rig(Path(sys.argv[1]))
rig.episode([False] * 5, end="success", task="first")
rig.episode([False, True, True, False], end="failure", first=10, task="second")
rig.recorder.flush()
rig.publish(rig.config.instruction_topic, rig.pubs[rig.config.instruction_topic].msg_type("third"))
rig.event("start")
for t, human in enumerate([False, False, False, True, True, False, False]):
    if human != rig.recorder.takeover:
        rig.publish(rig.config.takeover_topic, rig.pubs[rig.config.takeover_topic].msg_type(human))
    rig.step(20 + t)
print("RECORDING", flush=True)
time.sleep(120)
"""


def test_kill_mid_episode_then_recover_marks_it_incomplete(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(REPO / "tests")), str(tmp_path)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "RECORDING" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "RECORDING" in line, proc.stderr.read() if proc.poll() is not None else "child never got ready"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # What the crash left: two committed episodes, a spool, and an MCAP file without its footer.
    assert LeRobotDatasetReader(tmp_path / "dataset").meta.info["total_episodes"] == 2
    assert len(list((tmp_path / "spool").glob("*.spool"))) == 1
    (partial,) = (tmp_path / "mcap").glob("*.mcap.recording")
    assert not mcap_is_complete(partial)
    (spool,) = (tmp_path / "spool").glob("*.spool")
    # What `kinema train --dataset` checks to warn that the crashed episode is not in the dataset yet.
    assert pending_spools(tmp_path) == [spool] and pending_spools(tmp_path / "dataset") == [spool]
    spool_copy = spool.read_bytes()
    with spool.open("ab") as f:  # as if killed in the middle of writing a step: a torn record at the end
        f.write(spool_copy[-300:-100])

    report = EpisodeRecorder.recover(tmp_path)
    assert report.torn_records == 1
    assert len(report.episodes) == 1 and report.episodes[0].index == 2 and not report.episodes[0].complete
    assert report.incomplete_mcap == [str(tmp_path / "mcap" / "episode_000002.mcap.incomplete")]
    assert "incomplete" in str(report)
    eps = read_episodes(tmp_path / "dataset")
    assert [len(e) for e in eps] == [5, 4, 7]
    assert [e.complete for e in eps] == [True, True, False]
    assert [e.outcome for e in eps] == [True, False, False]
    assert [e.task for e in eps] == ["first", "second", "third"]
    assert eps[1].executed_by.tolist() == [0, 1, 1, 0]
    assert eps[2].executed_by.tolist() == [0, 0, 0, 1, 1, 0, 0]
    assert eps[2].segment.tolist() == [FI, FI, FI, HU, HU, P, P]
    np.testing.assert_array_equal(eps[2].observations["observation.state"],
                                  np.array([state(20 + t) for t in range(7)], np.float32))
    assert sorted(p.name for p in (tmp_path / "mcap").iterdir()) == [
        "episode_000000.mcap", "episode_000001.mcap", "episode_000002.mcap.incomplete"]
    assert all(mcap_is_complete(tmp_path / "mcap" / f"episode_00000{i}.mcap") for i in (0, 1))
    assert list((tmp_path / "spool").iterdir()) == []
    assert pending_spools(tmp_path) == []
    # Recovering again finds nothing to do.
    assert EpisodeRecorder.recover(tmp_path).episodes == []
    # A kill between the commit and the spool's removal leaves a spool that says which index it was committed
    # under: recovery then only cleans up, and never commits the episode twice.
    spool.write_bytes(spool_copy)
    recorder_module._Spool(spool, fsync_s=1.0).json(b"C", {"index": 2})
    again = EpisodeRecorder.recover(tmp_path)
    assert again.episodes == [] and again.already_committed == 1 and not spool.exists()
    assert LeRobotDatasetReader(tmp_path / "dataset").meta.info["total_episodes"] == 3
    # A new session appends after the recovered episode.
    rig = Rig(tmp_path)
    assert rig.recorder.recovery.episodes == []
    rig.episode([False] * 2, first=40)
    rig.recorder.close()
    assert [e.index for e in rig.recorder.episodes] == [3]
    assert len(read_episodes(tmp_path / "dataset")) == 4


# ------------------------------------------------------------------------------------------------- (e) bad input
def test_bad_input_is_rejected_with_reasons_and_recording_continues(tmp_path):
    rig = Rig(tmp_path, image_size=(H, W))
    cfg, rec = rig.config, rig.recorder
    rig.event("start")
    assert rig.step(0) == 0
    rig.now += 0.1
    rig.publish(cfg.state_topic, M.JointState(name=["j0", "bogus", "j2"], position=[9.0, 9.0, 9.0]))
    assert rec.last_reason["joint_states"].startswith("unknown joint names ['bogus'], missing ['j1']")
    rig.publish(cfg.state_topic, M.JointState(name=JOINTS, position=[1.0, 2.0]))
    assert rec.last_reason["joint_states"] == "3 names but 2 positions"
    rig.publish("/cam/wrist", M.Image.from_array(np.zeros((H * 4, W * 4, 3), np.uint8)))
    rig.publish("/cam/agentview", M.Image(height=H, width=W, encoding="rgb8", step=3 * W, data=b"\x00" * 10))
    rig.publish("/cam/agentview", M.Image(height=H, width=W, encoding="mono16", step=2 * W, data=b"\x00" * 2 * H * W))
    rig.publish(cfg.command_topic, M.Float64MultiArray(data=[1.0, 2.0]))
    rig.publish(cfg.command_topic, M.Float64MultiArray(data=[1.0, float("nan"), 2.0]))
    rig.event("dance")
    rig.event("start")
    assert rec.rejections["joint_states"] == 2
    assert rec.rejections["camera wrist"] == 1 and "expected 16x16" in rec.last_reason["camera wrist"]
    assert rec.rejections["camera agentview"] == 2
    assert rec.rejections["command"] == 2 and rec.rejections["episode"] == 2
    # Nothing bad reached the episode: the next sample still holds step 0's inputs, then recording goes on.
    assert rig.recorder.sample() == 1
    assert rig.step(2) == 2
    rig.now += 5.0  # inputs go stale: the sample is skipped and counted, not recorded with old data
    assert rig.recorder.sample() is None and "stale" in rec.last_reason["sample"]
    assert rig.step(3) == 3
    rig.event("success")
    rec.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    np.testing.assert_array_equal(ep.observations["observation.state"],
                                  np.array([state(0), state(0), state(2), state(3)], np.float32))
    assert rec.errors == []


def test_first_frame_sets_the_image_size_and_compressed_images_decode(tmp_path):
    rig = Rig(tmp_path, cameras=[CameraTopic("agentview", "/cam/jpeg", compressed=True)], resize=(H, W))
    big = cv2.resize(frame(0), (2 * W, 2 * H), interpolation=cv2.INTER_LINEAR)
    ok, png = cv2.imencode(".png", big[..., ::-1])
    assert ok
    rig.event("start")
    rig.now += 0.1
    rig.publish(rig.config.state_topic, M.JointState(name=JOINTS, position=state(0)))
    rig.publish(rig.config.command_topic, M.Float64MultiArray(data=command(0)))
    assert rig.recorder.sample() is None and "camera" in rig.recorder.last_reason["sample"]
    rig.publish("/cam/jpeg", M.CompressedImage(format="png", data=png.tobytes()))
    rig.publish("/cam/jpeg", M.CompressedImage(format="jpeg", data=b"not an image"))
    assert rig.recorder.rejections["camera agentview"] == 1
    assert rig.recorder.sample() == 0
    assert rig.recorder.sample() is None and "not after the previous step" in rig.recorder.last_reason["sample"]
    rig.now += 0.1
    assert rig.recorder.sample() == 1
    rig.event("success")
    rig.recorder.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    img = ep.observations["observation.images.agentview"]
    assert img.shape == (2, H, W, 3)
    expected = cv2.resize(big, (W, H), interpolation=cv2.INTER_AREA).astype(int)
    assert np.abs(img[0].astype(int) - expected).mean() < 3.0


# ------------------------------------------------------------------------------------------- episode control, keys
def test_abort_writes_nothing_and_keys_drive_episodes(tmp_path):
    rig = Rig(tmp_path)
    keys = KeyControl(rig.recorder, stream=io.StringIO(""))
    assert keys.handle(" ") == "start" and rig.recorder.recording
    rig.step(0)
    assert keys.handle("a") == "abort" and not rig.recorder.recording
    assert list((tmp_path / "mcap").iterdir()) == [] and list((tmp_path / "spool").iterdir()) == []
    assert keys.handle(" ") == "start"
    rig.step(1)
    rig.step(2)
    assert keys.handle("x") is None
    assert keys.handle("f") == "failure" and not rig.recorder.recording
    quit_called = []
    # The threaded reader: start, success (no step was taken: nothing written, counted), then quit.
    keys = KeyControl(rig.recorder, stream=io.StringIO(" sq"), on_quit=lambda: quit_called.append(True)).start()
    keys._thread.join(10)
    assert quit_called == [True]
    rig.recorder.close()
    eps = read_episodes(tmp_path / "dataset")
    assert [(len(e), e.outcome) for e in eps] == [(2, False)]  # the aborted one is gone; the empty one not written
    assert rig.recorder.rejections["episode"] == 1 and "before its first step" in rig.recorder.last_reason["episode"]
    assert not rig.recorder.recording


def test_close_mid_episode_commits_it_as_incomplete_and_trajectory_commands_are_sampled(tmp_path):
    rig = Rig(tmp_path, command_type="joint_trajectory", command_topic="/arm/joint_trajectory", cameras=[])
    rig.event("start")
    rig.publish(rig.config.state_topic, M.JointState(name=JOINTS, position=state(0)))
    points = [M.JointTrajectoryPoint(positions=[k, 10 + k, 20 + k][::-1], time_from_start=M.Duration.from_sec(0.1 * k))
              for k in range(1, 4)]
    rig.publish("/arm/joint_trajectory", M.JointTrajectory(joint_names=list(reversed(JOINTS)), points=points))
    for _ in range(5):
        rig.publish(rig.config.state_topic, M.JointState(name=JOINTS, position=state(0)))
        assert rig.recorder.sample() is not None
        rig.now += 0.1
    rig.recorder.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    assert not ep.complete and ep.outcome is False
    # the point in effect: due at 0.1, 0.2, 0.3 s after receipt; the last one holds afterwards
    np.testing.assert_allclose(ep.action[:, 0], [1, 1, 2, 3, 3])
    np.testing.assert_allclose(ep.action[:, 2], [21, 21, 22, 23, 23])


def test_threaded_sampling_and_hooks(tmp_path):
    bus = InprocBus()
    config = RecorderConfig(joint_names=list(JOINTS), fps=50.0, max_steps=5)
    tr = InprocTransport(bus)
    rec = EpisodeRecorder(tr, config, tmp_path, state_fn=lambda q: np.r_[q, q.sum()],
                          action_fn=lambda cmd, q: cmd - q).start()
    js, cmd = tr.publisher(config.state_topic, M.JointState), tr.publisher(config.command_topic, M.Float64MultiArray)
    ep_pub = tr.publisher(config.episode_topic, M.String)
    ep_pub.publish(M.String("start"))
    deadline = time.monotonic() + 20
    while rec.recording and time.monotonic() < deadline:
        js.publish(M.JointState(name=JOINTS, position=[1.0, 2.0, 3.0]))
        cmd.publish(M.Float64MultiArray(data=[1.5, 2.0, 2.0]))
        time.sleep(0.005)
    rec.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    assert len(ep) == 5  # max_steps ended it
    np.testing.assert_allclose(ep.observations["observation.state"], [[1, 2, 3, 6]] * 5)
    np.testing.assert_allclose(ep.action, [[0.5, 0, -1]] * 5)
    assert np.all(np.diff(ep.timestamp) > 0.01)  # sampled on the 50 Hz clock, not in a burst
    info = json.loads((tmp_path / "dataset/meta/info.json").read_text())
    assert info["features"]["observation.state"]["shape"] == [4]


def test_a_second_recorder_on_the_same_folder_is_refused(tmp_path):
    rig = Rig(tmp_path)
    with pytest.raises(RuntimeError, match="another writer"):
        EpisodeRecorder(InprocTransport(InprocBus()), rig.config, tmp_path)
    rig.recorder.close()


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="joint_names"):
        RecorderConfig(joint_names=["a", "a"])
    with pytest.raises(ValueError, match="image_size"):
        RecorderConfig(joint_names=["a"], image_size=(15, 16))
    with pytest.raises(ValueError, match="command_type"):
        RecorderConfig(joint_names=["a"], command_type="velocity")
    with pytest.raises(ValueError, match="RecorderConfig.state_topic: topic 'joint_states' is not a valid absolute"):
        RecorderConfig(joint_names=["a"], state_topic="joint_states")
    with pytest.raises(ValueError, match=r"RecorderConfig.cameras\[1\].topic and RecorderConfig.takeover_topic are "
                                         r"both '/kinema/takeover'"):
        RecorderConfig(joint_names=["a"], cameras=[CameraTopic("a", "/cam/a"), CameraTopic("b", "/kinema/takeover")])
    with pytest.raises(ValueError, match=r"RecorderConfig.max_age_s must be > 0 seconds; got 0"):
        RecorderConfig(joint_names=["a"], max_age_s=0)
    with pytest.raises(ValueError, match=r"RecorderConfig.failure_window must be >= 0; got -1"):
        RecorderConfig(joint_names=["a"], failure_window=-1)


# --------------------------------------------------------------------------------------------- back into training
def test_recordings_feed_batching_and_the_training_buffer(tmp_path):
    torch = pytest.importorskip("torch")
    from diffusion_rl.batching import collate_episodes
    from diffusion_rl.credit import SampleKind
    from kinema.train.buffer import StepBuffer

    rig = Rig(tmp_path, failure_window=2)
    rig.episode([False, False, False, True, True, False, False], end="success", task="open the drawer")
    rig.episode([False] * 4, end="failure", first=10)
    rig.recorder.close()
    eps = read_episodes(tmp_path / "dataset")
    batch = collate_episodes(eps, image_keys=["observation.images.agentview"])
    assert tuple(batch.valid.shape) == (2, 7) and batch.valid.sum().item() == 11
    assert tuple(batch.images["observation.images.agentview"].shape) == (2, 7, H, W, 3)
    assert batch.is_demo.tolist() == [False, False]  # deployment episodes are policy rollouts, not demos
    assert batch.outcome.tolist() == [True, False] and batch.complete.tolist() == [True, True]
    assert batch.segment[0].tolist() == [P, FI, FI, HU, HU, P, P]
    # Intervention-aware credit: policy steps before the takeover are unlabelled, the suffix takes the outcome.
    kind = batch.credit.kind
    assert kind[0].tolist() == [SampleKind.UNLABELLED] * 3 + [SampleKind.HUMAN] * 2 + [SampleKind.AUTONOMOUS] * 2
    assert kind[1, :4].tolist() == [SampleKind.AUTONOMOUS] * 4
    buffer = StepBuffer.from_episodes(eps, ("agentview", "wrist"))
    assert len(buffer) == 11
    out = buffer.batch(np.array([0, 8]), chunk_size=4)
    assert tuple(out["action"].shape) == (2, 4, 3) and out["task"] == ["open the drawer", "open the drawer"]
    assert out["observation.images.wrist"].dtype == torch.uint8


def test_reset_on_the_episode_topic_starts_a_new_episode(tmp_path):
    rig = Rig(tmp_path, cameras=[])
    rig.event("reset seed=3")
    rig.step(0)
    rig.step(1)
    rig.publish(rig.config.success_topic, M.Bool(True))
    rig.step(2)
    rig.event("reset")  # ends the first (unlabelled: the success topic decides), starts the next
    rig.step(3)
    rig.event("failure")
    rig.recorder.close()
    eps = read_episodes(tmp_path / "dataset")
    assert [(len(e), e.outcome, e.complete) for e in eps] == [(3, True, True), (1, False, True)]
    assert eps[0].success.tolist() == [False, False, True]


def test_robot_config_recordings_train_the_sim_vla(tmp_path):
    """A sim_panda recording with the kinematic hooks has the sim VLA's state (8,) and action (7,): the demo buffer of
    `kinema train --dataset` takes it, and SFT steps run on it."""
    torch = pytest.importorskip("torch")
    from kinema.train.buffer import StepBuffer
    from kinema.train.actor import actor_updates
    from policies.vla import VLAConfig, VLAPolicy
    from robot.config import load_robot_config
    from robot.kinematics import ActionMapper

    robot = load_robot_config("sim_panda")
    mapper = ActionMapper(robot)
    config = RecorderConfig.from_robot(robot, failure_window=2)
    assert config.joint_names == robot.command_joint_names and config.fps == robot.rates.control_hz
    assert config.sample_on == "command" and config.success_topic == robot.topics.success
    assert [(c.name, c.size) for c in config.cameras] == [("agentview", (64, 64)), ("wrist", (64, 64))]
    tr = InprocTransport(InprocBus())
    now = [0.0]
    rec = EpisodeRecorder(tr, config, tmp_path, state_fn=mapper.state, action_fn=mapper.to_action,
                          clock=lambda: now[0])
    pubs = {t: tr.publisher(t, ty) for t, ty in [(config.state_topic, M.JointState),
                                                 (config.command_topic, M.Float64MultiArray),
                                                 (config.takeover_topic, M.Bool), (config.episode_topic, M.String),
                                                 *((c.topic, M.Image) for c in config.cameras)]}
    home = np.r_[robot.kinematics.home, 0.04, 0.04]
    pubs[config.episode_topic].publish(M.String("start"))
    for t in range(8):
        now[0] += 1 / config.fps
        q = home + 0.01 * t * np.r_[np.ones(7), 0, 0]
        pubs[config.state_topic].publish(M.JointState(name=config.joint_names, position=q))
        for k, cam in enumerate(config.cameras):
            pubs[cam.topic].publish(M.Image.from_array(np.full((64, 64, 3), 40 * k + t, np.uint8)))
        if t == 4:
            pubs[config.takeover_topic].publish(M.Bool(True))
        # A streaming controller's command triggers the step (sample_on="command"): one step per command sent.
        pubs[config.command_topic].publish(M.Float64MultiArray(data=q + 0.01 * np.r_[np.ones(7), -4, -4]))
        assert rec.sample() is None  # the timer path has nothing to add at the same instant
    pubs[config.episode_topic].publish(M.String("success"))
    rec.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    assert ep.observations["observation.state"].shape == (8, 8) and ep.action.shape == (8, 7)
    np.testing.assert_allclose(ep.observations["observation.state"][0], mapper.state(home), atol=1e-6)
    assert (np.abs(ep.action) <= 1).all() and np.allclose(ep.action[:, 6], 1.0)  # fingers closing: gripper +1
    assert ep.segment.tolist() == [P, P, FI, FI, HU, HU, HU, HU]

    torch.set_num_threads(1)
    torch.manual_seed(0)
    buffer = StepBuffer.from_episodes([ep], ("agentview", "wrist"))
    policy = VLAPolicy(VLAConfig(chunk_size=4, n_action_steps=2, num_flow_steps=2))
    policy.set_normalization(buffer.stats())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    stats = actor_updates(policy, optimizer, steps=2, batch_size=4, demos=buffer, replay=None, replay_weights=None,
                          demo_fraction=1.0, aux_weight=0.0, rng=np.random.default_rng(0))
    assert all(np.isfinite(v) for v in stats.values())


@pytest.mark.parametrize("control_qos", [QOS_DEFAULT, QOS_LATCHED], ids=["volatile", "latched"])
def test_records_over_dds_on_loopback(tmp_path, control_qos):
    """The same recorder on the DDS backend (loopback only, see conftest.py): callbacks arrive on DDS threads.

    Takeover and instruction come from ordinary volatile publishers (`ros2 topic pub`'s default, what the policy
    node hears) or latched ones: the recorder must match both, or it labels a human's steps as the policy's."""
    dds = pytest.importorskip("robot.transport.dds")
    domain = int(os.environ["ROS_DOMAIN_ID"])
    ns = f"/rec{os.getpid()}_{'latched' if control_qos.transient_local else 'volatile'}"
    config = RecorderConfig(
        joint_names=list(JOINTS), state_topic=f"{ns}/joint_states", cameras=[CameraTopic("wrist", f"{ns}/wrist")],
        command_topic=f"{ns}/commands", takeover_topic=f"{ns}/takeover", episode_topic=f"{ns}/episode",
        instruction_topic=f"{ns}/instruction", success_topic=f"{ns}/success", sample_on="command", fps=20.0)
    with dds.DDSTransport(domain, "recorder") as rec_tr, dds.DDSTransport(domain, "robot") as robot_tr:
        rec = EpisodeRecorder(rec_tr, config, tmp_path)
        pubs = {"state": robot_tr.publisher(config.state_topic, M.JointState),
                "cam": robot_tr.publisher(f"{ns}/wrist", M.Image, QOS_SENSOR),
                "cmd": robot_tr.publisher(config.command_topic, M.Float64MultiArray),
                "takeover": robot_tr.publisher(config.takeover_topic, M.Bool, control_qos),
                "episode": robot_tr.publisher(config.episode_topic, M.String),
                "task": robot_tr.publisher(config.instruction_topic, M.String, control_qos)}
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(p.subscription_count() for p in pubs.values()):
            time.sleep(0.02)
        assert all(p.subscription_count() for p in pubs.values()), "DDS endpoints never matched"
        pubs["task"].publish(M.String("wipe the table"))
        pubs["takeover"].publish(M.Bool(False))
        time.sleep(0.1)
        pubs["episode"].publish(M.String("start"))
        time.sleep(0.1)
        for t in range(10):
            if t in (4, 7):
                pubs["takeover"].publish(M.Bool(t == 4))
            pubs["state"].publish(M.JointState(name=JOINTS, position=state(t)))
            pubs["cam"].publish(M.Image.from_array(frame(t)))
            time.sleep(0.02)
            pubs["cmd"].publish(M.Float64MultiArray(data=command(t)))
            time.sleep(0.03)
        pubs["episode"].publish(M.String("success"))
        assert wait_until(lambda: not rec.recording, 5)
        rec.close()
    (ep,) = read_episodes(tmp_path / "dataset")
    assert len(ep) == 10 and ep.task == "wipe the table" and ep.outcome
    np.testing.assert_array_equal(ep.action, np.array([command(t) for t in range(10)], np.float32))
    assert ep.executed_by.tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    topics = {topic for topic, _, _ in read_mcap(rec.episodes[0].mcap)}
    assert {config.takeover_topic, config.state_topic, f"{ns}/wrist", config.command_topic} <= topics


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
