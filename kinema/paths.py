"""Where kinema's shipped files are. The implementation lives in `robot.paths` (robot/ must not import kinema)."""

from robot.paths import assets_dir, read_yaml, resolve_shipped_yaml

__all__ = ["assets_dir", "read_yaml", "resolve_shipped_yaml"]
