"""Rollout collection: any batched policy, any vector of task envs, Episodes out.

A policy is a callable `obs_batch -> actions`, where `obs_batch` is `{key: array (B, ...)}` plus `"task": list[str]`
and `actions` is `(B, 7)` or a chunk `(B, H, 7)`; chunks are queued per env and executed step by step. A policy
may define `reset(env_indices)`, called when those envs start a new episode or when a human hands control back
(so it recomputes its chunk from the current state; wrappers flag that step with `info["handback"]`), and
`chunk_taken(env_index, episode, step)`, called for each env that starts executing a new chunk (`episode` is
the episode's start-order number), and `episode_finished(episode)` as each episode ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from diffusion_rl.data import IMAGE_PREFIX, Episode, ExecutedBy
from sim.env import CONTROL_HZ, TabletopEnv, TaskConfig
from sim.experts import ExpertConfig
from sim.monitor import DemoWrapper, MonitorConfig, SimulatedHuman
from sim.tasks import has_expert, make
from sim.vector import InProcessVector, ProcessVector


class BatchPolicy(Protocol):
    def __call__(self, obs: dict[str, Any]) -> np.ndarray: ...


def make_env(
    task: str,
    config: TaskConfig | dict[str, Any] | None = None,
    *,
    actor: str = "policy",
    expert: ExpertConfig | None = None,
    monitor: MonitorConfig | None = None,
    autopilot: ExpertConfig | None = None,
    **env_kwargs: Any,
):
    """Build a task env wrapped for who acts: `actor` is "policy", "expert" (demos) or "monitored" (policy + human).

    With `actor="monitored"`, `autopilot` replaces the policy by an imperfect scripted expert (see SimulatedHuman).
    """
    if actor in ("expert", "monitored") and not has_expert(task):
        raise ValueError(f"task {task!r} has no scripted expert (nor a simulated human built on one): give "
                         "demonstrations as a dataset (kinema train --dataset DIR), or act with a policy (--policy)")
    env = make(task, config, **env_kwargs)
    if actor == "expert":
        return DemoWrapper(env, expert)
    if actor == "monitored":
        return SimulatedHuman(env, monitor, autopilot=autopilot)
    if actor != "policy":
        raise ValueError(f"actor must be 'policy', 'expert' or 'monitored'; got {actor!r}")
    return env


def env_fn(task: str, **kwargs: Any) -> Callable[[], Any]:
    """A picklable env constructor, for worker processes."""
    return functools.partial(make_env, task, **kwargs)


def make_vector(task: str, num_envs: int, *, num_workers: int = 0, **kwargs: Any) -> InProcessVector | ProcessVector:
    """`num_workers=0` steps the envs in this process; otherwise spreads them over that many processes."""
    fns = [env_fn(task, **kwargs) for _ in range(num_envs)]
    return ProcessVector(fns, num_workers) if num_workers else InProcessVector(fns)


def zero_policy(obs: dict[str, Any]) -> np.ndarray:
    """Stands still with the gripper open (useful with `actor="expert"`, where the action is ignored)."""
    n = len(obs["task"])
    actions = np.zeros((n, 7), np.float32)
    actions[:, 6] = -1.0
    return actions


class RandomPolicy:
    """Uniform random actions in [-1, 1], from its own seeded generator (reproducible collections)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        return self.rng.uniform(-1.0, 1.0, (len(obs["task"]), 7)).astype(np.float32)


class _EpisodeBuffer:
    def __init__(self, seed: int | None, serial: int) -> None:
        self.seed = seed
        self.serial = serial  # start order: unique even when several episodes share a seed
        self.obs: dict[str, list[np.ndarray]] = {}
        self.privileged: dict[str, list[np.ndarray]] = {}
        self.actions: list[np.ndarray] = []
        self.executed_by: list[int] = []
        self.rewards: list[float] = []
        self.success: list[bool] = []
        self.wrong_target: bool | None = None  # None until a step's info says (tasks without wrong targets never do)
        self.task = ""

    def add_obs(self, obs: dict[str, Any], i: int, privileged: dict[str, Any], *, frames: bool = True) -> None:
        """Observation t and the privileged state at the same instant (from the info of the step that led to it);
        without `frames`, the camera images are left out."""
        self.task = obs["task"][i]
        for key, value in obs.items():
            if key != "task" and (frames or not key.startswith(IMAGE_PREFIX)):
                self.obs.setdefault(key, []).append(np.array(value[i]))
        for key, value in privileged.items():
            self.privileged.setdefault(key, []).append(np.asarray(value, np.float32))

    def add_step(self, action: np.ndarray, info: dict[str, Any], reward: float) -> None:
        self.actions.append(np.asarray(info.get("action", action), np.float32))
        self.executed_by.append(int(info.get("executed_by", ExecutedBy.POLICY)))
        self.rewards.append(reward)
        self.success.append(bool(info.get("is_success", False)))
        if "wrong_target" in info:
            self.wrong_target = bool(self.wrong_target) or bool(info["wrong_target"])

    def to_episode(self, task_id: str, policy_version: str, segment: np.ndarray | None) -> Episode:
        T = len(self.actions)
        observations = {k: np.stack(v[:T]) for k, v in self.obs.items()}
        privileged = {k: np.stack(v[:T]) for k, v in self.privileged.items()}
        return Episode(
            observations=observations,
            action=np.stack(self.actions),
            task=self.task,
            executed_by=np.asarray(self.executed_by, np.int8),
            segment=segment,
            reward=np.asarray(self.rewards, np.float32),
            success=np.asarray(self.success, bool),
            task_id=task_id,
            seed=self.seed,
            policy_version=policy_version,
            fps=CONTROL_HZ,
            privileged=privileged,
            wrong_target=self.wrong_target,
        )


def collect(
    vector: InProcessVector | ProcessVector,
    policy: BatchPolicy,
    seeds: Iterable[int],
    *,
    task_id: str,
    policy_version: str = "",
    record_privileged: bool = True,
    on_episode: Callable[[Episode], None] | None = None,
    frames: str = "every_step",
) -> list[Episode]:
    """Run `policy` in `vector` until one episode per seed has finished; return them in completion order.

    `frames`: "every_step" renders and records the cameras at every step (what training reads); "when_acting"
    renders them only for the observations the policy decides from, and the episodes hold no frames (what an
    evaluation needs: with chunks of 4 steps it renders a quarter of the frames).

    A policy with `episode_finished(episode)` is told each returned episode's start-order number (the `episode` that
    `chunk_taken` was told), in the order of the returned list. A policy with `about_to_act(seeds, steps)` is told,
    before each call, every env's episode seed and step (step None for an env that takes no chunk from the call:
    idle, or midway through its chunk): what a sampler needs to draw its noise per episode, the same whatever the
    batch or the process layout, and to compute chunks only for the envs that take them.
    """
    if frames not in ("every_step", "when_acting"):
        raise ValueError(f"frames must be 'every_step' or 'when_acting'; got {frames!r}")
    every_step = frames == "every_step"
    pending = list(seeds)
    episodes: list[Episode] = []
    n = vector.num_envs
    stale = np.zeros(n, bool)  # envs whose frames in `obs` are older than their state (not rendered since)
    buffers: list[_EpisodeBuffer | None] = [None] * n
    queues: list[list[np.ndarray]] = [[] for _ in range(n)]
    reset_fn = getattr(policy, "reset", None)
    chunk_taken = getattr(policy, "chunk_taken", None)
    episode_finished = getattr(policy, "episode_finished", None)
    about_to_act = getattr(policy, "about_to_act", None)
    started = [0]
    obs: dict[str, Any] = {}

    def start(i: int) -> None:
        nonlocal obs
        if not pending:
            buffers[i] = None
            return
        seed = pending.pop(0)
        obs, info = vector.reset_at(i, seed)
        buffers[i] = _EpisodeBuffer(seed, started[0])
        started[0] += 1
        buffers[i].add_obs(obs, i, info.get("privileged", {}) if record_privileged else {}, frames=every_step)
        stale[i] = False
        queues[i] = []
        if reset_fn is not None:
            reset_fn([i])

    for i in range(n):
        start(i)
    while any(b is not None for b in buffers):
        active = np.array([b is not None for b in buffers])
        if any(active[i] and not queues[i] for i in range(n)):
            deciding_stale = [i for i in range(n) if stale[i] and active[i] and not queues[i]]
            if deciding_stale:  # its chunk was cut short (a human took over): it first renders what it sees now
                obs = vector.observe_at(deciding_stale)
                stale[deciding_stale] = False
            if about_to_act is not None:
                about_to_act([b.seed if b is not None else None for b in buffers],
                             [len(b.actions) if b is not None and not queues[i] else None for i, b in enumerate(buffers)])
            out = np.asarray(policy(obs), np.float32)
            if out.ndim not in (2, 3) or out.shape[0] != n or out.shape[-1] != 7:
                raise ValueError(f"policy must return (B, 7) or (B, H, 7) with B={n}; got shape {out.shape}")
            if out.ndim == 2:
                out = out[:, None]
            taken = [i for i in range(n) if active[i] and not queues[i]]
            for i in taken:
                queues[i] = list(out[i])
            if chunk_taken is not None:  # policies that keep per-chunk records (SDE log-probs) learn who used what
                for i in taken:
                    chunk_taken(i, buffers[i].serial, len(buffers[i].actions))
        actions = np.zeros((n, 7), np.float32)
        for i in np.flatnonzero(active):
            actions[i] = queues[i].pop(0)
        observe = np.ones(n, bool) if every_step else np.array([not q for q in queues])
        obs, rewards, terminated, truncated, infos = vector.step(actions, active, observe)
        stale[active] = ~observe[active]
        for i in np.flatnonzero(active):
            info = infos[i]
            buffers[i].add_step(actions[i], info, float(rewards[i]))
            if info.get("executed_by", ExecutedBy.POLICY) == ExecutedBy.HUMAN:
                queues[i] = []  # the human's steps ignore the policy's chunk
            if info.get("handback") and reset_fn is not None:
                reset_fn([i])  # the policy restarts from the state the human hands back
            if terminated[i] or truncated[i]:
                ep = buffers[i].to_episode(task_id, policy_version, info.get("segment_labels"))
                episodes.append(ep)
                if episode_finished is not None:
                    episode_finished(buffers[i].serial)
                if on_episode is not None:
                    on_episode(ep)
                start(i)
            else:
                buffers[i].add_obs(obs, i, info.get("privileged", {}) if record_privileged else {}, frames=every_step)
    return episodes


def equivalent_instructions(task: str, episodes: Sequence[Episode], config: TaskConfig | dict[str, Any] | None = None) -> list[list[str]]:
    """Per episode, every training-template instruction naming its targets (`TabletopEnv.equivalent_instructions`),
    from its seed's scene on `task` with `config`: what its demonstration equally demonstrates. A seed that does not
    give the episode's own instruction there (other task settings, another task) is refused by name."""
    env = make(task, config, cameras=())
    try:
        if not isinstance(env.unwrapped, TabletopEnv):
            raise ValueError(f"{task} is not one of kinema's sim tasks: the instructions naming an episode's targets "
                             "are known for those only")  # fmt: skip
        out = []
        for i, ep in enumerate(episodes):
            if ep.seed is None:
                raise ValueError(f"episode {i} has no seed: its scene, and so what else names its targets, cannot be rebuilt")
            env.reset(seed=int(ep.seed))
            if env.unwrapped.task != ep.task:
                raise ValueError(f"episode {i} (seed {ep.seed}) was instructed {ep.task!r}, but seed {ep.seed} gives "
                                 f"{env.unwrapped.task!r} on {task} with these task settings: it was recorded with other "
                                 "settings (task_config, instruction split)")  # fmt: skip
            out.append(env.unwrapped.equivalent_instructions())
        return out
    finally:
        env.close()


def collect_demos(
    task: str,
    num_episodes: int,
    *,
    seeds: Sequence[int] | None = None,
    expert: ExpertConfig | None = None,
    num_envs: int = 4,
    num_workers: int = 0,
    on_episode: Callable[[Episode], None] | None = None,
    **env_kwargs: Any,
) -> list[Episode]:
    """Scripted-expert demonstrations (or a simulated teleoperator's, `expert.operator`): every step is executed by
    the expert and labelled human."""
    seeds = list(range(num_episodes)) if seeds is None else list(seeds)
    num_envs = max(1, min(num_envs, len(seeds)))
    vector = make_vector(task, num_envs, num_workers=min(num_workers, num_envs), actor="expert", expert=expert, **env_kwargs)
    try:
        version = "teleop" if expert is not None and expert.operator == "teleop" else "expert"
        return collect(vector, zero_policy, seeds, task_id=task, policy_version=version, on_episode=on_episode)
    finally:
        vector.close()
