"""Rollouts on Ray (`--rollout.backend ray`): actors that each own envs and a copy of the acting policy.

A round puts the acting policy in the object store once, saved whole (its weights and whatever else it acts with);
every actor loads it once and runs its share of the seeds through `sim.rollout.collect` (the one seeds→episodes path,
the same as the local backend's), returning `Episode`s. Sampling noise is drawn per (episode seed, step)
(`ChunkPolicy`), so an episode is the same whichever actor plays it. Seeds go out in small tasks from a queue: an
actor that dies mid-round is replaced and its task's seeds are played again, and the round reports how many episodes
it re-ran.

Without `ray.address` a local Ray starts on 127.0.0.1 with no dashboard, usage statistics off, a small object store
and a bounded number of CPUs; `ray.address auto` (or `ray://host:port`) joins a running cluster instead.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from diffusion_rl.data import Episode

TASKS_PER_ACTOR = 2
MAX_REPLACEMENTS = 3  # per task: a task that kills its actor this often is an error, not bad luck


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None  # without importing it: see pin_to_loopback


def pin_to_loopback() -> None:
    """Every address of a Ray started here is 127.0.0.1. Ray otherwise rewrites 127.0.0.1 to the machine's
    routable IP when connecting (its single-machine mode, the default on macOS, is what this switch selects)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read when ray is imported...
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    if "ray" in sys.modules:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False  # ...and here, read at each address lookup


def _import_ray() -> Any:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    try:
        import ray
    except ImportError as err:
        raise ImportError("rollout.backend ray needs Ray: pip install 'kinema[dist]'") from err
    return ray


def connect(address: str = "", *, num_cpus: int = 1, object_store_mb: int = 256) -> bool:
    """Join `address`, or start a local Ray pinned to 127.0.0.1; True when this call started or joined it."""
    if not address:
        pin_to_loopback()
    ray = _import_ray()
    if ray.is_initialized():
        return False
    common = dict(include_dashboard=False, log_to_driver=False, configure_logging=False)
    if address:
        ray.init(address=address, **common)
    else:
        ray.init(num_cpus=num_cpus, object_store_memory=object_store_mb * 2**20, _node_ip_address="127.0.0.1", **common)
    return True


class RolloutWorker:
    """A Ray actor: `num_envs` envs stepped in its process and a copy of the policy, loaded once per weights version."""

    def __init__(self, task: str, num_envs: int, env_kwargs: dict[str, Any], device: str = "cpu", threads: int = 1) -> None:
        os.environ["LP_NUM_THREADS"] = "1"  # as sim.vector's workers: llvmpipe would start a thread per core
        os.environ.setdefault("MUJOCO_GL", "egl")
        torch.set_num_threads(threads)
        from sim.rollout import make_vector

        self.vector = make_vector(task, num_envs, num_workers=0, **env_kwargs)
        self.device = device
        self.policy: Any = None
        self.version: int | None = None

    def pid(self) -> int:
        return os.getpid()

    def collect(self, weights: list[Any], version: int, seeds: list[int], runner_options: dict[str, Any],
                task_id: str, policy_version: str) -> tuple[list[Episode], dict[tuple[int, int], dict[str, Any]]]:  # fmt: skip
        """One episode per seed; `weights` is `[ObjectRef]` to the acting policy, saved whole (nested, so it is
        fetched only when the version changes)."""
        from kinema.train.evaluate import ChunkPolicy
        from sim.rollout import collect

        if version != self.version:
            ray = _import_ray()
            blob = ray.get(weights[0])
            self.policy = torch.load(io.BytesIO(blob), map_location=self.device, weights_only=False).eval().requires_grad_(False)
            self.version = version
        runner = ChunkPolicy(self.policy, **runner_options)
        episodes = collect(self.vector, runner, seeds, task_id=task_id, policy_version=policy_version)
        return episodes, runner.chunk_records()


class RayRolloutPool:
    """`num_workers` RolloutWorker actors kept across rounds; `run` plays one episode per seed on them."""

    def __init__(self, task: str, *, num_workers: int, envs_per_worker: int, env_kwargs: dict[str, Any],
                 gpus_per_worker: float = 0.0) -> None:  # fmt: skip
        ray = _import_ray()
        if not ray.is_initialized():
            raise RuntimeError("Ray is not running: call kinema.train.ray_rollout.connect() first")
        self.ray = ray
        self.envs_per_worker = envs_per_worker
        device = "cuda" if gpus_per_worker > 0 else "cpu"
        self._remote = ray.remote(num_cpus=1, num_gpus=gpus_per_worker, max_restarts=0)(RolloutWorker)
        self._args = (task, envs_per_worker, env_kwargs, device)
        self.actors = [self._new_actor() for _ in range(num_workers)]
        self._version = 0
        self.last_broadcast: dict[str, float] = {}
        self._running: dict[Any, tuple[int, int]] = {}  # ref -> (actor slot, task)

    def _new_actor(self) -> Any:
        return self._remote.remote(*self._args)

    def busy_slots(self) -> list[int]:
        """The actors (by position in `actors`) with a task in flight."""
        return sorted(slot for slot, _ in self._running.values())

    def pids(self) -> list[int]:
        return self.ray.get([a.pid.remote() for a in self.actors])

    def run(
        self, policy: Any, seeds: Sequence[int], *, runner_options: dict[str, Any], task_id: str, policy_version: str,
        on_episode: Callable[[Episode], None] | None = None,
    ) -> tuple[list[Episode], dict[tuple[int, int], dict[str, Any]], int]:  # fmt: skip
        """(episodes in seed order, chunk records keyed by (index in that list, step), episodes re-run)."""

        ray = self.ray
        start = time.perf_counter()
        # The policy whole, not its state_dict: what it acts with beyond its weights (a SmolVLA's normalisation
        # stats, kept out of LeRobot's state dict) travels too, and no actor needs to rebuild it from its config.
        buffer = io.BytesIO()
        torch.save(policy, buffer)
        weights = [ray.put(buffer.getvalue())]  # once per round, whatever the number of actors and tasks
        self._version += 1
        self.last_broadcast = {"ms": (time.perf_counter() - start) * 1e3, "bytes": float(buffer.getbuffer().nbytes)}
        # About TASKS_PER_ACTOR tasks per actor: each keeps its envs busy across seeds as a local round does, the queue
        # still balances the actors, and a dead actor's re-run is bounded to its task.
        size = max(1, self.envs_per_worker, -(-len(seeds) // (TASKS_PER_ACTOR * len(self.actors))))
        tasks = [list(seeds[i : i + size]) for i in range(0, len(seeds), size)]
        queue = list(range(len(tasks)))
        results: dict[int, tuple[list[Episode], dict]] = {}
        replaced = [0] * len(tasks)
        reran = 0
        running = self._running = {}  # ref -> (actor slot, task)

        def submit(slot: int) -> None:
            if queue:
                t = queue.pop(0)
                ref = self.actors[slot].collect.remote(weights, self._version, tasks[t], runner_options, task_id, policy_version)
                running[ref] = (slot, t)

        for slot in range(len(self.actors)):
            submit(slot)
        while running:
            [ref], _ = ray.wait(list(running), num_returns=1)
            slot, t = running.pop(ref)
            try:
                results[t] = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as err:
                replaced[t] += 1
                if replaced[t] > MAX_REPLACEMENTS:
                    raise RuntimeError(f"rollout seeds {tasks[t]} killed their Ray actor {replaced[t]} times") from err
                ray.kill(self.actors[slot], no_restart=True)  # dead already; released for good
                self.actors[slot] = self._new_actor()
                reran += len(tasks[t])
                queue.insert(0, t)  # the same seeds again, first
            else:
                if on_episode is not None:
                    for ep in results[t][0]:
                        on_episode(ep)
            submit(slot)
        episodes: list[Episode] = []
        records: dict[tuple[int, int], dict[str, Any]] = {}
        for t in range(len(tasks)):
            eps, recs = results[t]
            records.update({(len(episodes) + i, step): rec for (i, step), rec in recs.items()})
            episodes.extend(eps)
        return episodes, records, reran

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor, no_restart=True)
        self.actors = []


_POOL: tuple[tuple, RayRolloutPool] | None = None  # kept across rounds: actors and envs start once per run
_STARTED = False


def pool_for(cfg: Any, env_kwargs: dict[str, Any], policy: Any, num_seeds: int) -> RayRolloutPool:
    """The run's pool (started, or Ray joined, on first use) for `cfg`'s rollout settings."""
    global _POOL, _STARTED
    workers = max(1, cfg.rollout.ray_workers or cfg.workers)
    envs = -(-max(1, min(cfg.num_envs, num_seeds)) // workers)
    key = (cfg.task, repr(env_kwargs), workers, envs, cfg.rollout.gpus_per_worker)  # any policy: it travels whole
    if _POOL is not None and _POOL[0] == key:
        return _POOL[1]
    shutdown(keep_ray=True)
    _STARTED = connect(cfg.ray.address, num_cpus=cfg.ray.num_cpus or workers, object_store_mb=cfg.ray.object_store_mb) or _STARTED
    pool = RayRolloutPool(cfg.task, num_workers=workers, envs_per_worker=envs, env_kwargs=env_kwargs,
                          gpus_per_worker=cfg.rollout.gpus_per_worker)  # fmt: skip
    _POOL = (key, pool)
    return pool


def roll_out_on_ray(runner: Any, cfg: Any, seeds: Sequence[int], round_index: int, env_kwargs: dict[str, Any], *,
                    on_episode: Callable[[Episode], None] | None = None) -> tuple[list[Episode], int, dict[str, float]]:  # fmt: skip
    """`roll_out_policy` on the Ray backend: (episodes, episodes re-run, the weight broadcast's ms and bytes).

    The runner's chunk records (Flow-SDE) are moved into `runner`, keyed as `runner.chunk_records()` expects."""
    pool = pool_for(cfg, env_kwargs, runner.policy, len(seeds))
    options = {"n_action_steps": runner.n_action_steps, "sde_noise": runner.sde_noise}
    episodes, records, reran = pool.run(runner.policy, list(seeds), runner_options=options, task_id=cfg.task,
                                        policy_version=f"round-{round_index}", on_episode=on_episode)  # fmt: skip
    runner.finished = list(range(len(episodes)))
    runner.records = dict(records)
    return episodes, reran, dict(pool.last_broadcast)


def shutdown(*, keep_ray: bool = False) -> None:
    """Close the run's actors, and the local Ray this process started (unless `keep_ray`)."""
    global _POOL, _STARTED
    if _POOL is not None:
        _POOL[1].close()
        _POOL = None
    if not keep_ray and _STARTED:
        _import_ray().shutdown()
        _STARTED = False

