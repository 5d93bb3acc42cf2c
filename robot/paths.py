"""Where kinema's shipped files are: the one implementation (kinema.paths re-exports it).

robot/ must not import kinema (imports flow one way, DESIGN.md), so the installed copy is found by locating the
`kinema` package on sys.path without executing any of its code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


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


__all__ = ["assets_dir"]
