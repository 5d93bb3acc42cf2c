"""The install a newcomer does must carry every package, and CI must do what the README says."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_on_disk_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("diffusion_rl", "policies", "sim", "robot", "kinema")
        for p in (ROOT / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    missing = on_disk - listed
    assert not missing, f"packages with modules but missing from pyproject's [tool.setuptools].packages: {sorted(missing)}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.+?)\n```", readme)
    test_command = next(c for c in commands if c.rstrip().endswith("pytest -q"))
    ci = (ROOT / ".ci" / "run").read_text()
    steps = [s.strip() for s in test_command.split("&&")]
    assert steps[0].startswith("python3 -m venv") and steps[1].startswith(". ")
    for step in steps[2:]:
        assert step in ci, f".ci/run does not run the README's step {step!r}"


def test_cli_help_lists_every_command():
    out = subprocess.run([sys.executable, "-m", "kinema.cli", "--help"], capture_output=True, text=True, check=True).stdout
    assert "sim" in out and "MuJoCo tasks" in out
    sim = subprocess.run(
        [sys.executable, "-m", "kinema.cli", "sim", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for command in ("list", "collect", "render"):
        assert re.search(rf"^\s+{command}\s+\S", sim, re.M), f"`kinema sim --help` lacks a line for {command}"


def test_cli_help_states_each_options_default():
    """`kinema <command> --help` gives each plain option's default, as the README promises; required options and
    those without a default say nothing."""
    from kinema.cli import build_parser

    parser = build_parser()
    commands = {name: action for action in parser._subparsers._group_actions for name, action in action.choices.items()}
    sim = {name: p for a in commands["sim"]._subparsers._group_actions for name, p in a.choices.items()}
    cases = {"eval": commands["eval"], "deploy": commands["deploy"], "sim-robot": commands["sim-robot"],
             "sim collect": sim["collect"], "sim render": sim["render"]}
    for name, sub in cases.items():
        text = " ".join(sub.format_help().split("options:", 1)[1].split())  # past the usage; argparse wraps lines
        for action in sub._actions:
            if not action.option_strings or action.help is None or action.dest == "help":
                continue
            flag = action.option_strings[-1]
            entry = text.split(f" {flag} ", 1)[1].split(" --", 1)[0]
            stated = f"(default: {action.default})" in entry
            expected = not (action.required or action.default in (None, "") or isinstance(action.default, bool))
            assert stated == expected, f"`kinema {name} --help`, {flag}: default stated {stated}, expected {expected}"
