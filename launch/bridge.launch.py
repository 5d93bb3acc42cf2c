"""Deploy a kinema policy on a ROS 2 arm.

    ros2 launch launch/bridge.launch.py policy:=/path/to/checkpoint robot:=assets/robots/<arm>.yaml

Runs `kinema deploy` as a ROS 2 node: it reads /joint_states and the cameras named in the robot config, and
commands the arm's ros2_control controller through kinema's safety layer. `ros2 launch ... --show-args` lists
the arguments.

How launch_ros finds the executable: Node(package="kinema", executable="kinema") looks `kinema` up in the ament
index, i.e. it runs <prefix>/lib/kinema/kinema for the first <prefix> on AMENT_PREFIX_PATH that has the marker
<prefix>/share/ament_index/resource_index/packages/kinema. kinema is a pip package, not a colcon one, so register
its console script once, in the Python environment ROS 2 uses:

    pip install "kinema[ros]"
    prefix=$HOME/.local/kinema_ament
    mkdir -p $prefix/share/ament_index/resource_index/packages $prefix/lib/kinema
    touch $prefix/share/ament_index/resource_index/packages/kinema
    ln -sf "$(command -v kinema)" $prefix/lib/kinema/kinema
    export AMENT_PREFIX_PATH=$prefix:$AMENT_PREFIX_PATH   # e.g. in ~/.bashrc, after sourcing ROS 2

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


def _deploy_node(context):
    """Build `kinema deploy ...`, leaving out optional flags whose argument is empty."""

    def arg(name: str) -> str:
        return LaunchConfiguration(name).perform(context)

    arguments = ["deploy", "--policy", arg("policy"), "--robot", arg("robot"), "--backend", arg("backend")]
    if arg("instruction"):
        arguments += ["--instruction", arg("instruction")]
    if arg("record"):
        arguments += ["--record", arg("record")]
    # kinema's own default is loopback-only DDS; a robot on the network needs the explicit opt-out.
    local = arg("local").lower() == "true"
    arguments.append("--local" if local else "--no-local")
    return [Node(package="kinema", executable="kinema", name="kinema_deploy", arguments=arguments, output="screen",
                 additional_env=_local_env(local))]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument("policy", description="policy checkpoint folder (config.json + model.safetensors)"),
        DeclareLaunchArgument(
            "robot", default_value=DEFAULT_ROBOT,
            description="robot config YAML: joints (matched by name), limits, controller, topics, cameras, rates",
        ),
        DeclareLaunchArgument(
            "backend", default_value="auto", choices=["auto", "rclpy", "dds"],
            description="transport: rclpy (this ROS 2 install), dds (CycloneDDS, ROS 2 wire format) or auto",
        ),
        DeclareLaunchArgument(
            "instruction", default_value="", description="language instruction ('' = from the instruction topic)",
        ),
        DeclareLaunchArgument(
            "record", default_value="", description="folder for recorded episodes (LeRobotDataset v3 + MCAP); '' = off",
        ),
        DeclareLaunchArgument(
            "local", default_value="false", choices=["true", "false"],
            description="keep all ROS 2 traffic on this machine (loopback, either backend); for a sim robot on the same host",
        ),
        OpaqueFunction(function=_deploy_node),
    ])
