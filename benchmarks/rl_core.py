"""Benchmark the RL core: the cost of the credit machinery, and toy learning curves at an equal budget.

Two measured claims, each against a reference taken in the same run:

1. Speed (per 10^6 transitions): HABC critic updates, advantage computation (HABC advantages + gate + weights,
   GRPO, GAE) and the weighted per-sample flow loss, against a plain MSE over the same tensors.
   `credit_overhead_ratio` = (HABC weights from critic outputs + weighted flow loss, forward and backward)
   / (plain MSE, forward and backward), on the same (prediction, target) tensors.
2. Learning: on the bimodal toy (`diffusion_rl.toy`), AWR, NFT and Flow-GRPO (plus advantage-weighted FM and the
   no-RL control) at an equal number of model evaluations; `*_steps_to_80` is the number of optimiser steps
   until 80 % of the sample mass sits on the high-reward mode (median over seeds; null if not reached by most).

Usage: python benchmarks/rl_core.py [--quick] [--threads 1]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from diffusion_rl import advantages, flow, habc, toy  # noqa: E402


def _time(fn, *, reps: int, warmup: int = 2) -> float:
    """Median seconds per call of fn over `reps` timed calls."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _time_interleaved(fns: dict, *, reps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call for each fn, timed in interleaved rounds so that load from other processes
    (this machine is shared) hits all of them alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def bench_speed(*, quick: bool, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    reps = 3 if quick else 7
    per = 1e6

    # 1. Critic update: minibatches of 4096 windows, features of size 64 (a policy's pooled feature).
    feat_dim, mb = 64, 4096
    critic = habc.HABCCritic(feat_dim, hidden_dim=256, num_layers=2, value_scale=50.0)
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4)
    f, f_next = torch.randn(mb, feat_dim, generator=g), torch.randn(mb, feat_dim, generator=g)
    outcome = torch.rand(mb, generator=g) > 0.5
    term = torch.rand(mb, generator=g) > 0.95
    boot = ~term

    def critic_step():
        out = critic(f)
        with torch.no_grad():
            nxt = critic(f_next)
        loss, _ = habc.habc_critic_loss(
            out.z_v,
            out.v_e,
            nxt.v_e,
            outcome=outcome,
            viability_mask=outcome | ~outcome,
            efficiency_mask=outcome,
            terminal_success=term,
            bootstrap_ok=boot,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t_critic = _time(critic_step, reps=reps * 3) * per / mb

    # 2. Advantages on 2^18 transitions at once (HABC weights, GRPO in groups of 8, GAE over 512 x 512).
    m = 1 << 18
    z_v, z_vn = torch.randn(m, generator=g), torch.randn(m, generator=g)
    v_e, v_en = -50 * torch.rand(m, generator=g), -50 * torch.rand(m, generator=g)
    kind = torch.randint(0, 4, (m,), generator=g)
    out_m = torch.rand(m, generator=g) > 0.5
    has_next = torch.rand(m, generator=g) > 0.01
    term_m = ~has_next
    co, cn = habc.CriticOutput(z_v, v_e), habc.CriticOutput(z_vn, v_en)

    def habc_weights():
        return habc.habc_weights(
            co, cn, kind=kind, outcome=out_m, has_next=has_next, terminal_success=term_m, step=10_000
        )

    t_habc = _time(habc_weights, reps=reps) * per / m
    rewards = torch.rand(m, generator=g).round()
    gid = torch.arange(m) // 8
    t_grpo = _time(lambda: advantages.grpo_advantages(rewards, gid), reps=reps) * per / m
    t_mc = _time(lambda: advantages.mc_grpo_advantages(rewards, gid), reps=reps) * per / m
    n_env, t_len = 512, 512
    r2, v2, nv2 = (torch.randn(n_env, t_len, generator=g) for _ in range(3))
    te = torch.zeros(n_env, t_len, dtype=torch.bool)
    te[:, -1] = True
    tr = torch.zeros_like(te)
    t_gae = _time(lambda: advantages.gae(r2, v2, nv2, terminated=te, truncated=tr), reps=reps) * per / (n_env * t_len)

    # 3. Weighted per-sample flow loss vs a plain MSE over the same (B, horizon, action_dim) tensors.
    b, hor, adim = 1 << 15, 8, 7
    pred = torch.randn(b, hor, adim, generator=g, requires_grad=True)
    target = torch.randn(b, hor, adim, generator=g)
    kind_b, out_b = kind[:b], out_m[:b]
    co_b = habc.CriticOutput(z_v[:b], v_e[:b])
    cn_b = habc.CriticOutput(z_vn[:b], v_en[:b])

    def plain():
        pred.grad = None
        ((pred - target) ** 2).mean().backward()

    w_fixed = torch.rand(b, generator=g)

    def weighted_only(w=w_fixed):
        pred.grad = None
        flow.flow_matching_loss(pred, target, weights=w).mean().backward()

    def credit_and_weighted():
        pred.grad = None
        w, _ = habc.habc_weights(
            co_b, cn_b, kind=kind_b, outcome=out_b, has_next=has_next[:b], terminal_success=term_m[:b], step=10_000
        )
        flow.flow_matching_loss(pred, target, weights=w).mean().backward()

    ts = _time_interleaved({"plain": plain, "weighted": weighted_only, "credit": credit_and_weighted}, reps=reps * 5)
    t_plain, t_weighted, t_credit = (ts[k] * per / b for k in ("plain", "weighted", "credit"))
    return {
        "critic_update_s_per_1e6": t_critic,
        "habc_weights_s_per_1e6": t_habc,
        "grpo_s_per_1e6": t_grpo,
        "mc_grpo_s_per_1e6": t_mc,
        "gae_s_per_1e6": t_gae,
        "weighted_flow_loss_s_per_1e6": t_weighted,
        "plain_mse_s_per_1e6": t_plain,
        "credit_and_weighted_loss_s_per_1e6": t_credit,
        "credit_overhead_ratio": t_credit / t_plain,
        "weighted_loss_overhead_ratio": t_weighted / t_plain,
        "critic_update_vs_plain_mse_ratio": t_critic / t_plain,
        "flow_loss_shape": [hor, adim],
    }


def bench_toy(*, quick: bool, seeds: list[int]) -> dict:
    budget = 60_000 if quick else 200_000
    cfg = toy.ToyRLConfig(eval_budget=budget)
    out: dict = {"toy_eval_budget": budget, "toy_seeds": seeds, "toy_config": vars(cfg)}
    runs = [
        ("awr", "awr", cfg),
        ("nft", "nft", cfg),
        ("flow_grpo", "flow_grpo", cfg),
        ("awm", "awm", cfg),
        ("none", "none", cfg),
        ("nft_unanchored", "nft", dataclasses.replace(cfg, nft_ref_weight=0.0)),
    ]
    for key, method, run_cfg in runs:
        steps, evals, finals, curves = [], [], [], []
        for s in seeds:
            res = toy.run_toy_rl(method, run_cfg, seed=s)
            st, ev = res.first_reaching(0.8)
            steps.append(st)
            evals.append(ev)
            finals.append(res.mass[-1])
            curves.append(
                {"evals": res.evals[::4] + res.evals[-1:], "mass": [round(x, 3) for x in res.mass[::4] + res.mass[-1:]]}
            )
            print(
                f"  toy {key:14s} seed {s}: steps_to_80={st} evals_to_80={ev} final_mass={res.mass[-1]:.3f}", flush=True
            )
        reached = [x for x in steps if x is not None]
        majority = len(reached) * 2 > len(seeds)
        out[f"{key}_steps_to_80"] = statistics.median(reached) if majority else None
        out[f"{key}_evals_to_80"] = statistics.median([e for e in evals if e is not None]) if majority else None
        out[f"{key}_final_mass"] = statistics.mean(finals)
        out[f"{key}_final_mass_per_seed"] = [round(x, 3) for x in finals]
        out[f"{key}_steps_to_80_per_seed"] = steps
        out[f"{key}_curve_seed{seeds[0]}"] = curves[0]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small budgets, one seed: finishes in well under a minute")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest under contention)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    print("timing the credit machinery ...", flush=True)
    speed = bench_speed(quick=args.quick, seed=args.seed)
    for k, v in speed.items():
        print(f"  {k}: {v:.4g}" if isinstance(v, float) else f"  {k}: {v}", flush=True)
    print("toy learning curves at an equal number of model evaluations ...", flush=True)
    seeds = [args.seed] if args.quick else [args.seed, args.seed + 1, args.seed + 2]
    learning = bench_toy(quick=args.quick, seeds=seeds)
    result = {
        "benchmark": "rl_core",
        "quick": args.quick,
        "threads": args.threads,
        "torch": torch.__version__,
        "machine": platform.machine(),
        **speed,
        **learning,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
