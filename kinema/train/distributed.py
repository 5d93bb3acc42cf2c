"""Data-parallel learning under torchrun: `torchrun --nproc-per-node N -m kinema.cli train ...`.

Every rank runs the same learner on a disjoint, deterministic shard of the training steps (`shard`), with a share of
the configured batch (`local_batch_size`); gradients are averaged over the ranks before anything reads them
(`sync_gradients`, called by the shared update functions before clipping, and by a hook on every optimiser's step
for the updates that do not call it), so N ranks take the very step one process would take on the N batches
concatenated. Rank 0 alone writes the run folder. gloo on CPU, NCCL on GPUs (each rank on the GPU of its
LOCAL_RANK); MASTER_ADDR comes from torchrun. `kinema video train` uses the same pieces (kinema.video.trainer).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

_hook: Any = None
_alone = False  # see `alone`


def world() -> tuple[int, int]:
    """(rank, number of ranks); (0, 1) outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return world()[0] == 0


def init_from_env() -> bool:
    """Join the process group torchrun describes (WORLD_SIZE > 1); True when this process is one of several ranks."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        if torch.cuda.is_available():  # one GPU per rank: "cuda" then means this rank's
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # Ranks > 0 wait in a collective while rank 0 alone evaluates: allow for long evaluations.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(hours=4))
    install_step_hook()
    return True


def leave() -> None:
    """Leave the process group before the interpreter exits. A rank that exits with the group still open aborts
    now and then as gloo's threads are torn down ("terminate called without an active exception"), and torchrun
    then kills the ranks still writing the run."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def install_step_hook() -> None:
    """Average gradients before every optimiser step in this process (critics, success model, ...), unless the
    update already did (`sync_gradients`)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if _alone:
        return
    if getattr(optimizer, "_kinema_synced", False):
        optimizer._kinema_synced = False
    else:
        _all_reduce_mean(optimizer)


def _all_reduce_mean(optimizer: torch.optim.Optimizer) -> None:
    rank, size = world()
    if size == 1:
        return
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per step, not one per tensor
    dist.all_reduce(flat)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(optimizer: torch.optim.Optimizer) -> None:
    """The mean of every rank's gradients, now (before clipping reads their norm, as one process would)."""
    if world()[1] > 1:
        _all_reduce_mean(optimizer)
        optimizer._kinema_synced = True


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Optimiser steps this rank takes while the others wait (rank 0 fitting what they then read back from the run
    folder): no averaging, which would wait for ranks that take no step."""
    global _alone
    before, _alone = _alone, True
    try:
        yield
    finally:
        _alone = before


def shard(index: np.ndarray) -> np.ndarray:
    """This rank's disjoint, deterministic part of `index` (every rank-th entry)."""
    rank, size = world()
    return index if size == 1 else index[rank::size]


def local_batch_size(batch_size: int, name: str = "batch_size") -> int:
    """This rank's share of a batch of `batch_size` (the configured size is the global one)."""
    size = world()[1]
    if batch_size % size:
        raise ValueError(f"{name} {batch_size} does not split over {size} ranks: use a multiple of {size}")
    return batch_size // size


def broadcast_module(module: torch.nn.Module) -> None:
    """Rank 0's weights and buffers on every rank."""
    if world()[1] > 1:
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, 0)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` (picklable) on every rank."""
    if world()[1] == 1:
        return obj
    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, 0)
    return box[0]


def _collective_device(tensor: torch.Tensor) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else tensor.device


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on each) concatenated along dim 0 in rank order; `tensor` itself on
    one process. Rank r's rows are then `own_rows(len(tensor))`."""
    size = world()[1]
    if size == 1:
        return tensor
    local = tensor.detach().contiguous().to(_collective_device(tensor))
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(tensor.device)


def own_rows(n: int) -> slice:
    """This rank's rows of a `gather_rows` result, each rank holding n."""
    rank = world()[0]
    return slice(rank * n, (rank + 1) * n)


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Each value averaged over the ranks, in one collective; `values` itself on one process."""
    if world()[1] == 1 or not values:
        return values
    flat = torch.tensor(list(values.values()), dtype=torch.float64)
    flat = flat.to(_collective_device(flat))
    dist.all_reduce(flat)
    return dict(zip(values, (flat / world()[1]).tolist()))


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
