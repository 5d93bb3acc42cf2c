"""Video rewards on constructed videos with known answers, the registry, GDPO balancing, and the success reward."""

from __future__ import annotations

import sys
import textwrap

import cv2
import numpy as np
import pytest
import torch

from diffusion_rl.advantages import gdpo_advantages
from policies.video.rewards import (
    REWARDS,
    ExposureReward,
    OpticalFlowReward,
    RewardSet,
    SharpnessReward,
    SuccessReward,
    VideoClips,
    VideoSuccessConfig,
    episode_clips,
    make_reward,
    make_rewards,
    prompt_group_ids,
    roc_auc,
)


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Two threads on 2 shared cores made the success fit ~6x slower here (35 s against 6 s for the same steps).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------------------------
# Constructed videos
# ----------------------------------------------------------------------------------------------------------------


def square_video(speed: float = 2.0, *, frames: int = 9, size: int = 64, side: int = 16, bg=(0.3, 0.3, 0.3), fg=(0.9, 0.8, 0.2)) -> torch.Tensor:
    """A square translating right at `speed` px/frame over a uniform background: (1, F, 3, size, size)."""
    v = torch.tensor(bg, dtype=torch.float32).view(1, 3, 1, 1).repeat(frames, 1, size, size)
    for f in range(frames):
        x = int(round(8 + speed * f))
        v[f, :, 24 : 24 + side, x : x + side] = torch.tensor(fg).view(3, 1, 1)
    return v[None]


def tint(video: torch.Tensor, gain=(1.3, 0.8, 0.7), offset=(0.1, 0.0, -0.05)) -> torch.Tensor:
    """A global per-channel tint of every pixel (the background hack a short RL run found), clipped to [0, 1]."""
    g = torch.tensor(gain).view(1, 1, 3, 1, 1)
    o = torch.tensor(offset).view(1, 1, 3, 1, 1)
    return (video * g + o).clamp(0, 1)


FLOW = OpticalFlowReward()


def test_static_video_has_zero_motion_and_perfect_consistency():
    static = square_video(0.0)
    s = FLOW(static, ["a"])
    assert s["motion"].item() == 0.0
    assert s["temporal_consistency"].item() == 0.0


@pytest.mark.parametrize("speed", [1.0, 2.0, 3.0])
def test_translating_square_motion_is_its_speed_in_pixels_per_frame(speed):
    motion = FLOW(square_video(speed), ["a"])["motion"].item()
    print(f"speed {speed} px/frame -> motion {motion:.3f}")
    assert motion == pytest.approx(speed, rel=0.1)
    # The flow explains the frames: warping error stays near zero for a rigid translation.
    assert FLOW(square_video(speed), ["a"])["temporal_consistency"].item() > -0.01


def test_region_all_scales_motion_by_the_moving_area():
    full = OpticalFlowReward(region="all")(square_video(2.0), ["a"])["motion"].item()
    assert 0.0 < full < 0.6  # the square and its flow halo cover a fraction of the 64×64 frame


def test_flicker_has_high_warping_error_and_no_motion():
    steady = square_video(2.0)
    flicker = steady.clone()
    flicker[:, 1::2] = (flicker[:, 1::2] * 1.6).clamp(0, 1)  # every other frame brighter
    s_steady, s_flicker = FLOW(steady, ["a"]), FLOW(flicker, ["a"])
    print(f"warping error: steady {-s_steady['temporal_consistency'].item():.4f}, flicker {-s_flicker['temporal_consistency'].item():.4f}")
    assert s_flicker["temporal_consistency"].item() < -0.1
    assert s_flicker["temporal_consistency"].item() < s_steady["temporal_consistency"].item() - 0.1
    # A brightness change is not motion: the flicker does not buy the motion reward either.
    assert s_flicker["motion"].item() == pytest.approx(s_steady["motion"].item(), abs=0.1)


def test_tinted_background_does_not_raise_motion():
    static, moving = square_video(0.0), square_video(2.0)
    assert FLOW(tint(static), ["a"])["motion"].item() == 0.0
    assert FLOW(tint(moving), ["a"])["motion"].item() <= FLOW(moving, ["a"])["motion"].item() + 0.05
    # A tint that changes every frame (a pulsing background) is not motion either.
    pulsing = torch.cat([tint(static[:, f : f + 1], gain=(1 + 0.1 * f,) * 3, offset=(0.02 * f, 0, 0)) for f in range(9)], dim=1)
    assert FLOW(pulsing, ["a"])["motion"].item() < 0.1


def test_noise_video_is_inconsistent():
    noise = torch.rand(1, 9, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert FLOW(noise, ["a"])["temporal_consistency"].item() < -0.15


def test_flow_outputs_select_scores_and_are_not_differentiable():
    assert make_reward("motion").names == ("motion",)
    assert make_reward("temporal_consistency").names == ("temporal_consistency",)
    assert make_reward("flow").names == ("motion", "temporal_consistency")
    assert not FLOW.differentiable
    with pytest.raises(ValueError, match="at least 2 frames"):
        FLOW(torch.rand(1, 1, 3, 16, 16), ["a"])


def test_exposure_is_monotone_in_the_distance_to_target_and_in_clipping():
    levels = [0.5, 0.6, 0.7, 0.85]
    videos = torch.stack([torch.full((4, 3, 16, 16), v) for v in levels])
    s = ExposureReward(target=0.5)(videos, ["a"] * 4)["exposure"]
    assert torch.all(s[:-1] > s[1:]), s
    assert s[0].item() == pytest.approx(0.0, abs=1e-3)
    # Same mean luminance (0.5), more pixels clipped at 0 and 1 -> lower score.
    clipped = []
    for q in (0, 16, 32, 64):
        v = torch.full((4, 3, 16, 16), 0.5)
        flat = v.view(4, 3, -1)
        flat[:, :, :q] = 1.0
        flat[:, :, q : 2 * q] = 0.0
        clipped.append(v)
    s = ExposureReward(target=0.5)(torch.stack(clipped), ["a"] * 4)["exposure"]
    assert torch.all(s[:-1] > s[1:]), s
    # Alternating dark and bright frames average to the target but are scored per frame.
    alternating = torch.stack([torch.full((3, 16, 16), 0.2 if f % 2 else 0.8) for f in range(4)])[None]
    assert ExposureReward(target=0.5)(alternating, ["a"])["exposure"].item() < -0.25


def test_sharpness_decreases_with_blur():
    rng = np.random.default_rng(0)
    base = (rng.random((32, 32)) > 0.5).astype(np.float32)
    base = cv2.resize(base, (64, 64), interpolation=cv2.INTER_NEAREST)  # 2-pixel checks: edges everywhere
    frames = [base] + [cv2.GaussianBlur(base, (0, 0), sigma) for sigma in (0.7, 1.5, 3.0)]
    videos = torch.stack([torch.from_numpy(f)[None].repeat(3, 1, 1)[None].repeat(3, 1, 1, 1) for f in frames])
    s = SharpnessReward()(videos, ["a"] * 4)["sharpness"]
    print("sharpness by blur:", [round(x, 3) for x in s.tolist()])
    assert torch.all(s[:-1] > s[1:]), s
    assert SharpnessReward()(torch.full((1, 2, 3, 8, 8), 0.4), ["a"])["sharpness"].item() == 0.0


@pytest.mark.parametrize("name", ["exposure", "sharpness"])
def test_gradients_flow_for_differentiable_rewards(name):
    reward = make_reward(name)
    assert reward.differentiable
    videos = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1)).requires_grad_()
    reward(videos, ["a", "b"])[name].sum().backward()
    assert torch.isfinite(videos.grad).all() and videos.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------------------------
# Input checks, registry, plug-ins
# ----------------------------------------------------------------------------------------------------------------


def test_bad_videos_are_explained():
    r = ExposureReward()
    with pytest.raises(ValueError, match=r"\(B, F, 3, H, W\)"):
        r(torch.rand(2, 3, 16, 16), ["a", "b"])
    with pytest.raises(ValueError, match=r"\(x \+ 1\) / 2"):
        r(torch.rand(1, 2, 3, 8, 8) * 2 - 1, ["a"])
    with pytest.raises(ValueError, match="list of 2 strings"):
        r(torch.rand(2, 2, 3, 8, 8), ["only one"])
    with pytest.raises(ValueError, match="divide uint8"):
        r(torch.zeros(1, 2, 3, 8, 8, dtype=torch.uint8), ["a"])


def test_registry_errors_list_the_valid_rewards():
    with pytest.raises(ValueError, match="valid rewards: .*exposure.*motion.*sharpness.*success") as e:
        make_reward("motoin")
    assert "Did you mean 'motion'" in str(e.value)
    with pytest.raises(ValueError, match="bad options for reward 'exposure'.*'target'"):
        make_reward({"name": "exposure", "brightness": 2})
    with pytest.raises(ValueError, match="bad options for reward 'motion'.*'min_flow'"):
        make_reward({"name": "motion", "speed": 2})
    with pytest.raises(ValueError, match="needs a 'name' key"):
        make_reward({"target": 0.4})
    with pytest.raises(ValueError, match="cannot import reward module"):
        make_reward("no_such_pkg_xyz.module:Reward")
    with pytest.raises(ValueError, match="package.module:ClassName"):
        make_reward("policies.video.rewards:")
    with pytest.raises(ValueError, match="non-empty list"):
        make_rewards("motion")
    assert make_reward({"name": "exposure", "target": 0.4}).target == 0.4
    assert set(REWARDS) >= {"success", "motion", "temporal_consistency", "flow", "exposure", "sharpness"}


def test_user_reward_plugs_in_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_v2.py").write_text(
        textwrap.dedent(
            '''
            import torch

            class Redness:  # duck-typed: no kinema base class needed
                names = ("redness",)
                differentiable = True

                def __init__(self, scale=1.0):
                    self.scale = scale

                def __call__(self, videos, prompts):
                    return {"redness": self.scale * videos[:, :, 0].mean(dim=(1, 2, 3))}

            class WrongShape:
                names = ("bad",)
                differentiable = False

                def __call__(self, videos, prompts):
                    return {"bad": torch.zeros(3)}
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_rewards_v2", raising=False)
    reward = make_reward({"name": "my_rewards_v2:Redness", "scale": 2.0})
    videos = torch.zeros(2, 2, 3, 8, 8)
    videos[1, :, 0] = 0.5
    rs = make_rewards([reward, "exposure"])
    scores = rs.score(videos, ["a", "a"])
    assert scores["redness"].tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match="no attribute 'Missing'"):
        make_reward("my_rewards_v2:Missing")
    with pytest.raises(ValueError, match=r"score 'bad' must be a tensor of shape \(2,\)"):
        make_rewards(["my_rewards_v2:WrongShape"]).score(videos, ["a", "b"])


# ----------------------------------------------------------------------------------------------------------------
# GDPO balancing
# ----------------------------------------------------------------------------------------------------------------


class _Fixed:
    """A reward returning preset scores (to test balancing with known answers)."""

    differentiable = False

    def __init__(self, name, values):
        self.names = (name,)
        self.values = torch.tensor(values, dtype=torch.float32)

    def __call__(self, videos, prompts):
        return {self.names[0]: self.values[: videos.shape[0]]}


def test_gdpo_balances_where_a_weighted_sum_lets_the_big_scale_win():
    # One prompt group of 4. Sample 1 wins only on the big-scale reward, sample 2 only on the small one.
    big, small = _Fixed("big", [0, 1000, 0, 1000]), _Fixed("small", [0, 0, 1, 1])
    videos, prompts = torch.zeros(4, 2, 3, 4, 4), ["p"] * 4
    gdpo = RewardSet([big, small])(videos, prompts).advantages
    summed = RewardSet([big, small], balance="weighted_sum")(videos, prompts).advantages
    # Per-reward normalisation: each reward counts the same, so samples 1 and 2 tie; 3 (both) is best.
    assert gdpo[1].item() == pytest.approx(gdpo[2].item(), abs=1e-3)
    assert gdpo[3] > gdpo[1] > gdpo[0]
    # The raw sum follows the big reward: the small reward's win is worth nothing.
    assert summed[1] - summed[2] > 1.5 and summed[3] - summed[1] < 0.01
    # Weights apply after normalisation: doubling the small reward makes its win count more.
    favour_small = RewardSet([big, small], weights={"small": 2.0})(videos, prompts).advantages
    assert favour_small[2] > favour_small[1] + 0.5


def test_reward_set_matches_gdpo_advantages_and_logs_per_reward_stats():
    a = _Fixed("a", [0.1, 0.5, 0.3, 0.9, 0.2, 0.2])
    b = _Fixed("b", [1.0, 0.0, 1.0, 0.0, 4.0, 4.0])
    prompts = ["x", "x", "y", "y", "z", "z"]  # group z is constant in both rewards: degenerate, dropped
    out = RewardSet([a, b])(torch.zeros(6, 2, 3, 4, 4), prompts)
    expect = gdpo_advantages(torch.stack([a.values, b.values], 1), prompt_group_ids(prompts))
    assert torch.allclose(out.advantages, expect.advantages)
    assert out.weights.tolist() == [1, 1, 1, 1, 0, 0]
    assert out.stats["n_degenerate_groups"] == 1.0
    assert out.stats["reward/a/mean"] == pytest.approx(float(a.values.mean()))
    assert out.stats["reward/b/max"] == 4.0
    assert out.stats["reward/b/group_std"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert prompt_group_ids(prompts).tolist() == [0, 0, 1, 1, 2, 2]


def test_reward_set_rejects_collisions_and_unknown_weights():
    with pytest.raises(ValueError, match="'motion'"):
        RewardSet([make_reward("motion"), make_reward("flow")])
    with pytest.raises(ValueError, match=r"weights name unknown rewards \['sharp'\]"):
        make_rewards(["sharpness"], weights={"sharp": 1.0})
    with pytest.raises(ValueError, match="balance must be"):
        make_rewards(["sharpness"], balance="sum")


def test_reward_set_scores_real_rewards_together():
    rs = make_rewards(["flow", "exposure", "sharpness"])
    videos = torch.cat([square_video(0.0), square_video(2.0), tint(square_video(2.0)), square_video(3.0)])
    out = rs(videos, ["p", "p", "p", "p"])
    assert set(out.scores) == {"motion", "temporal_consistency", "exposure", "sharpness"}
    assert out.scores["motion"][0].item() == 0.0
    assert out.advantages.shape == (4,) and torch.isfinite(out.advantages).all()
    assert not rs.differentiable


# ----------------------------------------------------------------------------------------------------------------
# Episodes to clips, and the success reward
# ----------------------------------------------------------------------------------------------------------------


def test_roc_auc_known_values():
    assert roc_auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1])) == pytest.approx(0.75)
    assert roc_auc(torch.tensor([0.5, 0.5]), torch.tensor([0, 1])) == 0.5
    assert np.isnan(roc_auc(torch.tensor([0.1, 0.2]), torch.tensor([1, 1])))


def _episode(length: int, success: bool, task: str = "push the red brick"):
    from diffusion_rl.data import Episode

    images = np.stack([np.full((48, 48, 3), 10 * t, np.uint8) for t in range(length)])
    return Episode(
        observations={"observation.images.agentview": images, "observation.state": np.zeros((length, 8), np.float32)},
        action=np.zeros((length, 7), np.float32),
        task=task,
        outcome=success,
        task_id="push",
        seed=length,
    )


def test_episode_clips_shapes_frames_and_labels():
    eps = [_episode(20, True), _episode(9, False)]
    clips = episode_clips(eps, frames=5, size=16, stride=None)
    assert clips.videos.shape == (2, 5, 3, 16, 16) and clips.videos.dtype == torch.float32
    # Evenly spread, first and last frame kept: frames 0, 5, 10, 14, 19 (value 10·t / 255).
    assert torch.allclose(clips.videos[0, :, 0, 0, 0] * 255, torch.tensor([0.0, 50, 100, 140, 190]), atol=0.5)
    assert clips.success.tolist() == [True, False] and clips.prompts == ["push the red brick"] * 2
    assert clips.ends_at_outcome.tolist() == [True, True] and clips.seeds == [20, 9]
    strided = episode_clips(eps, frames=3, size=16, stride=4)
    assert torch.allclose(strided.videos[0, :, 0, 0, 0] * 255, torch.tensor([110.0, 150, 190]), atol=0.5)
    assert torch.allclose(strided.videos[1, :, 0, 0, 0] * 255, torch.tensor([0.0, 40, 80]), atol=0.5)
    assert len(clips.subset([1])) == 1 and clips.subset([1]).seeds == [9]
    with pytest.raises(ValueError, match="no camera 'wrist'; its cameras: \\['agentview'\\]"):
        episode_clips(eps, camera="wrist")


def _constructed_clips(n: int, seed: int, *, frames: int = 5, size: int = 16) -> VideoClips:
    """A square moves from the centre to the left or right; success iff it ends in the right half."""
    g = torch.Generator().manual_seed(seed)
    videos = torch.full((n, frames, 3, size, size), 0.4)
    success = torch.rand(n, generator=g) < 0.5
    for i in range(n):
        y = int(torch.randint(2, size - 6, (1,), generator=g))
        direction = 1 if success[i] else -1
        for f in range(frames):
            x = size // 2 - 2 + direction * round(f * (size // 2 - 3) / (frames - 1))
            videos[i, f, :, y : y + 4, x : x + 4] = torch.tensor([0.9, 0.2, 0.2]).view(3, 1, 1)
    prompts = ["move the red square right"] * n
    return VideoClips(videos, prompts, success, torch.ones(n, dtype=torch.bool))


def test_success_reward_machinery_on_a_constructed_task(tmp_path):
    """Known answer: success iff the square ends right. Fit, calibrate, save/load, gradients, tint."""
    torch.manual_seed(0)
    cfg = VideoSuccessConfig(frames=5, size=16, channels=(8, 16), frame_dim=16, text_dim=8, hidden_dim=16)
    train, held = _constructed_clips(48, 0), _constructed_clips(32, 1)
    reward = SuccessReward(cfg)
    with pytest.raises(RuntimeError, match="not fitted"):
        reward(train.videos[:2], train.prompts[:2])
    history = reward.fit(train, steps=120, batch_size=16, seed=0)
    assert {"loss", "p_mean", "target_mean", "n", "prefix_frames"} <= set(history[0])
    metrics = reward.calibration_figure(held, tmp_path / "figs" / "calibration.png")
    print("constructed success task, held out:", {k: round(v, 3) for k, v in metrics.items()})
    assert metrics["auc"] > 0.95 and metrics["brier"] < 0.1
    assert (tmp_path / "figs" / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    assert [p.name for p in (tmp_path / "figs").iterdir()] == ["calibration.png"]  # no temp file left

    # Tint does not buy success: failures stay failures after a global tint.
    p = reward.predict(held)
    p_tinted = reward.predict(VideoClips(tint(held.videos), held.prompts, held.success, held.ends_at_outcome))
    fail = ~held.success
    assert p_tinted[fail].mean() <= p[fail].mean() + 0.05
    assert roc_auc(p_tinted, held.success) > 0.95

    # Scores any video size/length (subsampled and resized inside), with gradients to the pixels.
    videos = held.videos[:2].repeat_interleave(2, dim=1)[:, :9]
    videos = torch.nn.functional.interpolate(videos.flatten(0, 1), size=(40, 40)).unflatten(0, (2, 9)).requires_grad_()
    s = reward(videos, held.prompts[:2])["success"]
    assert s.shape == (2,) and ((s > 0) & (s < 1)).all()
    s.sum().backward()
    assert torch.isfinite(videos.grad).all() and videos.grad.abs().sum() > 0

    # Atomic save, exact round trip, loud failures on foreign folders.
    reward.save(tmp_path / "success")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figs", "success"]
    loaded = make_reward({"name": "success", "path": str(tmp_path / "success")})
    assert torch.equal(loaded.predict(held), reward.predict(held))
    assert loaded.config == cfg and loaded.fitted
    (tmp_path / "other").mkdir()
    with pytest.raises(FileNotFoundError, match="missing config.json"):
        SuccessReward.load(tmp_path / "other")


def test_success_reward_needs_both_outcomes_and_matching_clips():
    cfg = VideoSuccessConfig(frames=5, size=16, channels=(8, 16), frame_dim=16, text_dim=8, hidden_dim=16)
    clips = _constructed_clips(8, 0)
    only_fail = VideoClips(clips.videos, clips.prompts, torch.zeros(8, dtype=torch.bool), clips.ends_at_outcome)
    with pytest.raises(ValueError, match="both outcomes"):
        SuccessReward(cfg).fit(only_fail, steps=1)
    with pytest.raises(ValueError, match=r"episode_clips\(frames=9, size=32"):
        SuccessReward().fit(clips, steps=1)
    with pytest.raises(ValueError, match="multiple of 2\\^len\\(channels\\)"):
        VideoSuccessConfig(size=20)
    with pytest.raises(ValueError, match="unknown VideoSuccessConfig keys \\['width'\\]"):
        make_reward({"name": "success", "width": 3})


@pytest.mark.slow
def test_success_reward_ranks_heldout_sim_episodes():
    """Trained on real push rollouts (noisy scripted expert: both outcomes), scored on held-out layouts."""
    from sim.experts import ExpertConfig
    from sim.rollout import collect_demos

    torch.manual_seed(0)
    kw = dict(expert=ExpertConfig(noise=0.3, wrong_grasp=0.5), num_envs=4, image_size=32, cameras=("agentview",), config={"horizon": 60})
    train = collect_demos("push", 64, seeds=range(64), **kw)
    held = collect_demos("push", 32, seeds=range(1000, 1032), **kw)
    reward = SuccessReward(VideoSuccessConfig(frames=9, size=32))
    reward.fit(train, steps=300, seed=0)
    metrics = reward.evaluate(held)
    print("push success reward, held out:", {k: round(v, 3) for k, v in metrics.items()})
    assert 4 <= metrics["n_success"] <= 28  # both outcomes are present in the held-out set
    assert metrics["auc"] > 0.7
    clips = episode_clips(held, frames=9, size=32, stride=reward.config.stride)
    p = reward.predict(clips)
    p_tinted = reward.predict(VideoClips(tint(clips.videos), clips.prompts, clips.success, clips.ends_at_outcome))
    print(f"mean p: {p.mean():.3f}, tinted {p_tinted.mean():.3f}")
    assert p_tinted.mean() <= p.mean() + 0.05
