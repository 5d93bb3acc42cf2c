"""Evaluate a policy in simulation: success rate with its standard error, steps-to-success, takeover rate."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from diffusion_rl.data import Episode, ExecutedBy
from sim.rollout import collect, make_vector

EVAL_SEED_OFFSET = 1_000_000  # evaluation seeds never overlap training/demo seeds
RUN_SEED_STRIDE = 10_000  # a run of seed s evaluates on EVAL_SEED_OFFSET + s·RUN_SEED_STRIDE + [0, episodes)


@dataclass
class Acting:
    """How a checkpoint acts, as a method defines it (`RLMethod.acting`, `RLMethod.selection`): `make()` gives a fresh
    runner (a `ChunkPolicy`) for each use, `description` says what acts, in words; `num_samples` > 1 for best-of-N."""

    make: Callable[[], ChunkPolicy]
    description: str
    num_samples: int = 1


class ChunkPolicy:
    """Adapts a VLA (or anything with `predict_action_chunk`) to sim.rollout's batched policy interface.

    ODE chunks start from noise drawn per (episode seed, step) when `collect` says which episode each env runs
    (`about_to_act`): an episode then plays out the same in any batch, in worker processes or not, so evaluations
    of two checkpoints on the same seeds are paired. With `sde_noise`, chunks are sampled with Flow-SDE steps and every chunk an env executes is recorded with its
    observation and per-step log-probs: `chunk_records()`, what the Flow-SDE PPO/GRPO baseline needs.
    """

    def __init__(self, policy: Any, *, n_action_steps: int | None = None, sde_noise: float | None = None, noise_scale: float = 1.0) -> None:
        if noise_scale != 1.0 and not policy.scales_initial_noise:
            raise ValueError(f"noise_scale scales a flow sampler's initial noise; {type(policy).__name__} samples latents of its own (use 1)")
        if noise_scale < 0:
            raise ValueError(f"noise_scale must be >= 0; got {noise_scale}")
        self.policy = policy
        self.n_action_steps = n_action_steps or policy.config.n_action_steps
        self.sde_noise = sde_noise
        self.noise_scale = noise_scale
        self.records: dict[tuple[int, int], dict[str, Any]] = {}  # by (episode start-order number, step)
        self.finished: list[int] = []  # start-order numbers, in the order `collect` returns the episodes
        self._last: tuple[dict[str, Any], dict[str, torch.Tensor]] | None = None
        self._episodes: tuple[list[int | None], list[int | None]] | None = None  # per env: (seed, step)
        self._rows: list[int] | None = None  # the envs of this call's batch that act on its chunks, by env index

    def about_to_act(self, seeds: list[int | None], steps: list[int | None]) -> None:
        """Each env's episode seed and step; a step of None: that env takes no chunk from the coming call (idle, or
        midway through its chunk), so no chunk is computed for it."""
        self._episodes, self._rows = (seeds, steps), None

    def _acting_rows(self, batch_size: int) -> list[int]:
        if self._episodes is None or len(self._episodes[1]) != batch_size:
            return list(range(batch_size))
        return [i for i, step in enumerate(self._episodes[1]) if step is not None]

    def _episode_noise(self, batch_size: int, samples: int = 0) -> torch.Tensor | None:
        """(B, chunk, action_dim) standard normal noise for the acting envs of this call, each env's drawn from its
        own (episode seed, step); with `samples`, (B, samples, chunk, action_dim), drawn in turn from the same
        generator (the first sample is the one drawn without `samples`)."""
        if self._episodes is None:
            return None
        acting = self._rows if self._rows is not None else self._acting_rows(len(self._episodes[1]))
        if len(acting) != batch_size:
            return None
        shape = (self.policy.config.chunk_size, self.policy.config.action_dim)
        rows = []
        for seed, step in ((self._episodes[0][i], self._episodes[1][i]) for i in acting):
            key = np.random.SeedSequence([int(seed), int(step)]).generate_state(1)[0] if seed is not None else 0
            g = torch.Generator().manual_seed(int(key))
            draws = [torch.randn(shape, generator=g) for _ in range(max(samples, 1))]
            rows.append(torch.stack(draws) if samples else draws[0])
        return torch.stack(rows).to(self.policy.device)

    def sample(self, batch: dict[str, Any]) -> torch.Tensor:
        """The ODE chunks (B, chunk, action_dim) to act with: the policy's, from the per-episode noise times
        `noise_scale` (0: every chunk from zero noise, a deterministic, mode-seeking sampler). Runners that choose or
        steer chunks (PA-RL's selection, DSRL's noise actor) override this."""
        B = len(batch["task"])
        noise = self._episode_noise(B)
        if noise is None:  # drawn here, so that a checkpoint's inference_noise_scale (what deploy uses) never applies
            cfg = self.policy.config
            noise = torch.randn(B, cfg.chunk_size, cfg.action_dim, device=self.policy.device)
        return self.policy.predict_action_chunk(batch, noise=noise * self.noise_scale)

    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        return self.chunks(obs)[:, : self.n_action_steps]

    @torch.no_grad()
    def chunks(self, obs: dict[str, Any]) -> np.ndarray:
        """Whole chunks (B, chunk_size, action_dim) for the batch of observations; zeros for the envs that
        `about_to_act` said take none (computed for the others only: the policy's cost is per sample)."""
        B = len(obs["task"])
        rows = self._rows = self._acting_rows(B)
        was_training = self.policy.training
        if was_training:  # train()/eval() walk every module: most calls find the policy in eval mode already
            self.policy.eval()
        batch = {k: (torch.from_numpy(np.ascontiguousarray(v[rows])) if isinstance(v, np.ndarray) else [v[i] for i in rows])
                 for k, v in obs.items()}  # fmt: skip
        if self.sde_noise is None:
            chunk = self.sample(batch)
        else:
            chunk, record = self.policy.sample_chunk_sde(batch, noise_level=self.sde_noise)
            self._last = ({k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in batch.items()}, record)
        if was_training:
            self.policy.train()
        out = np.zeros((B, *chunk.shape[1:]), np.float32)
        out[rows] = chunk.cpu().numpy()
        return out

    def episode_finished(self, episode: int) -> None:
        self.finished.append(episode)

    def chunk_records(self) -> dict[tuple[int, int], dict[str, Any]]:
        """The executed chunks' records keyed by (index of the episode in the list `collect` returned, env step at
        which the chunk was computed), in the order the chunks were taken; empty without `sde_noise`."""
        index = {serial: i for i, serial in enumerate(self.finished)}
        return {(index[serial], step): rec for (serial, step), rec in self.records.items() if serial in index}

    def chunk_taken(self, env_index: int, episode: int, step: int) -> None:
        if self._last is None:
            return
        batch, record = self._last
        row = self._rows.index(env_index)  # the env's row in the last call's batch of acting envs
        obs = {"obs": {k: v[row] for k, v in batch.items()}} if batch is not None else {}
        self.records[(episode, step)] = {**obs, **{k: (v[row] if v.ndim > 1 else v) for k, v in record.items()}}


class PlanAheadChunkPolicy(ChunkPolicy):
    """Chunks executed as the ROS 2 policy node executes them (robot/policy_node.py): a chunk planned from the
    observation of tick s runs from its index 1 at ticks s+1, s+2, ..., while tick s still executes the last action of
    the chunk before, so an action is always decided from an earlier tick's observation. For rollouts in simulation
    that match a robot loop's (`rl.rollout_plan_ahead`); an episode's first chunk starts at index 0."""

    def __init__(self, policy: Any, **kwargs: Any) -> None:
        super().__init__(policy, **kwargs)
        if policy.config.chunk_size < self.n_action_steps + 1:
            raise ValueError(f"planning ahead runs a chunk from index 1: chunk_size {policy.config.chunk_size} must exceed "
                             f"n_action_steps {self.n_action_steps}")  # fmt: skip
        self._previous: dict[int, np.ndarray] = {}  # per env: the chunk it runs now
        self._planned: np.ndarray | None = None  # this call's chunks, kept by the envs that take them

    def reset(self, indices: Sequence[int]) -> None:
        for i in indices:
            self._previous.pop(i, None)

    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        n = self.n_action_steps
        chunks = self._planned = self.chunks(obs)
        out = chunks[:, :n].copy()
        for i, previous in self._previous.items():
            out[i] = np.concatenate([previous[n : n + 1], chunks[i, 1:n]])
        return out

    def chunk_taken(self, env_index: int, episode: int, step: int) -> None:
        super().chunk_taken(env_index, episode, step)
        self._previous[env_index] = self._planned[env_index]


class SelectChunkPolicy(ChunkPolicy):
    """Best-of-N by value: PA-RL's action choice, V-GPS at inference, and the video policy's planning.
    `num_samples` chunks per observation, and the one valued most is executed. The value is a chunk critic's (the
    ODE chunks from the per-episode noise, optionally refined by `refine_steps` gradient steps on it) or, with
    `critic=None`, the policy's own prediction (`policy.plan`, which samples the candidates with their values).
    The first candidate is the chunk `ChunkPolicy(policy, noise_scale=...)` would execute, so N = 1 is the policy as
    it acts alone; the other N − 1 start from sampled noise (at `noise_scale` 0 they add the policy's spread around
    its deterministic chunk). With `record`, every executed chunk (the whole chunk_size) is kept by (episode, step):
    `chunk_records()`, what PA-RL distils. `margin` > 0 keeps the first candidate unless the critic values another
    more than `margin` above it (`select_chunks`)."""

    def __init__(self, policy: Any, critic: Any | None, *, num_samples: int, refine_steps: int = 0, step_size: float = 0.0,
                 record: bool = False, noise_scale: float = 1.0, margin: float = 0.0) -> None:  # fmt: skip
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1; got {num_samples}")
        if critic is None and not policy.plans:
            raise ValueError(f"best-of-N needs a value: a chunk critic, or a policy that predicts its chunks' values "
                             f"(policy.type video); {type(policy).__name__} predicts none")  # fmt: skip
        if margin and critic is None:
            raise ValueError("a selection margin applies to a chunk critic's values; this selection is by the policy's own plan")
        super().__init__(policy, noise_scale=noise_scale)
        self.critic, self.num_samples, self.refine_steps, self.step_size, self.record = critic, num_samples, refine_steps, step_size, record
        self.margin = margin

    def sample(self, batch: dict[str, Any]) -> torch.Tensor:
        from diffusion_rl.chunk_q import refine_chunks, select_chunks

        B, N = len(batch["task"]), self.num_samples
        if self.critic is None:
            planned = self.policy.plan(batch, candidates=N, noise=self._episode_noise(B))
            return planned["chunks"][torch.arange(B, device=planned["best"].device), planned["best"]]
        cfg = self.policy.config
        noise = self._episode_noise(B, samples=N)
        if noise is None:
            noise = torch.randn(B, N, cfg.chunk_size, cfg.action_dim, device=self.policy.device)
        if self.noise_scale != 1.0:
            noise = torch.cat([noise[:, :1] * self.noise_scale, noise[:, 1:]], dim=1)
        context = self.policy.encode(batch)[0]
        features = self.policy.context_features(context)
        context = context.repeat_interleave(N, dim=0)
        chunks = self.policy.predict_action_chunk(batch, noise=noise.flatten(0, 1), context=context).reshape(B, N, cfg.chunk_size, cfg.action_dim)
        self.critic.eval()
        chunks = refine_chunks(self.critic, features, chunks, steps=self.refine_steps, step_size=self.step_size)
        chosen, index, _ = select_chunks(self.critic, features, chunks, margin=self.margin)
        if self.record:
            self._last = (None, {"chunk": chosen.cpu(), "sample_index": index.cpu()})
        return chosen


class SteeredChunkPolicy(ChunkPolicy):
    """DSRL's acting: the noise actor turns the observation's features into the frozen sampler's initial noise
    (its Gaussian's ε is the per-episode noise, so a steered episode replays the same on the same seed; deterministic:
    the actor's mean). With `record`, the noise of every executed chunk is kept by (episode, step)."""

    def __init__(self, policy: Any, actor: Any, *, deterministic: bool = True, record: bool = False) -> None:
        super().__init__(policy)
        self.actor, self.deterministic, self.record = actor, deterministic, record

    def sample(self, batch: dict[str, Any]) -> torch.Tensor:
        B = len(batch["task"])
        cfg = self.policy.config
        eps = self._episode_noise(B)
        context = self.policy.encode(batch)[0]
        features = self.policy.context_features(context)
        self.actor.eval()
        noise, _ = self.actor(features, deterministic=self.deterministic, eps=None if eps is None else eps.flatten(1))
        if self.record:
            self._last = (None, {"noise": noise.cpu()})
        return self.policy.predict_action_chunk(batch, noise=noise.reshape(B, cfg.chunk_size, cfg.action_dim), context=context)


class ResidualChunkPolicy(ChunkPolicy):
    """Residual RL's acting: the frozen VLA's chunk from initial noise scaled by `base_noise_scale` (0: its
    deterministic chunk), plus a bounded correction on the executed steps: `scale` · z, z ∈ [−1, 1] from the residual
    actor, which reads the features and the base's executed steps (ResiP, Policy Decorator). The sum is clipped to
    the action range [−1, 1]. The actor's ε is the per-episode noise (a second draw, apart from the base's), so an
    episode replays the same on the same seed; deterministic: the actor's mean. With `record`, every executed
    chunk's z (as `noise`) and base steps (as `base`) are kept by (episode, step)."""

    def __init__(self, policy: Any, actor: Any, *, scale: float, base_noise_scale: float = 0.0, deterministic: bool = True,
                 record: bool = False) -> None:  # fmt: skip
        super().__init__(policy, noise_scale=base_noise_scale)
        if scale <= 0:
            raise ValueError(f"the residual's scale must be > 0 (in action units); got {scale}")
        self.actor, self.scale, self.deterministic, self.record = actor, scale, deterministic, record

    def sample(self, batch: dict[str, Any]) -> torch.Tensor:
        B, cfg, n = len(batch["task"]), self.policy.config, self.n_action_steps
        noise = self._episode_noise(B, samples=2)
        if noise is None:
            noise = torch.randn(B, 2, cfg.chunk_size, cfg.action_dim, device=self.policy.device)
        context = self.policy.encode(batch)[0]
        features = self.policy.context_features(context)
        chunk = self.policy.predict_action_chunk(batch, noise=noise[:, 0] * self.noise_scale, context=context)
        base = chunk[:, :n].flatten(1)
        self.actor.eval()
        z, _ = self.actor(torch.cat([features, base], dim=-1), deterministic=self.deterministic, eps=noise[:, 1, :n].flatten(1))
        if self.record:
            self._last = (None, {"noise": z.cpu(), "base": base.cpu()})
        executed = (base + self.scale * z).clamp(-1.0, 1.0).reshape(B, n, cfg.action_dim)
        return torch.cat([executed, chunk[:, n:]], dim=1)


def batch1_latency_ms(runners: dict[Any, ChunkPolicy], task: str, *, image_size: int, task_config: dict | None = None,
                      repeats: int = 20) -> dict[Any, float]:  # fmt: skip
    """Median wall milliseconds of one call of each runner on a single observation (what a robot waits for each
    chunk), by the runners' keys. The runners' calls alternate, so that other work on the machine slows each alike
    and their ratio holds even when the absolute figures do not."""
    import time

    vector = make_vector(task, 1, num_workers=0, image_size=image_size, config=task_config)
    try:
        obs, _ = vector.reset_at(0, EVAL_SEED_OFFSET)
    finally:
        vector.close()
    batch = {k: (v.copy() if isinstance(v, np.ndarray) else list(v)) for k, v in obs.items()}  # already a batch of 1
    times: dict[Any, list[float]] = {key: [] for key in runners}
    for _ in range(repeats + 1):  # the first round warms up
        for key, runner in runners.items():
            start = time.perf_counter()
            runner(batch)
            times[key].append(1000 * (time.perf_counter() - start))
    return {key: float(np.median(t[1:])) for key, t in times.items()}


@dataclass
class EvalResult:
    split: str
    episodes: int
    success: float
    success_se: float
    steps_to_success: float | None
    takeover_rate: float | None
    seeds: list[int] = field(default_factory=list)  # the episodes' seeds, ascending
    outcomes: list[int] = field(default_factory=list)  # 1 success, 0 failure, aligned with `seeds`
    # The share of episodes that reached a target the instruction did not name (failures, however the named target
    # stands); None for a task that defines no wrong target.
    wrong_target: float | None = None

    def as_dict(self, prefix: str = "") -> dict[str, Any]:
        return {
            f"{prefix}success": self.success,
            f"{prefix}success_se": self.success_se,
            f"{prefix}steps_to_success": self.steps_to_success,
            f"{prefix}takeover_rate": self.takeover_rate,
            f"{prefix}episodes": self.episodes,
            f"{prefix}seeds": self.seeds,
            f"{prefix}outcomes": self.outcomes,
            f"{prefix}wrong_target": self.wrong_target,
        }


def paired_outcome_differences(a: dict[str, Any], b: dict[str, Any], split: str) -> np.ndarray:
    """b's outcome − a's on each seed both evaluations of `split` ran (records as `EvalResult.as_dict` writes them;
    empty when they share none, or when either predates per-seed outcomes)."""
    if f"{split}/outcomes" not in a or f"{split}/outcomes" not in b:
        return np.zeros(0)
    first = dict(zip(a[f"{split}/seeds"], a[f"{split}/outcomes"]))
    second = dict(zip(b[f"{split}/seeds"], b[f"{split}/outcomes"]))
    return np.array([second[s] - first[s] for s in sorted(first.keys() & second.keys())], float)


def paired_difference(a: dict[str, Any], b: dict[str, Any], split: str) -> tuple[float, float, int] | None:
    """b − a in success, paired by seed: the mean difference, its standard error and the number of seeds paired.
    None when the evaluations share no seed."""
    d = paired_outcome_differences(a, b, split)
    if not len(d):
        return None
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), se, len(d)


def summarize(episodes: Sequence[Episode], split: str = "train") -> EvalResult:
    n = len(episodes)
    outcomes = np.array([ep.outcome for ep in episodes], float)
    p = float(outcomes.mean()) if n else 0.0
    steps = [ep.steps_to_success for ep in episodes if ep.outcome and ep.steps_to_success]
    takeovers = [sum(1 for _, _, who in ep.segments() if who == ExecutedBy.HUMAN) for ep in episodes]
    any_policy = any((ep.executed_by == ExecutedBy.POLICY).any() for ep in episodes)
    by_seed = sorted(episodes, key=lambda ep: (ep.seed is None, ep.seed or 0))
    known = [ep.wrong_target for ep in episodes if ep.wrong_target is not None]
    return EvalResult(
        split=split,
        episodes=n,
        success=p,
        success_se=math.sqrt(p * (1 - p) / n) if n else float("nan"),
        steps_to_success=float(np.mean(steps)) if steps else None,
        takeover_rate=float(np.mean(takeovers)) if any_policy and any(takeovers) else (0.0 if any_policy else None),
        seeds=[int(ep.seed) for ep in by_seed if ep.seed is not None],
        outcomes=[int(bool(ep.outcome)) for ep in by_seed if ep.seed is not None],
        wrong_target=float(np.mean(known)) if known else None,
    )


# What each split is called where a person reads it.
SPLIT_NAMES = {"train": "training templates", "heldout_instructions": "held-out paraphrases",
               "heldout_objects": "held-out colours", "ablated_instructions": "no target named"}  # fmt: skip
# Evaluation splits: which instruction templates and object combinations the held-out seeds use. In
# "ablated_instructions" the training templates name no target (nonsense words instead): the scene of each seed is the
# one the training split shows, and strict success should fall to what chance allows (drawer: at most one in two).
SPLITS = {
    "train": dict(instructions="train", objects="train"),
    "heldout_instructions": dict(instructions="heldout", objects="train"),
    "heldout_objects": dict(instructions="train", objects="heldout"),
    "ablated_instructions": dict(instructions="ablated", objects="train"),
}


def final_splits(cfg: Any) -> list[str]:
    """The splits a training run (`TrainConfig`) evaluates at SFT and at the end; those between rounds use "train"."""
    heldout = ["heldout_instructions", "heldout_objects"] if cfg.eval.heldout else []
    return ["train", *heldout, *(["ablated_instructions"] if cfg.eval.ablated else [])]


def evaluate(
    policy: Any,
    task: str,
    *,
    episodes: int,
    split: str = "train",
    num_envs: int = 8,
    num_workers: int = 0,
    image_size: int = 64,
    task_config: dict | None = None,
    seed: int = 0,
    on_episode: Callable[[Episode], None] | None = None,
    runner: ChunkPolicy | None = None,
) -> tuple[EvalResult, list[Episode]]:
    """Roll the policy out on held-out seeds. `split`: "train" (training templates and objects),
    "heldout_instructions" (paraphrases), "heldout_objects" (held-out object/colour combinations) or
    "ablated_instructions" (no target named). `seed`: the
    run's seed (runs of one seed share their evaluation episodes: paired). `runner`: what acts instead of
    `ChunkPolicy(policy)` (critic-selected or steered chunks). The cameras render only where the policy decides, so
    the episodes returned hold states, actions and outcomes, not frames."""
    if split not in SPLITS:
        raise ValueError(f"unknown evaluation split {split!r}; valid: {sorted(SPLITS)}")
    num_envs = max(1, min(num_envs, episodes))
    vector = make_vector(
        task, num_envs, num_workers=min(num_workers, num_envs), image_size=image_size, config=task_config, **SPLITS[split]
    )
    try:
        first = EVAL_SEED_OFFSET + seed * RUN_SEED_STRIDE
        seeds = range(first, first + episodes)
        eps = collect(vector, runner or ChunkPolicy(policy), seeds, task_id=task, policy_version="eval", record_privileged=False, on_episode=on_episode,
                      frames="when_acting")
    finally:
        vector.close()
    return summarize(eps, split), eps
