"""The RL core's boundaries: a light package import, and no imports of the rest of kinema."""

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
