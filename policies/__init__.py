"""kinema's policies, registered by type (`policy.type` in a training config, `policy_type` in a checkpoint's
config.json). Workflows create and load policies through `make_policy` and `load_policy`, and name no policy class.

Adding a type is a module exporting its config and policy classes plus one line in `POLICY_TYPES`, and its training
options as a group registered on `kinema.train.config.PolicyOptions` (a test checks that every type has one).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# type -> (module, config class, policy class); imported on first use, so `import policies` stays light.
POLICY_TYPES: dict[str, tuple[str, str, str]] = {
    "vla": ("policies.vla", "VLAConfig", "VLAPolicy"),
    "video": ("policies.video_policy", "VideoPolicyConfig", "VideoPolicy"),
    "smolvla": ("policies.smolvla", "SmolVLAConfig", "SmolVLAPolicy"),
    "pi0": ("policies.pi0", "Pi0Config", "Pi0Policy"),
}
LEROBOT_TYPES = {"smolvla": "smolvla", "pi0": "pi0"}  # a LeRobot checkpoint's config.json "type" -> the kinema type that loads it


def policy_classes(policy_type: str) -> tuple[type, type]:
    """(config class, policy class) of a registered type."""
    if policy_type not in POLICY_TYPES:
        raise ValueError(f"policy type {policy_type!r} is not known; valid: {', '.join(POLICY_TYPES)}")
    module, config_name, policy_name = POLICY_TYPES[policy_type]
    mod = importlib.import_module(module)
    return getattr(mod, config_name), getattr(mod, policy_name)


def make_policy(policy_type: str, config: Any) -> Any:
    """A new policy of `policy_type` from its config object."""
    return policy_classes(policy_type)[1](config)


def load_policy(directory: str | os.PathLike, **kwargs: Any) -> Any:
    """The policy saved in `directory` (`save_pretrained`), whatever its type; kwargs go to its `from_pretrained`."""
    from policies.checkpoint import load_checkpoint_config

    config = load_checkpoint_config(directory)
    policy_type = config.get("policy_type") or LEROBOT_TYPES.get(config.get("type", ""), "vla")
    return policy_classes(policy_type)[1].from_pretrained(str(directory), **kwargs)


__all__ = ["POLICY_TYPES", "load_policy", "make_policy", "policy_classes"]
