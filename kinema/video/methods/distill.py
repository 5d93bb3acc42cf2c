"""`train.method distill`: reward-weighted on-policy distillation in the manner of Stream-R1."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from diffusion_rl.distill import dmd_gradient, dmd_loss, reward_tilt_weights, saliency_weights
from diffusion_rl.flow import x0_from_velocity
from kinema.video.methods.base import FAKE, TRAINED, Method, TeacherOptions, TiltOptions, check_tilt
from policies.video.modeling_lora import BASE  # the pre-trained model with every adapter disabled


@dataclass
class DistillOptions(TeacherOptions, TiltOptions):
    saliency: bool = True  # Stream-R1's reward-gradient saliency weights (needs differentiable rewards)
    dmd_fake_updates: int = 1  # fake-score updates per student update (DMD2's two time-scale rule uses 5)


class RewardDistill(Method):
    """Reward-weighted on-policy distillation in the manner of Stream-R1: the student's own rollouts, a DMD
    target (real score = the reference with CFG, fake score = adapter `fake` fitted to the student's samples),
    per-rollout exp(β·r) weights and reward-gradient saliency weights over frames and pixels."""

    name = "distill"
    summary = "reward-weighted on-policy distillation (Stream-R1's DMD with reward tilt and saliency)"
    options_class = DistillOptions
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

    @classmethod
    def check_config(cls, cfg):
        check_tilt(cls.name, cfg.train.distill)
        if cfg.train.distill.dmd_fake_updates < 1:
            raise ValueError(f"train.distill.dmd_fake_updates must be >= 1; got {cfg.train.distill.dmd_fake_updates}")
