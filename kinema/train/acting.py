"""How a checkpoint acts, wherever it runs. `kinema eval`, `kinema sim`, `kinema deploy` and the benchmarks load a
checkpoint through `load_acting`; the method that trained it (named in its method.pt) says how it acts
(`RLMethod.acting`: a dsrl checkpoint through its noise actor, a residual one with its correction) and whether it
can choose among sampled chunks (`RLMethod.selection`: pa_rl's chunk critic). A checkpoint without method.pt (SFT,
another trainer's) acts as a plain policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kinema.train.evaluate import Acting, SelectChunkPolicy
from kinema.train.methods import METHODS, RLMethod
from policies.checkpoint import METHOD_FILE


@dataclass
class LoadedActing:
    """A checkpoint ready to act: its policy, the method that saved it ("" without method.pt), the initial-noise scale
    it acts at, how it acts alone, and its best-of-N selection (None unless asked for, or kept by the checkpoint)."""

    policy: Any
    method: str
    noise_scale: float
    acting: Acting
    selection: Acting | None = None

    @property
    def default(self) -> Acting:
        """What acts where one way is wanted (deploy, sim): the selection where the checkpoint plans by default
        (a video policy with planning_candidates > 1), else the policy as its method acts alone."""
        return self.selection if self.selection is not None and self.policy.plans else self.acting


def saved_method(checkpoint: str | Path) -> dict[str, Any] | None:
    """The method's name and state a `kinema train` checkpoint saved beside its weights (None for other checkpoints)."""
    path = Path(checkpoint) / METHOD_FILE
    return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None


def load_acting(checkpoint: str | Path, *, noise_scale: float | None = None, select: int | None = None,
                margin: float = 0.0) -> LoadedActing:  # fmt: skip
    """Load `checkpoint` to act as its method defines. `noise_scale`: the flow sampler's initial-noise scale (None:
    as its run evaluated it); `select` N > 1: best-of-N chunks by the checkpoint's value (its method's critic, or
    the policy's own prediction), None: the planning the checkpoint keeps; `margin`: keep the policy's own chunk
    unless the critic values another that much higher."""
    from policies import load_policy

    saved = saved_method(checkpoint)
    if saved is not None and saved.get("name") not in METHODS:
        raise ValueError(f"{Path(checkpoint) / METHOD_FILE} was saved by the method {saved.get('name')!r}, which this kinema "
                         f"does not know; known: {', '.join(sorted(METHODS))}")  # fmt: skip
    method: type[RLMethod] = METHODS[saved["name"]] if saved is not None else RLMethod
    state = saved["state"] if saved is not None else None
    policy = load_policy(str(checkpoint))
    if noise_scale is None:
        noise_scale = method.checkpoint_noise_scale(policy, state)
    if noise_scale < 0:
        raise ValueError(f"--noise-scale must be >= 0 (1: sampled, 0: zero noise); got {noise_scale}")
    if margin < 0:
        raise ValueError(f"--select-margin must be >= 0; got {margin}")
    if select is not None and select < 1:
        raise ValueError(f"--select must be >= 1 (1: no selection); got {select}")
    plans = policy.plans
    loaded = LoadedActing(policy, saved["name"] if saved is not None else "", noise_scale, method.acting(policy, state, noise_scale=noise_scale))
    n = select if select is not None else (policy.config.planning_candidates if plans else 1)
    if n > 1:
        loaded.selection = method.selection(policy, state, num_samples=n, noise_scale=noise_scale, margin=margin)
        if loaded.selection is None and plans and not margin:
            loaded.selection = Acting(lambda: SelectChunkPolicy(policy, None, num_samples=n),
                                      f"best of {n} sampled chunks by the policy's predicted value", n)  # fmt: skip
    found = "no method.pt" if saved is None else f"the method.pt of {saved['name']!r}"
    if margin and loaded.selection is None:
        raise ValueError(f"--select-margin applies to --select N > 1 with a pa_rl checkpoint's chunk critic (a critic its "
                         f"method keeps); {checkpoint} has {found} and --select is {select}")  # fmt: skip
    if n > 1 and loaded.selection is None:
        raise ValueError(f"--select needs a value for the chunks: the chunk critic of a pa_rl checkpoint (its method.pt) or a "
                         f"policy that predicts values (policy.type video); {checkpoint} has {found} and is a {type(policy).__name__}")
    return loaded
