"""Task registry: a plain dict from name to environment class, MuJoCo Playground style."""

from __future__ import annotations

import difflib
from typing import Any

from sim.env import TabletopEnv, TaskConfig
from sim.tasks.drawer import DrawerEnv
from sim.tasks.pick_place import PickPlaceEnv
from sim.tasks.push import PushEnv
from sim.tasks.stack import StackEnv

TASKS: dict[str, type[TabletopEnv]] = {
    cls.name: cls for cls in (PickPlaceEnv, StackEnv, PushEnv, DrawerEnv)
}


def task_class(name: str) -> type[TabletopEnv]:
    if name not in TASKS:
        close = difflib.get_close_matches(name, TASKS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}.{hint}")
    return TASKS[name]


def make(name: str, config: TaskConfig | dict[str, Any] | None = None, **kwargs: Any) -> TabletopEnv:
    """Build a task environment by name. `config` may be a TaskConfig or a dict of overrides of its defaults."""
    cls = task_class(name)
    if isinstance(config, dict):
        base = cls.default_config()
        unknown = set(config) - set(base.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown task config keys {sorted(unknown)}; valid: {sorted(base.__dataclass_fields__)}")
        config = base.replace(**{k: tuple(v) if isinstance(v, list) else v for k, v in config.items()})
    return cls(config, **kwargs)


__all__ = ["TASKS", "make", "task_class", "TaskConfig", "TabletopEnv"]
