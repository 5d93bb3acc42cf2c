"""Rewards for video generators: named scores per video, a registry, and GDPO-style multi-reward balancing.

A reward takes videos (B, F, C, H, W), float in [0, 1], and their prompts (list of B strings), and returns named
scores, `dict[str, Tensor (B,)]`; higher is better. A reward object declares the `names` it returns and whether
the scores are `differentiable` with respect to the pixels (Stream-R1's saliency weights need reward gradients).

Built in (nothing is downloaded; every model is built here and trained on our own sim rollouts):

| name                   | what it measures                                                     | differentiable |
|------------------------|----------------------------------------------------------------------|----------------|
| `success`              | P(task success | clip, prompt), diffusion_rl's TD success model       | yes            |
| `motion`               | mean optical-flow magnitude (px/frame) over the moving pixels        | no (OpenCV)    |
| `temporal_consistency` | −(mean |frame_t − warp(frame_t+1 by flow)|): flicker lowers it       | no (OpenCV)    |
| `flow`                 | both of the above from one optical-flow pass                         | no (OpenCV)    |
| `exposure`             | −|frame mean luminance − target| − clipped-pixel fraction            | yes            |
| `sharpness`            | variance of the luminance Laplacian                                  | yes            |

Modules: `base` (the interface), `image` (exposure, sharpness), `flow` (motion, temporal consistency), `clips`
(Episodes -> clips), `success` (the success model), `balance` (RewardSet), `registry` (names and plug-ins).

User rewards plug in by import path: `make_reward("my_pkg.module:MyReward")` or `{"name": "...:MyReward", ...kwargs}`.

Reward hacking, and what guards against it (measured while building it: a short RL run hacked a threshold reward by
tinting the whole background):
- optical flow runs on per-frame standardised grey levels, so a global brightness/tint change (constant, or
  flickering) is not motion; the warping error runs on the raw RGB frames, so flicker *is* penalised;
- the success model standardises every frame per colour channel before its encoder (a global per-channel gain
  and offset cancel exactly) and is trained with random tints, so tinting does not buy success;
- every single reward can still be gamed (noise maximises sharpness and motion; a static clip maximises temporal
  consistency): use several at once through `RewardSet`, which normalises each reward within its prompt group
  before summing (GDPO), so no reward's scale lets it drown the others, and keep the trainer's reference anchor.
"""

from policies.video.rewards.balance import RewardBatch, RewardSet, prompt_group_ids, reward_stats
from policies.video.rewards.base import VideoReward, check_scores, check_videos, luminance
from policies.video.rewards.clips import DEFAULT_STRIDE, VideoClips, episode_clips
from policies.video.rewards.flow import OpticalFlowReward
from policies.video.rewards.image import ExposureReward, SharpnessReward
from policies.video.rewards.registry import REWARDS, make_reward, make_rewards
from policies.video.rewards.success import SuccessReward, VideoSuccessConfig, VideoSuccessModel, roc_auc

__all__ = [
    "DEFAULT_STRIDE",
    "REWARDS",
    "ExposureReward",
    "OpticalFlowReward",
    "RewardBatch",
    "RewardSet",
    "SharpnessReward",
    "SuccessReward",
    "VideoClips",
    "VideoReward",
    "VideoSuccessConfig",
    "VideoSuccessModel",
    "check_scores",
    "check_videos",
    "episode_clips",
    "luminance",
    "make_reward",
    "make_rewards",
    "prompt_group_ids",
    "reward_stats",
    "roc_auc",
]
