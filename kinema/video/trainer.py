"""One trainer for post-training video flow generators; the methods are small strategy objects
(`kinema.video.methods`).

Every round reads the same way, whatever the method:
    1. draw prompts, `group_size` samples each (a group = one prompt);
    2. roll out (the method says with which adapter, with or without CFG, ODE or SDE);
    3. decode, score every reward, balance them into one advantage per sample (GDPO or a weighted sum);
       samples of reward-degenerate groups get weight 0 in the methods the reward drives (AWR, NFT, Flow-GRPO),
       not in those a teacher or a discriminator drives (distill, AFD, OPSD: `Method.reward_gated`);
       steps 1-3 make the round's `Rollout` (`kinema.video.rollout.collect_rollout`);
    4. `updates_per_round` gradient steps of the method's per-sample loss on that round's samples (none when a
       reward-gated method has every group degenerate: `train/idle_round`); only the LoRA adapter `default`
       trains, the base weights never change;
    5. the reference adapter follows the trained one as an EMA (`anchor.ref_schedule`, where the method keeps
       one); VideoAWR also keeps a separate EMA of `default` (decay 0.9, FlowAWR) that evaluation samples from.
    `round` counts finished rounds only.

Teachers (AFD, OPSD `train.opsd.teacher model`) are other generators: they read prompts with their own text encoder,
start from noise in their own latent shape and run as saved (their own LoRA adapters on). AFD resizes their
videos to the student's frames and size; OPSD needs matching latents (checked at construction).

Every tensor of a round lives on the generator's device; random draws come from the trainer's CPU generator
(checkpointed) and are moved there, so a run resumes identically and draws the same on any device.

Under torchrun (`kinema.train.distributed`) every rank draws the round's prompts alike and rolls out its own whole
groups (`train.prompts_per_round` / ranks each); advantages are balanced over the round, every rank's samples; each
update takes this rank's share of `train.batch_size` and averages the gradients over the ranks, so N ranks take
the step one process would take on their minibatches together. One process is unchanged.

Adapters (peft, named, on one transformer: no model copies; their names: `kinema.video.methods`):
    default  the trained student; evaluated CFG-free
    ref      EMA of `default` (VideoAWR's old reference that rolls out with CFG; NFT's and AFD's old policy)
    fake     distill only: the fake-score model of DMD, fitted to the student's samples
    (base)   adapters disabled: the pre-trained model, the anchor every method keeps (short runs without
             one hacked the reward or collapsed)

The math lives in the RL core (diffusion_rl.flow, .distill, .advantages); these modules only wire it.
Time convention: t = 1 is noise, x_t = (1 − t)·x_0 + t·ε, v = ε − x_0. Latents are (B, C, F, H, W),
videos (B, F, C, H, W) in [0, 1].
"""

from __future__ import annotations

import io
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffusion_rl.distill import stream_r1_reward
from kinema.train.distributed import gather_rows, local_batch_size, mean_over_ranks, shard, sync_gradients, world
from kinema.video.config import VideoTrainConfig
from kinema.video.methods import TRAINED, VIDEO_METHODS
from kinema.video.rollout import Rollout, collect_rollout, diversity, draw_prompts, ode_sample
from policies.checkpoint import atomic_folder
from policies.video.generator import BASE, VideoGenerator  # BASE: the pre-trained model with every adapter disabled
from policies.video.rewards import RewardSet, VideoReward

CHECKPOINT_FORMAT = 1


class VideoTrainer:
    """Rollout -> reward -> advantage -> updates, in rounds, for any method; evaluation; checkpoints.

    Args:
        cfg: the run's config (model sampling steps, method and its options, anchors, rewards).
        generator: a `policies.video.VideoGenerator` (pre-trained); LoRA adapters are added here.
        rewards: videos + prompts -> named (B,) scores.
        prompts: the prompt pool rounds draw from.
        teacher: optional black-box teacher for AFD/OPSD (a generator) ...
        teacher_clips: ... or AFD teacher videos: {prompt: (N, F, C, H, W)}.
        judge: optional held-out judge (videos + prompts -> named scores, e.g. a second success model fitted on
            other clips): scored on the evaluation samples only, as `eval/judge_<name>`; never in training.
    """

    def __init__(
        self,
        cfg: VideoTrainConfig,
        generator: VideoGenerator,
        rewards: RewardSet,
        prompts: Sequence[str],
        *,
        teacher: VideoGenerator | None = None,
        teacher_clips: dict[str, Tensor] | None = None,
        judge: VideoReward | None = None,
    ) -> None:
        if cfg.train.method not in VIDEO_METHODS:
            raise ValueError(f"train.method {cfg.train.method!r} is not known; valid: {', '.join(VIDEO_METHODS)}")
        if not prompts:
            raise ValueError("the prompt pool is empty")
        self.cfg = cfg
        self.generator = generator
        self.rewards = rewards
        self.prompts = list(prompts)
        self.teacher = teacher
        self.teacher_clips = teacher_clips
        self.judge = judge
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.np_rng = np.random.default_rng(cfg.seed)
        self.updates = 0
        self.round = 0
        method_cls = VIDEO_METHODS[cfg.train.method]
        if generator.adapters:
            raise ValueError(f"the generator already has LoRA adapters {generator.adapters}; pass the pre-trained base")
        generator.add_adapter(TRAINED, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha)  # active, trains
        for name in method_cls.adapters:
            generator.copy_adapter(TRAINED, name)  # the reference and the fake score start as the student
        self.params = list(generator.lora_parameters(TRAINED).values())
        if not self.params:
            raise RuntimeError("the generator exposes no LoRA weights for adapter 'default'")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=0.0)
        self.method = method_cls(self)
        decay = self.method.eval_ema_decay()
        self.eval_ema = generator.ema(TRAINED, decay=decay) if decay > 0 else None

    # Sampling ------------------------------------------------------------------------------------------------------
    def noise(self, batch: int, rng: torch.Generator | None = None, *, generator: VideoGenerator | None = None) -> Tensor:
        """Starting latents of `generator` (default: the student), in its latent shape, on its device; drawn by `rng`
        (default: the trainer's)."""
        generator = self.generator if generator is None else generator
        return generator.initial_noise(batch, generator=self.rng if rng is None else rng)

    def ode(self, emb: Tensor, adapter: str | None, *, guidance: float = 1.0, noise: Tensor | None = None,
            trajectory: bool = False, generator: VideoGenerator | None = None):
        """The pipeline's ODE (Euler on its sigmas) from fresh noise: latents (B, C, F', h, w) [, visited states]."""
        generator = self.generator if generator is None else generator
        noise = self.noise(emb.shape[0], generator=generator) if noise is None else noise
        steps = self.cfg.model.num_inference_steps
        return ode_sample(generator, emb, adapter, noise, num_steps=steps, guidance=guidance, trajectory=trajectory)

    def teacher_model(self) -> VideoGenerator:
        if self.teacher is None:
            raise ValueError(f"this method needs a teacher model: set train.{self.method.name}.teacher_path")
        return self.teacher

    @torch.no_grad()
    def teacher_videos(self, ro: Rollout) -> Tensor:
        """AFD's teacher videos, one per student sample, paired by prompt, in the student's frames and size: from
        a folder of clips, from a teacher generator, or from the base model with CFG (the default black box)."""
        frames, size = ro.videos.shape[1], ro.videos.shape[-2:]
        if self.teacher_clips is not None:
            out = []
            for p in ro.prompts:
                clips = self.teacher_clips[p]
                out.append(clips[int(self.np_rng.integers(len(clips)))])
            return resize_videos(torch.stack(out), frames, size).to(ro.videos.device)
        # One teacher sample per prompt, shared by its group.
        first = {int(g): i for i, g in reversed(list(enumerate(ro.group_ids.tolist())))}
        rows = [first[int(g)] for g in ro.group_ids.tolist()]
        uniq = sorted(set(first.values()))
        g = self.method.opt.teacher_guidance
        if self.teacher is not None:
            # Another model: its own text encoder, its own latent shape, its own adapters (as saved: adapter None).
            t = self.teacher
            emb = t.encode_prompts([ro.prompts[u] for u in uniq])
            vids = t.decode_latents(self.ode(emb, None, guidance=g, generator=t))
        else:
            vids = self.generator.decode_latents(self.ode(ro.embeds[uniq], BASE, guidance=g))
        pos = {u: k for k, u in enumerate(uniq)}
        vids = vids[torch.tensor([pos[r] for r in rows], device=vids.device)]
        return resize_videos(vids, frames, size).to(ro.videos.device)

    def tilt_reward(self, ro: Rollout) -> Tensor:
        """The r of the exp(β·r) rollout tilt (distill, OPSD): `train.<method>.tilt_reward`.

        balanced: Stream-R1's r = mean_k z_k − ½·std_k z_k over the rewards z-scored across the round (every
        rank's samples; `diffusion_rl.distill.stream_r1_reward`); advantage (our variant): the balanced GDPO
        advantage."""
        if self.method.opt.tilt_reward == "advantage":
            return ro.advantages
        z = torch.stack([s.float() for s in ro.scores.values()], dim=1)  # (B, K)
        round_z = gather_rows(z)
        z = (z - round_z.mean(0)) / (round_z.std(0, correction=0) + 1e-6)
        return stream_r1_reward(z).to(ro.advantages.device)

    def reward_saliency(self, ro: Rollout) -> tuple[Tensor, Tensor] | None:
        """Per-reward |∂r_k/∂pixels| maps (B, K, F, H, W) and z-scored rewards (B, K), from the differentiable
        rewards; None when no reward is differentiable."""
        videos = ro.videos.detach().clone().requires_grad_(True)
        differentiable = {n for r in self.rewards.rewards if r.differentiable for n in r.names}
        with torch.enable_grad():
            scores = self.rewards.score(videos, ro.prompts, grad=True)
            maps, axis = [], []
            for name, s in scores.items():
                if name not in differentiable or not s.requires_grad:
                    continue
                (grad,) = torch.autograd.grad(s.sum(), videos, retain_graph=True)
                maps.append(grad.abs().mean(2))  # (B, F, H, W)
                z = s.detach().float()
                round_z = gather_rows(z)  # z-scored over the round, every rank's samples
                axis.append((z - round_z.mean()) / (round_z.std(correction=0) + 1e-6))
        if not maps:
            return None
        return torch.stack(maps, 1), torch.stack(axis, 1)

    # One round -----------------------------------------------------------------------------------------------------
    def collect(self) -> Rollout:
        """This round's prompts (drawn by the trainer's numpy generator), rolled out, decoded and scored; under
        torchrun, this rank's whole groups of them."""
        k, g = self.cfg.train.prompts_per_round, self.cfg.train.group_size
        prompts, groups = draw_prompts(self.prompts, k, g, self.np_rng, self.generator.device)
        if world()[1] > 1:
            rows = (shard(np.arange(k))[:, None] * g + np.arange(g)).reshape(-1)
            prompts, groups = [prompts[i] for i in rows], groups[torch.from_numpy(rows).to(groups.device)]
        return collect_rollout(self.generator, self.method, self.rewards, prompts, groups)

    def train_round(self, on_update: Callable[[], None] | None = None) -> dict[str, Any]:
        """One round: rollouts, rewards, advantages, the method's updates. Returns the round's metrics.

        `round` counts finished rounds: it moves only at the end, so a checkpoint never claims a half-done round."""
        this_round = self.round + 1
        rank, size = world()
        if size > 1:
            # Each rank its own stream (rollout noise, minibatches, the losses' noise), one per round: the ranks draw
            # apart, and a resumed run draws what it would have (the checkpoint holds rank 0's state only).
            self.rng.manual_seed(int(np.random.SeedSequence([self.cfg.seed, this_round, rank]).generate_state(1)[0]))
        ro = self.collect()
        record: dict[str, Any] = {"kind": "round", "round": this_round, "method": self.method.name}
        for name, s in ro.scores.items():
            record[f"rollout/{name}"] = float(s.mean())
        record["rollout/diversity"] = diversity(ro.videos, ro.group_ids)
        for key, value in ro.extra["reward_stats"].items():  # reward/<name>/{mean,std,min,max,group_std}, adv/...
            if isinstance(value, (int, float)):
                record[key if key.startswith("reward/") else f"adv/{key}"] = float(value)
        adv = gather_rows(ro.advantages.float())  # the round's, every rank's
        record.update({"adv/mean": float(adv.mean()), "adv/std": float(adv.std(correction=0)), "adv/abs_max": float(adv.abs().max()),
                       "adv/weight_mean": float(gather_rows(ro.weights.float()).mean())})  # fmt: skip
        record.update(self.method.prepare(ro))
        n = len(ro.prompts)
        batch_size = min(local_batch_size(self.cfg.train.batch_size, "train.batch_size"), n)
        losses = []
        # A reward-gated method with every group degenerate has nothing to learn: no step, not even the anchor's
        # (at a zero-initialised adapter its gradient would be the rounding between two passes, scaled by Adam).
        # Every rank's groups count: the ranks step together or not at all.
        idle = self.method.reward_gated and not bool((gather_rows(ro.weights) > 0).any())
        record["train/idle_round"] = float(idle)
        for u in range(0 if idle else self.cfg.train.updates_per_round):
            idx = torch.randperm(n, generator=self.rng)[:batch_size]
            loss, stats = self.method.loss(ro, idx, u)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            sync_gradients(self.optimizer)  # the ranks' mean, before clipping reads its norm
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip)
            self.optimizer.step()
            self.updates += 1
            self.method.after_update()
            if self.eval_ema is not None:
                self.eval_ema.update()
            losses.append(float(loss.detach()))
            for k, v in stats.items():  # means over the round's updates; the first-update ratio check as is
                record[k] = v if k == "grpo/first_ratio_max_dev" else record.get(k, 0.0) + v / self.cfg.train.updates_per_round
            record["train/grad_norm"] = float(grad_norm)
            if on_update is not None:
                on_update()
        record["train/loss"] = float(np.mean(losses)) if losses else float("nan")
        # Under torchrun rank 0 logs the round: each float is averaged over the ranks. The reward and advantage stats
        # are the round's already (gathered); the rest are means over equal shares, so the round's means too, but
        # for the maxima (distill/tilt_max, grpo/first_ratio_max_dev, ...), which become the means of the ranks'.
        record.update(mean_over_ranks({k: v for k, v in record.items() if isinstance(v, float)}))
        record["train/updates"] = self.updates
        self.round = this_round
        return record

    # Evaluation ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompts: list[str], *, seed: int, adapter: str = TRAINED, guidance: float | None = None) -> Tensor:
        """CFG-free (by default) ODE samples of an adapter, with fixed noise: videos (B, F, C, H, W)."""
        g = torch.Generator().manual_seed(seed)
        emb = self.generator.encode_prompts(prompts)
        scale = self.cfg.model.guidance_scale if guidance is None else guidance
        return self.generator.decode_latents(self.ode(emb, adapter, guidance=scale, noise=self.noise(len(prompts), g)))

    def eval_prompts(self) -> tuple[list[str], Tensor]:
        k, s = self.cfg.eval.prompts, self.cfg.eval.samples_per_prompt
        base = [self.prompts[i % len(self.prompts)] for i in range(k)]
        return [p for p in base for _ in range(s)], torch.arange(k, device=self.generator.device).repeat_interleave(s)

    def showcase(self, videos: Tensor, k: int) -> tuple[Tensor, list[str]]:
        """k evaluation samples for the grids and MP4s: the first sample of each prompt first, then the second..."""
        prompts, _ = self.eval_prompts()
        n_p, n_s = self.cfg.eval.prompts, self.cfg.eval.samples_per_prompt
        order = torch.arange(n_p * n_s).reshape(n_p, n_s).T.flatten()[:k]
        return videos[order], [prompts[i] for i in order.tolist()]

    def evaluate(self, adapter: str = TRAINED) -> tuple[dict[str, float], Tensor]:
        """Rewards and diversity of fixed-noise samples; of the evaluation EMA where the method keeps one."""
        prompts, groups = self.eval_prompts()
        if adapter == TRAINED and self.eval_ema is not None:
            with self.eval_ema.swap_in():
                videos = self.sample(prompts, seed=self.cfg.eval.seed, adapter=adapter)
        else:
            videos = self.sample(prompts, seed=self.cfg.eval.seed, adapter=adapter)
        scores = self.rewards.score(videos, prompts)
        out = {f"eval/{k}": float(v.mean()) for k, v in scores.items()}
        out["eval/diversity"] = diversity(videos, groups)
        if self.judge is not None:  # the held-out judge sees the same samples; nothing of it reaches training
            with torch.no_grad():
                out.update({f"eval/judge_{k}": float(v.float().mean()) for k, v in self.judge.score(videos, prompts).items()})
        return out, videos

    # Checkpoints ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "format_version": CHECKPOINT_FORMAT,
            "method": self.method.name,
            "round": self.round,
            "updates": self.updates,
            "optimizer": self.optimizer.state_dict(),
            "method_state": self.method.state_dict(),
            "eval_ema": None if self.eval_ema is None else self.eval_ema.state_dict(),
            "rng": {
                "trainer": self.rng.get_state(),
                "numpy": self.np_rng.bit_generator.state,
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
            },
        }

    def save(self, path: Path, extra: dict[str, Any] | None = None) -> Path:
        """LoRA weights of every adapter (the trained one, its EMA reference, the fake score), optimisers, method
        state, RNG states and the round, written to a temporary folder and then renamed: a kill never leaves a
        half-written checkpoint."""
        with atomic_folder(path) as tmp:
            gen = self.generator  # every adapter in one file, keyed `<adapter>/<its own key>`
            adapters = {f"{name}/{k}": v for name in gen.adapters for k, v in gen.adapter_state_dict(name).items()}
            save_file({k: v.contiguous().cpu() for k, v in adapters.items()}, str(tmp / "adapters.safetensors"))
            buf = io.BytesIO()
            torch.save({**self.state_dict(), "extra": extra or {}}, buf)
            (tmp / "trainer.pt").write_bytes(buf.getvalue())
        return Path(path)

    def load(self, path: Path) -> dict[str, Any]:
        """Restore what `save` wrote; returns its `extra`."""
        path = Path(path)
        state = torch.load(path / "trainer.pt", weights_only=False)
        if state.get("format_version") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path} holds checkpoint format {state.get('format_version')}, expected {CHECKPOINT_FORMAT}")
        if state["method"] != self.method.name:
            raise ValueError(f"{path} was trained with method {state['method']!r}, not {self.method.name!r}")
        adapters, gen = load_file(str(path / "adapters.safetensors")), self.generator
        names = sorted({k.split("/", 1)[0] for k in adapters})
        if names != sorted(gen.adapters):
            raise ValueError(f"the checkpoint holds adapters {names}; this trainer has {sorted(gen.adapters)}")
        for name in names:
            prefix = f"{name}/"
            gen.load_adapter_state_dict(name, {k[len(prefix) :]: v for k, v in adapters.items() if k.startswith(prefix)})
        self.optimizer.load_state_dict(state["optimizer"])
        self.method.load_state_dict(state["method_state"])
        if (state.get("eval_ema") is None) != (self.eval_ema is None):
            raise ValueError(f"{path}: the checkpoint's evaluation EMA does not match this config (train.awr.eval_ema)")
        if self.eval_ema is not None:
            self.eval_ema.load_state_dict(state["eval_ema"])
        self.round, self.updates = state["round"], state["updates"]
        rng = state["rng"]
        self.rng.set_state(rng["trainer"])
        self.np_rng.bit_generator.state = rng["numpy"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        return state.get("extra", {})


def resize_videos(videos: Tensor, frames: int, size: tuple[int, int] | int) -> Tensor:
    """(B, F, C, H, W) -> (B, frames, C, *size): frames picked evenly over the clip, pixels area-resized (another
    teacher's videos in the student's format, for a discriminator that compares them)."""
    size = (size, size) if isinstance(size, int) else tuple(size)
    B, Fr, C, H, W = videos.shape
    if Fr != frames:
        idx = torch.as_tensor(np.round(np.linspace(0, Fr - 1, frames)).astype(np.int64), device=videos.device)
        videos = videos.index_select(1, idx)
    if (H, W) != size:
        videos = F.interpolate(videos.flatten(0, 1), size=size, mode="area").unflatten(0, (B, frames))
    return videos


def base_weights(generator: nn.Module) -> dict[str, Tensor]:
    """Every non-LoRA weight (for checking that training leaves the base model bit-identical)."""
    # peft renames a wrapped layer's weight to `<layer>.base_layer.weight`; unwrap, so the keys compare across it.
    return {k.replace(".base_layer.", "."): v.detach().clone() for k, v in generator.state_dict().items() if "lora_" not in k}

