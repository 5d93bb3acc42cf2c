"""`train.method opsd`: on-policy self-distillation."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from diffusion_rl.distill import opsd_loss, reward_tilt_weights
from kinema.train.distributed import gather_rows
from kinema.video.methods.base import TRAINED, Method, TeacherOptions, TiltOptions, check_tilt
from kinema.video.rollout import Rollout
from policies.video.modeling_lora import BASE  # the pre-trained model with every adapter disabled

TEACHERS = ("cfg", "privileged_prompt", "model")


@dataclass
class OPSDOptions(TeacherOptions, TiltOptions):
    teacher: str = "cfg"  # cfg (the guided reference) | privileged_prompt | model (teacher_path)
    teacher_path: str = ""  # teacher model: another generator folder, with the student's latent shape
    privileged_context: str = "the task succeeds"  # text the privileged-prompt teacher sees after the prompt


class OPSD(Method):
    """On-policy self-distillation: the student rolls out CFG-free; at the states it visited, a teacher — the
    reference with CFG, the reference with a privileged prompt, or another model — gives the velocity target.
    Rollouts are weighted by exp(β·A) (mean 1), so the reward chooses which of its own paths the student keeps."""

    name = "opsd"
    summary = "on-policy self-distillation: a teacher's velocity at the student's own states, rollouts reward-tilted"
    options_class = OPSDOptions
    reward_gated = False  # the teacher's target needs no reward spread; the tilt is where the reward enters

    def __init__(self, trainer):
        super().__init__(trainer)
        if self.opt.teacher == "model":
            teacher, student = trainer.teacher_model(), trainer.generator
            teacher_latents = teacher.latent_shape(1)[1:]  # (C, F', h, w): the batch dimension dropped
            student_latents = student.latent_shape(1)[1:]
            if teacher_latents != student_latents:
                tc, sc = teacher.config, student.config
                raise ValueError(
                    f"OPSD with train.opsd.teacher model queries the teacher at the student's states, so their latents must "
                    f"match: teacher latents {teacher_latents} (C, F', h, w) for {(tc.num_frames, tc.height, tc.width)}"
                    f" (frames, height, width), student {student_latents} for {(sc.num_frames, sc.height, sc.width)}."
                    " Use a teacher with the student's latent space and video size, or AFD (which only needs its videos)"
                )

    def rollout(self, prompts, embeds):
        return self.student_trajectory(embeds)

    def prepare(self, ro):
        tilt = reward_tilt_weights(self.tr.tilt_reward(ro), beta=self.opt.tilt_beta)
        ro.extra["w"] = tilt / gather_rows(tilt).mean()  # mean 1 over the round, every rank's samples
        if self.opt.teacher == "privileged_prompt":
            privileged = [f"{p}, {self.opt.privileged_context}" for p in ro.prompts]
            ro.extra["teacher_emb"] = self.tr.generator.encode_prompts(privileged)
        elif self.opt.teacher == "model":  # the teacher reads the prompts with its own text encoder
            ro.extra["teacher_emb"] = self.tr.teacher_model().encode_prompts(ro.prompts)
        return {}

    def teacher_velocity(self, ro: Rollout, x_t: Tensor, t: Tensor, idx: Tensor) -> Tensor:
        kind, g = self.opt.teacher, self.opt.teacher_guidance
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

    @classmethod
    def check_config(cls, cfg):
        o = cfg.train.opsd
        check_tilt(cls.name, o)
        if o.teacher not in TEACHERS:
            raise ValueError(f"train.opsd.teacher {o.teacher!r} is not known; valid: {', '.join(TEACHERS)}")
        if o.teacher == "model" and not o.teacher_path:
            raise ValueError("train.opsd.teacher is 'model' but train.opsd.teacher_path is empty")
