"""What every method's actor update shares: flow-matching steps on a mix of demonstrations and replay, the acting
average of the trained weights, and the policy's features of a buffer's steps (what the critics read)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kinema.train.buffer import StepBuffer
from kinema.train.distributed import local_batch_size, shard, sync_gradients, world

REPLAY_MIXING = ("fixed", "pooled")

# A per-sample actor loss: (policy, batch, context, replay_index) -> (B,), the first B - len(replay_index) samples
# demonstrations, the rest the replay steps `replay_index` names. The default is the policy's flow-matching loss.
ActorLoss = Callable[[Any, dict, Any, np.ndarray], torch.Tensor]


def actor_updates(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    batch_size: int,
    demos: StepBuffer,
    replay: StepBuffer | None,
    replay_weights: np.ndarray | None,
    demo_fraction: float,
    aux_weight: float,
    rng: np.random.Generator,
    mixing: str = "fixed",
    loss_fn: ActorLoss | None = None,
    train_mode: bool = True,
    on_step: Callable[[], None] | None = None,
    demo_weights: np.ndarray | None = None,
) -> dict[str, float]:
    """Flow-matching updates on a mix of demonstrations (weight 1) and replay steps drawn ∝ their credit weight.

    mixing "fixed": `demo_fraction` of every minibatch comes from the demonstrations. "pooled" (HABC's weighted
    loss over demos ∪ rollouts): demos and replay steps form one pool, a demo step counting 1 and a replay step its
    weight (the credit rules normalise kept weights to mean 1), so the replay share is W / (N_demo + W) and a
    handful of successes is not oversampled to half of every batch.

    `demo_weights` (one per demonstration step; None: uniform) draws the demonstration steps ∝ weight.

    `loss_fn` replaces the flow-matching loss (e.g. DiffusionNFT's); `train_mode` False runs the policy in eval mode
    (no augmentation or state dropout), for losses that compare it with a frozen copy on the very same inputs.

    Under torchrun (kinema.train.distributed) `batch_size` is the global batch: each rank draws its share from its
    own disjoint shard of the demonstration and replay steps, and the ranks' gradients are averaged every step.
    A policy that models the world (`experience_loss`, the video policy) also learns from every replay step whatever
    its credit: each update adds its experience loss on `experience_fraction` x batch_size replay steps drawn uniformly.
    """
    future = bool(getattr(policy, "reads_future", False))  # batches carry the chunk's end state and the outcome
    use_replay = replay is not None and replay_weights is not None and replay_weights.sum() > 0
    imitable = demos.imitable_index()
    if not len(imitable):
        raise ValueError("no demonstration step to imitate: every step is labelled idle or failure-inducing")
    if mixing not in REPLAY_MIXING:
        raise ValueError(f"replay mixing must be one of {REPLAY_MIXING}; got {mixing!r}")
    if not use_replay:
        replay_share = 0.0
    elif mixing == "pooled":
        replay_share = float(replay_weights.sum()) / (len(imitable) + float(replay_weights.sum()))
    else:
        replay_share = 1.0 - demo_fraction
    probs = replay_weights / replay_weights.sum() if use_replay else None
    replay_rows: Any = len(replay) if use_replay else 0
    if demo_weights is not None and len(demo_weights) != len(demos):
        raise ValueError(f"demo_weights has {len(demo_weights)} entries for {len(demos)} demonstration steps")
    if world()[1] > 1:  # this rank's disjoint shard of the steps (single process: untouched, the same draws)
        imitable = shard(imitable)
        if use_replay:
            replay_rows = shard(np.arange(len(replay)))
            shard_weights = replay_weights[replay_rows]
            probs = shard_weights / shard_weights.sum() if shard_weights.sum() > 0 else None  # else uniform
        batch_size = local_batch_size(batch_size, "the actor batch size")
    demo_probs = None
    if demo_weights is not None:
        w = np.asarray(demo_weights, dtype=np.float64)[imitable]
        if not (w.sum() > 0) or (w < 0).any():
            raise ValueError("demo_weights must be >= 0 with a positive sum over the imitable demonstration steps")
        demo_probs = w / w.sum()
    n_experience = 0
    if replay is not None and len(replay) and policy.learns_from_experience and policy.config.experience_fraction > 0:
        n_experience = max(1, int(round(batch_size * policy.config.experience_fraction)))
        experience_rows = shard(np.arange(len(replay))) if world()[1] > 1 else len(replay)
    losses, n_replay_total = [], 0
    policy.train(train_mode)
    for _ in range(steps):
        if mixing == "pooled":
            n_replay = int(rng.binomial(batch_size, replay_share))
        else:
            n_replay = int(round(batch_size * replay_share))
        n_replay_total += n_replay
        parts = [demos.batch(rng.choice(imitable, batch_size - n_replay, p=demo_probs), policy.config.chunk_size, future=future)] if n_replay < batch_size else []
        replay_index = rng.choice(replay_rows, n_replay, p=probs) if n_replay else np.zeros(0, dtype=np.int64)
        if n_replay:
            parts.append(replay.batch(replay_index, policy.config.chunk_size, future=future))
        batch = concat_batches(parts)
        experience = None
        if n_experience:  # uniform over this rank's replay steps, whatever their credit
            experience = replay.batch(rng.choice(experience_rows, n_experience), policy.config.chunk_size, future=future)
        losses.append(actor_step(policy, optimizer, batch, loss_fn=loss_fn, replay_index=replay_index, aux_weight=aux_weight,
                                 experience=experience))  # fmt: skip
        if on_step is not None:
            on_step()
    return {
        "actor/loss": float(np.mean(losses)) if losses else float("nan"),
        "actor/replay_share": n_replay_total / (batch_size * steps) if steps else replay_share,
    }


def actor_step(
    policy: Any, optimizer: torch.optim.Optimizer, batch: dict, *, loss_fn: ActorLoss | None = None,
    replay_index: np.ndarray | None = None, aux_weight: float = 0.0, experience: dict | None = None,
) -> float:  # fmt: skip
    """One gradient step on `batch` (mean per-sample loss), plus the policy's experience loss on `experience` (replay
    steps of a policy that models the world); under torchrun the ranks' gradients are averaged before clipping, so
    N ranks take the step one process takes on their batches concatenated. Returns this rank's loss."""
    context, aux_features = policy.encode(batch)
    if loss_fn is None:
        loss = policy.flow_loss(batch, context=context).mean()
    else:
        replay_index = np.zeros(0, dtype=np.int64) if replay_index is None else replay_index
        loss = loss_fn(policy, batch, context, replay_index).mean()
    if aux_weight and "aux_target" in batch:
        loss = loss + aux_weight * policy.aux_loss(batch, aux_features).mean()
    if experience is not None:
        loss = loss + policy.experience_loss(experience).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    sync_gradients(optimizer)
    torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    return float(loss.detach())


def policy_optimizer(policy: Any, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the policy's weights, as one fused kernel per step (on these CPUs the per-tensor loop of torch's
    default took a tenth of an SFT step)."""
    params = list(policy.parameters())
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


def concat_batches(parts: Sequence[dict]) -> dict:
    if len(parts) == 1:
        return parts[0]
    keys = set(parts[0]).intersection(*parts[1:])
    return {k: (sum((p[k] for p in parts), []) if k == "task" else torch.cat([p[k] for p in parts])) for k in keys}


def take_rows(batch: dict, rows: slice) -> dict:
    """The rows `rows` of a batch that `concat_batches` built (its inverse on one part)."""
    return {k: v[rows] for k, v in batch.items()}


@torch.no_grad()
def ema_update(ema: Any, online: Any, decay: float) -> None:
    """Exponential moving average of the weights: the policy that acts. Flow policies trained on small data
    swing widely between nearby checkpoints; the average does not."""
    # A frozen backbone's weights are equal in both: averaging them only costs time.
    pairs = [(e, o) for e, o in zip(ema.parameters(), online.parameters()) if o.requires_grad]
    if pairs:
        torch._foreach_lerp_([e for e, _ in pairs], [o for _, o in pairs], 1.0 - decay)
    for e, o in zip(ema.buffers(), online.buffers()):
        e.copy_(o)


def policy_features(policy: Any, buffer: StepBuffer, batch_size: int = 256, index: np.ndarray | None = None) -> torch.Tensor:
    """φ(s) for every step of a buffer (or the flat steps `index`), (N, hidden_dim), in eval mode (no augmentation)."""
    was_training = policy.training
    policy.eval()
    steps = np.arange(len(buffer)) if index is None else np.asarray(index)
    out = []
    with torch.no_grad():
        for start in range(0, len(steps), batch_size):
            out.append(policy.features(buffer.batch(steps[start : start + batch_size], policy.config.chunk_size)))
    policy.train(was_training)
    return torch.cat(out)


def split_per_episode(flat: torch.Tensor, buffer: StepBuffer) -> list[torch.Tensor]:
    return [flat[s : s + n] for s, n in zip(buffer.episode_start, buffer.episode_length)]
