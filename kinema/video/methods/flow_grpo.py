"""`train.method flow_grpo`: the Flow-GRPO baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusion_rl.flow import ppo_clip_loss, sde_kl_loss, sde_sample, sde_step_with_logprob
from kinema.video.methods.base import TRAINED, Method
from kinema.video.rollout import velocity_fn
from policies.video.modeling_lora import BASE  # the pre-trained model with every adapter disabled


@dataclass
class FlowGRPOOptions:
    clip: float = 1e-4  # Flow-GRPO clip range on mean-reduced log-prob ratios
    noise_level: float = 0.7  # Flow-SDE noise level a (σ_t = a·sqrt(t/(1 − t)))
    steps_per_update: int = 2  # SDE steps (of num_inference_steps) trained per update
    adv_clip_max: float = 5.0


class FlowGRPO(Method):
    """Flow-GRPO baseline: SDE rollouts of the trained adapter with per-step log-probs, GRPO advantages, the
    clipped ratio on re-evaluated steps, plus the per-step KL to the reference's SDE step. The ratio must be 1
    before a round's first update (the sampler and the learner are the same weights): checked, and logged."""

    name = "flow_grpo"
    summary = "Flow-GRPO: SDE rollouts with per-step log-probs, the clipped ratio, KL to the reference (the baseline)"
    options_class = FlowGRPOOptions
    RATIO_TOLERANCE = 1e-4  # the clip range itself: a larger mismatch would make clipping meaningless

    def rollout(self, prompts, embeds):
        sched = self.tr.generator.sigmas(self.cfg.model.num_inference_steps)
        fn = velocity_fn(self.tr.generator, embeds, TRAINED)
        with torch.no_grad():
            x0, states, nexts, log_probs = sde_sample(
                fn, self.tr.noise(len(prompts)), schedule=sched, noise_level=self.opt.noise_level,
                generator=self.tr.rng,
            )  # fmt: skip
        return x0, {"states": states, "nexts": nexts, "log_probs": log_probs, "sched": sched}

    def loss(self, ro, idx, update):
        ex, gen = ro.extra, self.tr.generator
        # The last step (σ from ~1e-3 to 0) is left out: its σ_t is so small that the log-prob and the KL there
        # measure the x̂_0 → v conversion's 1/t, not the policy.
        n_steps = max(1, ex["states"].shape[0] - 1)
        k = min(self.opt.steps_per_update, n_steps)
        steps = torch.randperm(n_steps, generator=self.tr.rng)[:k]
        emb = ro.embeds[idx]
        total, stats = 0.0, {}
        for j in steps.tolist():
            x_t, x_next = ex["states"][j][idx], ex["nexts"][j][idx]
            t = ex["sched"][j].expand(len(idx))
            t_next = ex["sched"][j + 1].expand(len(idx))
            with torch.no_grad():
                v_ref = gen.velocity(x_t, t, emb, adapter=BASE)
                ref = sde_step_with_logprob(v_ref, x_t, t, t_next, noise_level=self.opt.noise_level, prev_sample=x_next)
            v_theta = gen.velocity(x_t, t, emb, adapter=TRAINED)
            step = sde_step_with_logprob(v_theta, x_t, t, t_next, noise_level=self.opt.noise_level, prev_sample=x_next)
            pg, ppo = ppo_clip_loss(step.log_prob, ex["log_probs"][j][idx], ro.advantages[idx], clip_range=self.opt.clip, adv_clip_max=self.opt.adv_clip_max)
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
