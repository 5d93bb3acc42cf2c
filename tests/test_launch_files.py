"""The ROS 2 launch files, checked without ROS: stub `launch` / `launch_ros` modules record what the files build.

Each file must define generate_launch_description(); every argument is declared with a description (and a default
inside its choices); every Node runs kinema's console script with a subcommand and flags that kinema's own argparse
parser accepts, and a node launched with local:=true gets the network rule's pinned environment.
"""

import argparse
import importlib.util
import sys
import tomllib
import types
from pathlib import Path

import pytest

from robot.transport.loopback import loopback_variables

REPO = Path(__file__).resolve().parent.parent
LAUNCH_FILES = sorted((REPO / "launch").glob("*.launch.py"))

ROBOT_COMMANDS = {"deploy", "sim-robot"}

# launch_ros.actions.Node's own keywords, then the ExecuteProcess ones it forwards.
NODE_KWARGS = {
    "executable", "package", "name", "namespace", "exec_name", "parameters", "remappings", "ros_arguments",
    "arguments", "cmd", "cwd", "env", "additional_env", "shell", "sigterm_timeout", "sigkill_timeout",
    "emulate_tty", "output", "output_format", "log_cmd", "on_exit", "respawn", "respawn_delay", "prefix",
}


# ----------------------------------------------------------------------------------------------------------------
# Stubs of the launch API (only what a launch file may touch)
# ----------------------------------------------------------------------------------------------------------------


class LaunchDescription:
    def __init__(self, initial_entities=None):
        self.entities = list(initial_entities or [])


class DeclareLaunchArgument:
    def __init__(self, name, *, default_value=None, description=None, choices=None):
        self.name, self.default_value, self.description, self.choices = name, default_value, description, choices


class OpaqueFunction:
    def __init__(self, *, function, args=None, kwargs=None):
        self.function, self.args, self.kwargs = function, args or [], kwargs or {}

    def execute(self, context):
        return self.function(context, *self.args, **self.kwargs)


class LaunchConfiguration:
    def __init__(self, variable_name, *, default=None):
        self.variable_name, self.default = variable_name, default

    def perform(self, context):
        if self.variable_name in context.launch_configurations:
            return context.launch_configurations[self.variable_name]
        if self.default is not None:
            return self.default
        # The real launch raises SubstitutionFailure here: a configuration nobody declared.
        raise KeyError(f"launch configuration {self.variable_name!r} does not exist")


class Node:
    def __init__(self, **kwargs):
        unknown = set(kwargs) - NODE_KWARGS
        if unknown:
            raise TypeError(f"Node() got unexpected keyword arguments {sorted(unknown)}")
        if "executable" not in kwargs:
            raise TypeError("Node() missing required keyword argument 'executable'")
        self.kwargs = kwargs


class Context:
    def __init__(self, launch_configurations):
        self.launch_configurations = dict(launch_configurations)


@pytest.fixture()
def load(monkeypatch):
    stubs = {
        "launch": types.ModuleType("launch"),
        "launch.actions": types.ModuleType("launch.actions"),
        "launch.substitutions": types.ModuleType("launch.substitutions"),
        "launch_ros": types.ModuleType("launch_ros"),
        "launch_ros.actions": types.ModuleType("launch_ros.actions"),
    }
    stubs["launch"].LaunchDescription = LaunchDescription
    stubs["launch.actions"].DeclareLaunchArgument = DeclareLaunchArgument
    stubs["launch.actions"].OpaqueFunction = OpaqueFunction
    stubs["launch.substitutions"].LaunchConfiguration = LaunchConfiguration
    stubs["launch_ros.actions"].Node = Node
    stubs["launch"].actions, stubs["launch"].substitutions = stubs["launch.actions"], stubs["launch.substitutions"]
    stubs["launch_ros"].actions = stubs["launch_ros.actions"]
    for name, module in stubs.items():
        monkeypatch.setitem(sys.modules, name, module)

    def _load(path: Path):
        spec = importlib.util.spec_from_file_location(f"launch_file_{path.stem.replace('.', '_')}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return _load


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def _nodes(description: LaunchDescription, configs: dict) -> list[Node]:
    context = Context(configs)
    nodes = []
    for entity in description.entities:
        if isinstance(entity, OpaqueFunction):
            nodes += [e for e in entity.execute(context) if isinstance(e, Node)]
        elif isinstance(entity, Node):
            nodes.append(entity)
    return nodes


def _cli_subcommands() -> dict[str, argparse.ArgumentParser]:
    from kinema.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kinema.cli has no subcommands")


def _check_arguments(arguments: list) -> argparse.Namespace:
    assert arguments and all(isinstance(a, str) for a in arguments), arguments
    command, rest = arguments[0], arguments[1:]
    assert command in ROBOT_COMMANDS, f"unexpected kinema subcommand {command!r}"
    subparser = _cli_subcommands()[command]
    return subparser.parse_args(rest)  # argparse exits (SystemExit) on an unknown flag or a bad value


# ----------------------------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------------------------


def test_both_launch_files_exist_and_launch_is_not_a_package():
    assert {p.name for p in LAUNCH_FILES} == {"bridge.launch.py", "sim_robot.launch.py"}
    assert not (REPO / "launch" / "__init__.py").exists()  # would shadow ROS 2's own `launch` module


@pytest.mark.parametrize("path", LAUNCH_FILES, ids=lambda p: p.name)
def test_launch_file_declares_documented_arguments_and_runs_valid_kinema_commands(load, path):
    module = load(path)
    assert callable(getattr(module, "generate_launch_description", None))
    description = module.generate_launch_description()
    assert isinstance(description, LaunchDescription)

    declared = {e.name: e for e in description.entities if isinstance(e, DeclareLaunchArgument)}
    assert {"robot", "backend", "policy"} <= set(declared)
    for arg in declared.values():
        assert arg.description, f"launch argument {arg.name!r} has no description"
        if arg.choices is not None and arg.default_value is not None:
            assert arg.default_value in arg.choices, arg.name
    assert Path(declared["robot"].default_value).is_file(), "the default robot config must exist"

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    defaults = {name: arg.default_value for name, arg in declared.items() if arg.default_value is not None}
    variants = [
        {**defaults, "policy": "/ckpt"},
        {**defaults, "policy": "/ckpt", "local": "true", "record": "/tmp/rec", "backend": "dds"},
        {**defaults, "policy": "/ckpt", "local": "false", "instruction": "pick the red cube"},
    ]
    seen_commands = set()
    for configs in variants:
        nodes = _nodes(description, {k: v for k, v in configs.items() if k in declared})
        assert nodes, f"{path.name} launches no node"
        for node in nodes:
            kw = node.kwargs
            assert kw.get("package") == "kinema" and kw["executable"] in scripts, kw
            assert kw.get("parameters") in (None, []) or all(isinstance(p, (dict, str)) for p in kw["parameters"])
            parsed = _check_arguments(kw["arguments"])
            seen_commands.add(kw["arguments"][0])
            env = kw.get("additional_env") or {}
            if configs.get("local") == "true":
                assert "--local" in kw["arguments"] and parsed.local
                # The rclpy path too: rmw reads these when the node's context is created.
                assert env == loopback_variables(), env
            if configs.get("local") == "false":
                assert "--local" not in kw["arguments"] and "--no-local" in kw["arguments"] and not parsed.local
                assert not env
    expected = {"bridge.launch.py": {"deploy"}, "sim_robot.launch.py": {"sim-robot", "deploy"}}[path.name]
    assert seen_commands == expected


def test_sim_robot_launch_runs_the_policy_only_when_one_is_given(load):
    description = load(REPO / "launch" / "sim_robot.launch.py").generate_launch_description()
    declared = {e.name: e.default_value for e in description.entities if isinstance(e, DeclareLaunchArgument)}
    alone = _nodes(description, declared)
    assert [n.kwargs["arguments"][0] for n in alone] == ["sim-robot"]
    args = alone[0].kwargs["arguments"]
    assert args[args.index("--task") + 1] == "pick_place" and "--local" in args  # loopback by default
    assert alone[0].kwargs["additional_env"]["ROS_LOCALHOST_ONLY"] == "1"
    both = _nodes(description, {**declared, "policy": "/ckpt"})
    assert [n.kwargs["arguments"][0] for n in both] == ["sim-robot", "deploy"]


def test_bridge_launch_requires_a_policy(load):
    description = load(REPO / "launch" / "bridge.launch.py").generate_launch_description()
    declared = {e.name: e.default_value for e in description.entities if isinstance(e, DeclareLaunchArgument)}
    assert declared["policy"] is None  # no default: `ros2 launch` refuses to start without policy:=...
    with pytest.raises(KeyError, match="policy"):
        _nodes(description, {k: v for k, v in declared.items() if v is not None})
