"""A stand-in for a ros2_control arm, written as a robot's own ROS 2 code would be: plain rclpy, rosidl's message
classes, rclpy timers; nothing of kinema. tests/test_robot_e2e.py drives `kinema deploy` with it.

    python tests/ros2_control_stand_in.py CONFIG_JSON

What a ros2_control setup with a joint_state_broadcaster, a forward_position_controller and camera drivers exposes:
- `/joint_states` (sensor_msgs/JointState, reliable) at `state_hz`, stamped with the node's clock;
- one sensor_msgs/Image (rgb8, best effort: rclpy's sensor-data profile) per camera at `camera_hz`;
- the controller's commands topic (std_msgs/Float64MultiArray, reliable): each valid command (one finite value per
  joint) becomes the target, and the joints move toward it at up to `max_velocity` rad/s, integrated at each state
  tick (a position-controlled arm that follows its setpoint with a bounded speed).

To check that nothing is commanded before the first valid state, the node publishes no joint state until every
endpoint matched its peer (the command topic's publisher, the state and camera topics' subscriptions), then
`invalid_s` seconds of invalid joint states (alternately: a joint missing, a NaN position), then valid ones.

Ends on a line "stop" (or EOF) on stdin, or after `max_s` seconds; prints "ready" once up, and one JSON report as its
last line: every command with its arrival time, the joint state at every tick once valid, and counts. Times are
seconds since the node started, on one monotonic clock.

CONFIG_JSON keys: joint_names, initial, joint_states_topic, commands_topic, cameras ([{topic, width, height}]),
state_hz, camera_hz, max_velocity, invalid_s, max_s, and optionally match_timeout_s (default 30).

Network: this script pins nothing itself; its caller gives it an environment pinned to loopback
(robot.transport.loopback.loopback_environment), which rclpy's rmw reads at rclpy.init().
"""

import array
import json
import sys
import threading
import time

import numpy as np
import rclpy
from rclpy.qos import QoSProfile, qos_profile_sensor_data
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray


def main(config: dict) -> dict:
    names = list(config["joint_names"])
    q = np.array(config["initial"], np.float64)
    assert q.shape == (len(names),), "initial: one position per joint"
    state_dt, vmax = 1.0 / config["state_hz"], float(config["max_velocity"])
    t0 = time.monotonic()

    def now() -> float:
        return round(time.monotonic() - t0, 4)

    stop = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()

    rclpy.init()
    node = rclpy.create_node("ros2_control_stand_in")
    report: dict = {"commands": [], "trace": [], "rejected_commands": 0, "invalid_states": 0, "frames": 0,
                    "first_valid_t": None, "matched_t": None, "matched": False}
    target: list = [None]

    def on_command(m: Float64MultiArray) -> None:
        data = np.array(m.data, np.float64)
        report["commands"].append([now(), data.tolist()])
        if data.shape == q.shape and np.isfinite(data).all():
            target[0] = data
        else:
            report["rejected_commands"] += 1

    reliable = QoSProfile(depth=10)  # ROS 2's default: reliable, volatile, keep-last 10
    command_sub = node.create_subscription(Float64MultiArray, config["commands_topic"], on_command, reliable)
    state_pub = node.create_publisher(JointState, config["joint_states_topic"], reliable)
    cameras = []
    for i, cam in enumerate(config["cameras"]):
        h, w = cam["height"], cam["width"]
        frame = np.zeros((h, w, 3), np.uint8)
        frame[..., i % 3] = np.linspace(0, 255, w, dtype=np.uint8)  # some picture; its content is not checked
        cameras.append((node.create_publisher(Image, cam["topic"], qos_profile_sensor_data), h, w, frame.tobytes()))

    def all_matched() -> bool:
        return (command_sub.get_publisher_count() >= 1 and state_pub.get_subscription_count() >= 1
                and all(pub.get_subscription_count() >= 1 for pub, *_ in cameras))

    def publish_state() -> None:
        t = now()
        if report["matched_t"] is None:
            if not all_matched():
                return
            report["matched_t"], report["matched"] = t, True
        if target[0] is not None:  # follow the setpoint at a bounded speed
            step = vmax * state_dt
            q[:] = q + np.clip(target[0] - q, -step, step)
        msg = JointState()
        msg.header.stamp = node.get_clock().now().to_msg()
        if t < report["matched_t"] + config["invalid_s"]:
            k = report["invalid_states"]
            report["invalid_states"] += 1
            if k % 2 == 0:  # a joint missing (matched by name: this state does not say where that joint is)
                msg.name, msg.position = names[:-1], q[:-1].tolist()
            else:  # a NaN position
                msg.name, msg.position = names, [float("nan"), *q[1:].tolist()]
        else:
            if report["first_valid_t"] is None:
                report["first_valid_t"] = t
            msg.name, msg.position = names, q.tolist()
            report["trace"].append([t, q.tolist()])
        state_pub.publish(msg)

    def publish_frames() -> None:
        stamp = node.get_clock().now().to_msg()
        for pub, h, w, data in cameras:
            img = Image(height=h, width=w, encoding="rgb8", is_bigendian=0, step=3 * w)
            img.header.stamp = stamp
            img.data = array.array("B", data)
            pub.publish(img)
        report["frames"] += 1

    node.create_timer(state_dt, publish_state)
    node.create_timer(1.0 / config["camera_hz"], publish_frames)
    print("ready", flush=True)
    deadline = t0 + config["max_s"]
    match_deadline = t0 + config.get("match_timeout_s", 30.0)
    while not stop.is_set() and time.monotonic() < deadline:
        if report["matched_t"] is None and time.monotonic() > match_deadline:
            break
        rclpy.spin_once(node, timeout_sec=0.01)
    report["ended_t"] = now()
    report["final"] = q.tolist()
    node.destroy_node()
    rclpy.shutdown()
    return report


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
