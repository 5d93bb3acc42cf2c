"""benchmarks/video_rl.py's bookkeeping on constructed reward curves with known answers. (The measured speed-ups
are in the README, not here.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("video_rl", Path(__file__).resolve().parent.parent / "benchmarks" / "video_rl.py")
video_rl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(video_rl)


def curve(*points: tuple[float, float]) -> dict:
    return {"curve": [{"time_s": t, "reward": r} for t, r in points]}


def test_time_to_target_needs_two_evaluations_in_a_row():
    c = curve((0, -0.3), (10, -0.1), (20, -0.3), (30, -0.1), (40, -0.1))["curve"]
    # the lucky -0.1 at 10 s averages to -0.2 with its neighbours; two evaluations at -0.1 first arrive at 40 s
    assert video_rl.time_to(c, -0.15) == 40
    assert video_rl.time_to(c, 0.0) is None


def test_speedup_is_flow_grpos_time_over_the_first_other_methods():
    results = {
        "awr": curve((0, -0.3), (20, -0.1), (25, -0.1)),
        "nft": curve((0, -0.3), (40, -0.1), (50, -0.1)),
        "flow_grpo": curve((0, -0.3), (90, -0.1), (100, -0.1)),
    }
    at = video_rl.speedup_at(results, -0.15, grpo_budget=400)
    assert at["best"] == "awr" and at["speedup"] == pytest.approx(4.0) and not at["lower_bound"]


def test_speedup_is_a_lower_bound_when_flow_grpo_never_gets_there():
    results = {"awr": curve((0, -0.3), (20, -0.1), (25, -0.1)), "flow_grpo": curve((0, -0.3), (400, -0.25))}
    at = video_rl.speedup_at(results, -0.15, grpo_budget=400)
    assert at["speedup"] == pytest.approx(16.0) and at["lower_bound"]
    nobody = video_rl.speedup_at(results, 0.0, grpo_budget=400)
    assert nobody["best"] is None and nobody["speedup"] is None and not nobody["lower_bound"]


def test_a_faster_flow_grpo_gives_a_speedup_under_one_not_the_title():
    results = {"nft": curve((0, -0.3), (40, -0.1), (50, -0.1)), "flow_grpo": curve((0, -0.3), (10, -0.1), (20, -0.1))}
    at = video_rl.speedup_at(results, -0.15, grpo_budget=400)
    assert at["best"] == "nft" and at["speedup"] == pytest.approx(0.4) and not at["lower_bound"]


def seed_summary(seed: int, speedup: float | None, diversity: float | None = 1.0) -> dict:
    return {
        "seed": seed, "quick": False, "clock": "process_cpu_s", "frames": 5, "size": 16, "budget_s_per_method": 90.0,
        "budget_s_flow_grpo": 360.0, "target_fraction_of_gap": 0.5, "overrides": [], "speedup_vs_flow_grpo": speedup,
        "speedup_is_lower_bound": False, "best_method": "awr" if speedup else None, "time_to_target_s": {},
        "speedup_by_target_fraction": {"0.25": {"speedup_vs_flow_grpo": 2.0}}, "final_reward": {},
        "diversity_ratio": diversity, "peak_rss_mb": 600.0 + seed, "wall_s": 10.0,
    }  # fmt: skip


def test_across_seeds_reports_the_lower_median_and_ranks_a_failed_seed_lowest():
    five = [seed_summary(0, 3.9), seed_summary(1, None), seed_summary(2, 4.2), seed_summary(3, 5.0), seed_summary(4, 4.1)]
    out = video_rl.across_seeds(five)
    # sorted: None, 3.9, 4.1, 4.2, 5.0 -> the middle one
    assert out["speedup_vs_flow_grpo"] == pytest.approx(4.1)
    assert out["speedup_per_seed"] == [3.9, None, 4.2, 5.0, 4.1] and out["seeds"] == [0, 1, 2, 3, 4]
    assert out["peak_rss_mb"] == 604.0 and out["wall_s"] == 50.0
    # an even count takes the lower of the two middle values, so two failed seeds of four give no median
    four = [seed_summary(0, None), seed_summary(1, None), seed_summary(2, 6.0), seed_summary(3, 7.0)]
    assert video_rl.across_seeds(four)["speedup_vs_flow_grpo"] is None
    assert video_rl.across_seeds(five[:2] + five[2:3] + [seed_summary(3, 2.0)])["speedup_vs_flow_grpo"] == pytest.approx(2.0)


def test_every_methods_config_loads_with_the_benchmarks_reward_by_name():
    """The configs check reward names up front; the benchmark's `position` reward is registered by name, so every
    method's config loads (it once failed after the check was added), and a `--set` reaches its method only."""
    import argparse

    args = argparse.Namespace(seed=0, frames=5, size=16, steps=4, lr=1e-3, eval_samples=4, group=None, updates=None,
                              ref_weight=None, set=["awr:train.awr.shared_noise=false"])  # fmt: skip
    for method in video_rl.METHODS:
        cfg = video_rl.method_config(method, args)
        assert cfg.train.method == method and cfg.rewards.names == ["position"]
        assert cfg.train.awr.shared_noise == (method != "awr")  # the default elsewhere


def test_the_held_out_judge_learns_the_squares_position_from_other_clips_and_ignores_a_tint():
    """The toy's judge: a conv net fitted to the true centres of clips of another seed; on clips of a third seed it
    finds the square about as well as the reward's formula, and a global tint moves neither its centres nor its score."""
    import argparse

    import torch

    torch.manual_seed(0)
    args = argparse.Namespace(quick=True, frames=5, size=16, seed=0)
    reward = video_rl.PositionTarget(0.8)
    judge, info = video_rl.fit_judge(args, reward)
    assert info["train_seed"] != info["heldout_seed"] != 0  # neither the generator's clips (seed 0) nor each other's
    assert info["heldout_centre_mae"] < 0.08, info  # fraction of the width (a 16 px frame: ~1 px)
    assert info["heldout_corr_with_truth"] > 0.8 and info["heldout_corr_with_reward"] > 0.6, info
    videos, prompts = video_rl.square_clips(8, frames=5, size=16, seed=123)
    tinted = (videos * torch.tensor([1.2, 0.9, 1.0]).view(1, 1, 3, 1, 1) + 0.05).clamp(0, 1)
    a, b = judge.score(videos, prompts)["position"], judge.score(tinted, prompts)["position"]
    assert (a - b).abs().max() < 0.05


def test_judge_and_reward_gains_and_their_gap_per_method():
    results = {"awr": {"curve": [{"reward": -0.3, "judge": -0.28}, {"reward": -0.1, "judge": -0.25}]}}
    assert video_rl.gain(results["awr"], "reward") == pytest.approx(0.2)
    assert video_rl.gain(results["awr"], "judge") == pytest.approx(0.03)
