"""Small shape and reduction helpers shared by the RL core (private: no stable API)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_shape(name: str, x: Tensor, shape: Sequence[int | None]) -> None:
    """Raise a ValueError naming `name` unless `x.shape` matches `shape` (None matches any size)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.ndim != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape, strict=True)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"{name} must have shape {want}; got {tuple(x.shape)}")


def check_same_shape(**tensors: Tensor) -> None:
    """Raise a ValueError unless every given tensor has the same shape."""
    items = [(k, v) for k, v in tensors.items() if v is not None]
    if not items:
        return
    ref_name, ref = items[0]
    for name, x in items[1:]:
        if x.shape != ref.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, but {ref_name} has shape {tuple(ref.shape)}")


def expand_to(t: Tensor, x: Tensor) -> Tensor:
    """View a per-sample tensor `t` (B,) as (B, 1, ..., 1) so that it broadcasts against `x` (B, ...). A `t` of x's
    rank (e.g. one flow time per video frame, (B, 1, F, 1, 1)) is already per element and returned as it is."""
    if t.ndim == x.ndim and t.ndim > 1:
        return t
    if t.ndim == 0:
        t = t.expand(x.shape[0])
    if t.shape[0] != x.shape[0]:
        raise ValueError(f"per-sample tensor has {t.shape[0]} entries but the batch has {x.shape[0]}")
    return t.reshape(t.shape[0], *([1] * (x.ndim - 1)))


def per_sample_mean(x: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean over all non-batch dims: (B, ...) -> (B,). With `mask` (broadcastable to x), a masked mean.

    A sample whose mask is all zero gets 0 (not NaN), so that padding never poisons a sum.
    """
    if x.ndim == 1:
        return x if mask is None else torch.where(as_bool(mask), x, torch.zeros_like(x))
    dims = tuple(range(1, x.ndim))
    if mask is None:
        return x.mean(dim=dims)
    m = as_bool(mask)
    while m.ndim < x.ndim:
        m = m.unsqueeze(-1)
    m = m.expand_as(x)
    # `where`, not a product: a NaN/inf in a masked-out slot (padding) must not leak into the mean.
    return torch.where(m, x, torch.zeros_like(x)).sum(dim=dims) / m.sum(dim=dims).clamp_min(1).to(x.dtype)


def masked_mean(x: Tensor, mask: Tensor | None) -> Tensor:
    """Scalar mean of `x` over entries where `mask` is true (0 when nothing is selected)."""
    if mask is None:
        return x.mean()
    m = as_bool(mask)
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp_min(1).to(x.dtype)


def as_bool(x: Tensor) -> Tensor:
    return x if x.dtype == torch.bool else x != 0
