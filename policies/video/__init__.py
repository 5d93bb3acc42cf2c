"""Video generators: diffusers video flow models wrapped for the RL core, and their rewards.

The generator's names are imported lazily, so that `policies.video.rewards` does not pull diffusers in.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "VideoGenerator": "policies.video.generator",
    "EMA": "policies.video.generator",
    "BASE": "policies.video.generator",
    "VideoGeneratorConfig": "policies.video.configuration_video",
    "PRESETS": "policies.video.configuration_video",
    "preset_config": "policies.video.configuration_video",
    "check_video_shape": "policies.video.configuration_video",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'policies.video' has no attribute {name!r}")
