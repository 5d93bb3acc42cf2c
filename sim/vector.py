"""Batches of task environments: stepped in-process, or spread over worker processes with several envs each.

Both classes expose the same small interface, so rollout code never knows which one it drives:
`reset_at(i, seed)`, `step(actions, active, observe)`, `observe_at(indices)`, `num_envs`, `close()`. Observations come
back batched: `{key: array (num_envs, ...)}` plus `"task": list[str]`; infos come back as a list of dicts. A step's
`observe` mask says which envs render their cameras after it: an env left out keeps its last frames in the batch
(rendering is most of a step's cost, and a chunked policy reads frames only when it decides), until `observe_at`.

Worker processes start with `forkserver` (a fork of a process holding EGL/OpenGL state is unsafe), set
`LP_NUM_THREADS=1` before anything renders (llvmpipe otherwise spawns a thread per core in every process and the
cores thrash), and write camera frames into shared memory so only small messages cross the pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np

EnvFn = Callable[[], Any]


def _empty_obs_batch(space: Any, n: int) -> dict[str, Any]:
    batch: dict[str, Any] = {}
    for key, sub in space.spaces.items():
        if key == "task":
            batch[key] = [""] * n
        else:
            batch[key] = np.zeros((n, *sub.shape), sub.dtype)
    return batch


def _step_env(env: Any, action: np.ndarray, render: bool) -> tuple:
    """`env.step(action)`, its cameras not rendered when `render` is False (on envs that can skip them)."""
    base = env.unwrapped
    if render or not hasattr(base, "render_images"):
        return env.step(action)
    base.render_images = False
    try:
        return env.step(action)
    finally:
        base.render_images = True


def _current_observation(env: Any) -> dict[str, Any]:
    """The env's observation now, cameras rendered; {} from an env that never skips them (its frames are current)."""
    base = env.unwrapped
    return base._observation() if hasattr(base, "render_images") else {}


def _mask(values: np.ndarray | None, n: int) -> np.ndarray:
    return np.ones(n, bool) if values is None else np.asarray(values, bool)


class InProcessVector:
    """Envs stepped one after another in this process."""

    def __init__(self, env_fns: Sequence[EnvFn]) -> None:
        self.envs = [fn() for fn in env_fns]
        self.num_envs = len(self.envs)
        self.observation_space = self.envs[0].observation_space
        self.obs = _empty_obs_batch(self.observation_space, self.num_envs)

    def _store(self, i: int, obs: dict[str, Any]) -> None:
        for key, value in obs.items():
            self.obs[key][i] = value

    def reset_at(self, i: int, seed: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        obs, info = self.envs[i].reset(seed=seed)
        self._store(i, obs)
        return self.obs, info

    def step(self, actions: np.ndarray, active: np.ndarray | None = None, observe: np.ndarray | None = None):
        active, observe = _mask(active, self.num_envs), _mask(observe, self.num_envs)
        rewards = np.zeros(self.num_envs, np.float32)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        for i in np.flatnonzero(active):
            obs, rewards[i], terminated[i], truncated[i], infos[i] = _step_env(self.envs[i], actions[i], observe[i])
            self._store(i, obs)
        return self.obs, rewards, terminated, truncated, infos

    def observe_at(self, indices: Sequence[int]) -> dict[str, Any]:
        for i in indices:
            self._store(i, _current_observation(self.envs[i]))
        return self.obs

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _worker(conn: Any, env_fns: list[EnvFn], shm_specs: dict[str, tuple[str, tuple, str]], offset: int) -> None:
    os.environ["LP_NUM_THREADS"] = "1"
    os.environ.setdefault("MUJOCO_GL", "egl")
    envs = [fn() for fn in env_fns]
    shms = {k: shared_memory.SharedMemory(name=name) for k, (name, _, _) in shm_specs.items()}
    arrays = {k: np.ndarray(shape, np.dtype(dt), buffer=shms[k].buf) for k, (_, shape, dt) in shm_specs.items()}

    def store(j: int, obs: dict[str, Any]) -> dict[str, Any]:
        small = {}
        for key, value in obs.items():
            if key in arrays:
                arrays[key][offset + j] = value
            else:
                small[key] = value
        return small

    try:
        while True:
            cmd, payload = conn.recv()
            if cmd == "close":
                break
            try:
                if cmd == "reset":
                    j, seed = payload
                    obs, info = envs[j].reset(seed=seed)
                    reply: Any = (store(j, obs), info)
                elif cmd == "step":
                    actions, active, observe = payload
                    reply = []
                    for j, env in enumerate(envs):
                        if not active[j]:
                            reply.append(None)
                            continue
                        obs, reward, terminated, truncated, info = _step_env(env, actions[j], observe[j])
                        reply.append((store(j, obs), reward, terminated, truncated, info))
                elif cmd == "observe":
                    reply = [store(j, _current_observation(envs[j])) for j in payload]
                else:
                    raise ValueError(f"unknown worker command {cmd!r}")
                conn.send(("ok", reply))
            except Exception as err:  # noqa: BLE001 - sent back and re-raised in the parent, with its type
                conn.send(("error", (type(err), str(err), traceback.format_exc())))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        for env in envs:
            env.close()
        for shm in shms.values():
            shm.close()
        conn.close()


class ProcessVector:
    """`num_workers` processes, each holding a contiguous block of envs; camera frames travel in shared memory."""

    def __init__(self, env_fns: Sequence[EnvFn], num_workers: int = 2, *, timeout_s: float = 120.0) -> None:
        if num_workers < 1 or num_workers > len(env_fns):
            raise ValueError(f"num_workers must be in [1, {len(env_fns)}] (the number of envs); got {num_workers}")
        self.num_envs = len(env_fns)
        self.timeout_s = timeout_s
        probe = env_fns[0]()
        self.observation_space = probe.observation_space
        probe.close()
        self.obs = _empty_obs_batch(self.observation_space, self.num_envs)
        self._shms: dict[str, shared_memory.SharedMemory] = {}
        specs: dict[str, tuple[str, tuple, str]] = {}
        for key, arr in self.obs.items():
            if isinstance(arr, np.ndarray) and arr.dtype == np.uint8:
                shm = shared_memory.SharedMemory(create=True, size=max(arr.nbytes, 1))
                self._shms[key] = shm
                self.obs[key] = np.ndarray(arr.shape, arr.dtype, buffer=shm.buf)
                specs[key] = (shm.name, arr.shape, arr.dtype.str)
        ctx = mp.get_context("forkserver")
        blocks = np.array_split(np.arange(self.num_envs), num_workers)
        self.blocks = [b for b in blocks if len(b)]
        self.conns, self.procs = [], []
        for block in self.blocks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(child, [env_fns[i] for i in block], specs, int(block[0])), daemon=True
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.owner = {int(i): (w, j) for w, block in enumerate(self.blocks) for j, i in enumerate(block)}

    def _recv(self, w: int) -> Any:
        """A worker's reply; its exception re-raised here with the same type; a dead or stuck worker is an error."""
        conn = self.conns[w]
        if not conn.poll(self.timeout_s):
            self.close()
            raise RuntimeError(f"env worker {w} sent nothing for {self.timeout_s:.0f} s; the vector env was closed")
        try:
            status, reply = conn.recv()
        except (EOFError, ConnectionError) as err:
            self.close()
            raise RuntimeError(f"env worker {w} died (exit code {self.procs[w].exitcode}); the vector env was closed") from err
        if status == "error":
            kind, message, remote_tb = reply
            try:
                exc = kind(message)
            except Exception:  # noqa: BLE001 - exception types with unusual constructors
                exc = RuntimeError(message)
            raise exc from RuntimeError(f"in env worker {w}:\n{remote_tb}")
        return reply

    def _store_small(self, i: int, small: dict[str, Any]) -> None:
        for key, value in small.items():
            self.obs[key][i] = value

    def reset_at(self, i: int, seed: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
        w, j = self.owner[i]
        self.conns[w].send(("reset", (j, seed)))
        small, info = self._recv(w)
        self._store_small(i, small)
        return self.obs, info

    def step(self, actions: np.ndarray, active: np.ndarray | None = None, observe: np.ndarray | None = None):
        active, observe = _mask(active, self.num_envs), _mask(observe, self.num_envs)
        for w, block in enumerate(self.blocks):
            self.conns[w].send(("step", (np.asarray(actions)[block], active[block], observe[block])))
        rewards = np.zeros(self.num_envs, np.float32)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        replies, error = [], None
        for w in range(len(self.blocks)):  # read every worker's reply, so no stale reply stays in a pipe
            try:
                replies.append(self._recv(w))
            except Exception as err:  # noqa: BLE001
                replies.append(None)
                error = error or err
        if error is not None:
            raise error
        for block, reply in zip(self.blocks, replies):
            for i, result in zip(block, reply):
                if result is None:
                    continue
                small, rewards[i], terminated[i], truncated[i], infos[i] = result
                self._store_small(int(i), small)
        return self.obs, rewards, terminated, truncated, infos

    def observe_at(self, indices: Sequence[int]) -> dict[str, Any]:
        by_worker: dict[int, list[tuple[int, int]]] = {}
        for i in indices:
            w, j = self.owner[int(i)]
            by_worker.setdefault(w, []).append((int(i), j))
        for w, pairs in by_worker.items():
            self.conns[w].send(("observe", [j for _, j in pairs]))
        for w, pairs in by_worker.items():
            for (i, _), small in zip(pairs, self._recv(w)):
                self._store_small(i, small)
        return self.obs

    def close(self) -> None:
        if not self._shms:
            return
        for conn in self.conns:
            try:
                conn.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        for shm in self._shms.values():
            shm.close()
            shm.unlink()
        self._shms = {}

    def __del__(self) -> None:
        if getattr(self, "_shms", None):
            self.close()
