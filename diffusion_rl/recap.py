"""Recap (π*0.6, Physical Intelligence 2025): RL with experience and corrections via advantage-conditioned policies.

The policy is trained on all the data (demonstrations, its own rollouts, successes and failures, and human
corrections) with its ordinary flow-matching loss, and is told per step whether the step was an improvement: the
improvement indicator I_t = 1[A_t > ε], from a value function of the steps left to success. At inference it is asked
for improvements. Nothing is thrown away, so it keeps every pass over the demonstrations that continued imitation
gets, and the indicator separates the fast from the slow and the successful from the failed.

As the authors specify it:
- reward −1 per step until success, and a large negative cost at the end of a failure; returns normalised per task to
  [−1, 0] (here: divided by horizon × (1 + failure_cost), the failure cost in units of the horizon);
- a distributional value V(o) over B = 201 bins of the normalised return, trained by cross-entropy on Monte-Carlo
  returns of all the data;
- the advantage A_t = Σ_{k<N} r_{t+k} + V(o_{t+N}) − V(o_t), an N-step estimate (Monte-Carlo past the episode's end);
- ε per task, chosen so that a fixed share of the data (about 30 %) is labelled an improvement; human corrections
  are always labelled one;
- the indicator is dropped from a share of training samples, so that the policy also learns the unconditioned
  distribution (classifier-free guidance at inference, β ≥ 1).

Pure functions here; the method that runs them on the VLA is `kinema.train.methods.recap`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

# Indicator values as the policy reads them: 0 unconditioned (dropped), 1 an improvement, 2 not one.
UNCONDITIONED, POSITIVE, NEGATIVE = 0, 1, 2


def normalised_returns(lengths: Sequence[int], outcomes: Sequence[float], *, horizon: int, failure_cost: float = 1.0) -> list[np.ndarray]:
    """Per episode, the Monte-Carlo return of every step under Recap's reward (−1 per step, −failure_cost × horizon
    more at the end of a failure), divided by horizon × (1 + failure_cost): in [−1, 0), −(steps left) / norm for a
    success."""
    if horizon < 1 or failure_cost < 0:
        raise ValueError(f"horizon must be >= 1 and failure_cost >= 0; got {horizon}, {failure_cost}")
    norm = horizon * (1.0 + failure_cost)
    out = []
    for T, outcome in zip(lengths, outcomes):
        left = np.arange(T, 0, -1, dtype=np.float64)  # steps from t to the end, t included
        cost = 0.0 if outcome else failure_cost * horizon
        out.append((-(left + cost) / norm).clip(-1.0, 0.0).astype(np.float32))
    return out


def nstep_advantages(returns: Sequence[np.ndarray], values: Sequence[np.ndarray], lookahead: int) -> list[np.ndarray]:
    """A_t = (G_t − G_{t+N}) + V(o_{t+N}) − V(o_t): the rewards of the next N steps (a difference of Monte-Carlo
    returns) plus the value where they end, less the value here; past the episode's end, G_t − V(o_t)."""
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1; got {lookahead}")
    out = []
    for G, V in zip(returns, values):
        T = len(G)
        t = np.arange(T)
        ahead = t + lookahead
        inside = ahead < T
        end = np.minimum(ahead, T - 1)
        bootstrap = np.where(inside, G - G[end] + V[end], G)
        out.append((bootstrap - V).astype(np.float32))
    return out


def improvement_threshold(advantages: np.ndarray, positive_fraction: float) -> float:
    """ε such that `positive_fraction` of the steps have A > ε."""
    if not 0 < positive_fraction < 1:
        raise ValueError(f"positive_fraction must be in (0, 1); got {positive_fraction}")
    return float(np.quantile(advantages, 1.0 - positive_fraction))


def improvement_indicator(advantages: np.ndarray, threshold: float, always_positive: np.ndarray | None = None) -> np.ndarray:
    """Per step POSITIVE where A > ε or `always_positive` (human corrections), else NEGATIVE (int8)."""
    positive = advantages > threshold
    if always_positive is not None:
        positive = positive | always_positive
    return np.where(positive, POSITIVE, NEGATIVE).astype(np.int8)


class DistributionalValue(nn.Module):
    """V(o) over `bins` atoms evenly spaced on [−1, 0]: an MLP on observation features, trained by cross-entropy on
    the two-hot projection of the return onto the atoms; the value is the distribution's mean."""

    def __init__(self, feature_dim: int, *, bins: int = 201, hidden_dim: int = 256) -> None:
        super().__init__()
        if bins < 2:
            raise ValueError(f"bins must be >= 2; got {bins}")
        self.net = nn.Sequential(
            nn.Linear(feature_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, bins)
        )
        self.register_buffer("atoms", torch.linspace(-1.0, 0.0, bins))

    def forward(self, features: Tensor) -> Tensor:
        """(B,) expected normalised return."""
        return (self.net(features).softmax(-1) * self.atoms).sum(-1)

    def loss(self, features: Tensor, returns: Tensor) -> Tensor:
        """(B,) cross-entropy against the two-hot target of `returns`."""
        logits = self.net(features)
        return -(two_hot(returns, self.atoms) * F.log_softmax(logits, -1)).sum(-1)


def two_hot(values: Tensor, atoms: Tensor) -> Tensor:
    """(B, bins): each value split between its two neighbouring atoms in proportion to its distance from them."""
    values = values.clamp(float(atoms[0]), float(atoms[-1]))
    step = float(atoms[1] - atoms[0])
    position = (values - atoms[0]) / step
    low = position.floor().long().clamp(max=len(atoms) - 2)
    frac = position - low
    out = torch.zeros(len(values), len(atoms), dtype=values.dtype, device=values.device)
    out.scatter_(1, low[:, None], (1 - frac)[:, None])
    out.scatter_add_(1, (low + 1)[:, None], frac[:, None])
    return out


def fit_value(
    value: DistributionalValue, optimizer: torch.optim.Optimizer, features: Tensor, returns: Tensor, *, steps: int,
    batch_size: int, generator: torch.Generator | None = None, on_step: Callable[[], None] | None = None,
    sampling: Tensor | None = None,
) -> float:  # fmt: skip
    """`steps` minibatch steps of the value's cross-entropy on (features, returns), steps drawn uniformly or ∝
    `sampling` (one weight per step); returns the mean loss."""
    losses = []
    value.train()
    n = min(batch_size, len(features))
    for _ in range(steps):
        if sampling is None:
            index = torch.randint(len(features), (n,), generator=generator)
        else:
            index = torch.multinomial(sampling, n, replacement=True, generator=generator)
        loss = value.loss(features[index], returns[index]).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step()
    value.eval()
    return float(np.mean(losses)) if losses else float("nan")
