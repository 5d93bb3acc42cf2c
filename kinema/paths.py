"""Where kinema's shipped files are."""

from __future__ import annotations

from pathlib import Path


def assets_dir() -> Path:
    """The `assets/` folder: the checkout's own in a source tree, else the installed copy (`kinema._assets`)."""
    source = Path(__file__).resolve().parent.parent / "assets"
    if source.is_dir():
        return source
    import kinema._assets

    return Path(kinema._assets.__path__[0])
