"""The post-training methods of `kinema video train` as strategy objects: each says how it rolls out and what loss it
takes on a minibatch of the round's samples. `VideoTrainer` (kinema.video.trainer, whose docstring has the round,
the adapters and the time convention) drives them; `METHOD_CLASSES` registers them by name (`train.method`).

The math lives in the RL core (diffusion_rl.flow, .distill, .advantages); this module only wires it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
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
)
from diffusion_rl.flow import (
    awr_loss,
    awr_target,
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
from kinema.train.distributed import gather_rows, own_rows
from kinema.video.rollout import Rollout, velocity_fn
from policies.video.generator import BASE  # the pre-trained model with every adapter disabled

if TYPE_CHECKING:
    from kinema.video.trainer import VideoTrainer

# The adapters' names; `kinema.video.trainer` says what each holds.
TRAINED = "default"
REF = "ref"
FAKE = "fake"


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
            self.tr.generator.lerp_adapter(REF, TRAINED, decay=self.ref_decay())

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
        gen = self.tr.generator
        x_t, t, _ = self.noised(x0, low=self.opt.awr_t_low, schedule=gen.sigmas(20), groups=groups)
        v_old, v_base = gen.velocities(x_t, t, emb, (REF, BASE))  # unguided: the anchor may not use CFG
        v_theta = gen.velocity(x_t, t, emb, adapter=TRAINED)
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
        gen = self.tr.generator
        v_old, v_base = gen.velocities(x_t, t, emb, (REF, BASE))
        v_theta = gen.velocity(x_t, t, emb, adapter=TRAINED)
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
        fake = list(trainer.generator.lora_parameters(FAKE).values())
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
        gen = self.tr.generator
        emb = ro.embeds[idx]
        # 1. A one-step student output with grad, from a state the student's own rollout visited.
        j = int(torch.randint(0, ro.extra["states"].shape[0], (1,), generator=self.tr.rng))
        x_t = ro.extra["states"][j][idx]
        t = ro.extra["times"][j].expand(len(idx))
        # 2. DMD: the real and the fake score at the student output, noised afresh.
        with torch.no_grad():
            v_base, v_det = gen.velocities(x_t, t, emb, (BASE, TRAINED))
            x_det = x0_from_velocity(x_t, v_det, t)
            xn, tn, _ = self.noised(x_det, low=0.02, high=0.98)
            v_real = gen.velocity(xn, tn, emb, adapter=BASE, guidance_scale=self.opt.teacher_guidance)
            f_real = x0_from_velocity(xn, v_real, tn)
            f_fake = x0_from_velocity(xn, gen.velocity(xn, tn, emb, adapter=FAKE), tn)
            g = dmd_gradient(x_det, f_fake, f_real)
        # 3. The fake score follows the student's current outputs (`dmd_fake_updates` steps); fitted before the
        #    student's graph is built, so that switching adapters cannot touch the flags of a graph in flight.
        fake_loss = float(np.mean([self.fit_fake(x_det, emb) for _ in range(self.opt.dmd_fake_updates)]))
        # 4. The student's one-step output, pushed along −g with the reward tilt and the saliency weights.
        v_theta = gen.velocity(x_t, t, emb, adapter=TRAINED)
        x = x0_from_velocity(x_t, v_theta, t)
        sal = ro.extra.get("saliency")
        per = dmd_loss(x, g, weights=ro.extra["tilt"][idx] * ro.weights[idx], element_weights=None if sal is None else sal[idx])
        loss = per.mean() + self.anchor(v_theta, v_base, t).mean()
        return loss, {"distill/fake_loss": fake_loss}

    def fit_fake(self, x0: Tensor, emb: Tensor) -> float:
        """One flow-matching step of the fake-score adapter on the student's outputs (detached)."""
        x_t, t, noise = self.noised(x0)
        gen = self.tr.generator
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
        emb = trainer.generator.encode_prompts(["a"])
        self.disc = Discriminator(emb.shape[-1]).to(trainer.generator.device)
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
        # Whitened over the round (every rank's samples, under torchrun): this rank keeps its own rows.
        adv = afd_advantages(gather_rows(d_s), gather_rows(ro.group_ids), whiten=True)[own_rows(len(d_s))]
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
            teacher, student = trainer.teacher_model(), trainer.generator
            teacher_latents = teacher.latent_shape(1)[1:]  # (C, F', h, w): the batch dimension dropped
            student_latents = student.latent_shape(1)[1:]
            if teacher_latents != student_latents:
                tc, sc = teacher.config, student.config
                raise ValueError(
                    f"OPSD with opsd_teacher=model queries the teacher at the student's states, so their latents must "
                    f"match: teacher latents {teacher_latents} (C, F', h, w) for {(tc.num_frames, tc.height, tc.width)}"
                    f" (frames, height, width), student {student_latents} for {(sc.num_frames, sc.height, sc.width)}."
                    " Use a teacher with the student's latent space and video size, or AFD (which only needs its videos)"
                )

    def rollout(self, prompts, embeds):
        return self.student_trajectory(embeds)

    def prepare(self, ro):
        tilt = reward_tilt_weights(self.tr.tilt_reward(ro), beta=self.opt.tilt_beta)
        ro.extra["w"] = tilt / gather_rows(tilt).mean()  # mean 1 over the round, every rank's samples
        if self.opt.opsd_teacher == "privileged_prompt":
            privileged = [f"{p}, {self.opt.privileged_context}" for p in ro.prompts]
            ro.extra["teacher_emb"] = self.tr.generator.encode_prompts(privileged)
        elif self.opt.opsd_teacher == "model":  # the teacher reads the prompts with its own text encoder
            ro.extra["teacher_emb"] = self.tr.teacher_model().encode_prompts(ro.prompts)
        return {}

    def teacher_velocity(self, ro: Rollout, x_t: Tensor, t: Tensor, idx: Tensor) -> Tensor:
        kind, g = self.opt.opsd_teacher, self.opt.teacher_guidance
        if kind == "cfg":
            return self.tr.generator.velocity(x_t, t, ro.embeds[idx], adapter=BASE, guidance_scale=g)
        if kind == "privileged_prompt":
            return self.tr.generator.velocity(x_t, t, ro.extra["teacher_emb"][idx], adapter=BASE)
        # adapter None: the teacher as saved, its own LoRA adapters included.
        return self.tr.teacher_model().velocity(x_t, t, ro.extra["teacher_emb"][idx], adapter=None, guidance_scale=g)

    def loss(self, ro, idx, update):
        j = int(torch.randint(0, ro.extra["states"].shape[0], (1,), generator=self.tr.rng))
        x_t = ro.extra["states"][j][idx]
        t = ro.extra["times"][j].expand(len(idx))
        with torch.no_grad():
            v_teacher = self.teacher_velocity(ro, x_t, t, idx)
            v_base = self.tr.generator.velocity(x_t, t, ro.embeds[idx], adapter=BASE)
        v_s = self.tr.generator.velocity(x_t, t, ro.embeds[idx], adapter=TRAINED)
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
        sched = self.tr.generator.sigmas(self.cfg.model.num_inference_steps)
        fn = velocity_fn(self.tr.generator, embeds, TRAINED)
        with torch.no_grad():
            x0, states, nexts, log_probs = sde_sample(
                fn, self.tr.noise(len(prompts)), schedule=sched, noise_level=self.opt.grpo_noise_level,
                generator=self.tr.rng,
            )  # fmt: skip
        return x0, {"states": states, "nexts": nexts, "log_probs": log_probs, "sched": sched}

    def loss(self, ro, idx, update):
        ex, gen = ro.extra, self.tr.generator
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
                v_ref = gen.velocity(x_t, t, emb, adapter=BASE)
                ref = sde_step_with_logprob(v_ref, x_t, t, t_next, noise_level=self.opt.grpo_noise_level, prev_sample=x_next)
            v_theta = gen.velocity(x_t, t, emb, adapter=TRAINED)
            step = sde_step_with_logprob(v_theta, x_t, t, t_next, noise_level=self.opt.grpo_noise_level, prev_sample=x_next)
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
