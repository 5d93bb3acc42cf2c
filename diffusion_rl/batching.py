"""Episodes -> padded transition batches (torch), with the masks the credit machinery needs.

A batch holds N episodes padded to T steps. Step t of episode n is the pair (observation t, action t); the
environment's reward/success at t are what it reported *after* action t (the Episode's convention). The per-step
tensors are (N, T, ...); `valid` (N, T) marks real steps. `flat_index`/`flatten` give the (M,) transition view
(M = number of valid steps) that replay-style trainers sample from.

Terminated vs truncated (kept apart, CleanRL #457): the Episode contract records an outcome, not why the episode
stopped. We mark the last step of a *complete, successful* episode `terminated` (an absorbing success), and the
last step of every other episode `truncated` (time limit, human stop, recording cut): an MDP bootstrap is still
legitimate there. Outcome-supervised heads (viability, success model) nevertheless take the failure label 0 at
the last step of a complete episode: that label is final for *them* (`outcome_terminal`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from torch import Tensor

from diffusion_rl._util import check_shape
from diffusion_rl.credit import Credit, controller_segment_ids, intervention_credit
from diffusion_rl.data.episode import STATE_KEY, Episode

DEFAULT_DEMO_VERSIONS: tuple[str, ...] = ("expert", "demo", "scripted")


@dataclass
class TransitionBatch:
    """N padded episodes. Shapes: (N, T, ...) per step, (N,) per episode.

    Per step:
        state (N, T, D) float; action (N, T, A) float; valid (N, T) bool; time_index (N, T) long;
        executed_by (N, T) long (ExecutedBy, −1 on padding); segment (N, T) long (Segment, −1 on padding);
        segment_id (N, T) long: index of the controller run (policy/human) within the episode, −1 on padding;
        reward (N, T) float; success (N, T) bool; first_success (N, T) bool (where the task first counted as
        solved, successful episodes only); terminated, truncated (N, T) bool (last step only, see module doc);
        outcome_terminal (N, T) bool: last step of a complete episode (its outcome is a final label);
        steps_to_go (N, T) long: steps until the first success (1 at the first-success step, 0 after it), −1 in
        failed episodes and on padding.
    Per episode:
        outcome (N,) bool; steps_to_success (N,) long (−1 if never); length (N,) long; group_id (N,) long
        (episodes sharing task_id and seed); is_demo (N,) bool; complete (N,) bool.
    Credit (intervention-aware, see `diffusion_rl.credit`): `credit`, with outcome_labelled (N, T) etc.
    images: `observation.images.<cam>` -> (N, T, H, W, 3) uint8, only for the cameras asked for.
    """

    state: Tensor
    action: Tensor
    valid: Tensor
    time_index: Tensor
    executed_by: Tensor
    segment: Tensor
    segment_id: Tensor
    reward: Tensor
    success: Tensor
    first_success: Tensor
    terminated: Tensor
    truncated: Tensor
    outcome_terminal: Tensor
    steps_to_go: Tensor
    outcome: Tensor
    steps_to_success: Tensor
    length: Tensor
    group_id: Tensor
    is_demo: Tensor
    complete: Tensor
    credit: Credit
    images: dict[str, Tensor] = field(default_factory=dict)
    task: list[str] = field(default_factory=list)
    task_id: list[str] = field(default_factory=list)

    @property
    def num_episodes(self) -> int:
        return int(self.valid.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.valid.shape[1])

    def to(self, device: torch.device | str) -> TransitionBatch:
        """A copy with every tensor moved to `device`."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                v = v.to(device)
            elif isinstance(v, Credit):
                v = Credit(**{k.name: getattr(v, k.name).to(device) for k in fields(Credit)})
            elif isinstance(v, dict):
                v = {k: x.to(device) for k, x in v.items()}
            out[f.name] = v
        return TransitionBatch(**out)

    def flat_index(self) -> tuple[Tensor, Tensor]:
        """(episode_index (M,), time_index (M,)) of the valid steps, episode-major then time order."""
        ep, t = torch.nonzero(self.valid, as_tuple=True)
        return ep, t

    def flatten(self, x: Tensor) -> Tensor:
        """Per-step (N, T, ...) -> (M, ...) over valid steps; per-episode (N, ...) -> (M, ...) broadcast."""
        ep, t = self.flat_index()
        if x.shape[:2] == self.valid.shape:
            return x[ep, t]
        if x.shape[0] == self.num_episodes:
            return x[ep]
        raise ValueError(
            f"cannot flatten a tensor of shape {tuple(x.shape)}: expected (N, T, ...) = {tuple(self.valid.shape)} "
            f"or (N, ...) with N = {self.num_episodes}"
        )


def group_ids_from_keys(keys: Sequence[Hashable]) -> Tensor:
    """Dense integer ids (B,) for hashable keys: equal keys share an id (first-seen order)."""
    table: dict[Hashable, int] = {}
    return torch.tensor([table.setdefault(k, len(table)) for k in keys], dtype=torch.long)


def shift_next(x: Tensor, *, fill: float = 0.0, steps: int = 1) -> Tensor:
    """x[:, t + steps] at position t along dim 1, (N, T, ...); the last `steps` positions hold `fill`."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    out = torch.full_like(x, fill)
    if steps < x.shape[1]:
        out[:, :-steps] = x[:, steps:]
    return out


def frame_windows(x: Tensor, valid: Tensor, *, length: int, stride: int = 1) -> tuple[Tensor, Tensor]:
    """Causal frame windows ending at each step, zero-padded at the episode start (eVTA_0's input layout).

    Window t holds frames t − (length − 1)·stride, …, t − stride, t (oldest first).

    Args:
        x: (N, T, ...) per-step observations (states, images, features). valid: (N, T) bool.
    Returns: windows (N, T, length, ...) and their frame mask (N, T, length) bool (False where zero-padded).
    """
    check_shape("valid", valid, (x.shape[0], x.shape[1]))
    if length < 1 or stride < 1:
        raise ValueError(f"length and stride must be >= 1; got length={length}, stride={stride}")
    t_len = x.shape[1]
    offs = torch.arange(length - 1, -1, -1, device=x.device) * stride  # oldest first
    src = torch.arange(t_len, device=x.device)[:, None] - offs[None, :]  # (T, L)
    ok = src >= 0
    src_c = src.clamp_min(0)
    win = x[:, src_c]  # (N, T, L, ...)
    mask = ok[None].expand(x.shape[0], -1, -1) & valid[:, src_c] & valid[:, :, None]
    win = win * mask.reshape(*mask.shape, *([1] * (win.ndim - 3))).to(win.dtype)
    return win, mask


def _pad(arrays: list[np.ndarray], t_max: int, fill, dtype) -> np.ndarray:
    first = arrays[0]
    out = np.full((len(arrays), t_max, *first.shape[1:]), fill, dtype=dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return out


def collate_episodes(
    episodes: Sequence[Episode],
    *,
    image_keys: Sequence[str] = (),
    is_demo: Sequence[bool] | None = None,
    demo_versions: Sequence[str] = DEFAULT_DEMO_VERSIONS,
    pad_to: int | None = None,
    intervention_aware: bool = True,
    cut_at_handback: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> TransitionBatch:
    """Pad a list of Episodes into a `TransitionBatch`.

    Args:
        episodes: non-empty; all must share state and action dims.
        image_keys: cameras to include (full `observation.images.<cam>` keys). Images are large: default none.
        is_demo: per-episode flags for SFT demonstrations; default: `policy_version in demo_versions`.
        pad_to: pad to this many steps instead of the longest episode.
        intervention_aware / cut_at_handback: passed to `credit.intervention_credit` (False = naive credit ablation).
    """
    if not episodes:
        raise ValueError("collate_episodes needs at least one Episode")
    lengths = [len(e) for e in episodes]
    t_max = max(lengths) if pad_to is None else pad_to
    if t_max < max(lengths):
        raise ValueError(f"pad_to={pad_to} is shorter than the longest episode ({max(lengths)} steps)")
    if t_max == 0:
        raise ValueError("all episodes are empty")
    for k in ("action", STATE_KEY):
        dims = {(e.action if k == "action" else e.observations[k]).shape[1:] for e in episodes}
        if len(dims) > 1:
            raise ValueError(f"episodes disagree on the shape of {k!r}: {sorted(dims)}")

    # 1. Per-step arrays, padded.
    n = len(episodes)
    state = _pad([e.observations[STATE_KEY] for e in episodes], t_max, 0.0, np.float32)
    action = _pad([e.action for e in episodes], t_max, 0.0, np.float32)
    valid = _pad([np.ones(len(e), bool) for e in episodes], t_max, False, bool)
    executed_by = _pad([e.executed_by.astype(np.int64) for e in episodes], t_max, -1, np.int64)
    segment = _pad([e.segment.astype(np.int64) for e in episodes], t_max, -1, np.int64)
    reward = _pad([e.reward for e in episodes], t_max, 0.0, np.float32)
    success = _pad([e.success for e in episodes], t_max, False, bool)
    images = {}
    for key in image_keys:
        missing = [i for i, e in enumerate(episodes) if key not in e.observations]
        if missing:
            raise ValueError(
                f"image key {key!r} missing in episodes {missing[:5]}; available: {episodes[0].camera_keys}"
            )
        images[key] = torch.from_numpy(_pad([e.observations[key] for e in episodes], t_max, 0, np.uint8))

    # 2. Per-episode facts.
    outcome = np.array([bool(e.outcome) for e in episodes])
    complete = np.array([bool(e.complete) for e in episodes])
    sts = np.array([e.steps_to_success if e.steps_to_success is not None else -1 for e in episodes], np.int64)
    if is_demo is None:
        demo = np.array([e.policy_version in demo_versions for e in episodes])
    else:
        if len(is_demo) != n:
            raise ValueError(f"is_demo has {len(is_demo)} entries for {n} episodes")
        demo = np.asarray(is_demo, dtype=bool)
    groups = group_ids_from_keys(
        [(e.task_id, e.seed) if e.seed is not None else ("__ungrouped__", i) for i, e in enumerate(episodes)]
    )

    # 3. Derived per-step labels.
    tidx = np.broadcast_to(np.arange(t_max), (n, t_max))
    last = np.array(lengths) - 1
    is_last = valid & (tidx == last[:, None])
    terminated = is_last & (complete & outcome)[:, None]
    truncated = is_last & ~terminated
    outcome_terminal = is_last & complete[:, None]
    # The first success counts only in successful episodes; an outcome labelled by a human without a
    # success flag puts the success at the last step.
    fs_idx = np.where(outcome, np.where(sts > 0, sts - 1, last), -1)
    first_success = valid & (tidx == fs_idx[:, None]) & outcome[:, None]
    steps_to_go = np.where(outcome[:, None] & valid, np.maximum(fs_idx[:, None] + 1 - tidx, 0), -1)

    t = lambda a, dt=None: torch.as_tensor(np.ascontiguousarray(a), dtype=dt, device=device)  # noqa: E731
    valid_t = t(valid)
    executed_t = t(executed_by)
    outcome_t = t(outcome)
    first_success_t = t(first_success)
    is_demo_t = t(demo)
    credit = intervention_credit(
        executed_t,
        valid_t,
        outcome_t,
        first_success=first_success_t,
        is_demo=is_demo_t,
        enabled=intervention_aware,
        cut_at_handback=cut_at_handback,
    )
    return TransitionBatch(
        state=t(state, dtype),
        action=t(action, dtype),
        valid=valid_t,
        time_index=t(tidx.astype(np.int64)),
        executed_by=executed_t,
        segment=t(segment),
        segment_id=controller_segment_ids(executed_t, valid_t),
        reward=t(reward, dtype),
        success=t(success),
        first_success=first_success_t,
        terminated=t(terminated),
        truncated=t(truncated),
        outcome_terminal=t(outcome_terminal),
        steps_to_go=t(steps_to_go.astype(np.int64)),
        outcome=outcome_t,
        steps_to_success=t(sts),
        length=t(np.array(lengths, np.int64)),
        group_id=groups.to(device) if device is not None else groups,
        is_demo=is_demo_t,
        complete=t(complete),
        credit=credit,
        images={k: v.to(device) if device is not None else v for k, v in images.items()},
        task=[e.task for e in episodes],
        task_id=[e.task_id for e in episodes],
    )
