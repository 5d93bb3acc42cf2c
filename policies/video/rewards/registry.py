"""Rewards by name, by import path (`package.module:ClassName`), or from a spec dict."""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from policies.video.rewards.balance import RewardSet
from policies.video.rewards.base import VideoReward
from policies.video.rewards.flow import OpticalFlowReward
from policies.video.rewards.image import ExposureReward, SharpnessReward
from policies.video.rewards.success import success_from_spec


REWARDS: dict[str, Callable[..., VideoReward]] = {
    "success": success_from_spec,
    "flow": OpticalFlowReward,
    "motion": functools.partial(OpticalFlowReward, outputs=("motion",)),
    "temporal_consistency": functools.partial(OpticalFlowReward, outputs=("temporal_consistency",)),
    "exposure": ExposureReward,
    "sharpness": SharpnessReward,
}

RewardSpec = str | Mapping[str, Any] | VideoReward


def _import_reward(path: str) -> Callable[..., Any]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"a reward import path must look like 'package.module:ClassName'; got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import reward module {module_name!r} (from {path!r}): {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from reward path {path!r})")
        obj = getattr(obj, part)
    return obj


def _check_reward_object(reward: Any, source: str) -> VideoReward:
    names = getattr(reward, "names", None)
    if not callable(reward) or not names or isinstance(names, str):
        raise TypeError(
            f"reward {source} must be callable as reward(videos, prompts) -> dict[str, Tensor] and declare "
            f"`names` (a tuple of score names); got {type(reward).__name__} with names={names!r}"
        )
    if not hasattr(reward, "differentiable"):
        raise TypeError(f"reward {source} must declare `differentiable` (True or False)")
    return reward


def reward_factory(name: str) -> Callable[..., Any]:
    """What builds the reward `name`: a registry entry, or the object an import path 'pkg.mod:Class' names. An
    unknown name lists the valid ones (configs call this up front, before any expensive work)."""
    if ":" in name:
        return _import_reward(name)
    if name in REWARDS:
        return REWARDS[name]
    close = difflib.get_close_matches(name, list(REWARDS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"unknown reward {name!r}; valid rewards: {', '.join(sorted(REWARDS))}, or an import path 'package.module:ClassName'.{hint}"
    )


def make_reward(spec: RewardSpec) -> VideoReward:
    """One reward from a registry name, an import path 'pkg.mod:Class', a dict {"name": ..., **kwargs}, or an object."""
    if isinstance(spec, VideoReward):
        return spec
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"a reward spec dict needs a 'name' key; got keys {sorted(spec)}")
        name, kwargs = str(spec["name"]), {k: v for k, v in spec.items() if k != "name"}
    elif isinstance(spec, str):
        name, kwargs = spec, {}
    elif callable(spec) and hasattr(spec, "names"):
        return _check_reward_object(spec, type(spec).__name__)
    else:
        raise TypeError(f"a reward spec is a name, an import path, a dict or a reward object; got {type(spec).__name__}")
    factory = reward_factory(name)
    try:
        reward = factory(**kwargs)
    except TypeError as e:
        try:
            params = [p for p in inspect.signature(factory).parameters if p not in ("self", "kw", "kwargs")]
        except (TypeError, ValueError):
            params = []
        raise ValueError(f"bad options for reward {name!r} {sorted(kwargs)}: {e}; its parameters: {params}") from e
    return _check_reward_object(reward, repr(name))


def make_rewards(
    specs: Sequence[RewardSpec],
    *,
    weights: Mapping[str, float] | None = None,
    balance: Literal["gdpo", "weighted_sum"] = "gdpo",
    degenerate: Literal["drop", "downweight", "keep"] = "drop",
) -> RewardSet:
    """A `RewardSet` from a list of specs (see `make_reward`)."""
    if isinstance(specs, (str, Mapping)) or not len(specs):
        raise ValueError(f"make_rewards needs a non-empty list of reward specs; got {specs!r}")
    return RewardSet([make_reward(s) for s in specs], weights=weights, balance=balance, degenerate=degenerate)
