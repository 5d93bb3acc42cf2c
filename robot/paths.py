"""Where kinema's shipped files are, and how a shipped YAML is found and read: the one implementation (kinema.paths
re-exports it).

robot/ must not import kinema (imports flow one way: kinema uses robot, never the reverse), so the installed copy
is found by locating the `kinema` package on sys.path without executing any of its code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import yaml


def assets_dir() -> Path:
    """The `assets/` folder: the checkout's own in a source tree, else the installed copy (`kinema/_assets`)."""
    source = Path(__file__).resolve().parent.parent / "assets"
    if source.is_dir():
        return source
    # find_spec on a top-level package locates it without running its __init__ (find_spec("kinema._assets") would).
    spec = importlib.util.find_spec("kinema")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        installed = Path(location) / "_assets"
        if installed.is_dir():
            return installed
    raise FileNotFoundError(
        f"kinema's assets are neither at {source} (a source checkout) nor in an installed kinema/_assets folder; "
        "reinstall kinema (pip install kinema)"
    )


def resolve_shipped_yaml(name: str | Path, folder: str, what: str) -> Path:
    """A YAML file by path, or by name among the shipped ones in `assets/<folder>` (`sim_panda` =
    assets/robots/sim_panda.yaml); `what` names the kind of file in the error ("robot config", "config file")."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = assets_dir() / folder
    for candidate in (shipped / path.name, shipped / f"{path.name}.yaml"):
        if candidate.is_file():
            return candidate
    names = sorted(p.stem for p in shipped.glob("*.yaml"))
    problem = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
    raise FileNotFoundError(f"{what} {name} {problem}; shipped {folder}: {', '.join(names) or 'none'}")


def read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {err}") from None


__all__ = ["assets_dir", "read_yaml", "resolve_shipped_yaml"]
