"""`train.method afd`: adversarial flow distillation from a black-box teacher."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffusion_rl.distill import afd_advantages, afd_weights, bt_discriminator_loss
from kinema.train.distributed import gather_rows, own_rows
from kinema.video.methods.base import REF, Method, TeacherOptions
from kinema.video.methods.nft import DiffusionNFT, NFTOptions


@dataclass
class AFDOptions(TeacherOptions, NFTOptions):
    teacher_path: str = ""  # another model as teacher; "" = the reference itself, with CFG
    teacher_videos: str = ""  # a folder of teacher MP4s, each with a sibling .txt holding its prompt
    disc_lr: float = 1e-4  # discriminator learning rate (0 invites reward hacking; too high stops learning)


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
    summary = "adversarial flow distillation: a Bradley-Terry judge of teacher against student drives NFT's update"
    options_class = AFDOptions
    adapters = (REF,)
    reward_gated = False  # the discriminator gives the weight; the rewards are only logged

    def __init__(self, trainer):
        super().__init__(trainer)
        emb = trainer.generator.encode_prompts(["a"])
        self.disc = Discriminator(emb.shape[-1]).to(trainer.generator.device)
        self.disc_opt = torch.optim.AdamW(self.disc.parameters(), lr=self.opt.disc_lr)
        self.nft = DiffusionNFT(trainer, self.opt)  # NFT's update, under AFD's own β and clip

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
