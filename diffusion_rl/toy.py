"""A bimodal 1-D toy flow model, shared by the tests and `benchmarks/rl_core.py` (pure torch, CPU-sized).

Data: an equal mixture of N(−2, 0.35²) and N(+2, 0.35²). Reward: 1 for x > 0 (the high-reward mode), else 0.
A tiny MLP velocity net is pre-trained by plain flow matching to fit both modes equally (≈ 50 % mass each);
the RL methods must then move the sample mass onto the high-reward mode:

- `none`: the no-RL control arm, continued flow matching on fresh pre-training data (the demo-only
  control: without it, continued imitation passes for RL gain);
- `awm`: advantage-weighted flow matching, weights exp(A/τ) on the model's own samples;
- `nft`: DiffusionNFT (`flow.nft_loss`) against the round's frozen old model;
- `awr`: VideoAWR target regression (`advantages.awr_energies`, `flow.awr_target`, `flow.awr_loss`);
- `flow_grpo`: Flow-SDE rollouts with log-probs and the clipped-ratio loss (`flow.ppo_clip_loss`).

`run_toy_rl` counts model evaluations (rows through the velocity net, sampling and training alike) so that
methods can be compared at an equal budget.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from diffusion_rl import advantages as adv_lib
from diffusion_rl import flow

ToyMethod = Literal["none", "awm", "nft", "awr", "flow_grpo"]
TOY_METHODS: tuple[str, ...] = ("none", "awm", "nft", "awr", "flow_grpo")

MODES = (-2.0, 2.0)
MODE_STD = 0.35


def sample_data(n: int, *, generator: torch.Generator | None = None) -> Tensor:
    """(n, 1) draws from the equal two-mode mixture."""
    side = torch.randint(0, 2, (n, 1), generator=generator).float() * 2.0 - 1.0
    return side * MODES[1] + MODE_STD * torch.randn(n, 1, generator=generator)


def reward(x: Tensor) -> Tensor:
    """1 on the high-reward mode (x > 0), else 0; (n,)."""
    return (x[:, 0] > 0).float()


def high_mode_mass(x: Tensor) -> float:
    return float(reward(x).mean())


class ToyVelocityNet(nn.Module):
    """v_θ(x_t, t) for 1-D x: an MLP on [x, t, sin/cos features of t]."""

    def __init__(self, hidden: int = 64, num_freqs: int = 4):
        super().__init__()
        self.register_buffer("freqs", torch.arange(1, num_freqs + 1, dtype=torch.float32) * math.pi)
        self.net = nn.Sequential(
            nn.Linear(2 + 2 * num_freqs, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, hidden),
            nn.SiLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        tf = t.reshape(-1, 1) * self.freqs
        return self.net(torch.cat([x, t.reshape(-1, 1), tf.sin(), tf.cos()], dim=-1))


class ToyFlowPolicy:
    """The toy net behind the `FlowPolicy` protocol (an example of what a real policy exposes)."""

    def __init__(self, net: ToyVelocityNet):
        self.net = net

    def flow_loss(
        self, batch: Mapping[str, Any], *, weights: Tensor | None = None, targets: Mapping[str, Tensor] | None = None
    ) -> Tensor:
        x0 = batch["x0"]
        t = batch.get("t")
        t = flow.sample_time(x0.shape[0], generator=batch.get("generator")) if t is None else t
        noise = batch.get("noise")
        noise = torch.randn(x0.shape, generator=batch.get("generator")) if noise is None else noise
        x_t = flow.interpolate(x0, noise, t)
        v = self.net(x_t, t)
        target = (targets or {}).get("velocity", flow.velocity_target(x0, noise))
        return flow.flow_matching_loss(v, target, weights=weights)

    def sde_log_prob(self, batch: Mapping[str, Any], *, noise_level: float = 0.7) -> flow.SDEStep:
        v = self.net(batch["x_t"], batch["t"])
        return flow.sde_step_with_logprob(
            v, batch["x_t"], batch["t"], batch["t_next"], noise_level=noise_level, prev_sample=batch["x_next"]
        )

    def features(self, batch: Mapping[str, Any]) -> Tensor:
        return batch["x0"]


def pretrain(net: ToyVelocityNet, *, steps: int = 1500, batch_size: int = 256, lr: float = 3e-3, seed: int = 0) -> None:
    """Plain conditional flow matching on the mixture (in place)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        x0 = sample_data(batch_size, generator=g)
        noise = torch.randn(x0.shape, generator=g)
        t = flow.sample_time(batch_size, generator=g)
        loss = flow.flow_matching_loss(net(flow.interpolate(x0, noise, t), t), flow.velocity_target(x0, noise))
        opt.zero_grad(set_to_none=True)
        loss.mean().backward()
        opt.step()
        sched.step()


@functools.lru_cache(maxsize=4)
def pretrained_state(seed: int = 0, steps: int = 1500) -> dict[str, Tensor]:
    """The pre-trained toy net's state dict (cached per process: tests and benchmark share one pre-training)."""
    torch.manual_seed(seed)
    net = ToyVelocityNet()
    pretrain(net, steps=steps, seed=seed)
    return {k: v.clone() for k, v in net.state_dict().items()}


def make_pretrained(seed: int = 0) -> ToyVelocityNet:
    net = ToyVelocityNet()
    net.load_state_dict(pretrained_state(seed))
    return net


@torch.no_grad()
def evaluate_mass(net: ToyVelocityNet, *, n: int = 2000, num_steps: int = 10, seed: int = 1234) -> float:
    """High-mode mass of n deterministic Euler samples from fixed noise."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(n, 1, generator=g)
    return high_mode_mass(flow.euler_sample(net, noise, num_steps=num_steps))


@dataclass
class ToyRLConfig:
    """Budget and hyperparameters of a toy RL run (shared by all methods unless named)."""

    eval_budget: int = 120_000  # model evaluations (rows through the net), sampling + training
    group_size: int = 8  # rollouts per group
    num_groups: int = 32  # groups per iteration
    num_steps: int = 10  # sampler steps
    inner_steps: int = 4  # gradient steps per iteration
    lr: float = 1e-3
    awm_temperature: float = 1.0
    nft_beta: float = 1.0
    nft_adv_clip_max: float = 2.0
    # λ of NFT's reference anchor ‖v_θ − v_ref‖² (v_ref: the pre-trained model). Without it NFT reaches 80 %
    # and then diverges on this toy once most groups are all-positive (measured: mass back to ≈ 0.45).
    nft_ref_weight: float = 0.1
    awr_temperature: float = 1.0
    grpo_noise_level: float = 0.7
    grpo_clip_range: float = 0.2
    grpo_adv_clip_max: float = 5.0
    eval_every: int = 1  # iterations between mass evaluations
    degenerate: str = "drop"  # what to do with equal-reward groups


@dataclass
class ToyRunResult:
    method: str
    evals: list[int] = field(default_factory=list)  # model evaluations at each curve point
    steps: list[int] = field(default_factory=list)  # optimiser steps at each curve point
    mass: list[float] = field(default_factory=list)  # high-mode mass at each curve point
    degenerate_groups: int = 0  # equal-reward groups dropped over the run

    def first_reaching(self, level: float = 0.8) -> tuple[int | None, int | None]:
        """(optimiser steps, model evaluations) when the mass first reached `level`, or (None, None)."""
        for s, e, m in zip(self.steps, self.evals, self.mass, strict=True):
            if m >= level:
                return s, e
        return None, None


def run_toy_rl(method: ToyMethod, config: ToyRLConfig | None = None, *, seed: int = 0) -> ToyRunResult:
    """Fine-tune the pre-trained toy model with `method` until `config.eval_budget` model evaluations are spent."""
    if method not in TOY_METHODS:
        raise ValueError(f"method must be one of {TOY_METHODS}; got {method!r}")
    cfg = config or ToyRLConfig()
    g = torch.Generator().manual_seed(seed + 1)
    net = make_pretrained(seed)
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    policy = ToyFlowPolicy(net)
    ref = copy.deepcopy(net).requires_grad_(False)
    n = cfg.group_size * cfg.num_groups
    group_ids = torch.arange(cfg.num_groups).repeat_interleave(cfg.group_size)
    res = ToyRunResult(method)
    evals = steps = it = 0
    res.evals.append(0), res.steps.append(0), res.mass.append(evaluate_mass(net))

    while evals < cfg.eval_budget:
        # 1. Roll out the current model (the "old" policy of this round).
        old = copy.deepcopy(net).requires_grad_(False)
        noise = torch.randn(n, 1, generator=g)
        if method == "flow_grpo":
            with torch.no_grad():
                x0, states, nexts, old_lp = flow.sde_sample(
                    net, noise, num_steps=cfg.num_steps, noise_level=cfg.grpo_noise_level, generator=g
                )
        else:
            with torch.no_grad():
                x0 = flow.euler_sample(net, noise, num_steps=cfg.num_steps)
        evals += n * cfg.num_steps
        r = reward(x0)

        # 2. Credit.
        if method == "awr":
            ga = adv_lib.awr_energies(r, group_ids, temperature=cfg.awr_temperature, degenerate=cfg.degenerate)
        else:
            ga = adv_lib.grpo_advantages(r, group_ids, degenerate=cfg.degenerate)
        res.degenerate_groups += int(ga.stats["n_degenerate_groups"])
        keep = ga.weights > 0

        # 3. Update.
        for _ in range(cfg.inner_steps):
            if not bool(keep.any()) and method != "none":
                break
            if method == "flow_grpo":
                sched = flow.time_schedule(cfg.num_steps)
                losses = []
                for k in range(cfg.num_steps):
                    t = sched[k].expand(n)
                    step = policy.sde_log_prob(
                        {"x_t": states[k], "t": t, "t_next": sched[k + 1].expand(n), "x_next": nexts[k]},
                        noise_level=cfg.grpo_noise_level,
                    )
                    loss_k, _ = flow.ppo_clip_loss(
                        step.log_prob,
                        old_lp[k],
                        ga.advantages,
                        clip_range=cfg.grpo_clip_range,
                        adv_clip_max=cfg.grpo_adv_clip_max,
                    )
                    losses.append(loss_k)
                loss = (torch.stack(losses).mean(0) * ga.weights).sum() / ga.weights.sum().clamp_min(1.0)
                evals += n * cfg.num_steps
            else:
                xb = x0
                t = flow.sample_time(n, generator=g)
                eps = torch.randn(xb.shape, generator=g)
                x_t = flow.interpolate(xb, eps, t)
                if method in ("none", "awm"):
                    if method == "none":
                        w = torch.ones(n)
                        xb = sample_data(n, generator=g)
                    else:
                        w = flow.exp_advantage_weights(ga.advantages, temperature=cfg.awm_temperature) * ga.weights
                        w = w / w.sum().clamp_min(1e-8) * n
                    loss = policy.flow_loss({"x0": xb, "t": t, "noise": eps}, weights=w).mean()
                    evals += n
                else:
                    with torch.no_grad():
                        v_old = old(x_t, t)
                    v_theta = net(x_t, t)
                    evals += 2 * n
                    if method == "nft":
                        v_ref = None
                        if cfg.nft_ref_weight > 0:
                            with torch.no_grad():
                                v_ref = ref(x_t, t)
                            evals += n
                        per = flow.nft_loss(
                            v_theta,
                            v_old,
                            x_t=x_t,
                            x0=xb,
                            t=t,
                            advantages=ga.advantages,
                            beta=cfg.nft_beta,
                            adv_clip_max=cfg.nft_adv_clip_max,
                            v_ref=v_ref,
                            ref_weight=cfg.nft_ref_weight,
                        )
                    else:
                        x0_star = flow.awr_target(x_t=x_t, t=t, v_old=v_old, x0=xb, energies=ga.advantages)
                        per = flow.awr_loss(v_theta, x_t=x_t, t=t, x0=xb, x0_star=x0_star)
                    loss = (per * ga.weights).sum() / ga.weights.sum().clamp_min(1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            steps += 1
        it += 1
        if it % cfg.eval_every == 0 or evals >= cfg.eval_budget:
            res.evals.append(evals), res.steps.append(steps), res.mass.append(evaluate_mass(net))
    return res
