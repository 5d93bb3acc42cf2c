"""Task registry: a plain dict from name to environment class, MuJoCo Playground style."""

from __future__ import annotations

import difflib
from typing import Any

from sim.env import TabletopEnv, TaskConfig
from sim.tasks.external import SplitNotApplicable, is_external, make_external
from sim.tasks.drawer import DrawerEnv
from sim.tasks.pick_place import PickPlaceEnv
from sim.tasks.push import PushEnv
from sim.tasks.stack import StackEnv

TASKS: dict[str, type[TabletopEnv]] = {
    cls.name: cls for cls in (PickPlaceEnv, StackEnv, PushEnv, DrawerEnv)
}


# Harder variants for larger machines and curricula: more distractors, wider layouts, every colour.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "pick_place_hard": ("pick_place", {"num_distractors": 3, "x_range": (0.36, 0.66), "y_range": (-0.26, 0.26)}),
    "stack_hard": ("stack", {"num_distractors": 2, "x_range": (0.38, 0.66), "y_range": (-0.25, 0.25)}),
    "push_hard": ("push", {"num_distractors": 2, "x_range": (0.38, 0.66), "y_range": (-0.25, 0.25)}),
    "drawer_hard": ("drawer", {"num_distractors": 2, "x_range": (0.4, 0.58), "y_range": (-0.3, 0.3)}),
}


def task_names() -> list[str]:
    return sorted([*TASKS, *VARIANTS])


def check_task(name: str) -> None:
    """A task name kinema can build, or a ValueError that lists the valid ones (an external task's form is checked
    without building it)."""
    if name.startswith("robosuite/"):
        from sim.robosuite_adapter import resolve_name

        resolve_name(name)
    elif name.startswith("gym:") or ":" in name:
        if not name.startswith("gym:"):
            from sim.tasks.external import env_class

            env_class(name)
    else:
        task_class(name)


def has_expert(name: str) -> bool:
    """Whether kinema has a scripted expert for the task (its own families do; external tasks do not)."""
    return not is_external(name)


def task_class(name: str) -> type[TabletopEnv]:
    if name in VARIANTS:
        return TASKS[VARIANTS[name][0]]
    if name not in TASKS:
        close = difflib.get_close_matches(name, task_names(), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}.{hint}")
    return TASKS[name]


def make(name: str, config: TaskConfig | dict[str, Any] | None = None, **kwargs: Any) -> TabletopEnv:
    """Build a task environment by name. `config` may be a TaskConfig or a dict of overrides of its defaults.

    External tasks (`robosuite/<Task>`, `gym:<id>`, `package.module:Class`) run through the same interface; their
    config dict goes to their constructor (see `sim.tasks.external` for the contract they meet).
    """
    if is_external(name):
        if isinstance(config, TaskConfig):
            raise ValueError(f"{name} is an external task: pass its config as a dict of constructor arguments")
        return make_external(name, config, **kwargs)
    cls = task_class(name)
    if name in VARIANTS:
        overrides = dict(VARIANTS[name][1])
        if isinstance(config, TaskConfig):
            raise ValueError(f"{name} is a variant of {VARIANTS[name][0]}: pass config overrides as a dict")
        config = {**overrides, **(config or {})}
    if isinstance(config, dict):
        base = cls.default_config()
        unknown = set(config) - set(base.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown task config keys {sorted(unknown)}; valid: {sorted(base.__dataclass_fields__)}")
        config = base.replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
    return cls(config, **kwargs)


__all__ = [
    "TASKS", "VARIANTS", "SplitNotApplicable", "check_task", "has_expert", "is_external", "make", "task_class",
    "task_names", "TaskConfig", "TabletopEnv",
]
