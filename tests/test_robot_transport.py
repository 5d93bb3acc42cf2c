"""Transports: every message type round-trips on inproc and on DDS (ROS 2's wire format), QoS behaves as in ROS 2,
bad input gets clear errors, and DDS traffic stays on loopback (also across processes, and in a private network
namespace where the system allows one)."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import robot.messages as m
from robot.transport import QOS_DEFAULT, QOS_LATCHED, QOS_SENSOR, QoS, make_transport
from robot.transport.inproc import InprocBus, InprocTransport

dds = pytest.importorskip("robot.transport.dds")

REPO = Path(__file__).resolve().parent.parent
DOMAIN = int(os.environ["ROS_DOMAIN_ID"])  # set per session by conftest.py


# ----------------------------------------------------------------------------------------------------------------
# Sample messages: every type, non-trivial values, plus an all-defaults (empty arrays) variant
# ----------------------------------------------------------------------------------------------------------------


def _header(i: int = 0) -> m.Header:
    return m.Header(stamp=m.Time(sec=1_700_000_000 + i, nanosec=999_999_999), frame_id=f"base_link/カメラ-{i}")


def full_samples() -> dict[type, object]:
    rng = np.random.default_rng(0)
    dims = [m.MultiArrayDimension("joints", 7, 14), m.MultiArrayDimension("chunk", 2, 2)]
    point = m.JointTrajectoryPoint(
        positions=rng.normal(size=7), velocities=[0.5] * 7, accelerations=[], effort=[-1.0, np.nan],
        time_from_start=m.Duration(sec=2, nanosec=500_000_000),
    )
    samples = [
        m.Time(sec=-5, nanosec=4_000_000_000),  # nanosec is uint32: values above 2**31 must survive
        m.Duration(sec=-3, nanosec=7),
        _header(1),
        m.Bool(True),
        m.String("pick the red cube → 🤖 ünïcödé"),
        dims[0],
        m.MultiArrayLayout(dim=dims, data_offset=3),
        m.Float64MultiArray(m.MultiArrayLayout(dim=dims, data_offset=1), data=[0.1, -2.5, 1e300, -0.0]),
        m.JointState(_header(2), name=[f"joint{i}" for i in range(7)], position=rng.normal(size=7),
                     velocity=np.full(7, 0.25), effort=[]),
        m.Image.from_array(rng.integers(0, 256, (4, 5, 3), dtype=np.uint8), header=_header(3)),
        m.CompressedImage(_header(4), format="jpeg", data=bytes(range(256)) + b"\x00\x00"),
        m.Joy(_header(5), axes=[-1.0, 0.5, 0.0], buttons=[0, 1, -1, 2**31 - 1]),
        point,
        m.JointTrajectory(_header(6), joint_names=["a", "b"], points=[point, m.JointTrajectoryPoint(positions=[1.0])]),
    ]
    out = {type(s): s for s in samples}
    assert set(out) == set(m.MESSAGE_TYPES.values()), "a message type has no sample here"
    return out


FULL = full_samples()
TYPES = sorted(FULL, key=lambda cls: cls.__name__)


def assert_same(a, b, path="msg"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert np.array_equal(a, b, equal_nan=True), f"{path}: {a} != {b}"
    elif isinstance(a, list):
        assert len(a) == len(b), f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


class Inbox:
    """Collects callback deliveries; `wait(n)` blocks until n have arrived."""

    def __init__(self):
        self.items: list = []
        self._cv = threading.Condition()

    def __call__(self, msg):
        with self._cv:
            self.items.append(msg)
            self._cv.notify_all()

    def wait(self, n: int = 1, timeout: float = 5.0) -> list:
        with self._cv:
            self._cv.wait_for(lambda: len(self.items) >= n, timeout)
            return list(self.items)


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


# ----------------------------------------------------------------------------------------------------------------
# inproc
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("msg_type", TYPES, ids=lambda t: t.__name__)
def test_inproc_round_trips_every_message_type(msg_type):
    bus = InprocBus()
    a, b = InprocTransport(bus), InprocTransport(bus)
    inbox = Inbox()
    b.subscribe("/t", msg_type, inbox)
    pub = a.publisher("/t", msg_type)
    pub.publish(FULL[msg_type])
    pub.publish(msg_type())
    got = inbox.wait(2)
    assert_same(got[0], FULL[msg_type])
    assert_same(got[1], msg_type())
    assert got[0] is not FULL[msg_type]  # each subscriber gets its own copy, as after a trip over the wire


# ----------------------------------------------------------------------------------------------------------------
# DDS, two participants in this process
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    a = make_transport("dds", node_name="test_a", domain_id=DOMAIN)
    b = make_transport("dds", node_name="test_b", domain_id=DOMAIN)
    yield a, b
    a.close()
    b.close()


def _connect(pair, topic, msg_type, qos=QOS_DEFAULT, sub_qos=None):
    a, b = pair
    inbox = Inbox()
    sub = b.subscribe(topic, msg_type, inbox, sub_qos or qos)
    pub = a.publisher(topic, msg_type, qos)
    assert wait_until(lambda: pub.subscription_count() >= 1), f"{topic}: publisher never matched"
    return pub, sub, inbox


@pytest.mark.parametrize("msg_type", TYPES, ids=lambda t: t.__name__)
def test_dds_round_trips_every_message_type(pair, msg_type):
    pub, sub, inbox = _connect(pair, f"/rt_test/{msg_type.__name__.lower()}", msg_type)
    assert isinstance(pair[0], dds.DDSTransport)
    pub.publish(FULL[msg_type])
    pub.publish(msg_type())
    got = inbox.wait(2)
    assert len(got) == 2
    assert_same(got[0], FULL[msg_type])
    assert_same(got[1], msg_type())
    assert sub.dropped == 0


def test_wire_bytes_equal_ros2_cdr_from_the_upstream_msg_definitions():
    """Our CDR is byte for byte what a ROS 2 encoder (mcap_ros2, driven by the upstream .msg text) writes."""
    _dynamic = pytest.importorskip("mcap_ros2._dynamic")
    mcap_ros2 = pytest.importorskip("robot.mcap_ros2")  # the upstream .msg texts live there
    schema_text, to_ros2 = mcap_ros2.schema_text, mcap_ros2.to_ros2

    for msg_type, msg in FULL.items():
        codec = dds.codec_for(msg_type)
        ours = codec.wire_type.serialize(codec.to_wire(msg))
        assert ours[:4] == b"\x00\x01\x00\x00", f"{msg_type.__name__}: not plain little-endian CDR (XCDR1)"
        encode = _dynamic.serialize_dynamic(msg_type.ros_type, schema_text(msg_type.ros_type))[msg_type.ros_type]
        theirs = encode(to_ros2(msg))
        assert ours == theirs, f"{msg_type.__name__}: wire bytes differ from ROS 2 CDR"
        assert_same(codec.from_wire(codec.wire_type.deserialize(theirs)), msg)


def test_dds_names_are_ros2s_and_images_move_as_bytes(pair):
    assert dds.dds_topic_name("/arm/joint_states") == "rt/arm/joint_states"
    assert dds.dds_type_name("sensor_msgs/msg/JointState") == "sensor_msgs::msg::dds_::JointState_"
    assert dds.codec_for(m.Image).fast_bytes and dds.codec_for(m.CompressedImage).fast_bytes
    assert isinstance(dds.codec_for(m.Image).to_wire(FULL[m.Image]).data, bytes)

    # What the other side discovered (the names a ROS 2 node matches on). Not via a DCPSPublication reader:
    # taking from built-in topics segfaults in cyclonedds-python 11.0.1.
    pub, _, _ = _connect(pair, "/arm/joint_states", m.JointState)
    writer = pub._writer
    seen = writer.get_matched_subscription_data(writer.get_matched_subscriptions()[0])
    assert (seen.topic_name, seen.type_name) == ("rt/arm/joint_states", "sensor_msgs::msg::dds_::JointState_")


def test_transient_local_late_joiner_gets_the_latched_value(pair):
    a, b = pair
    pub = a.publisher("/rt_test/estop", m.Bool, QOS_LATCHED)
    pub.publish(m.Bool(False))
    pub.publish(m.Bool(True))
    latched, volatile = Inbox(), Inbox()
    b.subscribe("/rt_test/estop", m.Bool, latched, QOS_LATCHED)
    b.subscribe("/rt_test/estop", m.Bool, volatile, QoS(reliable=True, depth=1, transient_local=False))
    assert [x.data for x in latched.wait(1)] == [True]  # depth 1: only the last value
    time.sleep(0.2)
    assert volatile.items == []  # a volatile reader gets nothing from before it joined


def test_best_effort_camera_640x480(pair):
    frame = np.random.default_rng(1).integers(0, 256, (480, 640, 3), dtype=np.uint8)
    pub, sub, inbox = _connect(pair, "/rt_test/camera/image_raw", m.Image, QOS_SENSOR)
    # Best effort may lose a frame (that is its contract): send until one arrives.
    for _ in range(20):
        pub.publish(m.Image.from_array(frame, header=_header()))
        if inbox.wait(1, timeout=0.5):
            break
    got = inbox.wait(1)
    assert got, "no frame arrived over best-effort"
    assert (got[0].height, got[0].width, got[0].encoding, got[0].step) == (480, 640, "rgb8", 1920)
    np.testing.assert_array_equal(got[0].to_array(), frame)


def test_reliable_640x480_frames_arrive_complete_and_in_order(pair):
    frames = np.random.default_rng(2).integers(0, 256, (3, 480, 640, 3), dtype=np.uint8)
    pub, _, inbox = _connect(pair, "/rt_test/camera/reliable", m.Image)
    for i, frame in enumerate(frames):
        pub.publish(m.Image.from_array(frame, header=_header(i)))
    got = inbox.wait(3)
    assert [g.header.stamp.sec for g in got] == [_header(i).stamp.sec for i in range(3)]
    for g, frame in zip(got, frames):
        np.testing.assert_array_equal(g.to_array(), frame)


def test_best_effort_writer_does_not_match_a_reliable_reader(pair):
    a, b = pair
    b.subscribe("/rt_test/qos_mismatch", m.String, Inbox(), QOS_DEFAULT)
    pub = a.publisher("/rt_test/qos_mismatch", m.String, QOS_SENSOR)
    time.sleep(0.2)
    assert pub.subscription_count() == 0  # as in ROS 2: a reliable subscription needs a reliable publisher


def test_clear_errors_for_bad_topics_types_and_values(pair):
    a, _ = pair
    for bad in ["joint_states", "/a//b", "/a/", "/1st", "/with-dash", "/spa ce", "/" + "x" * 300]:
        with pytest.raises(ValueError, match="topic"):
            a.publisher(bad, m.String)
    a.publisher("/rt_test/typed", m.String)
    with pytest.raises(TypeError, match="std_msgs/msg/String, not std_msgs/msg/Bool"):
        a.subscribe("/rt_test/typed", m.Bool, print)
    with pytest.raises(TypeError, match="not a robot.messages type"):
        a.publisher("/rt_test/dict", dict)
    with pytest.raises(ValueError, match="depth"):
        a.publisher("/rt_test/depth", m.String, QoS(depth=0))
    pub = a.publisher("/rt_test/values", m.Image)
    with pytest.raises(TypeError, match="takes Image, got String"):
        pub.publish(m.String("x"))
    with pytest.raises(ValueError, match="height"):
        pub.publish(m.Image(height=-1))  # uint32
    with pytest.raises(ValueError, match="domain_id"):
        dds.DDSTransport(domain_id=500)


def test_malformed_sample_and_raising_callback_do_not_kill_the_reader(pair, caplog):
    from cyclonedds.pub import DataWriter
    from cyclonedds.topic import Topic

    a, b = pair
    calls = []

    def callback(msg):
        calls.append(msg.data)
        if msg.data == "boom":
            raise RuntimeError("callback failure")

    sub = b.subscribe("/rt_test/robust", m.String, callback)
    codec = dds.codec_for(m.String)
    # A raw writer of the right type sending a string that is not UTF-8: valid CDR (Cyclone itself checks the
    # structure on write and on receipt), but no ROS 2 string; decoding it fails in the reader.
    writer = DataWriter(a._participant, Topic(a._participant, "rt/rt_test/robust", codec.wire_type),
                        qos=dds.dds_qos(QOS_DEFAULT))
    assert wait_until(lambda: len(writer.get_matched_subscriptions()) >= 1)
    bad = codec.to_wire(m.String("x"))
    bad.serialize = lambda **_: b"\x00\x01\x00\x00" + (3).to_bytes(4, "little") + b"\xff\xfe\x00"
    writer.write(bad)
    writer.write(codec.to_wire(m.String("boom")))
    writer.write(codec.to_wire(m.String("after")))
    assert wait_until(lambda: calls == ["boom", "after"]), calls
    assert sub.dropped == 2 and sub.received == 1  # the malformed sample, and the callback that raised
    assert "malformed" in caplog.text
    dds._delete(writer)


def test_close_releases_the_reader_thread_and_is_idempotent():
    before = {t.name for t in threading.enumerate()}
    t = dds.DDSTransport(DOMAIN, "closer")
    t.subscribe("/rt_test/close", m.Bool, Inbox())
    pub = t.publisher("/rt_test/close", m.Bool)
    assert "kinema-dds-closer" in {th.name for th in threading.enumerate()}
    t.close()
    t.close()
    assert {th.name for th in threading.enumerate()} - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(m.Bool(True))
    with pytest.raises(RuntimeError, match="closed"):
        t.publisher("/rt_test/close", m.Bool)


# ----------------------------------------------------------------------------------------------------------------
# Loopback configuration, across processes
# ----------------------------------------------------------------------------------------------------------------


def test_loopback_config_is_the_default_and_pins_everything_to_127_0_0_1(monkeypatch, tmp_path):
    root = ET.parse(dds.LOOPBACK_CONFIG).getroot()
    ns = {"c": "https://cdds.io/config"}
    assert root.find(".//c:AllowMulticast", ns).text == "false"
    assert [p.get("address") for p in root.findall(".//c:Peers/c:Peer", ns)] == ["127.0.0.1"]
    assert [i.get("address") for i in root.findall(".//c:Interfaces/c:NetworkInterface", ns)] == ["127.0.0.1"]
    assert root.find(".//c:ParticipantIndex", ns).text == "auto"
    assert int(root.find(".//c:MaxAutoParticipantIndex", ns).text) >= 10
    assert root.find(".//c:Internal/c:MaxSampleSize", ns).text == "16MiB"  # the size cap, both directions

    loopback_uri = dds.LOOPBACK_CONFIG.resolve().as_uri()
    assert dds.loopback_environment({"PATH": "/bin", "ROS_STATIC_PEERS": "10.0.0.7"}) == {
        "PATH": "/bin", "CYCLONEDDS_URI": loopback_uri, "ROS_LOCALHOST_ONLY": "1",
        "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST", "ROS_STATIC_PEERS": "",
    }
    assert dds.loopback_environment({}, rmw=True)["RMW_IMPLEMENTATION"] == "rmw_cyclonedds_cpp"
    monkeypatch.delenv("CYCLONEDDS_URI")
    assert dds.resolve_config(None) == loopback_uri  # nothing set: loopback
    monkeypatch.setenv("CYCLONEDDS_URI", "file:///robot/lan.xml")
    assert dds.resolve_config(None) is None  # the user's CYCLONEDDS_URI wins
    assert dds.resolve_config("loopback") == loopback_uri
    own = tmp_path / "lan.xml"
    own.write_text("<CycloneDDS/>")
    assert dds.resolve_config(own) == own.resolve().as_uri()
    with pytest.raises(FileNotFoundError, match="not a file"):
        dds.resolve_config(tmp_path / "missing.xml")


# The driver: publishes JointState pings to an echo child process and checks every pong; then reports the UDP
# sockets this process holds and whether anyone joined DDS's multicast group (239.255.0.1) in this namespace.
_DRIVER = r"""
import json, os, subprocess, sys, time, threading
import numpy as np
import robot.messages as m
from robot.transport.dds import DDSTransport

ECHO = '''
import sys, threading
import robot.messages as m
from robot.transport import make_transport
t = make_transport("dds", node_name="echo")
done = threading.Event()
pub = t.publisher("/pong", m.JointState)
def on_ping(msg):
    pub.publish(msg)
    if msg.name == ["stop"]:
        done.set()
t.subscribe("/ping", m.JointState, on_ping)
ok = done.wait(30)
t.close()
sys.exit(0 if ok else 3)
'''

def own_udp_sockets():
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[9] in inodes:
                addr = cols[1].split(":")[0]
                out.append(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)) if len(addr) == 8 else addr)
    return out

t = DDSTransport(int(os.environ.get("ROS_DOMAIN_ID", "0")), "driver")
got, cv = [], threading.Condition()
def on_pong(msg):
    with cv:
        got.append(msg)
        cv.notify_all()
sub = t.subscribe("/pong", m.JointState, on_pong)
pub = t.publisher("/ping", m.JointState)
child = subprocess.Popen([sys.executable, "-c", ECHO])
deadline = time.monotonic() + 20
while (pub.subscription_count() < 1 or sub.publisher_count() < 1) and time.monotonic() < deadline:
    time.sleep(0.01)
sent = [m.JointState(name=["j0", "j1"], position=[i, -i / 3]) for i in range(20)]
for i, msg in enumerate(sent):  # one at a time: a ping-pong, not a burst into keep-last-10 queues
    pub.publish(msg)
    with cv:
        cv.wait_for(lambda: len(got) > i, 5)
pongs = len(got)
ok = pongs == len(sent) and all(
    g.name == s.name and np.array_equal(g.position, s.position) for g, s in zip(got, sent))
pub.publish(m.JointState(name=["stop"]))
rc = child.wait(30)
igmp = open("/proc/net/igmp").read()
print(json.dumps({"ok": ok, "pongs": pongs, "child_rc": rc, "sockets": own_udp_sockets(),
                  "spdp_multicast_joined": "0100FFEF" in igmp.upper()}))
t.close()
"""


def _run_driver(prefix: list[str], env: dict) -> dict:
    # Its own process group: on a timeout the driver's echo child is killed with it, not left running.
    proc = subprocess.Popen(prefix + [sys.executable, "-c", _DRIVER], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"the DDS driver did not finish within 90 s:\n{err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _check_driver_report(report: dict) -> None:
    assert report["ok"] and report["pongs"] == 20 and report["child_rc"] == 0, report
    # Cyclone binds its unicast receive sockets to the wildcard address (hard-coded upstream) and its transmit
    # socket to the chosen interface: with the loopback config that is 127.0.0.1, never a LAN address.
    assert "127.0.0.1" in report["sockets"], report
    assert set(report["sockets"]) <= {"127.0.0.1", "0.0.0.0"}, report


def test_ping_pong_across_processes_uses_loopback_by_default():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CYCLONEDDS_URI")  # no config anywhere: DDSTransport's own default must be loopback
    _check_driver_report(_run_driver([], env))


def _netns_available() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    return subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _netns_available(), reason="unprivileged network namespaces (unshare -rn) not available")
def test_ping_pong_across_processes_in_a_private_network_namespace():
    """Inside `unshare -n` only a loopback interface exists: nothing could leave even if a setting were wrong."""
    env = dds.loopback_environment({**os.environ, "PYTHONPATH": str(REPO)})
    report = _run_driver(["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "netns"], env)
    _check_driver_report(report)
    assert not report["spdp_multicast_joined"], report


# ----------------------------------------------------------------------------------------------------------------
# rclpy (only where ROS 2 is installed)
# ----------------------------------------------------------------------------------------------------------------


def _rclpy_importable() -> bool:
    try:
        import rclpy  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(_rclpy_importable(), reason="ROS 2 is installed here")
def test_rclpy_backend_without_ros_names_the_dds_alternative():
    with pytest.raises(ImportError, match="'dds' backend"):
        make_transport("rclpy", domain_id=DOMAIN)
    with make_transport("auto", domain_id=DOMAIN) as auto:
        assert isinstance(auto, dds.DDSTransport)  # auto falls back to DDS


@pytest.mark.skipif(not _rclpy_importable(), reason="rclpy not installed (no ROS 2 here)")
@pytest.mark.parametrize("msg_type", TYPES, ids=lambda t: t.__name__)
def test_rclpy_round_trips_every_message_type_and_talks_to_dds(msg_type):
    import rclpy.utilities

    ros = make_transport("rclpy", node_name="test_rclpy", domain_id=DOMAIN)
    try:
        inbox = Inbox()
        topic = f"/rclpy_test/{msg_type.__name__.lower()}"
        ros.subscribe(topic, msg_type, inbox)
        pub = ros.publisher(topic, msg_type)
        assert wait_until(lambda: pub.subscription_count() >= 1)
        pub.publish(FULL[msg_type])
        assert_same(inbox.wait(1)[0], FULL[msg_type])
        if rclpy.utilities.get_rmw_implementation_identifier() == "rmw_cyclonedds_cpp":
            # The point of the DDS backend: a real ROS 2 node and it understand each other.
            with dds.DDSTransport(DOMAIN, "test_dds_peer") as peer:
                dds_pub = peer.publisher(topic, msg_type)
                assert wait_until(lambda: dds_pub.subscription_count() >= 1)
                dds_pub.publish(FULL[msg_type])
                assert_same(inbox.wait(2)[1], FULL[msg_type])
    finally:
        ros.close()


@pytest.mark.skipif(_rclpy_importable(), reason="ROS 2 is installed here: rclpy.init would run")
def test_local_pins_the_rclpy_path_before_rclpy_is_touched(monkeypatch):
    """`--local` under rclpy: the pinned variables are in the environment before rclpy (and its rmw) load."""
    for var in ("CYCLONEDDS_URI", "ROS_LOCALHOST_ONLY", "ROS_AUTOMATIC_DISCOVERY_RANGE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ROS_STATIC_PEERS", "192.168.1.20")
    with pytest.raises(ImportError, match="'dds' backend"):  # no ROS here: the pinning is what we can observe
        make_transport("rclpy", domain_id=DOMAIN, local=True)
    assert os.environ["CYCLONEDDS_URI"] == dds.LOOPBACK_CONFIG.resolve().as_uri()
    assert os.environ["ROS_LOCALHOST_ONLY"] == "1"
    assert os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "LOCALHOST"
    assert os.environ["ROS_STATIC_PEERS"] == ""


def test_local_dds_ignores_a_lan_cyclonedds_uri(monkeypatch, tmp_path):
    lan = tmp_path / "lan.xml"
    lan.write_text("<CycloneDDS/>")
    monkeypatch.setenv("CYCLONEDDS_URI", lan.resolve().as_uri())
    # Another domain: this process already runs DOMAIN on CYCLONEDDS_URI (one config per domain per process).
    with make_transport("dds", domain_id=DOMAIN % 101 + 1, local=True) as t:
        assert t.config == dds.LOOPBACK_CONFIG.resolve().as_uri()
    assert os.environ["CYCLONEDDS_URI"] == dds.LOOPBACK_CONFIG.resolve().as_uri()
    with pytest.raises(ValueError, match="local=True"):
        make_transport("dds", domain_id=DOMAIN, local=True, config=str(lan))


def test_inproc_matches_qos_like_dds_so_mismatches_show_in_unit_tests():
    """Request-offered: a transient-local subscription never hears a volatile publisher, a reliable one never hears
    a best-effort publisher (both lose every message on a real DDS graph; inproc must not hide that)."""
    bus = InprocBus()
    t = InprocTransport(bus)
    heard: dict[str, list] = {"latched": [], "volatile": [], "reliable": [], "best_effort": []}
    t.subscribe("/a", m.Bool, heard["latched"].append, QOS_LATCHED)
    t.subscribe("/a", m.Bool, heard["volatile"].append, QOS_DEFAULT)
    t.subscribe("/b", m.Bool, heard["reliable"].append, QOS_DEFAULT)
    t.subscribe("/b", m.Bool, heard["best_effort"].append, QOS_SENSOR)
    t.publisher("/a", m.Bool, QOS_DEFAULT).publish(m.Bool(True))
    t.publisher("/a", m.Bool, QOS_LATCHED).publish(m.Bool(False))
    t.publisher("/b", m.Bool, QOS_SENSOR).publish(m.Bool(True))
    t.publisher("/b", m.Bool, QOS_DEFAULT).publish(m.Bool(False))
    assert [x.data for x in heard["latched"]] == [False]
    assert [x.data for x in heard["volatile"]] == [True, False]
    assert [x.data for x in heard["reliable"]] == [False]
    assert [x.data for x in heard["best_effort"]] == [True, False]


def test_make_transport_rejects_bad_backend_and_domain(monkeypatch):
    with pytest.raises(ValueError, match="unknown transport backend 'zmq'"):
        make_transport("zmq")
    monkeypatch.setenv("ROS_DOMAIN_ID", "robot1")
    with pytest.raises(ValueError, match="ROS_DOMAIN_ID='robot1'"):
        make_transport("dds")


def test_field_errors_name_the_field():
    to_wire = dds.codec_for(m.JointState).to_wire
    with pytest.raises(ValueError, match=r"sensor_msgs/msg/JointState.header=.*builtin_interfaces/msg/Time.sec=1.5"):
        to_wire(m.JointState(header=m.Header(stamp=m.Time(sec=1.5))))  # a float is not silently truncated
    with pytest.raises(ValueError, match=r"JointState.name=\['a', 3\]: expected str, got int"):
        to_wire(m.JointState(name=["a", 3]))


def test_message_dataclasses_follow_their_msg_definitions_field_for_field():
    import dataclasses

    from robot.messages import MESSAGE_TYPES, msg_fields

    for ros_type, cls in MESSAGE_TYPES.items():
        assert [f.name for f in dataclasses.fields(cls)] == [name for _, name in msg_fields(ros_type)], ros_type
    with pytest.raises(KeyError, match="no .msg definition"):
        msg_fields("std_msgs/msg/Nope")
