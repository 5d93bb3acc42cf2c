"""A MuJoCo arm exposed as a ROS 2 robot, optionally with a kinema policy driving it.

    ros2 launch launch/sim_robot.launch.py task:=pick_place
    ros2 launch launch/sim_robot.launch.py task:=pick_place policy:=/path/to/checkpoint

`kinema sim-robot` publishes /joint_states and the camera images and accepts forward-position and trajectory
commands, like a ros2_control arm. With `policy:=...`, `kinema deploy` runs against it. Both default to loopback
DDS (`local:=true`), so nothing leaves this machine.

The executable is found through the ament index; see bridge.launch.py for the one-time registration.
This folder is not a Python package (`launch` is ROS 2's own module name).
"""

import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "assets")
DEFAULT_ROBOT = os.path.normpath(os.path.join(ASSETS, "robots", "sim_panda.yaml"))


def _nodes(context):
    def arg(name: str) -> str:
        return LaunchConfiguration(name).perform(context)

    local = ["--local"] if arg("local").lower() == "true" else ["--no-local"]
    common = ["--robot", arg("robot"), "--backend", arg("backend"), *local]
    nodes = [
        Node(
            package="kinema", executable="kinema", name="kinema_sim_robot", output="screen",
            arguments=["sim-robot", "--task", arg("task"), "--seed", arg("seed"), "--rate", arg("rate"), *common],
        )
    ]
    if arg("policy"):
        deploy = ["deploy", "--policy", arg("policy"), *common]
        if arg("record"):
            deploy += ["--record", arg("record")]
        nodes.append(
            Node(package="kinema", executable="kinema", name="kinema_deploy", arguments=deploy, output="screen")
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
            description="pin DDS to this machine (loopback)",
        ),
        DeclareLaunchArgument("policy", default_value="", description="checkpoint to deploy against it ('' = none)"),
        DeclareLaunchArgument("record", default_value="", description="folder for recorded episodes ('' = off)"),
        OpaqueFunction(function=_nodes),
    ])
