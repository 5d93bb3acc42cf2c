"""`kinema train`: demonstrations -> SFT -> online RL in rounds -> evaluation and a report.

Reads top to bottom:
    1. set up the run folder (or resume one);
    2. demonstrations (scripted expert, or a LeRobotDataset folder);
    3. SFT of the VLA (the baseline checkpoint), evaluated;
    4. RL rounds: roll out (optionally with the simulated human) -> refit the success model (RLER) ->
       update the critics -> per-step credit -> weighted flow-matching actor updates -> evaluate -> checkpoint;
    5. final evaluation on training templates, held-out paraphrases and held-out objects; curves, videos, report.

Every method (SFT only, continued SFT, AWR, HABC and its ablations) runs through this one path, selected by
`rl.method` and `rl.habc.*`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from diffusion_rl.data import Episode
from diffusion_rl.data.lerobot_v3 import read_episodes, write_episodes
from diffusion_rl.habc import HABCConfig
from kinema.board import Board
from kinema.cputime import CpuClock
from kinema.sim_commands import progress_bar
from kinema.train.buffer import StepBuffer
from kinema.train.config import REPLAY_MIXING, TrainConfig, dump_config
from kinema.train.credit import CriticState, awr_step_weights, habc_step_weights, nft_step_weights, refit_success_model
from kinema.train.evaluate import SPLITS, ChunkPolicy, EvalResult, evaluate, summarize
from kinema.train.ppo import (
    flow_ppo_updates,
    gae_chunk_advantages,
    grpo_chunk_advantages,
    restrict_to_flow_grpo_settings,
)
from kinema.train.report import record_videos, write_curves, write_report
from policies.checkpoint import atomic_file, load_checkpoint_config, set_aside, write_text_atomic
from policies.vla import VLAConfig, VLAPolicy
from sim.env import CAMERAS
from sim.experts import ExpertConfig
from sim.monitor import MonitorConfig
from sim.rollout import collect, collect_demos, make_vector

STATE_FILE = "state.json"
ROLLOUT_SEED_OFFSET = 100_000  # rollout seeds: disjoint from demo seeds (0..) and evaluation seeds (1e6..)


class Run:
    """The run folder: metrics log, checkpoints, the resumable state.

    The state (state.json) is saved together with each checkpoint and records how many metrics records existed
    then (`metrics_records`). Records logged after it describe work the checkpoint does not hold (rounds after
    the last checkpoint, a final evaluation cut short): `resume()` drops them, because the resumed run redoes
    that work and logs it again.
    """

    METRICS = "metrics.jsonl"

    def __init__(self, root: Path, console: Console, *, tensorboard: bool = False, step_key: str = "env_steps") -> None:
        """`tensorboard`: also show every record as TensorBoard scalars at its `step_key` (kinema.board)."""
        self.root = root
        self.console = console
        self.board = Board(root, step_key) if tensorboard else None
        self.cpu = CpuClock()
        root.mkdir(parents=True, exist_ok=True)
        (root / "checkpoints").mkdir(exist_ok=True)
        if self.board is not None:
            console.print(f"TensorBoard: tensorboard --logdir {self.board.dir}")

    def log(self, record: dict[str, Any]) -> None:
        # cpu_s: CPU seconds the run has spent so far, env workers included (kinema.cputime).
        record = {"time": round(time.time(), 1), "cpu_s": round(self.cpu.seconds(), 1), **record}
        with open(self.root / self.METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.board is not None:
            self.board.log(record)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    def _lines(self) -> list[str]:
        path = self.root / self.METRICS
        if not path.exists():
            return []
        text = path.read_text()
        # A kill mid-write can leave a torn last line (no newline): it is not a record.
        return text.split("\n")[:-1]

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self._lines()]

    def state(self) -> dict[str, Any]:
        path = self.root / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def save_state(self, state: dict[str, Any]) -> None:
        state = {**state, "metrics_records": len(self._lines())}
        with atomic_file(self.root / STATE_FILE) as tmp:
            tmp.write_text(json.dumps(state, indent=2))

    def resume(self) -> dict[str, Any]:
        """The saved state, with metrics.jsonl rewritten (atomically) to the records it had when that state was
        saved: nothing past the checkpoint is kept, so the resumed run's records are not duplicates.
        State files without `metrics_records` (older runs) keep the records up to the checkpointed round."""
        state = self.state()
        if not state:
            return state
        lines = self._lines()
        keep = state.get("metrics_records")
        if keep is None:
            last = state.get("round", 0)
            kept = [line for line in lines if json.loads(line).get("round", 0) <= last]
        else:
            kept = lines[:keep]
        if (self.root / self.METRICS).exists():
            write_text_atomic(self.root / self.METRICS, "".join(line + "\n" for line in kept))
        if kept:  # CPU time after the checkpoint went with its records; the redo counts
            self.cpu.carry(json.loads(kept[-1]).get("cpu_s", 0.0))
        if self.board is not None:
            self.board.resumed_after([json.loads(line) for line in kept])
        return state


COLLECTED_WITH = "collected_with.json"  # beside a run's collected episodes: what collected them


def read_collected(folder: Path, *, task: str, seeds: range, settings: dict[str, Any]) -> list[Episode] | None:
    """The episodes an earlier start of this run collected into `folder` (None when there are none), reused only
    if they are what this config collects now: the same task and seeds, and the same collection `settings` (expert
    noise, image size, task config: see `write_collected`). Otherwise a clear error, rather than training a `stack`
    run on leftover `drawer` demos."""
    if not (folder / "meta" / "info.json").exists():
        return None
    episodes = read_episodes(folder)
    tasks = sorted({ep.task_id for ep in episodes})
    found = sorted(ep.seed for ep in episodes)
    recorded = folder / COLLECTED_WITH
    saved = json.loads(recorded.read_text()).get("settings") if recorded.is_file() else None  # None: older runs
    wanted = json.loads(json.dumps(settings, default=list))  # as it reads back from JSON
    problems = []
    if tasks != [task] or found != list(seeds):
        problems.append(
            f"{len(episodes)} episodes of {', '.join(tasks) or 'no task'} (seeds {found[0] if found else '-'}"
            f"..{found[-1] if found else '-'}), where this config collects {len(seeds)} of {task} (seeds "
            f"{seeds.start}..{seeds.stop - 1})"
        )
    if saved is not None and saved != wanted:
        problems += [f"{k} {saved.get(k)!r} (this config: {wanted.get(k)!r})" for k in sorted(saved.keys() | wanted.keys())
                     if saved.get(k) != wanted.get(k)]  # fmt: skip
    if problems:
        raise ValueError(
            f"{folder} was collected by an earlier start of this run with other settings: {'; '.join(problems)}. "
            f"Remove {folder} to collect afresh, or choose another --out"
        )
    return episodes


def write_collected(folder: Path, episodes: Sequence[Episode], *, settings: dict[str, Any]) -> list[Episode]:
    """Write freshly collected episodes with the settings that collected them, and read them back: a run trains on
    what is on disk, exactly as a resumed or restarted run will."""
    write_episodes(folder, episodes)
    write_text_atomic(folder / COLLECTED_WITH, json.dumps({"settings": settings}, indent=2, default=list))
    return read_episodes(folder)


def warn_if_other_task(episodes: Sequence[Episode], task: str, source: str | Path, console: Console) -> None:
    """A user's dataset of another task is allowed (e.g. a robot recording), but said so."""
    others = sorted({ep.task_id or "unlabelled" for ep in episodes} - {task})
    if others:
        console.print(f"[yellow]note: {source} holds episodes of {', '.join(others)}, and this run's task is {task}[/yellow]")


def save_checkpoint(
    run: Run, name: str, acting: VLAPolicy, online: VLAPolicy, optimizer: torch.optim.Optimizer, critics: CriticState, state: dict
) -> Path:
    """The acting (EMA) policy as the checkpoint (`VLAPolicy.from_pretrained`), plus what --resume needs:
    the online weights, the optimiser and the critics."""
    trainer = io.BytesIO()
    torch.save(
        {"online": online.state_dict(), "optimizer": optimizer.state_dict(), "critics": critics.state_dict(), "state": state},
        trainer,
    )
    path = run.root / "checkpoints" / name
    acting.save_pretrained(str(path), extra_files={"trainer.pt": trainer.getvalue()})
    return path


def load_trainer(path: Path, online: VLAPolicy, optimizer: torch.optim.Optimizer, critics: CriticState) -> None:
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    online.load_state_dict(trainer["online"])
    optimizer.load_state_dict(trainer["optimizer"])
    critics.load_state_dict(trainer["critics"])


@torch.no_grad()
def ema_update(ema: VLAPolicy, online: VLAPolicy, decay: float) -> None:
    """Exponential moving average of the weights: the policy that acts. Flow policies trained on small data
    swing widely between nearby checkpoints; the average does not."""
    for e, o in zip(ema.parameters(), online.parameters()):
        if o.requires_grad:  # a frozen backbone's weights are equal in both: averaging them only costs time
            e.lerp_(o, 1.0 - decay)
    for e, o in zip(ema.buffers(), online.buffers()):
        e.copy_(o)


def policy_features(policy: VLAPolicy, buffer: StepBuffer, batch_size: int = 256) -> torch.Tensor:
    """φ(s) for every step of a buffer, (N_steps, hidden_dim), in eval mode (no augmentation)."""
    was_training = policy.training
    policy.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(buffer), batch_size):
            index = np.arange(start, min(start + batch_size, len(buffer)))
            out.append(policy.features(buffer.batch(index, policy.config.chunk_size)))
    policy.train(was_training)
    return torch.cat(out)


def split_per_episode(flat: torch.Tensor, buffer: StepBuffer) -> list[torch.Tensor]:
    return [flat[s : s + n] for s, n in zip(buffer.episode_start, buffer.episode_length)]


@dataclasses.dataclass
class NFTTerms:
    """What the DiffusionNFT actor loss needs beyond the batch: the policy that sampled the round (frozen), each
    replay step's positive-branch weight r (aligned with the replay buffer), NFT's β and A_max."""

    old: VLAPolicy
    r: np.ndarray
    beta: float
    adv_clip_max: float


def actor_updates(
    policy: VLAPolicy,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    batch_size: int,
    demos: StepBuffer,
    replay: StepBuffer | None,
    replay_weights: np.ndarray | None,
    demo_fraction: float,
    aux_weight: float,
    rng: np.random.Generator,
    mixing: str = "fixed",
    nft: NFTTerms | None = None,
    on_step=None,
) -> dict[str, float]:
    """Flow-matching updates on a mix of demonstrations (weight 1) and replay steps drawn ∝ their credit weight.

    mixing "fixed": `demo_fraction` of every minibatch comes from the demonstrations. "pooled" (HABC's weighted
    loss over demos ∪ rollouts): demos and replay steps form one pool, a demo step counting 1 and a replay step its
    weight (the credit rules normalise kept weights to mean 1), so the replay share is W / (N_demo + W) and a
    handful of successes is not oversampled to half of every batch.

    With `nft` the loss is DiffusionNFT's instead of weighted flow matching: demos count as positives (r = 1), replay
    steps carry their own r. Policy and old policy then run in eval mode, so that both see the very same inputs (no
    augmentation or state dropout): v_θ − v_old must be the update alone.
    """
    use_replay = replay is not None and replay_weights is not None and replay_weights.sum() > 0
    imitable = demos.imitable_index()
    if not len(imitable):
        raise ValueError("no demonstration step to imitate: every step is labelled idle or failure-inducing")
    if mixing not in REPLAY_MIXING:
        raise ValueError(f"replay mixing must be one of {REPLAY_MIXING}; got {mixing!r}")
    if not use_replay:
        replay_share = 0.0
    elif mixing == "pooled":
        replay_share = float(replay_weights.sum()) / (len(imitable) + float(replay_weights.sum()))
    else:
        replay_share = 1.0 - demo_fraction
    probs = replay_weights / replay_weights.sum() if use_replay else None
    losses, n_replay_total = [], 0
    policy.train(nft is None)
    for _ in range(steps):
        if mixing == "pooled":
            n_replay = int(rng.binomial(batch_size, replay_share))
        else:
            n_replay = int(round(batch_size * replay_share))
        n_replay_total += n_replay
        parts = [demos.batch(rng.choice(imitable, batch_size - n_replay), policy.config.chunk_size)] if n_replay < batch_size else []
        replay_index = rng.choice(len(replay), n_replay, p=probs) if n_replay else np.zeros(0, dtype=np.int64)
        if n_replay:
            parts.append(replay.batch(replay_index, policy.config.chunk_size))
        batch = _concat_batches(parts)
        context, aux_features = policy.encode(batch)
        if nft is None:
            loss = policy.flow_loss(batch, context=context).mean()
        else:
            r = torch.from_numpy(np.concatenate([np.ones(batch_size - n_replay, np.float32), nft.r[replay_index]]))
            loss = policy.nft_loss(batch, old=nft.old, r=r, beta=nft.beta, adv_clip_max=nft.adv_clip_max, context=context).mean()
        if aux_weight and "aux_target" in batch:
            loss = loss + aux_weight * policy.aux_loss(batch, aux_features).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step()
    return {
        "actor/loss": float(np.mean(losses)) if losses else float("nan"),
        "actor/replay_share": n_replay_total / (batch_size * steps) if steps else replay_share,
    }


def _set_aside_interrupted_rollouts(rollouts: Path, last_round: int, console: Console) -> None:
    """Rollouts of a round after the last checkpoint came from a round the kill interrupted: that round runs again,
    so they are renamed `interrupted-round-NNN[-k]` (kept, never deleted, and no longer read as replay)."""
    for stale in sorted(rollouts.glob("round-*")):
        if not stale.name[6:].isdigit() or int(stale.name[6:]) <= last_round:
            continue
        dest = set_aside(stale, f"interrupted-{stale.name}")
        console.print(f"rollouts of the interrupted {stale.name} kept as {dest}; the round runs again")


def _concat_batches(parts: Sequence[dict]) -> dict:
    if len(parts) == 1:
        return parts[0]
    keys = set(parts[0]).intersection(*parts[1:])
    return {k: (sum((p[k] for p in parts), []) if k == "task" else torch.cat([p[k] for p in parts])) for k in keys}


def rollouts(
    policy: VLAPolicy, cfg: TrainConfig, seeds: Sequence[int], round_index: int, runner: ChunkPolicy | None = None,
    serials: list[int] | None = None,
) -> list[Episode]:
    kwargs: dict[str, Any] = dict(image_size=cfg.policy.image_size, config=cfg.task_config or None)
    if cfg.rl.interventions:
        kwargs.update(actor="monitored", monitor=MonitorConfig())
    num_envs = max(1, min(cfg.num_envs, len(seeds)))
    vector = make_vector(cfg.task, num_envs, num_workers=min(cfg.workers, num_envs), **kwargs)
    try:
        return collect(
            vector, runner or ChunkPolicy(policy), seeds, task_id=cfg.task, policy_version=f"round-{round_index}",
            serials=serials,
        )  # fmt: skip
    finally:
        vector.close()


def evaluate_all(policy: VLAPolicy, cfg: TrainConfig, episodes: int, *, heldout: bool) -> dict[str, EvalResult]:
    splits = list(SPLITS) if heldout else ["train"]
    out = {}
    for split in splits:
        try:
            out[split], _ = evaluate(
                policy, cfg.task, episodes=episodes, split=split, num_envs=cfg.num_envs, num_workers=cfg.workers,
                image_size=cfg.policy.image_size, task_config=cfg.task_config or None, seed=cfg.seed * 10_000,
            )  # fmt: skip
        except ValueError as err:  # e.g. a task without held-out object combinations
            out[split] = None
            Console(stderr=True).print(f"[yellow]skipping evaluation split {split}: {err}")
    return {k: v for k, v in out.items() if v is not None}


def _eval_record(stage: str, results: dict[str, EvalResult], env_steps: int, round_index: int) -> dict[str, Any]:
    record: dict[str, Any] = {"kind": "eval", "stage": stage, "round": round_index, "env_steps": env_steps}
    for split, res in results.items():
        record.update(res.as_dict(prefix=f"{split}/"))
    return record


def train(cfg: TrainConfig, *, resume: bool = False, console: Console | None = None) -> Path:
    console = console or Console(stderr=True)
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)

    # 1. Run folder ------------------------------------------------------------------------------------------------
    run = Run(cfg.run_dir(), console, tensorboard=cfg.tensorboard, step_key="env_steps")
    state = run.resume() if resume else {}  # drops metrics records the last checkpoint does not cover
    if resume and not state:
        raise FileNotFoundError(f"nothing to resume in {run.root}: no {STATE_FILE} (start it without --resume)")
    if not resume and run.state():
        raise FileExistsError(f"{run.root} already holds a run; pass --resume to continue it, or choose another --out")
    # Checked before the demos are collected; a resumed run loads its own checkpoint instead.
    init_changes = _check_init_policy(cfg, console) if cfg.init_policy and not state.get("latest_checkpoint") else {}
    write_text_atomic(run.root / "config.yaml", dump_config(cfg))
    cameras = CAMERAS

    # 2. Demonstrations ------------------------------------------------------------------------------------------------
    demo_dir = run.root / "demos"
    demo_seeds = range(cfg.seed * 10_000, cfg.seed * 10_000 + cfg.demos.episodes)
    demo_settings = {"demos": dataclasses.asdict(cfg.demos), "task_config": cfg.task_config, "image_size": cfg.policy.image_size}
    if cfg.dataset:
        if (Path(cfg.dataset) / "dataset" / "meta" / "info.json").exists():
            cfg.dataset = str(Path(cfg.dataset) / "dataset")  # a `kinema deploy --record` folder: its dataset part
        from robot.recorder import pending_spools

        if spools := pending_spools(cfg.dataset):  # a crashed recording: its last episode is not in the dataset yet
            console.print(
                f"[yellow]warning: {len(spools)} recorded episode(s) in {spools[0].parent} are not in the dataset "
                "yet (the recorder was interrupted); to include them, first run: python -c \"from robot.recorder "
                f"import EpisodeRecorder; print(EpisodeRecorder.recover('{Path(cfg.dataset).parent}'))\"[/yellow]"
            )
        demos = read_episodes(cfg.dataset)
        console.print(f"loaded {len(demos)} episodes from {cfg.dataset}")
        warn_if_other_task(demos, cfg.task, cfg.dataset, console)
    elif (collected := read_collected(demo_dir, task=cfg.task, seeds=demo_seeds, settings=demo_settings)) is not None:
        demos = collected
    else:
        with progress_bar(console) as bar:
            job = bar.add_task("demonstrations", total=cfg.demos.episodes, status="")
            demos = collect_demos(
                cfg.task, cfg.demos.episodes, seeds=demo_seeds,
                expert=ExpertConfig(noise=cfg.demos.noise, hesitation=cfg.demos.hesitation, wrong_grasp=cfg.demos.wrong_grasp),
                num_envs=cfg.num_envs, num_workers=cfg.workers, image_size=cfg.policy.image_size,
                config=cfg.task_config or None, on_episode=lambda ep: bar.update(job, advance=1),
            )  # fmt: skip
        demos = write_collected(demo_dir, demos, settings=demo_settings)
    demo_success = float(np.mean([e.outcome for e in demos])) if demos else 0.0
    demos = [ep for ep in demos if ep.outcome]  # imitate successes only
    if not demos:
        raise ValueError("no successful demonstration to imitate (every demo episode failed)")
    demo_buffer = StepBuffer.from_episodes(demos, cameras)
    run.log({"kind": "demos", "episodes": len(demos), "steps": len(demo_buffer), "success": demo_success})

    # 3. Policy and SFT ------------------------------------------------------------------------------------------------
    aux_dim = demo_buffer.aux.shape[1] if (demo_buffer.aux is not None and cfg.sft.aux_weight > 0) else 0
    vla_config = VLAConfig(**cfg.policy.vla_fields(), cameras=cameras, aux_dim=aux_dim, extra={"tasks": [cfg.task]})
    policy = VLAPolicy(vla_config)
    policy.set_normalization(demo_buffer.stats())
    critics = CriticState(vla_config.hidden_dim, critic_lr=cfg.rl.habc.critic_lr, value_scale=cfg.rl.habc.value_scale, seed=cfg.seed)
    env_steps, actor_step, start_round = 0, 0, 1
    latest = state.get("latest_checkpoint")
    # `policy` trains; `acting` (its EMA, or itself when the decay is 0) collects rollouts, is evaluated and saved.
    # Flow-SDE PPO must act with the very weights it updates, so it keeps no average.
    decay = 0.0 if cfg.rl.method == "flow_ppo" else cfg.policy.ema_decay

    if latest:
        acting = VLAPolicy.from_pretrained(str(run.root / latest))
        policy = VLAPolicy(acting.config)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.rl.lr, weight_decay=cfg.sft.weight_decay)
        load_trainer(run.root / latest, policy, optimizer, critics)
        if not decay:
            acting = policy
        env_steps, actor_step, start_round = state["env_steps"], state["actor_step"], state["round"] + 1
        console.print(f"resumed {run.root} after {latest} (round {state['round']})")
        _set_aside_interrupted_rollouts(run.root / "rollouts", state["round"], console)
    else:
        if cfg.init_policy:
            # Branch from an existing SFT checkpoint: every method of a comparison starts from the same policy.
            policy = VLAPolicy.from_pretrained(cfg.init_policy)
            for key, value in init_changes.items():  # read by the policy at each use: no rebuild needed
                setattr(policy.config, key, value)
            seen = list(policy.config.extra.get("tasks", []))
            policy.config.extra["tasks"] = seen if cfg.task in seen else [*seen, cfg.task]
            sft_steps = 0
        else:
            sft_steps = cfg.sft.steps
        acting = copy.deepcopy(policy).requires_grad_(False) if decay else policy
        optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.sft.lr, weight_decay=cfg.sft.weight_decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(sft_steps, 1), eta_min=cfg.rl.lr)
        with progress_bar(console) as bar, _interrupt_note(console, "SFT", run.root):
            job = bar.add_task("SFT", total=sft_steps, status="")

            done = [0]

            def sft_step() -> None:
                schedule.step()
                done[0] += 1
                if decay:  # warm-up of the average: early weights are noise, do not let them linger
                    ema_update(acting, policy, min(decay, (1 + done[0]) / (10 + done[0])))
                bar.update(job, advance=1)

            stats = actor_updates(
                policy, optimizer, steps=sft_steps, batch_size=cfg.sft.batch_size, demos=demo_buffer, replay=None,
                replay_weights=None, demo_fraction=1.0, aux_weight=cfg.sft.aux_weight if aux_dim else 0.0, rng=rng,
                on_step=sft_step,
            )  # fmt: skip
        run.log({"kind": "sft", "steps": sft_steps, "init_policy": cfg.init_policy, **stats})
        for group in optimizer.param_groups:
            group["lr"] = cfg.rl.lr
        if cfg.eval.baseline:
            with console.status("evaluating the SFT baseline"):
                results = evaluate_all(acting, cfg, cfg.eval.episodes, heldout=cfg.eval.heldout)
            run.log(_eval_record("sft", results, env_steps, 0))
            _print_eval(console, "SFT", results)
            record_videos(acting, cfg, run.root / "videos", "before")
        state = {"round": 0, "env_steps": 0, "actor_step": 0, "latest_checkpoint": "checkpoints/sft"}
        save_checkpoint(run, "sft", acting, policy, optimizer, critics, state)
        run.save_state(state)

    # 4. RL rounds -----------------------------------------------------------------------------------------------------
    method = cfg.rl.method
    rounds = 0 if method == "none" else cfg.rl.rounds
    # Flow-GRPO's KL anchor: the starting policy, as saved before the first round (also there after a resume).
    reference = None
    if method == "flow_ppo" and cfg.rl.ppo_kl_weight > 0:
        reference = VLAPolicy.from_pretrained(str(run.root / "checkpoints" / "sft")).requires_grad_(False).eval()
    if method == "flow_ppo":
        restrict_to_flow_grpo_settings(
            policy, optimizer, lr=cfg.rl.ppo_lr or cfg.rl.lr, expert_only=cfg.rl.ppo_expert_only
        )
    # NFT is on-policy: its r and v_old belong to the policy that sampled the newest round only.
    replay_rounds = 1 if method == "nft" else cfg.rl.replay_rounds
    replay: list[list[Episode]] = [
        read_episodes(run.root / "rollouts" / f"round-{r:03d}")
        for r in range(max(1, start_round - replay_rounds), start_round)
        if (run.root / "rollouts" / f"round-{r:03d}" / "meta" / "info.json").exists()
    ]
    habc_config = HABCConfig(
        gate=cfg.rl.habc.gate, warmup_steps=cfg.rl.habc.warmup_rounds * cfg.rl.updates_per_round,
        intervention_credit=cfg.rl.habc.intervention_credit, intervention_reweighting=cfg.rl.habc.intervention_reweighting,
        efficiency_target=cfg.rl.habc.efficiency_target,
    )  # fmt: skip
    try:
        with progress_bar(console) as bar:
            job = bar.add_task(f"RL ({method})", total=rounds * cfg.rl.updates_per_round, completed=(start_round - 1) * cfg.rl.updates_per_round, status="")
            for r in range(start_round, rounds + 1):
                record: dict[str, Any] = {"kind": "round", "round": r, "method": method}
                # 4a. Roll out the current policy (the continued-SFT control trains on demos only).
                replay_buffer, weights, nft = None, None, None
                if method != "sft_continued":
                    bar.update(job, status=f"round {r}: rollouts")
                    first = ROLLOUT_SEED_OFFSET + r * 1000
                    runner, serials = None, []
                    if method == "flow_ppo":  # chunks sampled with the SDE; GRPO: several rollouts per seed
                        per_seed = cfg.rl.group_size if cfg.rl.ppo_advantage == "grpo" else 1
                        seeds = [first + j // per_seed for j in range(cfg.rl.episodes_per_round)]
                        runner = ChunkPolicy(acting, sde_noise=cfg.rl.ppo_noise_level)
                    else:
                        seeds = list(range(first, first + cfg.rl.episodes_per_round))
                    new = rollouts(acting, cfg, seeds, r, runner, serials)
                    write_episodes(run.root / "rollouts" / f"round-{r:03d}", new)
                    env_steps += sum(len(ep) for ep in new)
                    rollout_stats = summarize(new)
                    record.update({"rollout/success": rollout_stats.success, "rollout/takeover_rate": rollout_stats.takeover_rate, "env_steps": env_steps})
                    replay = (replay + [new])[-replay_rounds:]
                    episodes = [ep for round_eps in replay for ep in round_eps]
                    record["replay/episodes"] = len(episodes)
                    replay_buffer = StepBuffer.from_episodes(episodes, cameras)
                    features = split_per_episode(policy_features(acting, replay_buffer), replay_buffer)
                    # 4b. RLER: calibration of the success model on fresh rollouts, then refit.
                    if cfg.rl.success_model:
                        new_feats = features[-len(new) :]
                        record.update(refit_success_model(critics, new, new_feats, target=cfg.rl.success_target))
                    # 4c-d. Critics and per-step credit.
                    bar.update(job, status=f"round {r}: critics")
                    if method == "habc":
                        reweighting = cfg.rl.habc.intervention_reweighting and r > cfg.rl.habc.intervention_reweighting_after
                        round_config = dataclasses.replace(habc_config, intervention_reweighting=reweighting)
                        record["habc/intervention_reweighting"] = reweighting
                        per_step, diag = habc_step_weights(
                            critics, episodes, features, config=round_config, critic_steps=cfg.rl.habc.critic_steps, actor_step=actor_step
                        )  # fmt: skip
                    elif method == "awr":
                        per_step, diag = awr_step_weights(
                            critics, episodes, features, temperature=cfg.rl.awr_temperature, critic_steps=cfg.rl.habc.critic_steps
                        )  # fmt: skip
                    elif method == "nft":
                        nft_r, per_step, diag = nft_step_weights(episodes, adv_clip_max=cfg.rl.nft_adv_clip_max)
                        nft = NFTTerms(copy.deepcopy(acting).requires_grad_(False).eval(), np.concatenate(nft_r), cfg.rl.nft_beta, cfg.rl.nft_adv_clip_max)
                    elif method == "flow_ppo" and cfg.rl.ppo_advantage == "gae":
                        per_step = None
                        chunk_advantages, diag = gae_chunk_advantages(
                            critics.value, critics.optimizers["value"], new, features[-len(new) :], serials,
                            runner.records, chunk_steps=acting.config.n_action_steps, lam=cfg.rl.ppo_gae_lambda,
                            critic_steps=cfg.rl.habc.critic_steps,
                        )  # fmt: skip
                    elif method == "flow_ppo":
                        per_step = None
                        chunk_advantages, diag = grpo_chunk_advantages(new, serials, runner.records)
                    else:
                        raise ValueError(f"rl.method {method!r} has no credit rule")
                    if per_step is not None:
                        weights = np.concatenate(per_step)
                        record["weights/nonzero_share"] = float((weights > 0).mean())
                    record.update(diag)
                # 4e. Actor: weighted flow matching on replay + demos (or PPO on the SDE log-probs for flow_ppo).
                bar.update(job, status=f"round {r}: actor")
                if method == "flow_ppo":
                    stats = flow_ppo_updates(
                        policy, optimizer, runner.records, chunk_advantages, epochs=cfg.rl.ppo_epochs,
                        batch_size=cfg.rl.batch_size, clip_range=cfg.rl.ppo_clip, noise_level=cfg.rl.ppo_noise_level, rng=rng,
                        target_kl=cfg.rl.ppo_target_kl, reference=reference, kl_weight=cfg.rl.ppo_kl_weight,
                    )  # fmt: skip
                    bar.update(job, advance=cfg.rl.updates_per_round)
                else:
                    stats = actor_updates(
                        policy, optimizer, steps=cfg.rl.updates_per_round, batch_size=cfg.rl.batch_size, demos=demo_buffer,
                        replay=replay_buffer, replay_weights=weights, demo_fraction=cfg.rl.demo_fraction, aux_weight=0.0,
                        rng=rng, mixing=cfg.rl.replay_mixing, nft=nft, on_step=lambda: (ema_update(acting, policy, decay) if decay else None, bar.update(job, advance=1)),
                    )  # fmt: skip
                actor_step += cfg.rl.updates_per_round
                record.update(stats)
                run.log(record)
                # 4f. Evaluate and checkpoint.
                bar.update(job, status=f"round {r}: evaluating")
                results = evaluate_all(acting, cfg, cfg.eval.round_episodes, heldout=False)
                run.log(_eval_record("round", results, env_steps, r))
                bar.update(job, status=f"round {r}: success {results['train'].success:.0%}")
                state = {"round": r, "env_steps": env_steps, "actor_step": actor_step, "latest_checkpoint": f"checkpoints/round-{r:03d}"}
                save_checkpoint(run, f"round-{r:03d}", acting, policy, optimizer, critics, state)
                run.save_state(state)
    except KeyboardInterrupt:
        path = save_checkpoint(run, "interrupted", acting, policy, optimizer, critics, state)
        console.print(f"[yellow]interrupted: the policy so far is in {path}; continue with `kinema train --resume {run.root}`")
        raise

    # 5. Final evaluation and report ------------------------------------------------------------------------------------
    if rounds and not state.get("final_done"):
        with console.status("final evaluation"):
            results = evaluate_all(acting, cfg, cfg.eval.episodes, heldout=cfg.eval.heldout)
        run.log(_eval_record("final", results, env_steps, rounds))
        _print_eval(console, f"after RL ({method})", results)
        record_videos(acting, cfg, run.root / "videos", "after")
        acting.save_pretrained(str(run.root / "checkpoints" / "final"))
        state["final_done"] = True
        run.save_state(state)
    write_curves(run.records(), run.root / "curves.png")
    write_report(cfg, run.records(), run.root)
    run.close()
    console.print(f"report: {run.root / 'report.md'}")
    return run.root


def _check_init_policy(cfg: TrainConfig, console: Console) -> dict[str, Any]:
    """`init_policy` must be the policy the config describes (config.yaml is the run's record), checked from its
    config.json before any demo is collected. Architecture fields must match; the others (execution and training
    options such as policy.n_action_steps) are returned, to be applied to the loaded policy. A task it never saw is
    allowed and said so."""
    saved = VLAConfig.from_dict(load_checkpoint_config(cfg.init_policy))
    fields = cfg.policy.vla_fields()
    wanted = VLAConfig(**fields)
    differ = [k for k in fields if getattr(saved, k) != getattr(wanted, k)]
    # The backbone is loaded from the checkpoint's own path: another path in the config cannot be applied afterwards.
    if fixed := [k for k in differ if k in VLAConfig.ARCHITECTURE_FIELDS or k == "backbone_path"]:
        diffs = ", ".join(f"policy.{k} {getattr(saved, k)!r} (config: {getattr(wanted, k)!r})" for k in fixed)
        raise ValueError(
            f"init_policy {cfg.init_policy} has another architecture than this config describes: {diffs}. Set those "
            "policy.* keys to the checkpoint's values"
        )
    changes = {k: getattr(wanted, k) for k in differ}
    if changes:
        console.print(f"note: the config's {', '.join(f'policy.{k}={v!r}' for k, v in changes.items())} replace init_policy's")
    seen = list(saved.extra.get("tasks", []))
    if cfg.task not in seen:
        console.print(f"[yellow]note: init_policy was trained on {', '.join(seen) or 'no recorded task'}; {cfg.task} is unseen[/yellow]")
    return changes


@contextlib.contextmanager
def _interrupt_note(console: Console, stage: str, root: Path):
    """Ctrl-C before the first checkpoint: say plainly that there is nothing to resume yet."""
    try:
        yield
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted during {stage}, before the first checkpoint: nothing in {root} to resume yet")
        raise


def _print_eval(console: Console, label: str, results: dict[str, EvalResult]) -> None:
    parts = [f"{split}: {res.success:.0%} ± {res.success_se:.0%} ({res.episodes} episodes)" for split, res in results.items()]
    console.print(f"[bold]{label}[/bold] success — " + "; ".join(parts))
