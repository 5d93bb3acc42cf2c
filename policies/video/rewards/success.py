"""P(task success | video, prompt): a clip encoder on diffusion_rl's SuccessHead, trained with its TD update."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffusion_rl.data import Episode
from diffusion_rl.success_model import (
    SuccessHead,
    brier_score,
    expected_calibration_error,
    make_target,
    success_model_update,
)
from policies.checkpoint import atomic_file
from policies.video.rewards.base import VideoReward
from policies.video.rewards.clips import DEFAULT_STRIDE, VideoClips, episode_clips
from policies.vla.text import HashTokenizer, TextEncoder


FORMAT_VERSION = 1
CHECKPOINT_KIND = "kinema.video_success_reward"


@dataclass
class VideoSuccessConfig:
    """The success reward's model: a per-frame conv encoder, a prompt encoder and diffusion_rl's SuccessHead."""

    frames: int = 9  # videos are subsampled to this many frames (evenly, last frame kept) before scoring
    size: int = 32  # and resized to size×size
    stride: int | None = DEFAULT_STRIDE  # how `fit`/`evaluate` cut Episodes into clips (see episode_clips)
    channels: tuple[int, ...] = (16, 32, 64)  # conv widths; each conv halves the resolution
    frame_dim: int = 64  # per-frame feature; the clip feature is [last, mean, last − first] (3 × frame_dim)
    text_dim: int = 32  # pooled prompt feature (hashed character trigrams, policies.vla.text)
    text_buckets: int = 4096
    max_words: int = 16
    hidden_dim: int = 64  # SuccessHead MLP width
    num_layers: int = 2  # SuccessHead MLP depth

    def __post_init__(self) -> None:
        self.channels = tuple(int(c) for c in self.channels)
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"VideoSuccessConfig.stride must be None or >= 1; got {self.stride}")
        if self.frames < 1:
            raise ValueError(f"VideoSuccessConfig.frames must be >= 1; got {self.frames}")
        if not self.channels or any(c < 1 for c in self.channels):
            raise ValueError(f"VideoSuccessConfig.channels must be positive widths; got {self.channels}")
        if self.size < 2 ** len(self.channels) or self.size % 2 ** len(self.channels):
            raise ValueError(
                f"VideoSuccessConfig.size must be a multiple of 2^len(channels) = {2 ** len(self.channels)}; got {self.size}"
            )
        for name in ("frame_dim", "text_dim", "text_buckets", "max_words", "hidden_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"VideoSuccessConfig.{name} must be >= 1; got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> VideoSuccessConfig:
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - valid)
        if unknown:
            raise ValueError(f"unknown VideoSuccessConfig keys {unknown}; valid keys: {sorted(valid)}")
        return cls(**d)


def standardise_frames(x: Tensor, eps: float = 0.02) -> Tensor:
    """Per frame and colour channel: (x − mean) / (std + eps) over the pixels, (..., C, H, W).

    A global per-channel gain and offset (a tint, a brightness change) cancels exactly, so the encoder cannot
    be bought with one; `eps` keeps near-uniform frames from amplifying noise.
    """
    mean = x.mean(dim=(-2, -1), keepdim=True)
    std = x.std(dim=(-2, -1), keepdim=True, correction=0)
    return (x - mean) / (std + eps)


class VideoSuccessModel(nn.Module):
    """logits (B,) = SuccessHead([last, mean, last − first] of per-frame features, prompt feature).

    `forward(x, task_ids)` takes clips (B, k, 3, size, size) of any length k ≥ 1 (the TD update feeds a prefix
    and the one-frame-longer prefix) and token ids from `tokenize`. It is the `model(x, task)` that
    `diffusion_rl.success_model.success_model_update` trains.
    """

    def __init__(self, config: VideoSuccessConfig):
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        in_ch = 5  # RGB + two coordinate channels: where the object is matters, not only what is there
        for ch in config.channels:
            layers += [nn.Conv2d(in_ch, ch, 3, stride=2, padding=1), nn.GroupNorm(min(8, ch), ch), nn.GELU()]
            in_ch = ch
        self.convs = nn.Sequential(*layers)
        side = config.size // 2 ** len(config.channels)
        self.project = nn.Sequential(nn.Flatten(), nn.Linear(in_ch * side * side, config.frame_dim), nn.GELU())
        self.tokenizer = HashTokenizer(config.text_buckets, config.max_words)
        self.text = TextEncoder(config.text_buckets, config.text_dim, 0, config.max_words)
        self.head = SuccessHead(3 * config.frame_dim, task_dim=config.text_dim, hidden_dim=config.hidden_dim, num_layers=config.num_layers)
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, config.size), torch.linspace(-1, 1, config.size), indexing="ij")
        self.register_buffer("coords", torch.stack([xs, ys])[None], persistent=False)

    @property
    def device(self) -> torch.device:
        return self.coords.device

    def tokenize(self, prompts: Sequence[str]) -> Tensor:
        ids, _ = self.tokenizer(list(prompts), self.device)
        return ids

    def prepare(self, videos: Tensor) -> Tensor:
        """Any (B, F, 3, H, W) in [0, 1] -> (B, frames, 3, size, size): frames picked evenly, bilinear resize.

        Both steps are differentiable (index selection and interpolation), so reward gradients reach the pixels.
        """
        B, Fr, C, H, W = videos.shape
        cfg = self.config
        if Fr != cfg.frames:
            idx = torch.as_tensor(np.round(np.linspace(0, Fr - 1, cfg.frames)).astype(np.int64), device=videos.device)
            videos = videos.index_select(1, idx)
        if (H, W) != (cfg.size, cfg.size):
            flat = videos.reshape(-1, C, H, W)
            flat = F.interpolate(flat, size=(cfg.size, cfg.size), mode="bilinear", align_corners=False, antialias=True)
            videos = flat.reshape(B, -1, C, cfg.size, cfg.size)
        return videos

    def frame_features(self, x: Tensor) -> Tensor:
        B, k = x.shape[:2]
        frames = standardise_frames(x.reshape(B * k, *x.shape[2:]))
        frames = torch.cat([frames, self.coords.expand(B * k, -1, -1, -1)], dim=1)
        return self.project(self.convs(frames)).reshape(B, k, -1)

    def forward(self, x: Tensor, task_ids: Tensor) -> Tensor:
        f = self.frame_features(x)
        clip = torch.cat([f[:, -1], f.mean(dim=1), f[:, -1] - f[:, 0]], dim=-1)
        _, text = self.text(task_ids, task_ids[:, :, 0] > 0)
        return self.head(clip, text)


def random_tint(x: Tensor, generator: torch.Generator, *, strength: float = 0.3) -> Tensor:
    """Augmentation: one random per-channel gain and offset per clip (B, F, 3, H, W), clipped to [0, 1]."""
    B = x.shape[0]
    gain = 1.0 + strength * (2 * torch.rand(B, 1, 3, 1, 1, generator=generator) - 1)
    offset = strength * (2 * torch.rand(B, 1, 3, 1, 1, generator=generator) - 1) * 0.5
    return (x * gain.to(x) + offset.to(x)).clamp(0.0, 1.0)


def random_shift(x: Tensor, generator: torch.Generator, *, pad: int) -> Tensor:
    """Augmentation: shift each clip (B, F, C, H, W) by up to `pad` pixels (edges replicated), the same for all its frames.

    Held-out layouts put objects where training layouts did not; shifting stops the encoder from keying on
    exact pixel positions (DrQ-style).
    """
    if pad <= 0:
        return x
    B, Fr, C, H, W = x.shape
    padded = F.pad(x.reshape(B, Fr * C, H, W), (pad, pad, pad, pad), mode="replicate")
    offsets = torch.randint(0, 2 * pad + 1, (B, 2), generator=generator).tolist()
    out = torch.stack([padded[b, :, dy : dy + H, dx : dx + W] for b, (dx, dy) in enumerate(offsets)])
    return out.reshape(B, Fr, C, H, W)


def roc_auc(scores: Tensor, labels: Tensor) -> float:
    """Area under the ROC curve (probability a random positive outscores a random negative; ties count ½).

    NaN when either class is absent.
    """
    s = scores.detach().double().flatten().cpu()
    y = labels.detach().bool().flatten().cpu()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    # Mann-Whitney U from average ranks (ties share their mean rank).
    order = torch.argsort(s, stable=True)
    sorted_s = s[order]
    _, inv, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    first = torch.cumsum(counts, 0) - counts
    avg_rank = first.double() + (counts.double() + 1.0) / 2.0  # 1-based
    ranks = torch.empty_like(s)
    ranks[order] = avg_rank[inv]
    u = float(ranks[y].sum()) - n_pos * (n_pos + 1) / 2.0
    return u / (n_pos * n_neg)


class SuccessReward(VideoReward):
    """P(task success | video, prompt) from a clip encoder and diffusion_rl's SuccessHead, trained by its TD update.

    Training (`fit`) follows eVTA_0 (diffusion_rl.success_model): the clip's prefixes are the windows; the target
    of a prefix is the target network's probability on the one-frame-longer prefix, and the full clip of a
    complete episode is terminal with the episode outcome. The reward of a generated video is p on its full
    (subsampled, resized) clip, so it is differentiable with respect to the pixels.

    Usage:
        reward = SuccessReward(VideoSuccessConfig(frames=9, size=32))
        reward.fit(train_episodes)               # or VideoClips from episode_clips
        reward.evaluate(heldout_episodes)        # {"auc", "brier", "ece", ...}
        reward.save("runs/x/success_reward"); SuccessReward.load("runs/x/success_reward")
    """

    names = ("success",)
    differentiable = True

    def __init__(self, config: VideoSuccessConfig | None = None, *, device: torch.device | str = "cpu"):
        self.config = config or VideoSuccessConfig()
        self.model = VideoSuccessModel(self.config).to(device)
        self.model.eval()
        self._target: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._step = 0
        self.fitted = False

    def to(self, device: torch.device | str) -> SuccessReward:
        self.model.to(device)
        if self._target is not None:
            self._target.to(device)
        return self

    # ----- scoring -------------------------------------------------------------------------------------------------
    def logits(self, videos: Tensor, prompts: Sequence[str]) -> Tensor:
        x = self.model.prepare(videos.to(self.model.device, torch.float32))
        return self.model(x, self.model.tokenize(prompts))

    def score(self, videos: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        if not self.fitted:  # an untrained head scores noise; as a reward that would train toward nothing
            raise RuntimeError("this SuccessReward is not fitted: call fit(episodes) or SuccessReward.load(path) first")
        p = torch.sigmoid(self.logits(videos, prompts))
        return {"success": p.to(videos.device)}

    @torch.no_grad()
    def predict(self, data: VideoClips | Sequence[Episode], *, batch_size: int = 64) -> Tensor:
        """p(success) per clip (N,), in eval mode, without gradients."""
        clips = self._clips(data)
        was = self.model.training
        self.model.eval()
        out = [self.score(clips.videos[i : i + batch_size], clips.prompts[i : i + batch_size])["success"] for i in range(0, len(clips), batch_size)]
        self.model.train(was)
        return torch.cat(out).cpu()

    def _clips(self, data: VideoClips | Sequence[Episode]) -> VideoClips:
        if isinstance(data, VideoClips):
            return data
        return episode_clips(data, frames=self.config.frames, size=self.config.size, stride=self.config.stride)

    # ----- training ------------------------------------------------------------------------------------------------
    def fit(
        self,
        data: VideoClips | Sequence[Episode],
        *,
        steps: int = 300,
        batch_size: int = 16,
        lr: float = 1e-3,
        weight_decay: float = 1e-4,
        tint_strength: float = 0.3,
        shift: int = 2,
        tau: float = 0.1,
        target_every: int = 16,
        seed: int = 0,
        progress: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Train (or, called again on fresh rollouts, refit: RLER) with `success_model_update`; per-step stats.

        Even steps train on full clips (the terminal frames, where the outcome is observed); odd steps on a
        random shorter prefix with the one-frame-longer prefix as x⁺. Each clip gets a random tint and a random
        shift of up to `shift` pixels (the same for x and x⁺): colour shifts must not carry the outcome, and
        without the shift the encoder memorises layouts (train AUC 1.0, held-out ~0.7 on push at 32 px).
        """
        if steps < 1 or batch_size < 1:
            raise ValueError(f"fit needs steps >= 1 and batch_size >= 1; got steps={steps}, batch_size={batch_size}")
        clips = self._clips(data)
        cfg = self.config
        if clips.videos.shape[1:] != (cfg.frames, 3, cfg.size, cfg.size):
            raise ValueError(
                f"clips are {tuple(clips.videos.shape[1:])}; this model reads ({cfg.frames}, 3, {cfg.size}, {cfg.size}): "
                f"cut them with episode_clips(frames={cfg.frames}, size={cfg.size}, stride={cfg.stride})"
            )
        n_pos = int(clips.success.sum())
        if n_pos == 0 or n_pos == len(clips):
            raise ValueError(
                f"the success reward needs both outcomes to learn from; got {n_pos} successes in {len(clips)} clips "
                "(add expert noise or wrong grasps to get failures, or a cleaner expert to get successes)"
            )
        device = self.model.device
        gen = torch.Generator().manual_seed(seed)
        if self._optimizer is None:  # a later call refits (RLER) with the same optimiser and target network
            self._target = make_target(self.model)
            self._optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        videos = clips.videos
        task_ids = self.model.tokenize(clips.prompts)
        outcome = clips.success.float()
        history = []
        self.model.train()
        for i in range(steps):
            idx = torch.randint(0, len(clips), (min(batch_size, len(clips)),), generator=gen)
            clip = videos[idx]
            if tint_strength > 0:
                clip = random_tint(clip, gen, strength=tint_strength)
            clip = random_shift(clip, gen, pad=shift)
            clip = clip.to(device)
            k = cfg.frames if i % 2 == 0 else int(torch.randint(1, max(cfg.frames, 2), (1,), generator=gen))
            full = k >= cfg.frames
            b = len(idx)
            batch = {
                "x": clip[:, :k],
                "x_next": clip if full else clip[:, : k + 1],
                "task": task_ids[idx.to(task_ids.device)],
                "outcome": outcome[idx].to(device),
                "terminal": (clips.ends_at_outcome[idx] & full).to(device),
                "has_next": torch.full((b,), not full, dtype=torch.bool, device=device),
            }
            stats = success_model_update(
                self.model, self._target, self._optimizer, batch, step=self._step, tau=tau, target_every=target_every, max_grad_norm=1.0
            )
            self._step += 1
            stats["prefix_frames"] = float(k)
            history.append(stats)
            if progress is not None:
                progress(i, stats)
        self.model.eval()
        self.fitted = True
        return history

    # ----- calibration ---------------------------------------------------------------------------------------------
    def evaluate(self, data: VideoClips | Sequence[Episode], *, n_bins: int = 10) -> dict[str, float]:
        """Held-out calibration and ranking: AUC, Brier score and ECE (diffusion_rl.success_model) of p vs outcome."""
        clips = self._clips(data)
        p = self.predict(clips)
        y = clips.success.float()
        return {
            "auc": roc_auc(p, y),
            "brier": float(brier_score(p, y)),
            "ece": float(expected_calibration_error(p, y, n_bins=n_bins)),
            "n": float(len(clips)),
            "n_success": float(y.sum()),
            "p_success_mean": float(p[y > 0].mean()) if (y > 0).any() else float("nan"),
            "p_failure_mean": float(p[y == 0].mean()) if (y == 0).any() else float("nan"),
        }

    def calibration_figure(self, data: VideoClips | Sequence[Episode], path: str | os.PathLike, *, n_bins: int = 10) -> dict[str, float]:
        """Reliability diagram and p histograms by outcome, as a PNG (written atomically); returns `evaluate`'s dict."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        clips = self._clips(data)
        p = self.predict(clips).numpy()
        y = clips.success.numpy().astype(bool)
        metrics = self.evaluate(clips, n_bins=n_bins)
        bins = np.clip((p * n_bins).astype(int), 0, n_bins - 1)
        centres, freq, conf = [], [], []
        for b in range(n_bins):
            sel = bins == b
            if sel.any():
                centres.append((b + 0.5) / n_bins)
                conf.append(p[sel].mean())
                freq.append(y[sel].mean())
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 4))
        ax1.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
        ax1.plot(conf, freq, "o-", label="model")
        ax1.set(xlabel="predicted p(success)", ylabel="observed success rate", xlim=(0, 1), ylim=(0, 1))
        ax1.set_title(f"Brier {metrics['brier']:.3f}  ECE {metrics['ece']:.3f}  AUC {metrics['auc']:.2f}")
        ax1.legend(loc="upper left")
        ax2.hist([p[y], p[~y]], bins=np.linspace(0, 1, n_bins + 1), label=["success", "failure"])
        ax2.set(xlabel="predicted p(success)", ylabel="clips")
        ax2.legend()
        fig.tight_layout()
        try:
            with atomic_file(path) as tmp:
                fig.savefig(tmp, dpi=100)
        finally:
            plt.close(fig)
        return metrics

    # ----- persistence ---------------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> Path:
        """`config.json` + `model.safetensors`, written to a temporary folder then renamed into place."""
        from policies.checkpoint import save_checkpoint

        config = {"kind": CHECKPOINT_KIND, "format_version": FORMAT_VERSION, "fitted": self.fitted, "config": dataclasses.asdict(self.config)}
        return save_checkpoint(directory, config, self.model.state_dict())

    @classmethod
    def load(cls, directory: str | os.PathLike, *, device: torch.device | str = "cpu") -> SuccessReward:
        from policies.checkpoint import load_checkpoint

        meta, state = load_checkpoint(directory, map_location="cpu")
        if meta.get("kind") != CHECKPOINT_KIND:
            raise ValueError(f"{directory} holds a {meta.get('kind', 'unknown')!r} checkpoint, not a video success reward ({CHECKPOINT_KIND!r})")
        if meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{directory} has success-reward format_version {meta.get('format_version')}; this code reads {FORMAT_VERSION}: refit it with SuccessReward.fit"
            )
        reward = cls(VideoSuccessConfig.from_dict(meta["config"]))
        own = reward.model.state_dict()
        if set(own) != set(state) or any(own[k].shape != state[k].shape for k in own):
            raise ValueError(f"{directory}: weights do not match the architecture in its config.json")
        reward.model.load_state_dict(state)
        reward.model.to(device).eval()
        reward.fitted = bool(meta.get("fitted", True))
        return reward


def success_from_spec(path: str | os.PathLike | None = None, *, device: str = "cpu", **config: Any) -> SuccessReward:
    """Registry entry: a fitted model from `path`, or (for tests and pretraining) a fresh one from config keys."""
    if path is not None:
        if config:
            raise ValueError(f"success reward: pass either path= (a saved model) or config keys, not both; got {sorted(config)}")
        return SuccessReward.load(path, device=device)
    return SuccessReward(VideoSuccessConfig.from_dict(config), device=device)
