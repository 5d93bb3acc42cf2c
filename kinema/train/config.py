"""`kinema train` configuration: typed dataclasses, loaded from YAML (assets/configs/) with dotted overrides.

    kinema train --config assets/configs/push_habc.yaml --rl.rounds 4 --sft.steps 3000

An unknown key, in the file or on the command line, is an error that lists the valid keys at that level.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import draccus
from draccus.utils import DecodingError

from kinema.paths import read_yaml, resolve_shipped_yaml

RL_METHODS = ("habc", "sft_continued", "awr", "flow_ppo", "nft", "none")
PPO_ADVANTAGES = ("grpo", "gae")
REPLAY_MIXING = ("fixed", "pooled")


T = TypeVar("T")

@dataclass
class DemoConfig:
    episodes: int = 40  # scripted demonstrations for SFT: the knob that places the SFT baseline (40 -> ~45% on drawer)
    noise: float = 0.05  # expert action noise: clean demos are what a flow head copies well
    hesitation: float = 0.0
    wrong_grasp: float = 0.0


@dataclass
class SFTConfig:
    steps: int = 1000  # gradient steps of supervised flow matching on the demos
    batch_size: int = 64
    lr: float = 3e-4
    weight_decay: float = 1e-4
    aux_weight: float = 1.0  # weight of the privileged object-position head (0 disables)


@dataclass
class HABCOptions:
    gate: str = "paper"  # paper | fixed_mix | viability_only | efficiency_only | exp
    intervention_credit: bool = True  # False: the "no intervention-aware credit" ablation
    intervention_reweighting: bool = False  # human steps weighted by g instead of 1 (the paper's "IR")
    intervention_reweighting_after: int = 0  # rounds without IR before it starts (the paper runs 3 rounds without)
    warmup_rounds: int = 0  # rounds with g = 1 (critics still train)
    critic_steps: int = 400  # critic gradient steps per round
    critic_lr: float = 3e-4  # HABC critic learning rate (with a soft-updated target critic for the TD head)
    efficiency_target: str = "td"  # td (the paper) | mc: observed steps-to-success as V_e's target (ours)
    value_scale: float = 1.0  # V_e = scale * head output; > 1 (e.g. the horizon) only with efficiency_target mc


@dataclass
class RLConfig:
    method: str = "habc"  # habc | sft_continued (the control) | awr | flow_ppo (Flow-SDE GRPO) | none (SFT only)
    rounds: int = 4
    episodes_per_round: int = 48  # rollouts per round
    updates_per_round: int = 600  # actor gradient steps per round
    batch_size: int = 64
    lr: float = 1e-4
    demo_fraction: float = 0.5  # replay_mixing fixed: share of each actor minibatch drawn from the demonstrations
    replay_mixing: str = "fixed"  # fixed (demo_fraction) | pooled: demos and weighted replay in one pool (HABC's loss)
    replay_rounds: int = 3  # rollouts of this many recent rounds are kept
    interventions: bool = False  # a simulated human monitors the policy and takes over before failures
    awr_temperature: float = 1.0  # single-critic AWR baseline: w = exp(A / temperature), clipped
    ppo_advantage: str = "grpo"  # flow_ppo: grpo (group-relative, rollouts in seed groups) | gae (PPO with a critic)
    group_size: int = 4  # flow_ppo with grpo: rollouts per seed (GRPO groups)
    # flow_ppo with gae: GAE's λ per chunk (γ = 0.99 per env step, so 0.99^n per chunk). On drawer (2 seeds) λ = 1 did
    # better (33 % against 19 %; SFT 44 %): the critic, fitted on earlier rounds, predicted a round worse than a constant.
    ppo_gae_lambda: float = 0.95
    ppo_clip: float = 0.2  # flow_ppo: clip range on the ratio of mean-reduced per-step log-probs
    # flow_ppo: Flow-SDE noise level a (σ_t = a·sqrt(t / (1 − t))). GRPO, 2 seeds each: 0.3 reached 42 % on drawer (0.5:
    # 26 %, SFT 44 %), 16 % on push (0.5: 13 %, SFT 22 %), 17 % on pick_place (its SFT 18 %; 0.5: 14 % from an SFT at
    # 15 %): at 0.5 the SDE rollouts succeed far less often than the ODE policy that is evaluated.
    ppo_noise_level: float = 0.3
    ppo_epochs: int = 2
    # flow_ppo's trust region. Without both, the tiny VLA moved 0.3-2.9 nats per log-prob element per round and fell
    # to 0 % success by round 4-5 (drawer and pick_place). Measured on drawer seed 0 (100 episodes, SFT 44 %):
    # target_kl 0.01 alone 23 %; + kl_weight 0.04 (Flow-GRPO's beta) 42 %; target_kl 0.005 + kl_weight 1.0 13 %.
    ppo_target_kl: float = 0.01  # stop a round's PPO updates once the approximate KL passes 1.5x this (0: off)
    ppo_kl_weight: float = 0.04  # Flow-GRPO's beta: KL of the SDE steps to the starting (SFT) policy (0: off)
    # πRL's own settings (train_expert_only, lr 5e-6 on π0). With the rest of the policy trainable at rl.lr (1e-4) the
    # baseline fell to 0 % on push and pick_place after one round: GRPO's gradient from ~6 successes a round is mostly
    # noise, and Adam turns noise into lr-sized steps (push seed 0, round 1: weights moved 0.6 %, the fused features
    # 20 %, the ODE actions 0.12). At 1e-5 it still fell (0-6 % by round 4); at 3e-6, expert only: push 13 % (SFT 22),
    # pick_place 9 % (SFT 15), but drawer 15 % where the old settings kept 32 % (SFT 44): no setting learns at this budget.
    ppo_lr: float = 3e-6  # flow_ppo's actor learning rate (0: rl.lr)
    ppo_expert_only: bool = True  # flow_ppo trains the action expert only, the encoders frozen
    # nft: DiffusionNFT on the action expert (our application of it to the VLA; the loss as the official code): each
    # rollout's outcome advantage within its round, r = clip(A / A_max)/2 + ½, both branches on the round's own samples.
    nft_beta: float = 1.0
    nft_adv_clip_max: float = 5.0
    success_model: bool = True  # refit the eVTA_0 success-probability model every round (RLER) and log calibration
    # Its targets: td (eVTA_0) | mc (ours, every step's target is the outcome). In a push seed-0 HABC run, rounds 2-4
    # (scored before each refit): ECE td 0.42-0.46, mc 0.06-0.10; terminal Brier td 0.20-0.24, mc 0.08-0.15 against the
    # base rate's 0.11-0.15 (td never beat it, mc in 2 of 3 rounds). Fitted on the last 3 rounds instead of the newest
    # (offline, same run): no better with either target (terminal Brier mc 0.18/0.14/0.29 against 0.15/0.15/0.28).
    success_target: str = "td"
    habc: HABCOptions = field(default_factory=HABCOptions)


@dataclass
class EvalConfig:
    episodes: int = 100  # per split at the final evaluation (>= 100 for a 4-5 point standard error)
    round_episodes: int = 48  # per evaluation between rounds
    heldout: bool = True  # also evaluate held-out paraphrases and held-out object combinations
    videos: int = 2  # rollout MP4s before and after RL
    baseline: bool = True  # evaluate the starting (SFT) policy; off when branching from a run that already did


@dataclass
class PolicyOptions:
    image_size: int = 64
    chunk_size: int = 8
    n_action_steps: int = 4
    num_flow_steps: int = 10
    backbone: str = "tiny"  # "tiny" (from scratch) or "smolvlm": the local SmolVLM/Idefics3 checkpoint at backbone_path, LoRA
    backbone_path: str = ""  # a local folder; nothing is downloaded
    backbone_layers: int = 0  # text layers of the backbone to run (SmolVLA runs half); 0: all
    backbone_image_size: int = 0  # side its vision tower sees; 0: native (512 for SmolVLM); smaller is much cheaper on CPU
    lora_rank: int = 8  # LoRA rank on the backbone's text model (0: frozen backbone, heads only)
    freeze_vision: bool = True  # False: LoRA on the vision tower too
    aux_input: str = "fused"  # what the privileged-position head reads: "fused" (+ state) | "perception" (images + text only)
    state_dropout: float = 0.0  # probability of hiding the end-effector pose from the policy per training sample
    augment_shift: int = 4  # random-shift augmentation in training (pixels); 0 disables
    ema_decay: float = 0.995  # the acting/evaluated policy is an EMA of the trained weights (0: no average)

    def vla_fields(self) -> dict[str, Any]:
        """The options that are VLAConfig fields (all but ema_decay): the one mapping from these keys to the policy."""
        from policies.vla.configuration_vla import VLAConfig

        names = {f.name for f in dataclasses.fields(VLAConfig)}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name in names}


@dataclass
class TrainConfig:
    # What the run's demos, SFT and checkpoints were made with: `--resume` refuses overrides of these.
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        "task", "task_config", "seed", "dataset", "init_policy", "policy", "demos", "sft", "rl.method", "rl.interventions",
    )  # fmt: skip

    task: str = "drawer"  # the task family (kinema sim list); drawer is the quickest to learn on a CPU
    task_config: dict[str, Any] = field(default_factory=dict)  # overrides of the task's difficulty config
    out: str = ""  # run folder; default runs/<task>-<method>-s<seed>
    seed: int = 0
    num_envs: int = 8  # envs per rollout batch
    workers: int = 2  # env worker processes (0: step envs in this process)
    threads: int = 1  # torch threads; one per process is fastest on a shared CPU
    dataset: str = ""  # train SFT on this LeRobotDataset folder instead of collecting scripted demos
    init_policy: str = ""  # start RL from this checkpoint instead of running SFT (e.g. another run's checkpoints/sft)
    tensorboard: bool = False  # also log the metrics as TensorBoard scalars in RUN_DIR/tensorboard (kinema[tensorboard])
    policy: PolicyOptions = field(default_factory=PolicyOptions)
    demos: DemoConfig = field(default_factory=DemoConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.rl.method not in RL_METHODS:
            raise ValueError(f"rl.method {self.rl.method!r} is not known; valid: {', '.join(RL_METHODS)}")
        if self.rl.habc.gate not in ("paper", "fixed_mix", "viability_only", "efficiency_only", "exp"):
            raise ValueError(
                f"rl.habc.gate {self.rl.habc.gate!r} is not known; valid: paper, fixed_mix, viability_only, efficiency_only, exp"
            )
        if self.rl.replay_mixing not in REPLAY_MIXING:
            raise ValueError(f"rl.replay_mixing {self.rl.replay_mixing!r} is not known; valid: {', '.join(REPLAY_MIXING)}")
        for name, value in (("rl.ppo_target_kl", self.rl.ppo_target_kl), ("rl.ppo_kl_weight", self.rl.ppo_kl_weight)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (0 turns it off); got {value}")
        if self.rl.habc.efficiency_target not in ("td", "mc"):
            raise ValueError(f"rl.habc.efficiency_target {self.rl.habc.efficiency_target!r} is not known; valid: td, mc")
        if self.rl.success_target not in ("td", "mc"):
            raise ValueError(f"rl.success_target {self.rl.success_target!r} is not known; valid: td, mc")
        if self.rl.ppo_advantage not in PPO_ADVANTAGES:
            raise ValueError(f"rl.ppo_advantage must be one of {', '.join(PPO_ADVANTAGES)}; got {self.rl.ppo_advantage!r}")
        if not 0.0 <= self.rl.ppo_gae_lambda <= 1.0:
            raise ValueError(f"rl.ppo_gae_lambda must be in [0, 1]; got {self.rl.ppo_gae_lambda}")
        if self.rl.ppo_lr < 0:
            raise ValueError(f"rl.ppo_lr must be >= 0 (0: use rl.lr); got {self.rl.ppo_lr}")
        if self.rl.method == "nft" and self.rl.interventions:
            raise ValueError("rl.method nft learns from autonomous rollouts only; set rl.interventions false (or use habc)")
        if self.rl.method == "nft" and self.rl.replay_mixing != "fixed":
            raise ValueError(f"rl.method nft mixes demos and rollouts by rl.demo_fraction; rl.replay_mixing must be fixed, got {self.rl.replay_mixing!r}")
        for name, value in (("rl.nft_beta", self.rl.nft_beta), ("rl.nft_adv_clip_max", self.rl.nft_adv_clip_max)):
            if value <= 0:
                raise ValueError(f"{name} must be > 0; got {value}")
        if not 0.0 <= self.rl.demo_fraction <= 1.0:
            raise ValueError(f"rl.demo_fraction must be in [0, 1]; got {self.rl.demo_fraction}")
        for name, value in (
            ("sft.steps", self.sft.steps), ("rl.rounds", self.rl.rounds), ("rl.updates_per_round", self.rl.updates_per_round),
            ("rl.habc.critic_steps", self.rl.habc.critic_steps), ("workers", self.workers),
            ("rl.habc.intervention_reweighting_after", self.rl.habc.intervention_reweighting_after),
        ):  # fmt: skip
            if value < 0:
                raise ValueError(f"{name} must be >= 0; got {value}")
        for name, value in (
            ("sft.batch_size", self.sft.batch_size), ("rl.batch_size", self.rl.batch_size), ("threads", self.threads),
            ("rl.episodes_per_round", self.rl.episodes_per_round), ("rl.group_size", self.rl.group_size),
            ("rl.replay_rounds", self.rl.replay_rounds), ("num_envs", self.num_envs), ("eval.episodes", self.eval.episodes),
            ("eval.round_episodes", self.eval.round_episodes),
        ):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if self.demos.episodes < 1 and not self.dataset:
            raise ValueError(f"demos.episodes must be >= 1 (or give a dataset); got {self.demos.episodes}")
        if not 0.0 <= self.policy.ema_decay < 1.0:
            raise ValueError(f"policy.ema_decay must be in [0, 1) (0: no average); got {self.policy.ema_decay}")
        # The policy's own rules (VLAConfig), checked now rather than after the demos are collected.
        from policies.vla.configuration_vla import VLAConfig

        try:
            VLAConfig(**self.policy.vla_fields())
        except ValueError as err:
            raise ValueError(str(err).replace("VLAConfig.", "policy.")) from None

    def run_dir(self) -> Path:
        return Path(self.out or f"runs/{self.task}-{self.rl.method}-s{self.seed}")


def _valid_keys(cls: type, prefix: str = "") -> dict[str, list[str]]:
    """Per dotted prefix, the valid field names (nested dataclasses recurse)."""
    out = {prefix: [f.name for f in dataclasses.fields(cls)]}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            out.update(_valid_keys(type(default), f"{prefix}{f.name}."))
    return out


def _check_keys(data: Any, valid: dict[str, list[str]], prefix: str = "", source: str = "") -> None:
    if not isinstance(data, dict) or prefix not in valid:
        return
    for key, value in data.items():
        if key not in valid[prefix]:
            raise ValueError(f"unknown config key '{prefix}{key}'{source}; valid keys here: {', '.join(valid[prefix])}")
        if f"{prefix}{key}." in valid:
            _check_keys(value, valid, f"{prefix}{key}.", source)


def resolve_config_path(name: str) -> Path:
    """A config file by path, or by name among the shipped ones (`drawer_habc` = assets/configs/drawer_habc.yaml),
    which also works from an installed wheel."""
    return resolve_shipped_yaml(name, "configs", "config file")


def load_run_config(
    config_path: str | None, overrides: list[str], resume: str | None, *, config_class: type[T] = TrainConfig
) -> T:
    """The config of a fresh run (`config_path` + overrides), or, with `resume`, the run folder's own config.yaml
    (+ overrides, `out` pinned to that folder): what `--resume RUN_DIR` continues."""
    if not resume:
        return load_config(config_path, overrides, config_class=config_class)
    saved = Path(resume) / "config.yaml"
    if not saved.is_file():
        raise FileNotFoundError(f"{resume} is not a kinema run folder (no config.yaml)")
    after = load_config(str(saved), [*overrides, "--out", str(resume)], config_class=config_class)
    # Checked before the run rewrites its config.yaml: a refused override must leave the run resumable as it was.
    # Only keys the file holds: one an older kinema did not write has no saved value to keep.
    fixed = getattr(config_class, "RESUME_FIXED", ())
    old, new = _flatten(read_yaml(saved) or {}), _flatten(dataclasses.asdict(after))
    changed = [k for k in sorted(old) if any(k == f or k.startswith(f + ".") for f in fixed) and not _same(old[k], new.get(k))]
    if changed:
        diffs = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
        raise ValueError(
            f"--resume cannot change {diffs}: the run's data and checkpoints were made with the saved values "
            f"({', '.join(fixed)} stay fixed on resume). Nothing in {resume} was changed; start a new run (another "
            "--out) to change them"
        )
    return after


def _same(saved: Any, value: Any) -> bool:
    """A saved config value and a new one mean the same (a path spelt another way, a tuple read back as a list)."""
    if isinstance(saved, str) and isinstance(value, str) and saved and value:
        return saved == value or os.path.realpath(saved) == os.path.realpath(value)
    if isinstance(value, tuple):
        value = list(value)
    return saved == value


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_config(
    config_path: str | None = None, overrides: list[str] | None = None, *, config_class: type[T] = TrainConfig
) -> T:
    """A config (TrainConfig by default; any dataclass config of kinema's) from an optional YAML file (a path, or a
    shipped name) plus `--a.b value` / `--a.b=value` overrides. An unknown key is an error listing the valid ones."""
    valid = _valid_keys(config_class)
    if config_path:
        path = resolve_config_path(config_path)
        config_path = str(path)
        _check_keys(read_yaml(path) or {}, valid, "", f" in {path}")
    for arg in overrides or []:
        if arg.startswith("--"):
            dotted = arg[2:].split("=", 1)[0]
            *parents, leaf = dotted.split(".")
            prefix = "".join(p + "." for p in parents)
            if prefix not in valid or leaf not in valid[prefix]:
                level = valid.get(prefix, valid[""])
                raise ValueError(f"unknown config key {dotted!r} on the command line; valid keys here: {', '.join(level)}")
    try:
        return draccus.parse(config_class=config_class, config_path=config_path, args=list(overrides or []))
    except Exception as err:  # draccus wraps our own validation errors; surface the one that names the field
        chain: list[BaseException] = [err]
        while (nxt := _cause_of(chain[-1])) is not None:
            chain.append(nxt)
        source = f" (config {config_path} and the command line)" if config_path else " (on the command line)"
        for cause in chain:  # a value of the wrong type: draccus's message names the key, the root cause does not
            if isinstance(cause, DecodingError):
                raise ValueError(f"invalid config value{source}: {cause}") from None
        if isinstance(chain[-1], ValueError):
            raise ValueError(str(chain[-1])) from None
        raise ValueError(f"invalid config{source}: {err}") from None


def _cause_of(err: BaseException) -> BaseException | None:
    """The exception `err` was raised from or during, as Python itself would print it (`from None` hides it)."""
    if err.__cause__ is not None:
        return err.__cause__
    return None if err.__suppress_context__ else err.__context__


def config_keys_help(config_class: type = TrainConfig) -> str:
    """Every dotted config key with its default, for `kinema train --help` (or another config's command)."""
    lines = ["config keys (defaults):"]
    for prefix, names in _valid_keys(config_class).items():
        obj: Any = config_class()
        for part in filter(None, prefix.split(".")):
            obj = getattr(obj, part)
        values = [f"{prefix}{n}={getattr(obj, n)!r}" for n in names if not dataclasses.is_dataclass(getattr(obj, n))]
        lines.append("  " + "  ".join(values))
    return "\n".join(lines)


def dump_config(config: Any) -> str:
    return draccus.dump(config)
