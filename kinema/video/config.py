"""`kinema video train` configuration: typed dataclasses, loaded from YAML (assets/configs/video_*.yaml) with
dotted overrides on the command line.

    kinema video train --config video_awr --train.rounds 4 --rewards.names '[success, motion]'

An unknown key, in the file or on the command line, is an error that lists the valid keys at that level; an
unknown method or reward names the valid ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kinema import common
from kinema.video.methods import VIDEO_METHODS

METHODS = tuple(VIDEO_METHODS)
BALANCING = ("gdpo", "weighted_sum")
REF_SCHEDULES = ("constant", "flowawr")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    preset: str = "tiny"  # a named preset built offline (policies.video), used unless `path` is set
    path: str = ""  # a local diffusers directory (WanPipeline layout) or a saved VideoGenerator
    lora_rank: int = 8  # LoRA rank of the trained adapters
    lora_alpha: int = 16
    num_inference_steps: int = 8  # sampling steps of rollouts and evaluation samples
    guidance_scale: float = 1.0  # CFG scale of evaluation samples (1 = CFG-free, what VideoAWR keeps working)
    device: str = "cpu"  # where the generator, the rollouts and every training tensor live (e.g. cuda, cuda:1)
    dtype: str = "float32"  # weights of the transformer, VAE and text encoder (bfloat16 on a GPU); the RL math is float32


@dataclass
class DataConfig:
    task: str = "pick_place"  # sim task whose rollout videos pre-train the model and train the success reward
    dataset: str = ""  # read the videos from this LeRobotDataset v3 folder instead of collecting them
    episodes: int = 64  # scripted episodes to collect (a mix of successes and failures, see wrong_grasp)
    noise: float = 0.05  # expert action noise
    wrong_grasp: float = 0.4  # share of episodes with a mis-aimed grasp: the failures the success reward learns from
    camera: str = "agentview"  # which camera's frames make the videos
    frames: int = 9  # frames per clip (4k + 1 for the Wan VAE)
    size: int = 32  # clip height and width in pixels (a multiple of 16)


@dataclass
class PretrainConfig:
    steps: int = 1500  # gradient steps of plain flow matching on the sim videos (0: use the model as loaded)
    lr: float = 1e-3
    batch_size: int = 8
    cfg_dropout: float = 0.1  # share of empty prompts, so that the unconditional branch CFG needs is learnt too


@dataclass
class RewardConfig:
    names: list[str] = field(default_factory=lambda: ["success"])  # rewards by name (policies.video.rewards)
    weights: list[float] = field(default_factory=list)  # one per reward (default: all 1)
    balancing: str = "gdpo"  # gdpo: each reward z-scored within its prompt group, then summed | weighted_sum (then GRPO)


@dataclass
class JudgeConfig:
    """A held-out judge of task success, beside the training reward: a second success model of another architecture
    and seed, fitted on sim episodes of its own (seeds disjoint from the reward's), never used in training. Its gain
    before -> after is reported next to the reward's; a reward that rises while the judge does not is the
    reward-hacking signal. Its agreement with the sim's ground truth is measured on clips neither model saw."""

    enabled: bool = True
    episodes: int = 0  # sim episodes of its own (0: as many as data.episodes), collected with other seeds
    dataset: str = ""  # with data.dataset: a LeRobotDataset folder of other episodes to fit it on (else it is skipped)
    steps: int = 400  # fitting steps (as the reward's)
    seed_offset: int = 1  # fitted with seed + this: another initialisation and batch order than the reward's


@dataclass
class AnchorConfig:
    """Every method keeps an anchor to the reference (the pre-trained model with its adapters off): without one,
    short runs hacked threshold rewards or collapsed to identical samples (measured on the tiny models)."""

    # λ·‖v_θ − v_base‖² on the trained samples (AWR, NFT, distill, AFD, OPSD). FlowAWR's faithful λ
    # is 1e-4; 0.01 is our variant, the value the tiny-model runs of benchmarks/video_rl.py were tuned with
    # (measured: short runs without an anchor hacked the rewards or collapsed).
    ref_weight: float = 0.01
    kl_weight: float = 0.04  # Flow-GRPO: β of the per-step KL to the reference's SDE step
    # How the old/EMA reference adapter follows the trained one, θ_old ← d·θ_old + (1 − d)·θ:
    #   constant (our variant, measured on the tiny model): d = ref_decay after ref_warmup_updates (d = 0 before);
    #   flowawr (FlowAWR, faithful): d = 0 until update 75, then min(0.0075·(update − 75), 0.999).
    ref_schedule: str = "constant"
    ref_decay: float = 0.9
    ref_warmup_updates: int = 0  # constant schedule: updates with d = 0 (the old policy *is* the current one)


@dataclass
class PostTrainRounds:
    """What every method's rounds share; each method's own options follow as groups (see `PostTrainConfig`)."""

    method: str = "awr"  # awr | nft | distill | afd | opsd | flow_grpo
    rounds: int = 60  # rollout -> reward -> update rounds
    prompts_per_round: int = 4  # distinct prompts per round
    group_size: int = 4  # samples per prompt (the group of group-relative advantages)
    updates_per_round: int = 8  # gradient steps per round over that round's rollouts
    batch_size: int = 8
    lr: float = 1e-3  # LoRA learning rate: at 3e-4 the tiny model barely moved within a CPU budget
    grad_clip: float = 1.0


# The options group of every registered method that has options: train.awr, train.nft, train.distill, ...
PostTrainConfig = dataclasses.make_dataclass(
    "PostTrainConfig",
    [(m.name, m.options_class, field(default_factory=m.options_class)) for m in VIDEO_METHODS.values() if m.options_class],
    bases=(PostTrainRounds,),
)
PostTrainConfig.__module__ = __name__


@dataclass
class VideoEvalConfig:
    interval: int = 5  # evaluate and checkpoint every this many rounds (and after the last)
    prompts: int = 4  # evaluation prompts (fixed for the whole run)
    samples_per_prompt: int = 8  # for the reward mean and the diversity (mean pairwise distance within a prompt)
    seed: int = 12345  # evaluation noise: the same for every evaluation
    videos: int = 4  # samples in the before/after grids and MP4s (one per prompt first)


@dataclass
class VideoTrainConfig:
    # What the run's clips, pre-trained model, adapters and method state were made with: `--resume` refuses overrides
    # of these (the device and dtype may change, e.g. to continue on a GPU).
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        "seed", "model.preset", "model.path", "model.lora_rank", "model.lora_alpha", "data", "pretrain", "train.method",
        "judge",
    )

    out: str = ""  # run folder; default runs/video-<method>-s<seed>
    seed: int = 0
    threads: int = 1  # torch threads: one is fastest on a shared CPU (measured)
    tensorboard: bool = False  # also log the metrics as TensorBoard scalars in RUN_DIR/tensorboard (kinema[tensorboard])
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    rewards: RewardConfig = field(default_factory=RewardConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    train: PostTrainConfig = field(default_factory=PostTrainConfig)
    eval: VideoEvalConfig = field(default_factory=VideoEvalConfig)

    # Before each method had its own group, its options were flat in train.options with method prefixes; an old
    # run's config.yaml still loads and resumes. Options several methods shared go to each of them (`migrate`).
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        **{f"train.options.awr_{k}": f"train.awr.{k}" for k in ("temperature", "rollout_guidance", "t_low", "shared_noise", "eval_ema")},
        "train.options.nft_beta": "train.nft.beta", "train.options.adv_clip_max": "train.nft.adv_clip_max",
        "train.options.tilt_beta": "train.distill.tilt_beta", "train.options.tilt_reward": "train.distill.tilt_reward",
        "train.options.saliency": "train.distill.saliency", "train.options.dmd_fake_updates": "train.distill.dmd_fake_updates",
        "train.options.teacher_guidance": "train.distill.teacher_guidance", "train.options.teacher_path": "train.afd.teacher_path",
        "train.options.teacher_videos": "train.afd.teacher_videos", "train.options.disc_lr": "train.afd.disc_lr",
        "train.options.opsd_teacher": "train.opsd.teacher", "train.options.privileged_context": "train.opsd.privileged_context",
        "train.options.grpo_clip": "train.flow_grpo.clip", "train.options.grpo_noise_level": "train.flow_grpo.noise_level",
        "train.options.grpo_steps_per_update": "train.flow_grpo.steps_per_update",
    }  # fmt: skip
    SHARED_OLD_OPTIONS: ClassVar[dict[str, tuple[str, ...]]] = {  # new key (as renamed) -> the other groups that read it
        "nft.adv_clip_max": ("afd", "flow_grpo"), "nft.beta": ("afd",), "distill.tilt_beta": ("opsd",),
        "distill.tilt_reward": ("opsd",), "distill.teacher_guidance": ("afd", "opsd"), "afd.teacher_path": ("opsd",),
    }  # fmt: skip

    @classmethod
    def migrate(cls, data: dict[str, Any], old_names: list[str]) -> None:
        train = data.get("train", {})
        if isinstance(train.get("options"), dict) and not train["options"]:
            del train["options"]  # every old key moved out of it
        for key, groups in cls.SHARED_OLD_OPTIONS.items():
            group, leaf = key.split(".")
            if leaf in train.get(group, {}):
                for other in groups:
                    train.setdefault(other, {}).setdefault(leaf, train[group][leaf])

    def __post_init__(self) -> None:
        if self.train.method not in METHODS:
            raise ValueError(f"train.method {self.train.method!r} is not known; valid: {', '.join(METHODS)}")
        if self.rewards.balancing not in BALANCING:
            raise ValueError(f"rewards.balancing {self.rewards.balancing!r} is not known; valid: {', '.join(BALANCING)}")
        if not self.rewards.names:
            raise ValueError("rewards.names is empty; name at least one reward")
        # Names and presets are checked now, not after the sim clips are collected and the success reward fitted.
        from policies.video.configuration_video import preset_config
        from policies.video.rewards.registry import reward_factory

        for name in self.rewards.names:
            try:
                reward_factory(name)
            except ValueError as err:
                raise ValueError(f"rewards.names: {err}") from None
        if not self.model.path:
            try:
                preset_config(self.model.preset)
            except ValueError as err:
                raise ValueError(f"model.preset: {err}") from None
        if self.rewards.weights and len(self.rewards.weights) != len(self.rewards.names):
            raise ValueError(
                f"rewards.weights has {len(self.rewards.weights)} entries for {len(self.rewards.names)} rewards "
                f"({', '.join(self.rewards.names)}); give one weight per reward, or none"
            )
        VIDEO_METHODS[self.train.method].check_config(self)
        for name, value, valid in (
            ("anchor.ref_schedule", self.anchor.ref_schedule, REF_SCHEDULES),
            ("model.dtype", self.model.dtype, DTYPES),
        ):
            if value not in valid:
                raise ValueError(f"{name} {value!r} is not known; valid: {', '.join(valid)}")
        if self.train.group_size < 2:
            raise ValueError(f"train.group_size must be >= 2 (group-relative advantages); got {self.train.group_size}")
        if self.data.frames < 1 or (self.data.frames - 1) % 4:
            below = 4 * max(0, (self.data.frames - 1) // 4) + 1
            raise ValueError(
                f"data.frames must be 4k + 1 (the Wan VAE compresses time by 4 after the first frame); got "
                f"{self.data.frames}: use {below} or {below + 4}"
            )
        if self.data.size < 16 or self.data.size % 16:
            raise ValueError(f"data.size must be a positive multiple of 16 (the transformer's patches); got {self.data.size}")
        if not 0.0 <= self.anchor.ref_decay < 1.0:
            raise ValueError(f"anchor.ref_decay must be in [0, 1); got {self.anchor.ref_decay}")
        for name, value in (
            ("pretrain.steps", self.pretrain.steps),
            ("train.rounds", self.train.rounds),
            ("train.updates_per_round", self.train.updates_per_round),
            ("anchor.ref_weight", self.anchor.ref_weight),
            ("anchor.kl_weight", self.anchor.kl_weight),
            ("judge.episodes", self.judge.episodes),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0; got {value}")
        for name, value in (
            ("train.prompts_per_round", self.train.prompts_per_round),
            ("train.batch_size", self.train.batch_size),
            ("eval.interval", self.eval.interval),
            ("eval.samples_per_prompt", self.eval.samples_per_prompt),
            ("model.num_inference_steps", self.model.num_inference_steps),
            ("pretrain.batch_size", self.pretrain.batch_size),
            ("threads", self.threads),
            ("judge.steps", self.judge.steps),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if self.data.episodes < 1 and not self.data.dataset:
            raise ValueError(f"data.episodes must be >= 1 (or give data.dataset); got {self.data.episodes}")
        if not self.data.dataset:  # a dataset's cameras are checked when its episodes are read
            from sim.env import CAMERAS

            if self.data.camera not in CAMERAS:
                raise ValueError(f"data.camera {self.data.camera!r} is not a camera the sim records; valid: {', '.join(CAMERAS)}")
        import torch  # the device string as torch reads it, checked before any clip is collected

        try:
            torch.device(self.model.device)
        except RuntimeError:
            raise ValueError(f"model.device {self.model.device!r} is not a torch device (e.g. cpu, cuda, cuda:1, mps)") from None

    def run_dir(self) -> Path:
        return Path(self.out or f"runs/video-{self.train.method}-s{self.seed}")


def load_video_config(config_path: str | None = None, overrides: list[str] | None = None) -> VideoTrainConfig:
    """VideoTrainConfig from an optional YAML file (a path or a shipped name such as `video_awr`) plus
    `--a.b value` / `--a.b=value` overrides (kinema's one config loader, `kinema.common.load_config`)."""
    return common.load_config(config_path, overrides, config_class=VideoTrainConfig)


def config_keys_help() -> str:
    """Every dotted config key with its default, for `kinema video train --help`."""
    return common.config_keys_help(VideoTrainConfig)


def dump_config(config: VideoTrainConfig) -> str:
    return common.dump_config(config)
