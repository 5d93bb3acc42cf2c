"""ROS 2 bridge latency over DDS on loopback: the policy node's observation-to-command overhead against raw DDS.

Two processes on one loopback DDS domain (the network rule: robot.transport.loopback pins this process and its
children, and the domain is always a private random one, never the caller's ROS_DOMAIN_ID, so that the benchmark's
policy node can never command a real arm on this host): this one plays the robot and measures; a child plays the
other side. In the same run:
1. raw: JointState ping-pong RTT through an echo in the child (the physical limit of this transport on this machine),
   interleaved with the bridge's states (half a period apart), so both see the same load;
2. bridge, state-triggered: /joint_states -> the policy node (zero-cost policy, EE-delta actions through IK and the
   safety layer, ticking on every fresh state) -> the forward-position command back, at 50 Hz and at 200 Hz. Each
   state carries a distinct joint1 position, so every command identifies the state it answers (this process
   computes the expected command with the same mapper); overhead = bridge p99 - raw p99 at the same rate, the worse
   of the two rates; `ratio_p99` = bridge p99 / raw p99 at that rate;
3. bridge, timer-triggered (what `kinema deploy` runs): the node ticks on its own 200 Hz clock and commands from the
   latest state. The age of the answered state when its command arrives includes the wait for the next tick (up to
   one period, `timer_period_ms`), so it is reported as it is, with its ratio to raw p99;
4. loss: commands the node published minus commands received, over the timer-triggered 200 Hz run (60 s; 30 s in
   --quick, or 20 s when the run so far leaves no room for 30 s under a minute: see `loss_seconds`);
5. image: 640x480 rgb8 Image round trip through the echo node (best-effort camera QoS, as cameras use);
6. interop (where rclpy is importable, else null): JointState ping-pong RTT at 50 Hz between this process's DDS
   backend (CycloneDDS) and an echo that is a real ROS 2 node (the rclpy backend on rclpy's default rmw, Fast DDS),
   pinned to loopback like the rest: the DDS backend talking to ROS 2 as a robot's drivers run it.

Targets: overhead p99 <= 2 ms, 0 commands lost at 200 Hz, image round trip p99 <= 10 ms. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import time
from typing import Any

import numpy as np

PING, PONG, IMAGE, IMAGE_ECHO = "/bench/ping", "/bench/pong", "/bench/image", "/bench/image_echo"


def bench_robot(rate_hz: float):
    """sim_panda without cameras, ticking at up to `rate_hz` (the bounded rate leaves room for jitter)."""
    from robot.config import RatesConfig, load_robot_config, replace

    robot = load_robot_config("sim_panda")
    return replace(robot, cameras=[], rates=RatesConfig(control_hz=rate_hz, max_command_hz=5 * rate_hz, state_timeout_ms=500, image_timeout_ms=500))


# ----- the other side (child process) -------------------------------------------------------------------------------
def serve(role: str, rate_hz: float, conn, trigger: str = "state") -> None:
    from robot import messages as msg
    from robot.transport import QOS_SENSOR, make_transport

    # rclpy_echo: the echo as a real ROS 2 node (rclpy, on its default rmw), for the interop measurement.
    backend = "rclpy" if role == "rclpy_echo" else "dds"
    transport = make_transport(backend, node_name=f"bench_{role}", local=True)
    stats: dict[str, Any] = {}
    node = None
    # Both roles echo pings: the bridge's process echoes them too, so raw and bridge round trips are measured at
    # the same moments, between the same two processes, under the same load.
    pong = transport.publisher(PONG, msg.JointState)
    transport.subscribe(PING, msg.JointState, pong.publish)
    if role == "echo":
        image_echo = transport.publisher(IMAGE_ECHO, msg.Image, QOS_SENSOR)
        transport.subscribe(IMAGE, msg.Image, image_echo.publish, QOS_SENSOR)
    elif role == "bridge":
        from robot.policy_node import HOLD_STILL, ConstantPolicy, PolicyNode

        node = PolicyNode(transport, bench_robot(rate_hz), ConstantPolicy(HOLD_STILL), "hold still", trigger=trigger,
                          status_period_s=3600)
        node.start()
    conn.send("ready")
    conn.recv()  # "stop"
    if node is not None:
        node.close()
        stats = {"published": node.stats["commands_published"], "ticks": node.tick_count, "safety": dict(node.safety.counters)}
    transport.close()
    conn.send(stats)


class Child:
    def __init__(self, role: str, rate_hz: float = 200.0, trigger: str = "state") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(role, rate_hz, child_conn, trigger), daemon=True)
        self.proc.start()
        try:
            ready = self.conn.poll(60) and self.conn.recv() == "ready"
        except EOFError:  # the child died before saying anything
            ready = False
        if not ready:
            self._end()
            raise RuntimeError(f"benchmark {role} process did not start (exit code {self.proc.exitcode})")

    def _end(self) -> None:
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)

    def stop(self) -> dict[str, Any]:
        try:
            self.conn.send("stop")
            return self.conn.recv() if self.conn.poll(30) else {}
        finally:
            self._end()


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1e3, 3) if values else None


def paced(rate_hz: float, n: int, fn) -> None:
    period = 1.0 / rate_hz
    t0 = time.perf_counter()
    for k in range(n):
        delay = t0 + k * period - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        fn(k)


def wait_for(predicate, timeout: float, poke=None) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        if poke is not None:
            poke()
        time.sleep(0.05)
    return False


# ----- measurements (this process) ----------------------------------------------------------------------------------
def image_rtt(transport, n: int, rate_hz: float) -> tuple[list[float], int]:
    from robot import messages as msg
    from robot.transport import QOS_SENSOR

    sent: dict[int, float] = {}
    rtts: list[float] = []
    frame = np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8)

    def on_echo(m: msg.Image) -> None:
        t = time.perf_counter()
        k = m.header.stamp.sec
        if k in sent and m.height == 480 and m.width == 640 and len(m.data) == frame.nbytes:
            rtts.append(t - sent.pop(k))

    transport.subscribe(IMAGE_ECHO, msg.Image, on_echo, QOS_SENSOR)
    pub = transport.publisher(IMAGE, msg.Image, QOS_SENSOR)

    def send(k: int) -> None:
        sent[k] = time.perf_counter()
        pub.publish(msg.Image.from_array(frame, msg.Header(stamp=msg.Time(sec=k))))

    wait_for(lambda: len(rtts) > 0, 20, poke=lambda: send(10**6))
    time.sleep(0.2)
    rtts.clear()
    paced(rate_hz, n, send)
    time.sleep(0.3)
    return rtts, len(sent)


def ping_rtt(transport, n: int, rate_hz: float) -> tuple[list[float], int]:
    """JointState pings to the echo in a child process, `n` at `rate_hz` after a warm-up; their round trips and the
    number never answered."""
    from robot import messages as msg

    sent: dict[int, float] = {}
    rtts: list[float] = []
    warm = 10**6  # warm-up pings carry k >= warm
    warm_answers: list[int] = []

    def on_pong(m: msg.JointState) -> None:
        t = time.perf_counter()
        k = int(round(m.position[0]))
        if k >= warm:
            warm_answers.append(k)
        elif k in sent:
            rtts.append(t - sent.pop(k))

    sub = transport.subscribe(PONG, msg.JointState, on_pong)
    pub = transport.publisher(PING, msg.JointState)
    pokes = iter(range(warm, 2 * warm))

    def send(k: int) -> None:
        sent[k] = time.perf_counter()
        pub.publish(msg.JointState(name=["joint1"], position=[float(k)]))

    # Ping until one comes back (matching, both ways), then let the other warm-up answers drain.
    answered = wait_for(lambda: bool(warm_answers), 30,
                        poke=lambda: pub.publish(msg.JointState(name=["joint1"], position=[float(next(pokes))])))
    if answered:
        time.sleep(0.2)
        paced(rate_hz, n, send)
        time.sleep(0.3)
    sub.close()
    pub.close()
    return rtts, (len(sent) if answered else n)


def rclpy_importable() -> bool:
    try:
        import rclpy  # noqa: F401
    except ImportError:
        return False
    return True


def bridge_run(transport, rate_hz: float, seconds: float, trigger: str = "state") -> dict[str, Any]:
    """States at `rate_hz` to a fresh policy node process (ticking on each state, or on its own `rate_hz` timer);
    per state, the latency of the first command answering it."""
    from robot import messages as msg
    from robot.kinematics import ActionMapper
    from robot.policy_node import HOLD_STILL

    robot = bench_robot(rate_hz)
    mapper = ActionMapper(robot)
    names = robot.command_joint_names
    home = np.concatenate([robot.home, [0.04, 0.04]])
    zero = HOLD_STILL
    n = int(seconds * rate_hz)
    warm = int(rate_hz)  # one second of warm-up states, not measured
    positions, expected = [], {}
    for k in range(warm + n):
        q = home.copy()
        q[0] += 1e-5 * k  # distinct per state, far below any step bound
        positions.append(q)
        expected[mapper.to_command(zero, q[:7]).tobytes()] = k
    sent: dict[int, float] = {}
    latencies: list[float] = []
    received = [0]
    matched: set[int] = set()

    def on_command(m: msg.Float64MultiArray) -> None:
        t = time.perf_counter()
        received[0] += 1
        k = expected.get(m.data.tobytes())
        # The first command for a state only: a timer tick with no fresh state repeats the last one's command.
        if k is not None and k in sent and k >= warm and k not in matched:
            latencies.append(t - sent[k])
            matched.add(k)

    pinged: dict[int, float] = {}
    raw: list[float] = []

    def on_pong(m: msg.JointState) -> None:
        t = time.perf_counter()
        k = int(round(m.position[0] * 1e6))
        if k in pinged and k >= warm:
            raw.append(t - pinged.pop(k))

    child = Child("bridge", rate_hz, trigger)
    try:
        sub = transport.subscribe(robot.controller.commands_topic, msg.Float64MultiArray, on_command)
        pong_sub = transport.subscribe(PONG, msg.JointState, on_pong)
        pub = transport.publisher(robot.topics.joint_states, msg.JointState)
        ping = transport.publisher(PING, msg.JointState)
        wait_for(lambda: min(pub.subscription_count(), sub.publisher_count(), ping.subscription_count(), pong_sub.publisher_count()) > 0, 30)

        def send(i: int) -> None:
            # States and pings alternate, half a period apart, both at `rate_hz`.
            k = i // 2
            if i % 2 == 0:
                sent[k] = time.perf_counter()
                pub.publish(msg.JointState(name=names, position=positions[k]))
            else:
                pinged[k] = time.perf_counter()
                ping.publish(msg.JointState(name=names, position=np.r_[k * 1e-6, np.zeros(len(names) - 1)]))

        paced(2 * rate_hz, 2 * (warm + n), send)
        time.sleep(0.5)  # let the last commands arrive before counting
    finally:
        stats = child.stop()
    for endpoint in (sub, pong_sub, pub, ping):
        endpoint.close()
    published = int(stats.get("published", 0))
    return {
        "raw": raw,
        "latencies": latencies,
        "states": n,
        "answered": len(matched),
        "published": published,
        "received": received[0],
        "lost": published - received[0],
        "node_safety": stats.get("safety", {}),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="under a minute: shorter runs (the JSON says how long)")
    args = parser.parse_args()
    from robot.transport.loopback import pin_to_loopback

    # The network rule: this run and its (spawned) children stay on loopback, on a private random domain, whatever
    # ROS_DOMAIN_ID says: the caller's domain may hold a real arm listening on the commands topic.
    pin_to_loopback()
    os.environ["ROS_DOMAIN_ID"] = str(random.SystemRandom().randint(1, 101))

    from robot.transport import make_transport

    q = args.quick
    image_n = 100 if q else 300
    interop_n = 100 if q else 500  # pings at 50 Hz: 2 s or 10 s
    seconds_50, seconds_200 = (5.0, 5.0) if q else (20.0, 20.0)
    budget_s = 60.0  # --quick's promise
    t_start = time.perf_counter()
    transport = make_transport("dds", node_name="bench_robot", local=True)
    try:
        echo = Child("echo")
        try:
            images, image_sent_unanswered = image_rtt(transport, image_n, 20.0)
        finally:
            echo.stop()
        b50 = bridge_run(transport, 50.0, seconds_50)
        b200 = bridge_run(transport, 200.0, seconds_200)
        # The loss window: 30 s in --quick when it still fits under a minute (a second of warm-up, ~1.5 s of process
        # start and wind-down, 2 s of slack), else 20 s.
        elapsed = time.perf_counter() - t_start
        loss_seconds = 60.0 if not q else (30.0 if elapsed + 30.0 + 4.5 <= budget_s else 20.0)
        timer = bridge_run(transport, 200.0, loss_seconds, trigger="timer")
        # Last, so that it never shortens the loss window; in --quick only when it still fits under a minute
        # (~2 s of pings, ~2 s to start the rclpy process, 1 s of slack).
        interop: tuple[list[float], int] | None = None
        interop_note = None if rclpy_importable() else "rclpy not installed (pip install 'kinema[rclpy]')"
        if interop_note is None and q and time.perf_counter() - t_start + 5.0 > budget_s:
            interop_note = "skipped in --quick: no room left under a minute"
        if interop_note is None:
            ros_echo = Child("rclpy_echo")
            try:
                interop = ping_rtt(transport, interop_n, 50.0)
            finally:
                ros_echo.stop()
    finally:
        transport.close()

    raw = b50["raw"] + b200["raw"] + timer["raw"]
    over = {
        hz: None if not b["raw"] or not b["latencies"] else round(pct(b["latencies"], 99) - pct(b["raw"], 99), 3)
        for hz, b in ((50, b50), (200, b200))
    }
    over50 = {
        hz: None if not b["raw"] or not b["latencies"] else round(pct(b["latencies"], 50) - pct(b["raw"], 50), 3)
        for hz, b in ((50, b50), (200, b200))
    }
    worst = max((hz for hz in over if over[hz] is not None), key=lambda hz: over[hz], default=None)
    worst_run = {50: b50, 200: b200}.get(worst)
    result = {
        "benchmark": "bridge_latency",
        "quick": q,
        "transport": "dds (cyclonedds, loopback)",
        "raw_rtt_samples": len(raw),
        "raw_rtt_p50_ms": pct(raw, 50),
        "raw_rtt_p99_ms": pct(raw, 99),
        "raw_rtt_50hz_p99_ms": pct(b50["raw"], 99),
        "raw_rtt_200hz_p99_ms": pct(b200["raw"], 99),
        "bridge_50hz_p50_ms": pct(b50["latencies"], 50),
        "bridge_50hz_p99_ms": pct(b50["latencies"], 99),
        "bridge_200hz_p50_ms": pct(b200["latencies"], 50),
        "bridge_200hz_p99_ms": pct(b200["latencies"], 99),
        "bridge_50hz_samples": len(b50["latencies"]),
        "bridge_200hz_samples": len(b200["latencies"]),
        # Per rate, bridge p99 minus the raw p99 measured alongside it; the headline is the worse of the two rates
        # (pooling them would weight the rates by their sample counts).
        "overhead_p99_ms": None if None in over.values() else max(over.values()),
        "overhead_50hz_p99_ms": over[50],
        "overhead_200hz_p99_ms": over[200],
        "overhead_p50_ms": None if None in over50.values() else max(over50.values()),
        # The reference ratio (Conventions): bridge p99 / raw p99, at the rate where the overhead is worse.
        "ratio_p99": None if worst_run is None else ratio(pct(worst_run["latencies"], 99), pct(worst_run["raw"], 99)),
        "ratio_rate_hz": worst,
        # deploy's path: the node's own 200 Hz timer; the state's age includes the wait for the next tick.
        "timer_200hz_state_age_p50_ms": pct(timer["latencies"], 50),
        "timer_200hz_state_age_p99_ms": pct(timer["latencies"], 99),
        "timer_200hz_raw_rtt_p99_ms": pct(timer["raw"], 99),
        "timer_200hz_ratio_p99": ratio(pct(timer["latencies"], 99), pct(timer["raw"], 99)),
        "timer_period_ms": 5.0,
        "timer_200hz_states_answered": timer["answered"],
        "timer_200hz_states": timer["states"],
        "loss_seconds": loss_seconds,
        "loss_trigger": "timer",
        "commands_published": timer["published"],
        "commands_received": timer["received"],
        "commands_lost": timer["lost"],
        "states_unanswered_200hz": b200["states"] - b200["answered"],
        "states_unanswered_50hz": b50["states"] - b50["answered"],
        "image_rtt_samples": len(images),
        "image_rtt_p50_ms": pct(images, 50),
        "image_rtt_p99_ms": pct(images, 99),
        "images_lost": image_sent_unanswered,
        # DDS backend <-> a real ROS 2 node (rclpy on its default rmw; null where rclpy is not installed)
        "interop_peer": None if interop is None else "rclpy (rmw default: Fast DDS), separate process",
        "interop_rtt_samples": None if interop is None else len(interop[0]),
        "interop_rtt_p50_ms": None if interop is None else pct(interop[0], 50),
        "interop_rtt_p99_ms": None if interop is None else pct(interop[0], 99),
        "interop_pings_lost": None if interop is None else interop[1],
        "interop_note": interop_note,
        "targets": {"overhead_p99_ms": 2.0, "commands_lost": 0, "image_rtt_p99_ms": 10.0},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    if q and loss_seconds < 30.0:
        result["loss_seconds_note"] = "20 s, not 30: the runs before it left no room for 30 s under a minute"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
