"""The Flow-SDE policy-gradient baseline (πRL / Flow-GRPO style) for the VLA.

Rollouts sample each action chunk with Flow-SDE steps and record every step's Gaussian log-prob. Each executed
chunk then gets an advantage, in one of πRL's two ways (`rl.ppo_advantage`):
- grpo: episodes are rolled out in groups sharing a seed; the sparse outcome gives GRPO advantages within each
  group (groups where every episode ended alike carry no signal: dropped and counted);
- gae: PPO with a critic, on the chunk-level MDP. A value head on the policy's features at each chunk's first step
  gives GAE advantages from the sparse outcome, and is then regressed on the λ-returns. Every episode carries a
  signal.
Each recorded denoising step is then a PPO sample: clipped ratio of its log-prob under the current model to the
one at rollout time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from diffusion_rl.advantages import gae, grpo_advantages
from diffusion_rl.data import Episode
from diffusion_rl.flow import ppo_clip_loss, sde_kl_loss
from kinema.train.distributed import sync_gradients


def restrict_to_flow_grpo_settings(policy: Any, optimizer: torch.optim.Optimizer, *, lr: float, expert_only: bool) -> None:
    """The baseline's own learning rate and, with expert_only, πRL's `train_expert_only`: every parameter outside the
    action expert is frozen. Frozen parameters get no gradient, so AdamW skips them, weight decay included.

    Always sets the rate: after a resume the optimiser holds the one it was saved with."""
    if lr <= 0:
        raise ValueError(f"flow_ppo's learning rate must be > 0; got {lr}")
    for group in optimizer.param_groups:
        group["lr"] = lr
    if expert_only:
        policy.requires_grad_(False)
        policy.expert.requires_grad_(True)


ChunkKey = tuple[int, int]  # (index of the episode, env step at which the chunk was computed): ChunkPolicy.chunk_records()


def grpo_chunk_advantages(
    episodes: Sequence[Episode], records: Mapping[ChunkKey, Any]
) -> tuple[dict[ChunkKey, float], dict[str, float]]:
    """GRPO: each chunk gets its episode's outcome advantage within the group of episodes sharing a seed, scaled by
    mean chunks per episode / its episode's chunks, so that every episode weighs the same in the loss.

    Unscaled, successes (which end early: 24-80 steps against 120-150 for failures) gave so few of the samples
    that the per-sample mean advantage was -0.22 to -0.47 in every round checked (drawer, push, pick_place): most
    of the objective said "make every sample the policy drew less likely". Flow-GRPO, one sample per trajectory,
    has no such bias."""
    rewards = torch.tensor([float(ep.outcome) for ep in episodes])
    groups = torch.tensor([int(ep.seed) for ep in episodes])
    adv = grpo_advantages(rewards, groups)
    per_episode = dict(enumerate(adv.advantages.tolist()))
    chunks = Counter(serial for serial, _ in records if serial in per_episode)
    mean_chunks = sum(chunks.values()) / max(len(chunks), 1)
    advantages = {key: per_episode[key[0]] * mean_chunks / chunks[key[0]] for key in records if key[0] in per_episode}
    return advantages, {f"grpo/{k}": float(v) for k, v in adv.stats.items()}


def gae_chunk_advantages(
    value: nn.Module,
    value_optimizer: torch.optim.Optimizer,
    episodes: Sequence[Episode],
    features: Sequence[Tensor],
    records: Mapping[ChunkKey, Any],
    *,
    chunk_steps: int,
    gamma: float = 0.99,
    lam: float = 0.95,
    critic_steps: int = 200,
) -> tuple[dict[ChunkKey, float], dict[str, float]]:
    """PPO with a critic, on the chunk-level MDP (πRL's): the decisions are the executed chunks, the states their
    first steps, the discount γ^chunk_steps per chunk; GAE(λ) advantages, normalised over the round's chunks.

    The reward is the sparse outcome, given by an episode's last chunk, which ends it (terminated, no bootstrap).
    Per env step instead, λ^(steps) would leave the outcome ~1e-3 of its size at the start of a long episode. The
    advantages use the critic as it was before this round (PPO's order: a critic fitted to these very episodes
    first would explain their returns away); then the critic is regressed on the λ-returns for critic_steps.
    """
    if len(features) != len(episodes):
        raise ValueError(f"need one feature array per episode; got {len(features)} for {len(episodes)} episodes")
    serials = range(len(episodes))
    starts: dict[int, list[int]] = {serial: [] for serial in serials}
    for serial, step in records:
        if serial in starts:
            starts[serial].append(step)
    kept = [i for i, serial in enumerate(serials) if starts[serial]]
    if not kept:
        return {}, {}
    chunks = [sorted(starts[serials[i]]) for i in kept]
    n, c_max = len(kept), max(len(c) for c in chunks)
    valid = torch.arange(c_max)[None] < torch.tensor([len(c) for c in chunks])[:, None]
    last = torch.zeros(n, c_max, dtype=torch.bool)
    last[torch.arange(n), torch.tensor([len(c) for c in chunks]) - 1] = True
    rewards = last.float() * torch.tensor([float(episodes[i].outcome) for i in kept])[:, None]
    x = torch.zeros(n, c_max, features[0].shape[-1])
    for row, (i, c) in enumerate(zip(kept, chunks)):
        x[row, : len(c)] = features[i][c]
    with torch.no_grad():
        values = value(x).squeeze(-1) * valid
    next_values = torch.cat([values[:, 1:], torch.zeros(n, 1)], dim=1)
    adv, returns = gae(rewards, values, next_values, terminated=last, truncated=torch.zeros_like(last), valid=valid,
                       gamma=gamma**chunk_steps, lam=lam)  # fmt: skip
    raw = adv[valid]
    normalised = (raw - raw.mean()) / (raw.std() + 1e-8) if len(raw) > 1 else raw
    keys = [(serials[i], step) for i, c in zip(kept, chunks) for step in c]  # the row-major order of adv[valid]
    # The critic's regression on the λ-returns. Explained variance as CleanRL logs it: of the values the advantages
    # used (the critic before this round's fit) against the λ-returns.
    xs, ys = x[valid], returns[valid]
    explained = 1 - float((ys - values[valid]).var() / ys.var().clamp(min=1e-8))
    for _ in range(critic_steps):
        loss = (value(xs).squeeze(-1) - ys).pow(2).mean()
        value_optimizer.zero_grad()
        loss.backward()
        value_optimizer.step()
    stats = {
        "gae/adv_std": float(raw.std()) if len(raw) > 1 else 0.0,
        "gae/value_loss": float(loss.detach()) if critic_steps else float("nan"),
        "gae/explained_variance": explained,
    }
    return dict(zip(keys, normalised.tolist())), stats


def flow_ppo_updates(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    records: Mapping[ChunkKey, dict[str, Any]],
    advantages: Mapping[ChunkKey, float],
    *,
    epochs: int,
    batch_size: int,
    clip_range: float,
    noise_level: float,
    rng: np.random.Generator,
    target_kl: float = 0.0,
    reference: Any = None,
    kl_weight: float = 0.0,
    on_step=None,
) -> dict[str, float]:
    """PPO epochs over every recorded stochastic denoising step of the chunks with a non-zero advantage.

    target_kl > 0: the round's updates stop once a minibatch's approximate KL to the rollout policy (measured before
    its update) passes 1.5 × target_kl; like CleanRL's `target_kl`, the check follows the update, so the update that
    crossed is kept (stable-baselines3 skips it). Without it the tiny VLA moved 0.3–2.9 nats per log-prob element
    in a round and collapsed to 0 % success by round 4 (drawer and pick_place; benchmarks/RESULTS.md).
    kl_weight > 0 (with `reference`, the frozen starting policy): Flow-GRPO's β·KL between the current and the
    reference policy's SDE steps at the recorded states, an anchor on the cumulative drift that the per-round
    trust region does not bound.
    """
    if kl_weight > 0 and reference is None:
        raise ValueError("kl_weight > 0 needs the reference policy")
    # Every stochastic denoising step of every chunk with a signal is one PPO sample.
    samples: list[tuple[dict[str, Any], int, float]] = []
    for key, rec in records.items():
        a = advantages.get(key, 0.0)
        if a != 0.0:
            for k in range(rec["log_prob"].shape[0]):
                samples.append((rec, k, a))
    stats: dict[str, list[float]] = {"loss": [], "approx_kl": [], "clipfrac": []}
    # Eval mode: the log-prob must be re-evaluated on the very inputs of the rollout (no image augmentation),
    # so that the ratio is exactly 1 before the first update. Gradients flow all the same.
    policy.eval()
    stopped_early = False
    for _ in range(epochs):
        if stopped_early:
            break
        order = rng.permutation(len(samples))
        for start in range(0, len(order), batch_size):
            chosen = [samples[i] for i in order[start : start + batch_size]]
            batch = _stack(chosen)
            step = policy.sde_log_prob(batch, noise_level=noise_level)
            loss, ppo = ppo_clip_loss(step.log_prob, batch["old_log_prob"], batch["advantage"], clip_range=clip_range)
            if kl_weight > 0:
                with torch.no_grad():
                    ref = reference.sde_log_prob(batch, noise_level=noise_level)
                kl = sde_kl_loss(step.mean, ref.mean, step.std_dev_t)
                loss = loss + kl_weight * kl
                stats.setdefault("kl_to_reference", []).append(float(kl.mean().detach()))
            optimizer.zero_grad(set_to_none=True)
            loss.mean().backward()
            sync_gradients(optimizer)  # torchrun: the ranks' mean, before clipping
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            stats["loss"].append(float(loss.mean().detach()))
            stats["approx_kl"].append(float(ppo.approx_kl))
            stats["clipfrac"].append(float(ppo.clipfrac))
            if on_step is not None:
                on_step()
            if target_kl > 0 and float(ppo.approx_kl) > 1.5 * target_kl:
                stopped_early = True
                break
    policy.train()
    out = {f"ppo/{k}": float(np.mean(v)) if v else float("nan") for k, v in stats.items()}
    out["ppo/samples"] = len(samples)
    out["ppo/updates"] = len(stats["loss"])
    return out


def _stack(chosen: list[tuple[dict[str, Any], int, float]]) -> dict[str, Any]:
    obs_keys = chosen[0][0]["obs"].keys()
    batch: dict[str, Any] = {}
    for key in obs_keys:
        values = [rec["obs"][key] for rec, _, _ in chosen]
        batch[key] = values if key == "task" else torch.stack(values)
    batch["x_t"] = torch.stack([rec["x_t"][k] for rec, k, _ in chosen])
    batch["x_next"] = torch.stack([rec["x_next"][k] for rec, k, _ in chosen])
    batch["t"] = torch.stack([rec["t"][k] for rec, k, _ in chosen])
    batch["t_next"] = torch.stack([rec["t_next"][k] for rec, k, _ in chosen])
    batch["old_log_prob"] = torch.stack([rec["log_prob"][k] for rec, k, _ in chosen])
    batch["advantage"] = torch.tensor([a for _, _, a in chosen])
    return batch
