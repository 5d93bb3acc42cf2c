"""Tasks from outside kinema's own families, through the same `sim.tasks.make`:

    robosuite/<Task>        robosuite's tasks (Lift, Stack, Door, ...) behind `sim.robosuite_adapter` (extra: robosuite)
    gym:<id>                a registered gymnasium env (gymnasium's `module:Env-v0` form imports the module first)
    package.module:Class    any gymnasium.Env class, by entry point

The contract an external task meets, so that `kinema sim`, `kinema train` and `kinema eval` run it unchanged:
- `reset(seed=...)` -> (obs, info) and `step(action)` -> (obs, reward, terminated, truncated, info), gymnasium style;
- obs: `observation.images.agentview` and `observation.images.wrist` (uint8, H x W x 3), `observation.state`
  (float32, shape (8,): end-effector position (3), quaternion wxyz (4), gripper opening in [0, 1]), and `task` (the
  instruction). Keys the env names otherwise are mapped by the task config's `keys` ({kinema's key: the env's});
  an env without an instruction gets the config's `instruction`;
- action: 7 floats in [-1, 1] (end-effector translation (3), rotation (3), gripper: +1 closes);
- `info["is_success"]`: the outcome, true on the step the task is solved (which should terminate the episode);
- optional: `info["privileged"]` (a dict of arrays: auxiliary targets in training), `render()` (an RGB frame, for
  videos), an `image_size` constructor argument (the camera side kinema asks for).
An env whose observation space is not a Dict (gymnasium's CartPole: a Box) or whose action space is not a Box of 7
is refused when made, with an error naming the space and this contract. The episode length is the config's
`horizon`, else the env's `spec.max_episode_steps`, else 200. Every other task config key goes to the env's
constructor (`--task-config '{"key": value}'`). Held-out instruction or object splits exist only where the env takes
`instructions=`/`objects=` arguments; otherwise evaluating one is reported as not applicable.
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace
from typing import Any

import gymnasium as gym
import numpy as np

PREFIXES = ("robosuite/", "gym:")
DEFAULT_HORIZON = 200
REQUIRED = ("observation.images.agentview", "observation.images.wrist", "observation.state")


class SplitNotApplicable(ValueError):
    """An evaluation split this task has no notion of (e.g. held-out colours on a robosuite task)."""


def is_external(name: str) -> bool:
    return name.startswith(PREFIXES) or ":" in name


def _split_kwargs(name: str, kwargs: dict[str, Any], accepts: set[str] | None) -> dict[str, Any]:
    """Drop `instructions`/`objects` for an env without them when they ask for the training split; refuse a held-out
    split it cannot give. `accepts`: the env's constructor arguments (None: it takes any)."""
    kwargs = dict(kwargs)
    for key in ("instructions", "objects"):
        if key in kwargs and (accepts is not None and key not in accepts):
            if (split := kwargs.pop(key)) != "train":
                what = "held-out" if split == "heldout" else split
                raise SplitNotApplicable(f"{name} has no {what} {key} (its env takes no {key}= argument): not applicable")
    return kwargs


def make_external(name: str, config: dict[str, Any] | None = None, **kwargs: Any) -> gym.Env:
    config = dict(config or {})
    if name.startswith("robosuite/"):
        from sim.robosuite_adapter import RobosuiteEnv, make_robosuite  # robosuite is optional: imported on request

        accepts = set(inspect.signature(RobosuiteEnv.__init__).parameters) - {"robosuite_kwargs"}
        return make_robosuite(name, **{**config, **_split_kwargs(name, kwargs, accepts)})
    if name.startswith("gym:"):
        env_id = name[len("gym:") :]
        if ":" in env_id:  # gymnasium's `module:Env-v0`: the module registers the id when imported
            module_name, _, env_id = env_id.rpartition(":")
            env_class(f"{module_name}:__name__")
        try:
            spec = gym.spec(env_id)
        except gym.error.Error as err:
            raise ValueError(f"task {name!r}: {err} (a registered gymnasium id; `gym:module:Env-v0` imports module first)") from None
        entry = spec.entry_point
        target = env_class(entry) if isinstance(entry, str) else entry
        build = lambda **kw: gym.make(spec, **kw).unwrapped  # noqa: E731 (the horizon is ours, not a TimeLimit)
        accepts = _parameters(target)
        default_horizon = spec.max_episode_steps
    else:
        cls = env_class(name)
        build, accepts = cls, _parameters(cls)
        default_horizon = None
    keys = config.pop("keys", {}) or {}
    instruction = config.pop("instruction", None)
    horizon = config.pop("horizon", None)
    kwargs = _split_kwargs(name, kwargs, accepts)
    if accepts is not None:  # kinema's own keyword arguments go only where the env takes them
        kwargs = {k: v for k, v in kwargs.items() if k in accepts}
    else:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("image_size", "cameras")}
    env = build(**config, **kwargs)
    horizon = int(horizon or default_horizon or getattr(getattr(env, "spec", None), "max_episode_steps", None) or DEFAULT_HORIZON)
    return ExternalTask(env, name=name, keys=keys, instruction=instruction, horizon=horizon)


def _parameters(target: Any) -> set[str] | None:
    """The keyword arguments a constructor takes (None: any, it has **kwargs)."""
    params = inspect.signature(target).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _describe(space: gym.Space) -> str:
    """A space in a few characters: a Box's bounds can fill lines."""
    return f"Box{space.shape}" if isinstance(space, gym.spaces.Box) else str(space)


def env_class(name: str) -> type:
    """`package.module:Class`, imported, with an error that says which part was not found."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"task {name!r}: cannot import module {module_name!r} ({err}); an external task is "
                         "`package.module:Class` on the Python path, `gym:<registered id>` or `robosuite/<Task>`") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"task {name!r}: module {module_name!r} has no {attr!r}")
    return cls


class ExternalTask(gym.Wrapper):
    """An external env seen through kinema's keys, with the horizon kinema counts and `config.horizon` like kinema's
    own tasks. The first observation and info are checked against the contract (module docstring)."""

    def __init__(self, env: gym.Env, *, name: str, keys: dict[str, str], instruction: str | None, horizon: int) -> None:
        super().__init__(env)
        self.task_name, self.keys, self.instruction = name, dict(keys), instruction
        self.config = SimpleNamespace(horizon=horizon)
        self.steps = 0
        space, actions = env.observation_space, env.action_space
        if not isinstance(space, gym.spaces.Dict):
            raise ValueError(f"task {name!r}: its observation space is {_describe(space)}, not a Dict: kinema's "
                             f"external-task contract wants a dict with {list(REQUIRED)} (camera images uint8 HxWx3, "
                             "state float32 (8,)) and 'task', its own names mapped by the task config's `keys` "
                             "(sim/tasks/external.py)")
        if not (isinstance(actions, gym.spaces.Box) and actions.shape == (7,)):
            raise ValueError(f"task {name!r}: its action space is {_describe(actions)}; kinema's policies act "
                             "with a Box of 7 floats in [-1, 1] (end-effector translation 3, rotation 3, gripper 1) "
                             "(sim/tasks/external.py)")
        renamed = {ours: space[theirs] for ours, theirs in self.keys.items() if theirs in space.spaces}
        kept = {k: v for k, v in space.spaces.items() if k not in self.keys.values()}
        spaces = {**kept, **renamed}
        if "task" not in spaces:
            spaces["task"] = gym.spaces.Text(max_length=256)
        self.observation_space = gym.spaces.Dict(spaces)

    def _obs(self, obs: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(obs, dict):
            raise ValueError(f"task {self.task_name!r}: observations must be a dict with {list(REQUIRED)} and 'task'; got {type(obs).__name__}")
        obs = dict(obs)
        for ours, theirs in self.keys.items():
            if theirs in obs:
                obs[ours] = obs.pop(theirs)
        missing = [k for k in REQUIRED if k not in obs]
        if missing:
            raise ValueError(f"task {self.task_name!r}: observations lack {missing} (have {sorted(obs)}); map them with the "
                             "task config's `keys`, e.g. --task-config '{\"keys\": {\"observation.state\": \"state\"}}'")
        if "task" not in obs:
            if self.instruction is None:
                raise ValueError(f"task {self.task_name!r}: its observations have no 'task' (instruction): map one with the "
                                 "task config's `keys` or give one as `instruction`")
            obs["task"] = self.instruction
        obs["observation.state"] = np.asarray(obs["observation.state"], np.float32)
        return obs

    def reset(self, **kwargs: Any):
        self.steps = 0
        obs, info = self.env.reset(**kwargs)
        return self._obs(obs), info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        if "is_success" not in info:
            raise ValueError(f"task {self.task_name!r}: step() must report info['is_success'] (the outcome kinema learns from)")
        truncated = bool(truncated) or (not terminated and self.steps >= self.config.horizon)
        return self._obs(obs), reward, terminated, truncated, info

    def render(self):
        return self.env.render()
