"""`train.method awr`: VideoAWR, after FlowAWR."""

from __future__ import annotations

from dataclasses import dataclass

from diffusion_rl.advantages import awr_energies
from diffusion_rl.flow import awr_loss, awr_target
from kinema.video.methods.base import REF, TRAINED, Method
from policies.video.modeling_lora import BASE  # the pre-trained model with every adapter disabled


@dataclass
class AWROptions:
    temperature: float = 0.5  # τ of the VideoAWR energies softmax(A/τ) (FlowAWR's faithful τ is 1; 0.5 is ours)
    rollout_guidance: float = 1.5  # CFG scale of the reference's rollouts (the anchor stays unguided)
    t_low: float = 0.5  # decoupled per-sample timesteps from [t_low, 1] of the model's 20-step schedule (high noise)
    shared_noise: bool = True  # a prompt group's samples share their training t and noise (ours; FlowAWR: False)
    eval_ema: float = 0.9  # FlowAWR evaluates a separate EMA of the trained weights with this decay (0: the raw adapter)


class VideoAWR(Method):
    """VideoAWR (FlowAWR): the EMA reference rolls out with CFG; the student regresses x̂_0 toward
    x̂_0,old + E·(x_0 − x̂_0,old) against the reference's *unguided* prediction, at decoupled per-sample
    high-noise timesteps; plus λ·‖v_θ − v_base‖². Inference stays CFG-free."""

    name = "awr"
    summary = "VideoAWR (FlowAWR): advantage-weighted regression toward the EMA reference's x̂_0 (the default)"
    options_class = AWROptions
    adapters = (REF,)
    anchor_space = "velocity"  # FlowAWR's form

    def rollout(self, prompts, embeds):
        return self.tr.ode(embeds, REF, guidance=self.opt.rollout_guidance), {}

    def eval_ema_decay(self):
        return self.opt.eval_ema

    def prepare(self, ro):
        base = ro.advantages  # the balanced advantage; the energies re-normalise it per group
        energies = awr_energies(base, ro.group_ids, temperature=self.opt.temperature)
        ro.extra["energies"] = energies.advantages
        ro.weights = ro.weights * energies.weights
        return {"awr/energy_abs_mean": float(energies.advantages.abs().mean()), "awr/energy_clip_rate": energies.stats["energy_clip_rate"]}

    def loss(self, ro, idx, update):
        x0, emb = ro.latents[idx], ro.embeds[idx]
        # The model's own (shifted) 20-step schedule: Wan's shift 3-5 puts these steps at other noise levels.
        groups = ro.group_ids[idx] if self.opt.shared_noise else None
        gen = self.tr.generator
        x_t, t, _ = self.noised(x0, low=self.opt.t_low, schedule=gen.sigmas(20), groups=groups)
        v_old, v_base = gen.velocities(x_t, t, emb, (REF, BASE))  # unguided: the anchor may not use CFG
        v_theta = gen.velocity(x_t, t, emb, adapter=TRAINED)
        x0_star = awr_target(x_t=x_t, t=t, v_old=v_old, x0=x0, energies=ro.extra["energies"][idx])
        per = awr_loss(v_theta, x_t=x_t, t=t, x0=x0, x0_star=x0_star)
        return (per * ro.weights[idx]).mean() + self.anchor(v_theta, v_base, t).mean(), {}

    @classmethod
    def check_config(cls, cfg):
        if not 0.0 <= cfg.train.awr.eval_ema < 1.0:
            raise ValueError(f"train.awr.eval_ema must be in [0, 1); got {cfg.train.awr.eval_ema}")
