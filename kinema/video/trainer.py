"""One trainer for post-training video flow generators; the methods are small strategy objects.

Every round reads the same way, whatever the method:
    1. draw prompts, `group_size` samples each (a group = one prompt);
    2. roll out (the method says with which adapter, with or without CFG, ODE or SDE);
    3. decode, score every reward, balance them into one advantage per sample (GDPO or a weighted sum);
       samples of reward-degenerate groups get weight 0 in the methods the reward drives (AWR, NFT, Flow-GRPO),
       not in those a teacher or a discriminator drives (distill, AFD, OPSD: `Method.reward_gated`);
    4. `updates_per_round` gradient steps of the method's per-sample loss on that round's samples (none when a
       reward-gated method has every group degenerate: `train/idle_round`); only the LoRA adapter `default`
       trains, the base weights never change;
    5. the reference adapter follows the trained one as an EMA (`anchor.ref_schedule`, where the method keeps
       one); VideoAWR also keeps a separate EMA of `default` (decay 0.9, FlowAWR) that evaluation samples from.
    `round` counts finished rounds only.

Teachers (AFD, OPSD `opsd_teacher=model`) are other generators: they read prompts with their own text encoder,
start from noise in their own latent shape and run as saved (their own LoRA adapters on). AFD resizes their
videos to the student's frames and size; OPSD needs matching latents (checked at construction).

Every tensor of a round lives on the generator's device; random draws come from the trainer's CPU generator
(checkpointed) and are moved there, so a run resumes identically and draws the same on any device.

Adapters (peft, named, on one transformer: no model copies):
    default  the trained student; evaluated CFG-free
    ref      EMA of `default` (VideoAWR's old reference that rolls out with CFG; NFT's and AFD's old policy)
    fake     distill only: the fake-score model of DMD, fitted to the student's samples
    (base)   adapters disabled: the pre-trained model, the anchor every method keeps (short runs without
             one hacked the reward or collapsed)

The math lives in the RL core (diffusion_rl.flow, .distill, .advantages); this module only wires it.
Time convention: t = 1 is noise, x_t = (1 − t)·x_0 + t·ε, v = ε − x_0. Latents are (B, C, F, H, W),
videos (B, F, C, H, W) in [0, 1].
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffusion_rl.advantages import awr_energies
from diffusion_rl.distill import (
    afd_advantages,
    afd_weights,
    bt_discriminator_loss,
    dmd_gradient,
    dmd_loss,
    opsd_loss,
    reward_tilt_weights,
    saliency_weights,
    stream_r1_reward,
)
from diffusion_rl.flow import (
    awr_loss,
    awr_target,
    euler_sample,
    flowawr_ref_decay,
    interpolate,
    nft_loss,
    ppo_clip_loss,
    reference_anchor,
    sample_time,
    sde_kl_loss,
    sde_sample,
    sde_step_with_logprob,
    x0_from_velocity,
)
from kinema.video.config import VideoTrainConfig
from policies.checkpoint import atomic_folder
from policies.video.generator import BASE  # the pre-trained model with every adapter disabled
from policies.video.rewards import RewardSet

TRAINED = "default"
REF = "ref"
FAKE = "fake"
CHECKPOINT_FORMAT = 1



# ----------------------------------------------------------------------------------------------------------------
# The generator, seen through the few calls the methods need
# ----------------------------------------------------------------------------------------------------------------


class Model:
    """The few generator calls the methods make, with the adapter named at every call (a LoRA name or BASE).

    `guidance` > 1 is CFG against the generator's negative prompt. Sampling uses the generator's own schedule
    (the pipeline's sigmas), so rollouts, evaluation samples and `generate()` integrate the same ODE.
    """

    def __init__(self, generator: Any) -> None:
        self.gen = generator

    @property
    def device(self) -> torch.device:
        return self.gen.device

    def latent_shape(self) -> tuple[int, ...]:
        return tuple(self.gen.latent_shape(1))[1:]

    def video_shape(self) -> tuple[int, int, int]:
        c = self.gen.config
        return c.num_frames, c.height, c.width

    def embed(self, prompts: Sequence[str]) -> Tensor:
        return self.gen.encode_prompts(list(prompts))

    def velocity(self, x: Tensor, t: Tensor, emb: Tensor, adapter: str | None, *, guidance: float = 1.0) -> Tensor:
        return self.gen.velocity(x, t, emb, adapter=adapter, guidance_scale=guidance)

    def velocities(self, x: Tensor, t: Tensor, emb: Tensor, adapters: Sequence[str]) -> list[Tensor]:
        """Unguided velocities of several adapters at the same inputs, in one batched pass (no grad)."""
        return self.gen.velocities(x, t, emb, adapters)

    def velocity_fn(self, emb: Tensor, adapter: str | None, *, guidance: float = 1.0) -> Callable[[Tensor, Tensor], Tensor]:
        return lambda x, t: self.velocity(x, t, emb, adapter, guidance=guidance)

    def schedule(self, num_steps: int) -> Tensor:
        return self.gen.sigmas(num_steps)

    def noise(self, batch: int, generator: torch.Generator) -> Tensor:
        return self.gen.initial_noise(batch, generator=generator)

    def decode(self, latents: Tensor) -> Tensor:
        return self.gen.decode_latents(latents)

    def lora_parameters(self, adapter: str) -> dict[str, nn.Parameter]:
        return self.gen.lora_parameters(adapter)

    def all_adapter_state(self) -> dict[str, Tensor]:
        return {f"{name}/{k}": v for name in self.gen.adapters for k, v in self.gen.adapter_state_dict(name).items()}

    def load_all_adapter_state(self, state: dict[str, Tensor]) -> None:
        names = sorted({k.split("/", 1)[0] for k in state})
        if names != sorted(self.gen.adapters):
            raise ValueError(f"the checkpoint holds adapters {names}; this trainer has {sorted(self.gen.adapters)}")
        for name in names:
            prefix = f"{name}/"
            self.gen.load_adapter_state_dict(name, {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})


# ----------------------------------------------------------------------------------------------------------------
# Rollouts
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One round's samples. B = prompts × group_size."""

    prompts: list[str]
    group_ids: Tensor  # (B,)
    embeds: Tensor  # (B, L, D)
    latents: Tensor  # (B, C, F, H, W) the clean samples x_0
    videos: Tensor  # (B, F, C, H, W) in [0, 1]
    scores: dict[str, Tensor] = field(default_factory=dict)  # per reward, (B,)
    advantages: Tensor | None = None  # (B,) the balanced advantage
    weights: Tensor | None = None  # (B,) 0 for samples of degenerate groups
    extra: dict[str, Any] = field(default_factory=dict)  # what one method needs (SDE records, trajectories, ...)


def diversity(videos: Tensor, group_ids: Tensor) -> float:
    """Mean pairwise RMS distance between the videos of one prompt, averaged over prompts. (B, F, C, H, W)."""
    values = []
    for g in torch.unique(group_ids):
        x = videos[group_ids == g].flatten(1).float()
        if len(x) < 2:
            continue
        d = torch.cdist(x, x) / math.sqrt(x.shape[1])
        n = len(x)
        values.append(float(d.sum() / (n * (n - 1))))
    return float(np.mean(values)) if values else 0.0


# ----------------------------------------------------------------------------------------------------------------
# Methods: each says how it rolls out and what loss it takes on a minibatch of the round's samples
# ----------------------------------------------------------------------------------------------------------------


class Method:
    """A post-training method. Subclasses set the adapters they need and implement `rollout` and `loss`."""

    name = ""
    adapters: tuple[str, ...] = ()  # besides `default`
    # Whether samples of reward-degenerate groups (every sample scored the same) are dropped. True where the
    # reward *is* the learning signal; the distillation methods learn from a teacher/discriminator, which a
    # constant reward does not make uninformative.
    reward_gated = True
    anchor_space = "x0"  # see `anchor`

    def __init__(self, trainer: VideoTrainer) -> None:
        self.tr = trainer
        self.cfg = trainer.cfg
        self.opt = trainer.cfg.train.options

    # Hooks ----------------------------------------------------------------------------------------------------------
    def rollout(self, prompts: list[str], embeds: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """Clean latents (B, C, F, H, W) and any extras. Default: the trained adapter, ODE, CFG-free."""
        return self.tr.ode(embeds, TRAINED), {}

    def prepare(self, ro: Rollout) -> dict[str, float]:
        """After scoring, before the updates (per-sample targets, discriminator steps, ...)."""
        return {}

    def loss(self, ro: Rollout, idx: Tensor, update: int) -> tuple[Tensor, dict[str, float]]:
        raise NotImplementedError

    def eval_ema_decay(self) -> float:
        """Decay of a separate EMA of the trained adapter that evaluation samples from; 0 = the raw adapter."""
        return 0.0

    def ref_decay(self) -> float:
        """The EMA reference's decay at the current update (`anchor.ref_schedule`)."""
        a, step = self.cfg.anchor, self.tr.updates
        if a.ref_schedule == "flowawr":
            return flowawr_ref_decay(step)
        return 0.0 if step < a.ref_warmup_updates else a.ref_decay

    def after_update(self) -> None:
        if REF in self.adapters:
            self.tr.model.gen.lerp_adapter(REF, TRAINED, decay=self.ref_decay())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    # Shared pieces --------------------------------------------------------------------------------------------------
    def noised(self, x0: Tensor, *, low: float = 0.0, high: float = 1.0, schedule: Tensor | None = None,
               groups: Tensor | None = None):
        """x_t, t, noise for clean latents x0. With `groups` (B,), the samples of one group share their t and noise
        (common random numbers: a group's samples then differ only in x0, so the noise cancels between them)."""
        # Drawn by the trainer's CPU generator, then moved to the latents' device: the draws (and so a resumed
        # run) are the same on every device, and the generator's state is what the checkpoint stores.
        sched = None if schedule is None else schedule.cpu()
        if groups is None:
            rows, n = torch.arange(x0.shape[0]), x0.shape[0]
        else:
            _, rows = torch.unique(groups.cpu(), return_inverse=True)
            n = int(rows.max()) + 1
        t = sample_time(n, low=low, high=high, schedule=sched, generator=self.tr.rng)[rows].to(x0.device)
        noise = torch.randn((n, *x0.shape[1:]), generator=self.tr.rng)[rows].to(x0.device, x0.dtype)
        return interpolate(x0, noise, t), t, noise

    def student_trajectory(self, embeds: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """The student's CFG-free ODE rollout with the states it visited: "states" (S, B, ...), "times" (S,)."""
        x0, traj = self.tr.ode(embeds, TRAINED, trajectory=True)
        return x0, {"states": torch.stack([s for s, _ in traj]), "times": torch.stack([t[0] for _, t in traj])}

    def anchor(self, v_theta: Tensor, v_base: Tensor, t: Tensor) -> Tensor:
        """λ·‖v_θ − v_base‖² per sample (`diffusion_rl.flow.reference_anchor`), λ = anchor.ref_weight.

        Our variant for NFT, distill, AFD and OPSD: x̂_0 space (= t²·‖v_θ − v_base‖²), because the tiny default
        predicts x̂_0 and derives v = (x_t − x̂_0)/t, so near t = 0 a velocity-space penalty grows as 1/t² and
        swamps every other term. VideoAWR keeps FlowAWR's velocity form (`anchor_space`)."""
        return reference_anchor(v_theta, v_base, weight=self.cfg.anchor.ref_weight, t=t, space=self.anchor_space)


class VideoAWR(Method):
    """VideoAWR (FlowAWR): the EMA reference rolls out with CFG; the student regresses x̂_0 toward
    x̂_0,old + E·(x_0 − x̂_0,old) against the reference's *unguided* prediction, at decoupled per-sample
    high-noise timesteps; plus λ·‖v_θ − v_base‖². Inference stays CFG-free."""

    name = "awr"
    adapters = (REF,)
    anchor_space = "velocity"  # FlowAWR's form

    def rollout(self, prompts, embeds):
        return self.tr.ode(embeds, REF, guidance=self.opt.awr_rollout_guidance), {}

    def eval_ema_decay(self):
        return self.opt.awr_eval_ema

    def prepare(self, ro):
        base = ro.advantages  # the balanced advantage; the energies re-normalise it per group
        energies = awr_energies(base, ro.group_ids, temperature=self.opt.awr_temperature)
        ro.extra["energies"] = energies.advantages
        ro.weights = ro.weights * energies.weights
        return {"awr/energy_abs_mean": float(energies.advantages.abs().mean()), "awr/energy_clip_rate": energies.stats["energy_clip_rate"]}

    def loss(self, ro, idx, update):
        x0, emb = ro.latents[idx], ro.embeds[idx]
        # The model's own (shifted) 20-step schedule: Wan's shift 3-5 puts these steps at other noise levels.
        groups = ro.group_ids[idx] if self.opt.awr_shared_noise else None
        x_t, t, _ = self.noised(x0, low=self.opt.awr_t_low, schedule=self.tr.model.schedule(20), groups=groups)
        m = self.tr.model
        v_old, v_base = m.velocities(x_t, t, emb, (REF, BASE))  # unguided: the anchor may not use CFG
        v_theta = m.velocity(x_t, t, emb, TRAINED)
        x0_star = awr_target(x_t=x_t, t=t, v_old=v_old, x0=x0, energies=ro.extra["energies"][idx])
        per = awr_loss(v_theta, x_t=x_t, t=t, x0=x0, x0_star=x0_star)
        return (per * ro.weights[idx]).mean() + self.anchor(v_theta, v_base, t).mean(), {}


class DiffusionNFT(Method):
    """DiffusionNFT: the old (EMA) policy samples CFG-free; on the samples' own noised states, the positive
    velocity β·v_θ + (1 − β)·v_old and the negative (1 + β)·v_old − β·v_θ are mixed by r(A); plus the anchor."""

    name = "nft"
    adapters = (REF,)

    def rollout(self, prompts, embeds):
        return self.tr.ode(embeds, REF), {}

    def nft(self, ro: Rollout, idx: Tensor, *, advantages: Tensor | None = None, r: Tensor | None = None) -> Tensor:
        """NFT's loss on the minibatch `idx`, weighted by `ro.weights` (all 1 for AFD: see `reward_gated`)."""
        x0, emb = ro.latents[idx], ro.embeds[idx]
        x_t, t, _ = self.noised(x0, low=0.02)
        m = self.tr.model
        v_old, v_base = m.velocities(x_t, t, emb, (REF, BASE))
        v_theta = m.velocity(x_t, t, emb, TRAINED)
        per = nft_loss(
            v_theta, v_old, x_t=x_t, x0=x0, t=t, advantages=advantages, r=r, beta=self.opt.nft_beta,
            adv_clip_max=self.opt.adv_clip_max,
        )  # fmt: skip
        return (per * ro.weights[idx]).mean() + self.anchor(v_theta, v_base, t).mean()

    def loss(self, ro, idx, update):
        return self.nft(ro, idx, advantages=ro.advantages[idx]), {}


class RewardDistill(Method):
    """Reward-weighted on-policy distillation in the manner of Stream-R1: the student's own rollouts, a DMD
    target (real score = the reference with CFG, fake score = adapter `fake` fitted to the student's samples),
    per-rollout exp(β·r) weights and reward-gradient saliency weights over frames and pixels."""

    name = "distill"
    adapters = (FAKE,)
    reward_gated = False  # the DMD signal needs no reward spread; the tilt is where the reward enters

    def __init__(self, trainer):
        super().__init__(trainer)
        fake = list(trainer.model.lora_parameters(FAKE).values())
        for p in fake:  # the generator leaves only the active adapter trainable; the fake score trains too
            p.requires_grad_(True)
        self.fake_opt = torch.optim.AdamW(fake, lr=trainer.cfg.train.lr)

    def rollout(self, prompts, embeds):
        return self.student_trajectory(embeds)

    def prepare(self, ro):
        ro.extra["tilt"] = reward_tilt_weights(self.tr.tilt_reward(ro), beta=self.opt.tilt_beta)
        stats = {"distill/tilt_max": float(ro.extra["tilt"].max())}
        sal = self.tr.reward_saliency(ro) if self.opt.saliency else None
        if sal is not None:
            w = saliency_weights(*sal)  # (B, F, H, W) in pixels
            lat = ro.latents.shape  # (B, C, F', H', W'): pool the pixel weights onto the latent grid
            w = F.adaptive_avg_pool3d(w[:, None], lat[2:])
            ro.extra["saliency"] = w / w.mean(dim=(1, 2, 3, 4), keepdim=True)
            stats["distill/saliency_max"] = float(ro.extra["saliency"].max())
        stats["distill/saliency"] = float(sal is not None)
        return stats

    def loss(self, ro, idx, update):
        m = self.tr.model
        emb = ro.embeds[idx]
        # 1. A one-step student output with grad, from a state the student's own rollout visited.
        j = int(torch.randint(0, ro.extra["states"].shape[0], (1,), generator=self.tr.rng))
        x_t = ro.extra["states"][j][idx]
        t = ro.extra["times"][j].expand(len(idx))
        # 2. DMD: the real and the fake score at the student output, noised afresh.
        with torch.no_grad():
            v_base, v_det = m.velocities(x_t, t, emb, (BASE, TRAINED))
            x_det = x0_from_velocity(x_t, v_det, t)
            xn, tn, _ = self.noised(x_det, low=0.02, high=0.98)
            f_real = x0_from_velocity(xn, m.velocity(xn, tn, emb, BASE, guidance=self.opt.teacher_guidance), tn)
            f_fake = x0_from_velocity(xn, m.velocity(xn, tn, emb, FAKE), tn)
            g = dmd_gradient(x_det, f_fake, f_real)
        # 3. The fake score follows the student's current outputs (`dmd_fake_updates` steps); fitted before the
        #    student's graph is built, so that switching adapters cannot touch the flags of a graph in flight.
        fake_loss = float(np.mean([self.fit_fake(x_det, emb) for _ in range(self.opt.dmd_fake_updates)]))
        # 4. The student's one-step output, pushed along −g with the reward tilt and the saliency weights.
        v_theta = m.velocity(x_t, t, emb, TRAINED)
        x = x0_from_velocity(x_t, v_theta, t)
        sal = ro.extra.get("saliency")
        per = dmd_loss(x, g, weights=ro.extra["tilt"][idx] * ro.weights[idx], element_weights=None if sal is None else sal[idx])
        loss = per.mean() + self.anchor(v_theta, v_base, t).mean()
        return loss, {"distill/fake_loss": fake_loss}

    def fit_fake(self, x0: Tensor, emb: Tensor) -> float:
        """One flow-matching step of the fake-score adapter on the student's outputs (detached)."""
        x_t, t, noise = self.noised(x0)
        gen = self.tr.model.gen
        with gen.use_adapter(FAKE):  # the generator's own loss, in its prediction space
            loss = gen.flow_loss({"x0": x0, "prompt_embeds": emb, "t": t, "noise": noise}).mean()
        self.fake_opt.zero_grad(set_to_none=True)
        loss.backward()
        self.fake_opt.step()
        self.fake_opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def state_dict(self):
        return {"fake_opt": self.fake_opt.state_dict()}

    def load_state_dict(self, state):
        self.fake_opt.load_state_dict(state["fake_opt"])


class Discriminator(nn.Module):
    """AFD's judge D(video, prompt) -> scalar: a small 3-D conv net on pixels, conditioned on the pooled prompt."""

    def __init__(self, text_dim: int, width: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv3d(3, width, (3, 4, 4), stride=(1, 2, 2), padding=(1, 1, 1)),
            nn.SiLU(),
            nn.Conv3d(width, 2 * width, (3, 4, 4), stride=(2, 2, 2), padding=(1, 1, 1)),
            nn.SiLU(),
            nn.AdaptiveAvgPool3d(1),
            nn.Flatten(),
        )
        self.text = nn.Linear(text_dim, 2 * width)
        self.head = nn.Linear(2 * width, 1)

    def forward(self, videos: Tensor, emb: Tensor) -> Tensor:
        h = self.net(videos.transpose(1, 2) * 2.0 - 1.0)  # (B, F, C, H, W) -> (B, C, F, H, W) in [-1, 1]
        return self.head(F.silu(h + self.text(emb.mean(1)))).squeeze(-1)


class AFD(Method):
    """AFD: a black-box teacher (a generator, the guided reference, or a folder of videos) against the student
    on the same prompts; a Bradley–Terry discriminator's centred score on the student's samples is the advantage,
    which drives NFT's forward-process update on the student's own noised samples. The rewards are only logged."""

    name = "afd"
    adapters = (REF,)
    reward_gated = False  # the discriminator gives the weight; the rewards are only logged

    def __init__(self, trainer):
        super().__init__(trainer)
        emb = trainer.model.embed(["a"])
        self.disc = Discriminator(emb.shape[-1]).to(trainer.model.device)
        self.disc_opt = torch.optim.AdamW(self.disc.parameters(), lr=self.opt.disc_lr)
        self.nft = DiffusionNFT(trainer)

    def rollout(self, prompts, embeds):
        return self.nft.rollout(prompts, embeds)

    def prepare(self, ro):
        teacher = self.tr.teacher_videos(ro)  # (B, F, C, H, W), prompt-paired with the student's samples
        stats = {}
        losses = []
        for _ in range(max(1, self.cfg.train.updates_per_round // 2)):
            d_t, d_s = self.disc(teacher, ro.embeds), self.disc(ro.videos, ro.embeds)
            loss = bt_discriminator_loss(d_t, d_s).mean()
            self.disc_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.disc_opt.step()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            d_s = self.disc(ro.videos, ro.embeds)
            d_t = self.disc(teacher, ro.embeds)
        adv = afd_advantages(d_s, ro.group_ids, whiten=True)
        ro.extra["afd_r"] = afd_weights(adv)
        stats.update({
            "afd/disc_loss": float(np.mean(losses)),
            "afd/teacher_minus_student": float((d_t - d_s).mean()),
            # P(D ranks the teacher's video above the student's): falls toward 0.5 as the student catches up.
            "afd/disc_accuracy": float((d_t > d_s).float().mean()),
        })
        return stats

    def loss(self, ro, idx, update):
        return self.nft.nft(ro, idx, r=ro.extra["afd_r"][idx]), {}

    def state_dict(self):
        return {"disc": self.disc.state_dict(), "disc_opt": self.disc_opt.state_dict()}

    def load_state_dict(self, state):
        self.disc.load_state_dict(state["disc"])
        self.disc_opt.load_state_dict(state["disc_opt"])


class OPSD(Method):
    """On-policy self-distillation: the student rolls out CFG-free; at the states it visited, a teacher — the
    reference with CFG, the reference with a privileged prompt, or another model — gives the velocity target.
    Rollouts are weighted by exp(β·A) (mean 1), so the reward chooses which of its own paths the student keeps."""

    name = "opsd"
    reward_gated = False  # the teacher's target needs no reward spread; the tilt is where the reward enters

    def __init__(self, trainer):
        super().__init__(trainer)
        if self.opt.opsd_teacher == "model":
            teacher, student = trainer.teacher_model(), trainer.model
            if teacher.latent_shape() != student.latent_shape():
                raise ValueError(
                    f"OPSD with opsd_teacher=model queries the teacher at the student's states, so their latents must "
                    f"match: teacher latents {teacher.latent_shape()} (C, F', h, w) for {teacher.video_shape()} "
                    f"(frames, height, width), student {student.latent_shape()} for {student.video_shape()}. Use a "
                    "teacher with the student's latent space and video size, or AFD (which only needs its videos)"
                )

    def rollout(self, prompts, embeds):
        return self.student_trajectory(embeds)

    def prepare(self, ro):
        tilt = reward_tilt_weights(self.tr.tilt_reward(ro), beta=self.opt.tilt_beta)
        ro.extra["w"] = tilt / tilt.mean()
        if self.opt.opsd_teacher == "privileged_prompt":
            ro.extra["teacher_emb"] = self.tr.model.embed([f"{p}, {self.opt.privileged_context}" for p in ro.prompts])
        elif self.opt.opsd_teacher == "model":  # the teacher reads the prompts with its own text encoder
            ro.extra["teacher_emb"] = self.tr.teacher_model().embed(ro.prompts)
        return {}

    def teacher_velocity(self, ro: Rollout, x_t: Tensor, t: Tensor, idx: Tensor) -> Tensor:
        kind, g = self.opt.opsd_teacher, self.opt.teacher_guidance
        if kind == "cfg":
            return self.tr.model.velocity(x_t, t, ro.embeds[idx], BASE, guidance=g)
        if kind == "privileged_prompt":
            return self.tr.model.velocity(x_t, t, ro.extra["teacher_emb"][idx], BASE)
        # adapter None: the teacher as saved, its own LoRA adapters included.
        return self.tr.teacher_model().velocity(x_t, t, ro.extra["teacher_emb"][idx], None, guidance=g)

    def loss(self, ro, idx, update):
        j = int(torch.randint(0, ro.extra["states"].shape[0], (1,), generator=self.tr.rng))
        x_t = ro.extra["states"][j][idx]
        t = ro.extra["times"][j].expand(len(idx))
        with torch.no_grad():
            v_teacher = self.teacher_velocity(ro, x_t, t, idx)
            v_base = self.tr.model.velocity(x_t, t, ro.embeds[idx], BASE)
        v_s = self.tr.model.velocity(x_t, t, ro.embeds[idx], TRAINED)
        # Our variant: compared as x̂_0 = x_t − t·v (the same minimiser, bounded near t = 0; see `anchor`).
        per = opsd_loss(v_s, v_teacher, weights=ro.extra["w"][idx] * ro.weights[idx], t=t, space="x0")
        return per.mean() + self.anchor(v_s, v_base, t).mean(), {}


class FlowGRPO(Method):
    """Flow-GRPO baseline: SDE rollouts of the trained adapter with per-step log-probs, GRPO advantages, the
    clipped ratio on re-evaluated steps, plus the per-step KL to the reference's SDE step. The ratio must be 1
    before a round's first update (the sampler and the learner are the same weights): checked, and logged."""

    name = "flow_grpo"
    RATIO_TOLERANCE = 1e-4  # the clip range itself: a larger mismatch would make clipping meaningless

    def rollout(self, prompts, embeds):
        sched = self.tr.model.schedule(self.cfg.model.num_inference_steps)
        fn = self.tr.model.velocity_fn(embeds, TRAINED)
        with torch.no_grad():
            x0, states, nexts, log_probs = sde_sample(
                fn, self.tr.noise(len(prompts)), schedule=sched, noise_level=self.opt.grpo_noise_level,
                generator=self.tr.rng,
            )  # fmt: skip
        return x0, {"states": states, "nexts": nexts, "log_probs": log_probs, "sched": sched}

    def loss(self, ro, idx, update):
        ex, m = ro.extra, self.tr.model
        # The last step (σ from ~1e-3 to 0) is left out: its σ_t is so small that the log-prob and the KL there
        # measure the x̂_0 → v conversion's 1/t, not the policy.
        n_steps = max(1, ex["states"].shape[0] - 1)
        k = min(self.opt.grpo_steps_per_update, n_steps)
        steps = torch.randperm(n_steps, generator=self.tr.rng)[:k]
        emb = ro.embeds[idx]
        total, stats = 0.0, {}
        for j in steps.tolist():
            x_t, x_next = ex["states"][j][idx], ex["nexts"][j][idx]
            t = ex["sched"][j].expand(len(idx))
            t_next = ex["sched"][j + 1].expand(len(idx))
            with torch.no_grad():
                ref = sde_step_with_logprob(m.velocity(x_t, t, emb, BASE), x_t, t, t_next, noise_level=self.opt.grpo_noise_level, prev_sample=x_next)
            step = sde_step_with_logprob(m.velocity(x_t, t, emb, TRAINED), x_t, t, t_next, noise_level=self.opt.grpo_noise_level, prev_sample=x_next)
            pg, ppo = ppo_clip_loss(step.log_prob, ex["log_probs"][j][idx], ro.advantages[idx], clip_range=self.opt.grpo_clip, adv_clip_max=self.opt.adv_clip_max)
            if update == 0:
                dev = float((step.log_prob.detach() - ex["log_probs"][j][idx]).exp().sub(1.0).abs().max())
                stats["grpo/first_ratio_max_dev"] = max(dev, stats.get("grpo/first_ratio_max_dev", 0.0))
                if dev > self.RATIO_TOLERANCE:
                    raise RuntimeError(
                        f"Flow-GRPO: the importance ratio before the first update is 1 ± {dev:.2e}, not 1: the "
                        "re-evaluated log-prob differs from the sampled one (dropout on? adapter not the sampler's?)"
                    )
            kl = sde_kl_loss(step.mean, ref.mean, step.std_dev_t)
            total = total + ((pg + self.cfg.anchor.kl_weight * kl) * ro.weights[idx]).mean() / k
            stats["grpo/approx_kl"] = stats.get("grpo/approx_kl", 0.0) + float(ppo.approx_kl) / k
            stats["grpo/clipfrac"] = stats.get("grpo/clipfrac", 0.0) + float(ppo.clipfrac) / k
            stats["grpo/kl_ref"] = stats.get("grpo/kl_ref", 0.0) + float(kl.detach().mean()) / k
        return total, stats


METHOD_CLASSES: dict[str, type[Method]] = {
    cls.name: cls for cls in (VideoAWR, DiffusionNFT, RewardDistill, AFD, OPSD, FlowGRPO)
}


# ----------------------------------------------------------------------------------------------------------------
# The trainer
# ----------------------------------------------------------------------------------------------------------------


class VideoTrainer:
    """Rollout -> reward -> advantage -> updates, in rounds, for any method; evaluation; checkpoints.

    Args:
        cfg: the run's config (model sampling steps, method and its options, anchors, rewards).
        generator: a `policies.video.VideoGenerator` (pre-trained); LoRA adapters are added here.
        rewards: videos + prompts -> named (B,) scores.
        prompts: the prompt pool rounds draw from.
        teacher: optional black-box teacher for AFD/OPSD (a generator) ...
        teacher_clips: ... or AFD teacher videos: {prompt: (N, F, C, H, W)}.
    """

    def __init__(
        self,
        cfg: VideoTrainConfig,
        generator: Any,
        rewards: RewardSet,
        prompts: Sequence[str],
        *,
        teacher: Any | None = None,
        teacher_clips: dict[str, Tensor] | None = None,
    ) -> None:
        if cfg.train.method not in METHOD_CLASSES:
            raise ValueError(f"train.method {cfg.train.method!r} is not known; valid: {', '.join(METHOD_CLASSES)}")
        if not prompts:
            raise ValueError("the prompt pool is empty")
        self.cfg = cfg
        self.model = Model(generator)
        self.rewards = rewards
        self.prompts = list(prompts)
        self.teacher = Model(teacher) if teacher is not None else None
        self.teacher_clips = teacher_clips
        self.rng = torch.Generator().manual_seed(cfg.seed)
        self.np_rng = np.random.default_rng(cfg.seed)
        self.updates = 0
        self.round = 0
        method_cls = METHOD_CLASSES[cfg.train.method]
        if generator.adapters:
            raise ValueError(f"the generator already has LoRA adapters {generator.adapters}; pass the pre-trained base")
        generator.add_adapter(TRAINED, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha)  # active, trains
        for name in method_cls.adapters:
            generator.copy_adapter(TRAINED, name)  # the reference and the fake score start as the student
        self.params = list(self.model.lora_parameters(TRAINED).values())
        if not self.params:
            raise RuntimeError("the generator exposes no LoRA weights for adapter 'default'")
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=0.0)
        self.method = method_cls(self)
        decay = self.method.eval_ema_decay()
        self.eval_ema = generator.ema(TRAINED, decay=decay) if decay > 0 else None

    # Sampling ------------------------------------------------------------------------------------------------------
    def noise(self, batch: int, generator: torch.Generator | None = None, *, model: Model | None = None) -> Tensor:
        """Starting latents of `model` (default: the student), in that model's latent shape, on its device."""
        return (model or self.model).noise(batch, generator or self.rng)

    @torch.no_grad()
    def ode(self, emb: Tensor, adapter: str, *, guidance: float = 1.0, noise: Tensor | None = None,
            trajectory: bool = False, model: Model | None = None):
        """The pipeline's ODE (Euler on its sigmas) from fresh noise: latents (B, C, F', h, w) [, visited states]."""
        model = model or self.model
        return euler_sample(
            model.velocity_fn(emb, adapter, guidance=guidance), self.noise(emb.shape[0], model=model) if noise is None else noise,
            schedule=model.schedule(self.cfg.model.num_inference_steps), return_trajectory=trajectory,
        )  # fmt: skip

    def teacher_model(self) -> Model:
        if self.teacher is None:
            raise ValueError("this method needs a teacher model: set train.options.teacher_path")
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
        g = self.cfg.train.options.teacher_guidance
        if self.teacher is not None:
            # Another model: its own text encoder, its own latent shape, its own adapters (as saved: adapter None).
            t = self.teacher
            vids = t.decode(self.ode(t.embed([ro.prompts[u] for u in uniq]), None, guidance=g, model=t))
        else:
            vids = self.model.decode(self.ode(ro.embeds[uniq], BASE, guidance=g))
        pos = {u: k for k, u in enumerate(uniq)}
        vids = vids[torch.tensor([pos[r] for r in rows], device=vids.device)]
        return resize_videos(vids, frames, size).to(ro.videos.device)

    def tilt_reward(self, ro: Rollout) -> Tensor:
        """The r of the exp(β·r) rollout tilt (distill, OPSD): `train.options.tilt_reward`.

        balanced: Stream-R1's r = mean_k z_k − ½·std_k z_k over the rewards z-scored across the round
        (`diffusion_rl.distill.stream_r1_reward`); advantage (our variant): the balanced GDPO advantage."""
        if self.cfg.train.options.tilt_reward == "advantage":
            return ro.advantages
        z = torch.stack([s.float() for s in ro.scores.values()], dim=1)  # (B, K)
        z = (z - z.mean(0)) / (z.std(0, correction=0) + 1e-6)
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
                axis.append((z - z.mean()) / (z.std(correction=0) + 1e-6))
        if not maps:
            return None
        return torch.stack(maps, 1), torch.stack(axis, 1)

    # One round -----------------------------------------------------------------------------------------------------
    def sample_prompts(self) -> tuple[list[str], Tensor]:
        k, g = self.cfg.train.prompts_per_round, self.cfg.train.group_size
        pick = self.np_rng.choice(len(self.prompts), size=k, replace=k > len(self.prompts))
        prompts = [self.prompts[i] for i in pick for _ in range(g)]
        return prompts, torch.arange(k, device=self.model.device).repeat_interleave(g)

    def collect(self) -> Rollout:
        prompts, groups = self.sample_prompts()
        embeds = self.model.embed(prompts)
        with torch.no_grad():
            latents, extra = self.method.rollout(prompts, embeds)
            videos = self.model.decode(latents)
        ro = Rollout(prompts, groups, embeds, latents.detach(), videos, extra=extra)
        scored = self.rewards(videos, prompts, groups)
        dev = self.model.device  # rewards may score elsewhere (a CPU success model): the losses live here
        ro.scores = {k: v.to(dev) for k, v in scored.scores.items()}
        ro.advantages, ro.weights = scored.advantages.to(dev), scored.weights.to(dev)
        if not self.method.reward_gated:
            ro.weights = torch.ones_like(ro.weights)
        ro.extra["reward_stats"] = scored.stats
        return ro

    def train_round(self, on_update: Callable[[], None] | None = None) -> dict[str, Any]:
        """One round: rollouts, rewards, advantages, the method's updates. Returns the round's metrics.

        `round` counts finished rounds: it moves only at the end, so a checkpoint never claims a half-done round."""
        this_round = self.round + 1
        ro = self.collect()
        record: dict[str, Any] = {"kind": "round", "round": this_round, "method": self.method.name}
        for name, s in ro.scores.items():
            record[f"rollout/{name}"] = float(s.mean())
        record["rollout/diversity"] = diversity(ro.videos, ro.group_ids)
        for key, value in ro.extra["reward_stats"].items():  # reward/<name>/{mean,std,min,max,group_std}, adv/...
            if isinstance(value, (int, float)):
                record[key if key.startswith("reward/") else f"adv/{key}"] = float(value)
        adv = ro.advantages.float()
        record.update({"adv/mean": float(adv.mean()), "adv/std": float(adv.std(correction=0)), "adv/abs_max": float(adv.abs().max()),
                       "adv/weight_mean": float(ro.weights.float().mean())})  # fmt: skip
        record.update(self.method.prepare(ro))
        n = len(ro.prompts)
        losses = []
        # A reward-gated method with every group degenerate has nothing to learn: no step, not even the anchor's
        # (at a zero-initialised adapter its gradient would be the rounding between two passes, scaled by Adam).
        idle = self.method.reward_gated and not bool((ro.weights > 0).any())
        record["train/idle_round"] = float(idle)
        for u in range(0 if idle else self.cfg.train.updates_per_round):
            idx = torch.randperm(n, generator=self.rng)[: min(self.cfg.train.batch_size, n)]
            loss, stats = self.method.loss(ro, idx, u)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
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
        record["train/updates"] = self.updates
        self.round = this_round
        return record

    # Evaluation ----------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def sample(self, prompts: list[str], *, seed: int, adapter: str = TRAINED, guidance: float | None = None) -> Tensor:
        """CFG-free (by default) ODE samples of an adapter, with fixed noise: videos (B, F, C, H, W)."""
        g = torch.Generator().manual_seed(seed)
        emb = self.model.embed(prompts)
        scale = self.cfg.model.guidance_scale if guidance is None else guidance
        return self.model.decode(self.ode(emb, adapter, guidance=scale, noise=self.noise(len(prompts), g)))

    def eval_prompts(self) -> tuple[list[str], Tensor]:
        k, s = self.cfg.eval.prompts, self.cfg.eval.samples_per_prompt
        base = [self.prompts[i % len(self.prompts)] for i in range(k)]
        return [p for p in base for _ in range(s)], torch.arange(k, device=self.model.device).repeat_interleave(s)

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
            save_file({k: v.contiguous().cpu() for k, v in self.model.all_adapter_state().items()}, str(tmp / "adapters.safetensors"))
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
        self.model.load_all_adapter_state(load_file(str(path / "adapters.safetensors")))
        self.optimizer.load_state_dict(state["optimizer"])
        self.method.load_state_dict(state["method_state"])
        if (state.get("eval_ema") is None) != (self.eval_ema is None):
            raise ValueError(f"{path}: the checkpoint's evaluation EMA does not match this config (train.options.awr_eval_ema)")
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
