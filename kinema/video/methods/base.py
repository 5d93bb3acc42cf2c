"""What every post-training method of `kinema video train` is: a strategy object that says how it rolls out and
what loss it takes on a minibatch of the round's samples. `VideoTrainer` (kinema.video.trainer, whose docstring has
the round, the adapters and the time convention) drives it. The math lives in the RL core (diffusion_rl.flow,
.distill, .advantages); the methods only wire it. Options that several methods share are declared once here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from diffusion_rl.flow import flowawr_ref_decay, interpolate, reference_anchor, sample_time

if TYPE_CHECKING:
    from kinema.video.config import VideoTrainConfig
    from kinema.video.rollout import Rollout
    from kinema.video.trainer import VideoTrainer

TILT_REWARDS = ("advantage", "balanced")


@dataclass
class TeacherOptions:
    """What the methods with a teacher share (distill, AFD, OPSD)."""

    teacher_guidance: float = 1.5  # CFG scale of the teacher (distill's real score, AFD's teacher, OPSD's cfg teacher)


@dataclass
class TiltOptions:
    """Stream-R1's exp(β·r) rollout tilt (distill, OPSD)."""

    tilt_beta: float = 1.0
    # r of the tilt: balanced (Stream-R1: mean − ½·std of the round's z-scored rewards) | advantage (ours: GDPO's)
    tilt_reward: str = "balanced"


def check_tilt(method: str, options: TiltOptions) -> None:
    if options.tilt_reward not in TILT_REWARDS:
        raise ValueError(f"train.{method}.tilt_reward {options.tilt_reward!r} is not known; valid: {', '.join(TILT_REWARDS)}")


# The adapters' names; `kinema.video.trainer` says what each holds.
TRAINED = "default"
REF = "ref"
FAKE = "fake"


class Method:
    """A post-training method. Subclasses set their name, summary and options and the adapters they need, and
    implement `rollout` and `loss`; `VIDEO_METHODS` (kinema/video/methods/__init__.py) registers them."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line, for --help
    options_class: ClassVar[type | None] = None  # its options, at train.<name> (none when None)
    adapters: ClassVar[tuple[str, ...]] = ()  # besides `default`
    # Whether samples of reward-degenerate groups (every sample scored the same) are dropped. True where the
    # reward *is* the learning signal; the distillation methods learn from a teacher/discriminator, which a
    # constant reward does not make uninformative.
    reward_gated = True
    anchor_space = "x0"  # see `anchor`

    def __init__(self, trainer: VideoTrainer, options: Any = None) -> None:
        """`options`: another method's options to act under (AFD runs NFT's update with its own); default its own."""
        self.tr = trainer
        self.cfg = trainer.cfg
        self.opt = options if options is not None else getattr(trainer.cfg.train, self.name, None)

    @classmethod
    def check_config(cls, cfg: VideoTrainConfig) -> None:
        """Refuse settings this method cannot honour, naming the key (called when the config loads)."""

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
