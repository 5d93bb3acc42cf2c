"""A MuJoCo arm exposed as a ROS 2 robot, optionally with a kinema policy driving it.

    ros2 launch launch/sim_robot.launch.py task:=pick_place
    ros2 launch launch/sim_robot.launch.py task:=pick_place policy:=/path/to/checkpoint

`kinema sim-robot` publishes /joint_states and the camera images and accepts forward-position and trajectory
commands, like a ros2_control arm. With `policy:=...`, `kinema deploy` runs against it. Both default to
`local:=true`: `--local` and the pinned environment (CycloneDDS loopback XML, ROS_LOCALHOST_ONLY=1,
ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST) with either backend, rclpy included, so nothing leaves this machine.

The executable is found through the ament index; see bridge.launch.py for the one-time registration.
This folder is not a Python package (`launch` is ROS 2's own module name).
"""

import os
import sys

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

try:
    from robot.transport.loopback import loopback_variables
except ImportError:  # run from a checkout whose kinema is not installed in ROS 2's Python: use the checkout's
    sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)))
    from robot.transport.loopback import loopback_variables

from robot.paths import assets_dir

DEFAULT_ROBOT = str(assets_dir() / "robots" / "sim_panda.yaml")


def _local_env(local: bool) -> dict:
    """The node's environment additions: with local:=true, the network rule's pinned variables (the same ones
    `--local` sets, from robot.transport.loopback), so that nothing the node or its rmw starts leaves this host."""
    return loopback_variables() if local else {}


def _nodes(context):
    def arg(name: str) -> str:
        return LaunchConfiguration(name).perform(context)

    local = arg("local").lower() == "true"
    common = ["--robot", arg("robot"), "--backend", arg("backend"), "--local" if local else "--no-local"]
    env = _local_env(local)
    nodes = [
        Node(
            package="kinema", executable="kinema", name="kinema_sim_robot", output="screen", additional_env=env,
            arguments=["sim-robot", "--task", arg("task"), "--seed", arg("seed"), "--rate", arg("rate"), *common],
        )
    ]
    if arg("policy"):
        deploy = ["deploy", "--policy", arg("policy"), *common]
        if arg("record"):
            deploy += ["--record", arg("record")]
        nodes.append(
            Node(package="kinema", executable="kinema", name="kinema_deploy", arguments=deploy, output="screen",
                 additional_env=env)
        )
    return nodes


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument("task", default_value="pick_place", description="sim task (see `kinema sim list`)"),
        DeclareLaunchArgument("robot", default_value=DEFAULT_ROBOT, description="robot config YAML of the sim arm"),
        DeclareLaunchArgument(
            "backend", default_value="auto", choices=["auto", "rclpy", "dds"],
            description="transport: rclpy (this ROS 2 install), dds (CycloneDDS, ROS 2 wire format) or auto",
        ),
        DeclareLaunchArgument("seed", default_value="0", description="episode seed (layouts follow from it)"),
        DeclareLaunchArgument("rate", default_value="50", description="simulation and /joint_states rate in Hz"),
        DeclareLaunchArgument(
            "local", default_value="true", choices=["true", "false"],
            description="keep all ROS 2 traffic on this machine (loopback), with either backend",
        ),
        DeclareLaunchArgument("policy", default_value="", description="checkpoint to deploy against it ('' = none)"),
        DeclareLaunchArgument("record", default_value="", description="folder for recorded episodes ('' = off)"),
        OpaqueFunction(function=_nodes),
    ])
