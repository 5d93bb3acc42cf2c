"""`train.method nft`: DiffusionNFT on the video generator."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from diffusion_rl.flow import nft_loss
from kinema.video.methods.base import REF, TRAINED, Method
from kinema.video.rollout import Rollout
from policies.video.modeling_lora import BASE  # the pre-trained model with every adapter disabled


@dataclass
class NFTOptions:
    beta: float = 1.0  # DiffusionNFT's β
    adv_clip_max: float = 5.0


class DiffusionNFT(Method):
    """DiffusionNFT: the old (EMA) policy samples CFG-free; on the samples' own noised states, the positive
    velocity β·v_θ + (1 − β)·v_old and the negative (1 + β)·v_old − β·v_θ are mixed by r(A); plus the anchor."""

    name = "nft"
    summary = "DiffusionNFT: positive and negative velocities around the EMA policy, mixed by the advantage"
    options_class = NFTOptions
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
            v_theta, v_old, x_t=x_t, x0=x0, t=t, advantages=advantages, r=r, beta=self.opt.beta,
            adv_clip_max=self.opt.adv_clip_max,
        )  # fmt: skip
        return (per * ro.weights[idx]).mean() + self.anchor(v_theta, v_base, t).mean()

    def loss(self, ro, idx, update):
        return self.nft(ro, idx, advantages=ro.advantages[idx]), {}
