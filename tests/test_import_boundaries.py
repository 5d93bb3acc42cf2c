"""Which package may import which (DESIGN.md): the RL core stands alone and loads light, sim needs no torch, robot
reaches into sim in one module only, policies know nothing of the application, and kinema has no import cycle."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "diffusion_rl"
FORBIDDEN = ("policies", "sim", "robot", "kinema", "launch", "rclpy", "mujoco")


def test_package_import_does_not_load_torch():
    code = "import sys, diffusion_rl, diffusion_rl.data; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_core_imports_nothing_else_of_the_project():
    files = [p for p in CORE.glob("*.py")]
    assert len(files) >= 8
    for path in files:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top not in FORBIDDEN, f"{path.name} imports {name}"
                if top == "diffusion_rl":
                    assert name == "diffusion_rl" or name.split(".")[1] in {p.stem for p in files} | {"data"}, (
                        f"{path.name} imports {name}"
                    )


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every module a file imports, at any depth of the file (function-level imports count; those for type checkers
    only do not), resolved to dotted names; `from pkg import name` counts as pkg.name when that is a module of ours,
    else as pkg."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    typing_only = {
        id(inner) for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for inner in ast.walk(node)
    }  # fmt: skip
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                is_module = (ROOT / candidate.replace(".", "/")).with_suffix(".py").is_file() or (
                    ROOT / candidate.replace(".", "/") / "__init__.py"
                ).is_file()
                out.append(candidate if is_module else base)
    return out


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_sim_never_imports_torch():
    for path in (ROOT / "sim").rglob("*.py"):
        bad = [m for m in imported_modules(path) if m.split(".")[0] in ("torch", "policies", "kinema", "robot")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
    code = "import sys, sim, sim.tasks, sim.env, sim.rollout, sim.vector, sim.monitor, sim.experts; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_robot_imports_sim_only_in_the_sim_robot_and_its_simulated_person():
    importers = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "robot").rglob("*.py")
        if any(m.split(".")[0] == "sim" for m in imported_modules(path))
    )  # fmt: skip
    assert importers == ["robot/sim_person.py", "robot/sim_robot.py"]  # the hardware-free twin: the bridge runs without sim
    for path in (ROOT / "robot").rglob("*.py"):
        assert not [m for m in imported_modules(path) if m.split(".")[0] == "kinema"], path


def test_policies_import_nothing_of_the_application_the_simulator_or_the_robot():
    for path in (ROOT / "policies").rglob("*.py"):
        bad = [m for m in imported_modules(path) if m.split(".")[0] in ("kinema", "sim", "robot")]
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_kinema_has_no_import_cycle_and_no_workflow_imports_a_command_module():
    modules = {module_name(p): p for p in (ROOT / "kinema").rglob("*.py")}
    graph = {name: {m for m in imported_modules(path) if m in modules and m != name} for name, path in modules.items()}
    commands = {name for name in modules if name == "kinema.cli" or name.endswith("commands")}
    for name, deps in graph.items():
        if name not in commands:
            assert not deps & commands, f"{name} imports the command module(s) {sorted(deps & commands)}"
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep] if dep in path else [name, dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_cli_builds_without_the_video_extra():
    """The robosuite venv (and any install without kinema[video]) has no diffusers: every command's parser, `kinema
    video train --help`'s method list included, must build without it."""
    code = ("import sys; sys.modules['diffusers'] = None; sys.modules['transformers'] = None\n"
            "from kinema.cli import build_parser; build_parser(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
