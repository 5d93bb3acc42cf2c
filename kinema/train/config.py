"""`kinema train` configuration: typed dataclasses, loaded from YAML (assets/configs/) with dotted overrides.

    kinema train --config assets/configs/push_habc.yaml --rl.rounds 4 --sft.steps 3000

An unknown key, in the file or on the command line, is an error that lists the valid keys at that level. Each RL
method's options are a group of their own (`rl.habc.*`, `rl.ppo.*`, ...), declared by the method
(`kinema.train.methods`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import draccus

from kinema.train.actor import REPLAY_MIXING
from kinema.train.methods import METHODS, RLMethod
from kinema.train.methods.base import HUMAN_STEPS
from sim.experts import APPROACHES, OPERATORS


DEMO_WEIGHTINGS = ("uniform", "return")
DEMO_IDLE = ("keep", "drop")
DEMO_INSTRUCTIONS = ("as_collected", "equivalent")


@dataclass
class DemoConfig:
    episodes: int = 40  # scripted demonstrations for SFT: the knob that places the SFT baseline (README, shipped configs)
    noise: float = 0.05  # expert action noise: clean demos are what a flow head copies well
    # DART (Laskey et al. 2017): stationary std of slowly varying noise on the command the expert executes, its clean
    # command recorded as the label, so that the demos show recoveries from off-path states (0: off)
    perturb: float = 0.0
    # How the pick-and-place expert comes down onto an object: gate | funnel (`sim.experts.ExpertConfig.approach`)
    approach: str = "gate"
    hesitation: float = 0.0
    wrong_grasp: float = 0.0
    source: str = "scripted"  # scripted (the expert) | teleop: a simulated teleoperator's slower, hesitant, detouring demos
    # How this run's SFT and rounds draw the demos' steps: uniform | return (ours: reward-weighted regression over
    # the demos, an episode `temperature` steps slower than the fastest weighing 1/e of it; for demos of uneven speed).
    weighting: str = "uniform"
    temperature: float = 10.0
    # The demos' idle steps (the arm neither moves nor changes its grip: a teleoperator's pauses): keep | drop (cut out
    # before training, HELP's idle rule on the demos, as VLA data pipelines drop no-op actions; ours)
    idle: str = "keep"
    # Which instruction each demo step is imitated under: as_collected | equivalent (ours: at each use, one drawn from
    # every training-template instruction naming the episode's targets -- its template and its naming, e.g. the
    # drawer by place or by colour -- regenerated from the episode's seed; a sim task's demos only)
    instructions: str = "as_collected"


@dataclass
class SFTConfig:
    steps: int = 2000  # gradient steps of supervised flow matching on the demos (where drawer's validation success flattens: benchmarks/sft_plateau.py)
    batch_size: int = 64
    lr: float = 3e-4
    weight_decay: float = 1e-4
    aux_weight: float = 1.0  # weight of the auxiliary losses: the privileged-position head, a grounded encoder's pixel loss (0: neither)


@dataclass
class RLRoundOptions:
    """What every method's rounds share; each method's own options follow as groups (see `RLConfig`)."""

    method: str = "habc"  # see `kinema train --help` for the registered methods
    rounds: int = 4
    episodes_per_round: int = 48  # rollouts per round
    updates_per_round: int = 600  # actor gradient steps per round
    batch_size: int = 64
    lr: float = 1e-4
    demo_fraction: float = 0.5  # replay_mixing fixed: share of each actor minibatch drawn from the demonstrations
    replay_mixing: str = "fixed"  # fixed (demo_fraction) | pooled: demos and weighted replay in one pool (HABC's loss)
    replay_rounds: int = 3  # rollouts of this many recent rounds are kept
    interventions: bool = False  # a simulated human monitors the policy and takes over before failures
    success_model: bool = True  # refit the eVTA_0 success-probability model every round (RLER) and log calibration
    success_target: str = "td"  # the success model's targets: td (eVTA_0) | mc (ours: every step's target is the outcome)
    # The ODE sampler's initial noise in the rollouts, scaled: 1 sampled (as the methods specify); below 1 the rollouts
    # act nearer the policy's mode (ours: more successes per round to learn from, less spread between them).
    rollout_noise_scale: float = 1.0
    # Rollouts execute chunks as the ROS 2 policy node does, each planned one tick ahead (ours: the in-simulation
    # counterpart of a robot loop's rollouts, benchmarks/robot_loop.py)
    rollout_plan_ahead: bool = False
    # The human's steps every method imitates: all (recovery and correction, as RaC and HG-DAgger) | correction (ours:
    # without the recovery drive back to the last good pose)
    human_steps: str = "all"


# The options group of every registered method that has options: rl.habc, rl.awr, rl.ppo, rl.nft, ...
RLConfig = dataclasses.make_dataclass(
    "RLConfig",
    [(m.options_key, m.options_class, field(default_factory=m.options_class)) for m in METHODS.values() if m.options_key],
    bases=(RLRoundOptions,),
)
RLConfig.__module__ = __name__


@dataclass
class EvalConfig:
    episodes: int = 100  # per split at the final evaluation (>= 100 for a 4-5 point standard error)
    round_episodes: int = 48  # per evaluation between rounds
    heldout: bool = True  # also evaluate held-out paraphrases and held-out object combinations
    ablated: bool = False  # also evaluate instructions that name no target (success should fall to chance)
    videos: int = 8  # episodes in the before/after video grids (the same seeds both times; 0: none)
    baseline: bool = True  # evaluate the starting (SFT) policy; off when branching from a run that already did
    # The ODE sampler's initial noise in evaluations, scaled: 1 sampled, 0 zero noise (deterministic, mode-seeking;
    # worth +8 to +12 points on drawer). Compare arms at the same setting; DSRL's actor picks its own noise.
    noise_scale: float = 1.0


ROLLOUT_BACKENDS = ("local", "ray")


@dataclass
class RolloutOptions:
    backend: str = "local"  # local: env worker processes on this machine (`workers`) | ray: Ray actors (`ray.*`)
    ray_workers: int = 0  # ray: rollout actors, each with its own envs and policy copy (0: `workers`, at least 1)
    gpus_per_worker: float = 0.0  # ray: GPU share of each actor (0: the policy runs on the actor's CPU)


@dataclass
class RayOptions:
    address: str = ""  # join this cluster ("auto", "ray://host:port"); empty: start a local Ray on 127.0.0.1
    num_cpus: int = 0  # a local Ray's CPUs (0: one per rollout actor)
    object_store_mb: int = 256  # a local Ray's object store


@dataclass
class RobotLoopOptions:
    """`kinema train --robot ROBOT`: the rounds' episodes run on a ROS 2 robot (kinema/train/robot_rounds.py)."""

    config: str = ""  # a robot config, YAML path or shipped name (as `kinema deploy --robot`); empty: rounds in simulation
    backend: str = "auto"  # auto: rclpy where ROS 2 is installed, else dds (as `kinema deploy --backend`)
    local: bool = True  # keep the ROS 2 traffic on this machine (as `kinema deploy --local`); false for a robot on the network
    episode_seconds: float = 30.0  # an episode ends at the success topic's True, or after this long (a failure)
    wait_robot: float = 20.0  # seconds to wait for the robot's joint states, then as long for its controller
    instruction: str = ""  # the task in words when the robot does not publish it on its instruction topic
    # Before each episode "reset" goes out on the episode topic; topic: that resets the scene (the sim robot, a reset
    # routine) | operator: a person resets it and presses Enter in this terminal
    reset: str = "topic"
    sim_eval: bool = True  # also evaluate in the simulated task (SFT, each round, final); false: a robot with no sim twin
    inference: str = "auto"  # the policy node's (as `kinema deploy --inference`): auto | sync (acts as the evaluation does) | async


@dataclass
class PolicyOptions(draccus.ChoiceRegistry):
    """The policy to train. `policy.type` picks its options group (`vla`, `video`, each registered below); the fields
    here are every type's. `--policy.type video --policy.video_size 32`; YAML `policy: {type: video, video_size: 32}`."""

    image_size: int = 64
    chunk_size: int = 8
    n_action_steps: int = 4
    num_flow_steps: int = 10
    ema_decay: float = 0.995  # the acting/evaluated policy is an EMA of the trained weights (0: no average)

    @classmethod
    def default_choice_name(cls) -> str:
        return "vla"

    @property
    def type(self) -> str:
        return self.get_choice_name(type(self))

    def config_class(self) -> type:
        from policies import policy_classes

        return policy_classes(self.type)[0]

    def policy_fields(self) -> dict[str, Any]:
        """The options that are fields of the policy type's config (all but ema_decay, a training option): the one
        mapping from these keys to the policy."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ema_decay"}

    def check(self) -> None:
        """The policy's own rules (its config class), checked when the config loads rather than after the demos are
        collected."""
        config_class = self.config_class()
        try:
            config_class(**self.policy_fields())
        except ValueError as err:
            raise ValueError(str(err).replace(f"{config_class.__name__}.", "policy.")) from None

    def advice(self) -> str | None:
        """What the run is likely missing with these options, said once at its start (None: nothing)."""
        return None

    def make(self, *, cameras: tuple[str, ...], aux_dim: int, tasks: list[str], stats: dict[str, Any]) -> Any:
        """The run's new policy: its config from these options, normalised by the demonstrations' stats."""
        from policies import make_policy

        config = self.config_class()(**self.policy_fields(), cameras=cameras, aux_dim=aux_dim, extra={"tasks": tasks})
        policy = make_policy(self.type, config)
        policy.set_normalization(stats)
        return policy


@PolicyOptions.register_subclass("vla")
@dataclass
class VLAOptions(PolicyOptions):
    """The VLA (policies/vla): an image+text encoder, FiLM, a flow-matching action expert."""

    backbone: str = "tiny"  # "tiny" (from scratch) or "smolvlm": the local SmolVLM/Idefics3 checkpoint at backbone_path, LoRA
    backbone_path: str = ""  # a local folder; nothing is downloaded
    backbone_layers: int = 0  # text layers of the backbone to run (SmolVLA runs half); 0: all
    backbone_image_size: int = 0  # side its vision tower sees; 0: native (512 for SmolVLM); smaller is much cheaper on CPU
    lora_rank: int = 8  # LoRA rank on the backbone's text model (0: frozen backbone, heads only)
    freeze_vision: bool = True  # False: LoRA on the vision tower too
    # what the privileged-position head reads: "fused" (+ state) | "perception" (images + text only) | "keypoints"
    aux_input: str = "fused"
    # "patchify" (stride-4 first conv) | "spatial_softmax" (full resolution, keypoints) | "patchify_grounded" (+ where the words' objects are)
    vision_encoder: str = "patchify"
    keypoints: int = 32  # spatial_softmax, patchify_grounded: (x, y) keypoints per camera
    where_weight: float = 1.0  # patchify_grounded: its locators classify the named target's / goal's cell (pixel labels) in SFT
    locator_stride: int = 4  # patchify_grounded: its locators' map at image_size / 4 or / 2 (2: 2-pixel cells, sharper points)
    instruction_input: str = "pooled"  # "pooled" (FiLM + fused feature) | "locator" (patchify_grounded: through its keypoints alone)
    # patchify_grounded: cameras whose target and goal points join the state (detached, as the pixel oracle's labels), e.g. [agentview]
    state_points: tuple[str, ...] = ()
    state_points_training: str = "located"  # what those points are in SFT: "located" (the locator's) | "labels" (the sim's pixel labels)
    state_dropout: float = 0.0  # probability of hiding the end-effector pose from the policy per training sample
    augment_shift: int = 4  # random-shift augmentation in training (pixels); 0 disables
    text_position_jitter: bool = False  # instructions start at a random word position in training (tiny backbone)
    text_filler_words: float = 0.0  # share of training instructions given 1-2 random unknown words (e.g. 0.5)
    text_positions: str = "absolute"  # word order (tiny backbone): "absolute" slot embeddings | "relative" (neighbours, no slot)


@PolicyOptions.register_subclass("video")
@dataclass
class VideoPolicyOptions(PolicyOptions):
    """The video-diffusion policy (policies/video_policy): frames and actions denoised together by a Wan transformer."""

    video_size: int = 32  # side of the frames the video model denoises
    generator_path: str = ""  # a `kinema video train` run folder or a local diffusers-layout Wan folder (LoRA-tuned); empty: a tiny random Wan
    lora_rank: int = 8  # generator_path only: LoRA rank on the pretrained transformer (the tiny one trains fully)
    planning_candidates: int = 1  # best-of-N chunks ranked by predicted value; 1: no planning
    slot_times: str = "independent"  # "independent" (UWM): actions and future frames noised apart, given slots clean | "shared" (Cosmos)
    acting: str = "actions"  # "actions": acting denoises the action slot alone (cheap) | "joint": the whole sequence, futures too
    action_head: str = "expert"  # "expert": a flow MLP on the transformer's features denoises the chunk | "slot": the transformer, as a slot
    action_gradients: str = "trunk"  # expert head: "stop" keeps the action loss out of the transformer (Video Policy)
    expert_layer: int = -1  # expert head: the transformer block whose outputs over the current slots it reads (-1: the last)
    expert_text: bool = False  # expert head: also reads the instruction's mean text embedding itself

    def advice(self) -> str | None:
        if self.generator_path:
            return None
        return ("the video policy starts from a random tiny Wan trunk (drawer: 18-20 % after 1000 SFT steps, the VLA "
                "33 %: benchmarks/RESULTS.md); a video model's prior is what Cosmos Policy's results rest on: "
                "--policy.generator_path RUN_DIR takes a `kinema video train` run (on drawer its tiny generator did not "
                "help yet: 6 %, 3.6x the CPU a step) or a local Wan checkpoint folder (GPU)")  # fmt: skip


@dataclass
class LeRobotFlowOptions(PolicyOptions):
    """A LeRobot flow VLA checkpoint (policies/lerobot_flow), post-trained as it is: `--policy.checkpoint FOLDER`
    (LeRobot's folder, or a kinema run's checkpoint of one). The shared keys at 0 keep the checkpoint's own values.
    Each architecture registers a subclass naming its policy class and what locates its language side locally."""

    name: ClassVar[str] = ""  # how errors name the checkpoint kind

    chunk_size: int = 0  # the checkpoint's (an architecture field: another value is refused)
    n_action_steps: int = 0  # actions executed per chunk; 0: the checkpoint's
    num_flow_steps: int = 0  # Euler steps; 0: the checkpoint's num_steps
    checkpoint: str = ""  # the folder to start from (config.json, model.safetensors, policy_*processor files)
    camera_map: dict[str, str] = field(default_factory=dict)  # kinema camera -> the checkpoint's image feature
    # "expert": the action expert and its projections (LeRobot's default) | "lora": those + LoRA on the VLM's text
    # attention (merged into the weights on save) | "vlm": the VLM's text layers too | "all": everything
    trainable: str = "expert"
    lora_rank: int = 16  # trainable lora only
    # checkpoint: keep the normalisation stats it was trained with | dataset: the run's demonstrations' (a checkpoint
    # that never saw this task's state and action ranges, e.g. trained from scratch here)
    normalization: str = "checkpoint"

    def policy_fields(self) -> dict[str, Any]:
        """The options that set fields of the policy's config (by their names there); 0 and "" keep the checkpoint's."""
        fields = {"image_size": self.image_size, "chunk_size": self.chunk_size, "n_action_steps": self.n_action_steps,
                  "num_steps": self.num_flow_steps, "camera_map": dict(self.camera_map), "trainable": self.trainable,
                  "lora_rank": self.lora_rank, "lora_alpha": float(self.lora_rank), **self.language_fields()}  # fmt: skip
        return {k: v for k, v in fields.items() if v or k == "chunk_size"}

    def language_fields(self) -> dict[str, Any]:
        """The architecture's own fields (where its VLM or tokenizer is, locally)."""
        return {}

    def check(self) -> None:
        from policies.lerobot_flow import TRAINABLE

        if not self.checkpoint:
            raise ValueError(f"policy.type {self.type} post-trains an existing checkpoint: set policy.checkpoint to a local "
                             f"LeRobot {self.name} folder (config.json, model.safetensors, policy_*processor files)")  # fmt: skip
        if not (Path(self.checkpoint) / "config.json").is_file():
            raise ValueError(f"policy.checkpoint {self.checkpoint!r} has no config.json; expected a local LeRobot {self.name} folder")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"policy.trainable must be one of {list(TRAINABLE)}; got {self.trainable!r}")
        if self.normalization not in ("checkpoint", "dataset"):
            raise ValueError(f"policy.normalization must be 'checkpoint' or 'dataset'; got {self.normalization!r}")
        for name in ("chunk_size", "n_action_steps", "num_flow_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"policy.{name} must be >= 0 (0: the checkpoint's); got {getattr(self, name)}")

    def make(self, *, cameras: tuple[str, ...], aux_dim: int, tasks: list[str], stats: dict[str, Any]) -> Any:
        """The checkpoint, loaded; it keeps the normalisation it was trained with, and must fit the task's state."""
        from policies import policy_classes

        fields = self.policy_fields()
        chunk_size = fields.pop("chunk_size")
        policy = policy_classes(self.type)[1].from_pretrained(self.checkpoint, **fields)
        config = policy.config
        if chunk_size and chunk_size != config.chunk_size:
            raise ValueError(f"policy.chunk_size {chunk_size}: the checkpoint {self.checkpoint} predicts chunks of {config.chunk_size} (set 0 or that)")
        state_dim = len(stats["observation.state"]["mean"])
        if state_dim != config.state_dim:
            raise ValueError(f"the task's observation.state has {state_dim} values; the {self.name} checkpoint {self.checkpoint} was trained on {config.state_dim}")
        config.extra["tasks"] = [*config.extra.get("tasks", []), *(t for t in tasks if t not in config.extra.get("tasks", []))]
        if self.normalization == "dataset":
            policy.set_normalization(stats)
        return policy


@PolicyOptions.register_subclass("smolvla")
@dataclass
class SmolVLAOptions(LeRobotFlowOptions):
    """A LeRobot SmolVLA checkpoint (policies/smolvla): `--policy.checkpoint FOLDER` and `--policy.vlm_path` (a local
    copy of its VLM's config and tokenizer)."""

    name: ClassVar[str] = "SmolVLA"
    vlm_path: str = ""  # the VLM's config.json and tokenizer, locally; empty: the checkpoint's vlm_model_name if local

    def language_fields(self) -> dict[str, Any]:
        return {"vlm_path": self.vlm_path}


@PolicyOptions.register_subclass("pi0")
@dataclass
class Pi0Options(LeRobotFlowOptions):
    """A LeRobot pi0 checkpoint (policies/pi0): `--policy.checkpoint FOLDER`; `--policy.tokenizer_path` where the
    folder holds no tokenizer of its own (LeRobot main saves one beside the checkpoint)."""

    name: ClassVar[str] = "pi0"
    tokenizer_path: str = ""  # a local copy of PaliGemma's tokenizer; empty: the one beside the checkpoint

    def language_fields(self) -> dict[str, Any]:
        return {"tokenizer_path": self.tokenizer_path}


@dataclass
class TrainConfig:
    # What the run's demos, SFT and checkpoints were made with: `--resume` refuses overrides of these.
    RESUME_FIXED: ClassVar[tuple[str, ...]] = (
        "task", "task_config", "seed", "dataset", "init_policy", "policy", "demos", "sft", "rl.method", "rl.interventions",
        "robot.config",
    )  # fmt: skip

    task: str = "drawer"  # the task family (kinema sim list); drawer is the quickest to learn on a CPU
    task_config: dict[str, Any] = field(default_factory=dict)  # overrides of the task's difficulty config
    out: str = ""  # run folder; default runs/<task>-<method>-s<seed>
    seed: int = 0
    num_envs: int = 8  # envs per rollout batch
    workers: int = 2  # env worker processes (0: step envs in this process)
    threads: int = 1  # torch threads while envs step (rollouts, evaluations): a second one spins against the env workers
    # torch threads for SFT and the rounds' updates, while the env workers wait (0: every core this process may use,
    # or OMP_NUM_THREADS where it is set, as torchrun and the test workers set it)
    learner_threads: int = 0
    dataset: str = ""  # train SFT on this LeRobotDataset folder instead of collecting scripted demos
    init_policy: str = ""  # start RL from this checkpoint instead of running SFT (e.g. another run's checkpoints/sft)
    tensorboard: bool = False  # also log the metrics as TensorBoard scalars in RUN_DIR/tensorboard (kinema[tensorboard])
    policy: PolicyOptions = field(default_factory=VLAOptions)
    demos: DemoConfig = field(default_factory=DemoConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutOptions = field(default_factory=RolloutOptions)
    ray: RayOptions = field(default_factory=RayOptions)
    robot: RobotLoopOptions = field(default_factory=RobotLoopOptions)

    # Keys an older kinema wrote, and where they live now: an old run's config.yaml still loads and resumes.
    RENAMED_KEYS: ClassVar[dict[str, str]] = {
        **{f"rl.ppo_{k}": f"rl.ppo.{k}" for k in (
            "advantage", "gae_lambda", "clip", "noise_level", "epochs", "target_kl", "kl_weight", "lr", "expert_only")},
        "rl.group_size": "rl.ppo.group_size", "rl.awr_temperature": "rl.awr.temperature",
        "rl.nft_beta": "rl.nft.beta", "rl.nft_adv_clip_max": "rl.nft.adv_clip_max",
        "rl.demo_weighting": "demos.weighting", "rl.demo_temperature": "demos.temperature",
    }  # fmt: skip

    @staticmethod
    def migrate(data: dict[str, Any], old_names: list[str]) -> None:
        """Before the methods had their own options, rl.habc.critic_steps also set the AWR and GAE critics' steps."""
        rl = data.get("rl", {})
        steps = rl.get("habc", {}).get("critic_steps")
        if steps is not None:
            for group in ("awr", "ppo"):
                rl.setdefault(group, {}).setdefault("critic_steps", steps)

    def __post_init__(self) -> None:
        if self.rl.method not in METHODS:
            raise ValueError(f"rl.method {self.rl.method!r} is not known; valid: {', '.join(METHODS)}")
        if self.policy.type not in METHODS[self.rl.method].policy_types:  # each method says which policy types it trains
            supported = [name for name, method in METHODS.items() if self.policy.type in method.policy_types]
            raise ValueError(f"rl.method {self.rl.method!r} does not train a {self.policy.type!r} policy; valid for it: {', '.join(supported)}")
        if isinstance(self.policy, LeRobotFlowOptions) and self.init_policy:
            raise ValueError(f"policy.type {self.policy.type} starts from policy.checkpoint (a LeRobot {self.policy.name} folder, or a "
                             f"kinema run's checkpoint of one); init_policy {self.init_policy!r} has no part: name it as policy.checkpoint")  # fmt: skip
        METHODS[self.rl.method].check_config(self)
        if self.rl.rollout_plan_ahead and (METHODS[self.rl.method].rollout_plan is not RLMethod.rollout_plan or self.robot.config):
            raise ValueError(f"rl.rollout_plan_ahead runs the policy's own chunks in simulation as the ROS 2 node would; "
                             f"rl.method {self.rl.method!r} acts with a runner of its own" if not self.robot.config else
                             "rl.rollout_plan_ahead is for rounds in simulation: a robot's rounds already run through the node")  # fmt: skip
        if self.rl.replay_mixing not in REPLAY_MIXING:
            raise ValueError(f"rl.replay_mixing {self.rl.replay_mixing!r} is not known; valid: {', '.join(REPLAY_MIXING)}")
        if self.rl.human_steps not in HUMAN_STEPS:
            raise ValueError(f"rl.human_steps {self.rl.human_steps!r} is not known; valid: {', '.join(HUMAN_STEPS)}")
        if self.rl.human_steps != "all" and not self.rl.interventions:
            raise ValueError(f"rl.human_steps {self.rl.human_steps} chooses which of the simulated human's steps are "
                             "imitated: it needs rl.interventions true; got rl.interventions false")
        if self.rl.success_target not in ("td", "mc"):
            raise ValueError(f"rl.success_target {self.rl.success_target!r} is not known; valid: td, mc")
        if not 0.0 <= self.rl.demo_fraction <= 1.0:
            raise ValueError(f"rl.demo_fraction must be in [0, 1]; got {self.rl.demo_fraction}")
        for name, value in (
            ("sft.steps", self.sft.steps), ("rl.rounds", self.rl.rounds), ("rl.updates_per_round", self.rl.updates_per_round),
            ("workers", self.workers), ("learner_threads", self.learner_threads),
        ):  # fmt: skip
            if value < 0:
                raise ValueError(f"{name} must be >= 0; got {value}")
        for name, value in (
            ("sft.batch_size", self.sft.batch_size), ("rl.batch_size", self.rl.batch_size), ("threads", self.threads),
            ("rl.episodes_per_round", self.rl.episodes_per_round),
            ("rl.replay_rounds", self.rl.replay_rounds), ("num_envs", self.num_envs), ("eval.episodes", self.eval.episodes),
            ("eval.round_episodes", self.eval.round_episodes),
        ):  # fmt: skip
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}")
        if self.robot.config:
            method = METHODS[self.rl.method]
            if not method.learns_from_recordings:
                learners = [name for name, m in METHODS.items() if m.learns_from_recordings]
                raise ValueError(f"robot.config: rl.method {self.rl.method!r} cannot train on a robot's recorded episodes "
                                 f"(it needs its own rollout records or actor); valid with a robot: {', '.join(learners)}")
            if self.rollout.backend != "local":
                raise ValueError(f"robot.config: the rounds' episodes come from the robot; rollout.backend {self.rollout.backend!r} has no part")
            if self.robot.reset not in ("topic", "operator"):
                raise ValueError(f"robot.reset {self.robot.reset!r} is not known; valid: topic, operator")
            from robot.policy_node import check_inference

            check_inference(self.robot.inference, "robot.inference")
            if self.robot.episode_seconds <= 0 or self.robot.wait_robot < 0:
                raise ValueError(f"robot.episode_seconds must be > 0 and robot.wait_robot >= 0; got {self.robot.episode_seconds}, {self.robot.wait_robot}")
        if self.rollout.backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"rollout.backend {self.rollout.backend!r} is not known; valid: {', '.join(ROLLOUT_BACKENDS)}")
        if self.rollout.ray_workers < 0 or self.rollout.gpus_per_worker < 0 or self.ray.num_cpus < 0:
            raise ValueError("rollout.ray_workers, rollout.gpus_per_worker and ray.num_cpus must be >= 0; got "
                             f"{self.rollout.ray_workers}, {self.rollout.gpus_per_worker}, {self.ray.num_cpus}")
        if self.ray.object_store_mb < 75:  # Ray refuses a smaller store
            raise ValueError(f"ray.object_store_mb must be >= 75; got {self.ray.object_store_mb}")
        from policies import policy_classes

        scales_noise = policy_classes(self.policy.type)[1].scales_initial_noise
        if self.eval.noise_scale < 0 or (self.eval.noise_scale != 1.0 and not scales_noise):
            raise ValueError(f"eval.noise_scale scales the VLA's initial flow noise and must be >= 0 (1: sampled, 0: zero noise); "
                             f"got {self.eval.noise_scale} with policy.type {self.policy.type}")
        if self.rl.rollout_noise_scale < 0 or (self.rl.rollout_noise_scale != 1.0 and not scales_noise):
            raise ValueError(f"rl.rollout_noise_scale scales the VLA's initial flow noise in the rollouts and must be >= 0 "
                             f"(1: sampled, 0: zero noise); got {self.rl.rollout_noise_scale} with policy.type {self.policy.type}")
        if self.demos.weighting not in DEMO_WEIGHTINGS:
            raise ValueError(f"demos.weighting {self.demos.weighting!r} is not known; valid: {', '.join(DEMO_WEIGHTINGS)}")
        if self.demos.idle not in DEMO_IDLE:
            raise ValueError(f"demos.idle {self.demos.idle!r} is not known; valid: {', '.join(DEMO_IDLE)}")
        if self.demos.instructions not in DEMO_INSTRUCTIONS:
            raise ValueError(f"demos.instructions {self.demos.instructions!r} is not known; valid: {', '.join(DEMO_INSTRUCTIONS)}")
        if self.demos.temperature <= 0:
            raise ValueError(f"demos.temperature is in steps and must be > 0; got {self.demos.temperature}")
        if self.demos.source not in OPERATORS:
            raise ValueError(f"demos.source {self.demos.source!r} is not known; valid: {', '.join(OPERATORS)}")
        if self.demos.approach not in APPROACHES:
            raise ValueError(f"demos.approach {self.demos.approach!r} is not known; valid: {', '.join(APPROACHES)}")
        if not (self.demos.perturb >= 0 and math.isfinite(self.demos.perturb)):
            raise ValueError(f"demos.perturb is a noise std in action units and must be a finite number >= 0; got {self.demos.perturb}")
        if self.demos.episodes < 1 and not self.dataset:
            raise ValueError(f"demos.episodes must be >= 1 (or give a dataset); got {self.demos.episodes}")
        if not 0.0 <= self.policy.ema_decay < 1.0:
            raise ValueError(f"policy.ema_decay must be in [0, 1) (0: no average); got {self.policy.ema_decay}")
        self.policy.check()

    def run_dir(self) -> Path:
        return Path(self.out or f"runs/{self.task}-{self.rl.method}-s{self.seed}")


