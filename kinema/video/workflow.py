"""`kinema video train`: sim videos -> success reward -> pre-trained tiny generator -> post-training -> report.

Reads top to bottom:
    1. set up the run folder (or resume one);
    2. sim rollout videos: scripted episodes of `data.task` with noise and wrong grasps (successes and failures),
       or a LeRobotDataset folder; cut into clips of `data.frames` × `data.size`²; prompts = task instructions;
    3. the rewards; the success reward is fitted on those clips (held-out calibration logged), once per run; the
       held-out judge, a second success model of another architecture and seed, on sim episodes of its own;
    4. the generator: loaded from the run folder, from `model.path`, or built from the preset and pre-trained by
       plain flow matching on the clips;
    5. post-training rounds with the chosen method (`VideoTrainer`), evaluated and checkpointed every
       `eval.interval` rounds; Ctrl-C saves and exits;
    6. evaluation after, sample grids and MP4s before/after, reward curves, report.md, and the post-trained
       generator as a diffusers folder, `final/` (`kinema.video.export`).

Under torchrun (`torchrun --nproc-per-node N -m kinema.cli video train ...`) rank 0 makes stages 2-4 while the
other ranks wait, then they read them back from the run folder; every rank post-trains on its share of each round
(`kinema.video.trainer`); rank 0 alone evaluates, logs and writes the run folder.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from diffusion_rl.data.lerobot_v3 import read_episodes
from kinema.common import Run, progress_bar, read_collected, start_run, warn_if_other_task, write_collected
from kinema.train import distributed
from kinema.video.config import VideoTrainConfig
from kinema.video.export import FINAL_DIR, export_trainer
from kinema.video.report import write_grid, write_report, write_reward_curves, write_videos_mp4
from kinema.video.trainer import VideoTrainer
from policies.checkpoint import write_text_atomic
from policies.video.rewards import RewardSet, SuccessReward, VideoClips, VideoSuccessConfig, episode_clips, make_rewards

SIM_DIR = "sim_videos"
PRETRAINED_DIR = "pretrained"
SUCCESS_DIR = "success_reward"
JUDGE_SIM_DIR = "sim_videos_judge"
JUDGE_DIR = "success_judge"
JUDGE_SKIPPED = "skipped.json"
# The judge's architecture: other depths and widths than the reward's VideoSuccessConfig defaults (3 convs of
# 16-32-64, frame feature 64, head 64 x 2), so that it does not share the reward's inductive biases.
JUDGE_ARCH: dict[str, Any] = dict(channels=(24, 48, 48, 96), frame_dim=48, text_dim=24, hidden_dim=96, num_layers=3)


# ----------------------------------------------------------------------------------------------------------------
# 2. Sim videos
# ----------------------------------------------------------------------------------------------------------------


def sim_clips(cfg: VideoTrainConfig, run: Run, console: Console) -> VideoClips:
    """The sim rollout clips: read from `data.dataset`, from the run folder, or collected (and saved there)."""
    d = cfg.data
    if d.dataset:
        episodes = read_episodes(d.dataset)
        warn_if_other_task(episodes, d.task, d.dataset, console)
        return episode_clips(episodes, frames=d.frames, size=d.size, camera=d.camera)
    seeds = range(cfg.seed * 10_000, cfg.seed * 10_000 + d.episodes)
    return collected_clips(cfg, run.root / SIM_DIR, seeds, console, label="sim videos")


def judge_seeds(cfg: VideoTrainConfig) -> range:
    """The judge's own episode seeds: after the reward's (`seed·10000 + [0, data.episodes)`), never among them."""
    start = cfg.seed * 10_000 + max(5_000, cfg.data.episodes)
    return range(start, start + (cfg.judge.episodes or cfg.data.episodes))


def collected_clips(cfg: VideoTrainConfig, folder: Path, seeds: range, console: Console, *, label: str) -> VideoClips:
    """Clips of scripted sim episodes with these seeds: read back from `folder`, or collected and saved there."""
    from sim.experts import ExpertConfig
    from sim.rollout import collect_demos

    d = cfg.data
    settings = {"noise": d.noise, "wrong_grasp": d.wrong_grasp, "image_size": max(64, d.size)}
    if (collected := read_collected(folder, task=d.task, seeds=seeds, settings=settings)) is not None:
        episodes = collected
    else:
        with progress_bar(console) as bar:
            job = bar.add_task(label, total=len(seeds), status=d.task)
            # The videos' camera alone: rendering, coding and decoding the other halved the collection's speed.
            episodes = collect_demos(
                d.task, len(seeds), seeds=seeds,
                expert=ExpertConfig(noise=d.noise, wrong_grasp=d.wrong_grasp), num_envs=4,
                image_size=settings["image_size"], cameras=(d.camera,), on_episode=lambda ep: bar.update(job, advance=1),
            )  # fmt: skip
        episodes = write_collected(folder, episodes, settings=settings)
    return episode_clips(episodes, frames=d.frames, size=d.size, camera=d.camera)


# ----------------------------------------------------------------------------------------------------------------
# 3. Rewards
# ----------------------------------------------------------------------------------------------------------------


def build_rewards(cfg: VideoTrainConfig, clips: VideoClips | None, run: Run, console: Console) -> RewardSet:
    """The configured rewards; `success` is the success model fitted on the sim clips (saved in the run folder)."""
    specs: list[Any] = []
    for name in cfg.rewards.names:
        if name == "success":
            specs.append(success_reward(cfg, clips, run, console))
        else:
            specs.append(name)
    # Weights key by score name; each built-in reward but `flow` returns one score named like the reward.
    weights = dict(zip(cfg.rewards.names, cfg.rewards.weights)) if cfg.rewards.weights else None
    return make_rewards(specs, weights=weights, balance=cfg.rewards.balancing)


def success_reward(cfg: VideoTrainConfig, clips: VideoClips | None, run: Run, console: Console) -> SuccessReward:
    folder = run.root / SUCCESS_DIR
    if (folder / "config.json").exists():
        return SuccessReward.load(folder)
    if clips is None:
        raise ValueError("the success reward needs sim clips to be fitted on")
    train, val = split_heldout(clips, cfg.seed)
    n_val = len(val)
    reward = SuccessReward(VideoSuccessConfig(frames=cfg.data.frames, size=cfg.data.size))
    steps = 400
    with progress_bar(console) as bar:
        job = bar.add_task("success reward", total=steps, status="")
        reward.fit(train, steps=steps, seed=cfg.seed, progress=lambda i, s: bar.update(job, advance=1))
    metrics = reward.calibration_figure(val, run.root / "success_calibration.png")
    run.log({"kind": "success_reward", "train_clips": len(train), **metrics})
    console.print(f"success reward: held-out AUC {metrics['auc']:.2f}, Brier {metrics['brier']:.3f} (n={n_val})")
    reward.save(folder)
    return reward


def split_heldout(clips: VideoClips, seed: int) -> tuple[VideoClips, VideoClips]:
    """(train, held-out): a held-out quarter of each outcome, so that the calibration numbers see both."""
    g = torch.Generator().manual_seed(seed)
    val_idx, train_idx = [], []
    for outcome in (True, False):
        members = torch.nonzero(clips.success == outcome).flatten()
        members = members[torch.randperm(len(members), generator=g)]
        k = max(1, len(members) // 4) if len(members) > 1 else 0
        val_idx += members[:k].tolist()
        train_idx += members[k:].tolist()
    return clips.subset(train_idx), clips.subset(val_idx)


def concat_clips(a: VideoClips, b: VideoClips) -> VideoClips:
    return VideoClips(
        torch.cat([a.videos, b.videos]), a.prompts + b.prompts, torch.cat([a.success, b.success]),
        torch.cat([a.ends_at_outcome, b.ends_at_outcome]),
        a.task_ids + b.task_ids if a.task_ids and b.task_ids else [], a.seeds + b.seeds if a.seeds and b.seeds else [],
    )  # fmt: skip


def held_out_judge(cfg: VideoTrainConfig, clips: VideoClips | None, rewards: RewardSet, run: Run,
                   console: Console) -> SuccessReward | None:
    """The held-out judge of task success (`judge`): loaded from the run folder, or fitted on episodes of its own.

    It is another architecture (`JUDGE_ARCH`) fitted with another seed on clips disjoint from the reward's (sim
    episodes with other seeds, or `judge.dataset`), and it is never used in training. Its agreement with the
    ground truth is measured on clips neither model was fitted on: its own held-out quarter and the reward's.
    None when disabled or skipped (a `judge` record with the reason is logged, and `skipped.json` keeps it)."""
    j = cfg.judge
    folder = run.root / JUDGE_DIR
    if not j.enabled:
        return None
    if (folder / "config.json").exists():
        return SuccessReward.load(folder)
    if (folder / JUDGE_SKIPPED).exists() or clips is None:
        return None

    def skip(reason: str) -> None:
        console.print(f"[yellow]held-out judge skipped: {reason}")
        run.log({"kind": "judge", "skipped": reason})
        write_text_atomic(folder / JUDGE_SKIPPED, json.dumps({"reason": reason}) + "\n")

    d = cfg.data
    if d.dataset:
        if not j.dataset:
            skip("data.dataset is set and judge.dataset is empty: no episodes of its own to fit it on")
            return None
        own = episode_clips(read_episodes(j.dataset), frames=d.frames, size=d.size, camera=d.camera)
    else:
        own = collected_clips(cfg, run.root / JUDGE_SIM_DIR, judge_seeds(cfg), console, label="judge's sim videos")
    shared = {s for s in own.seeds if s is not None} & {s for s in clips.seeds if s is not None}
    if shared:
        raise ValueError(f"the judge's episodes share seeds {sorted(shared)[:5]} with the reward's: they must be other "
                         "episodes (judge.dataset must not hold the episodes of data.dataset)")
    n_pos = int(own.success.sum())
    if n_pos < 2 or len(own) - n_pos < 2:
        skip(f"its {len(own)} episodes hold {n_pos} successes: it needs at least two of each outcome")
        return None
    train, own_val = split_heldout(own, cfg.seed + j.seed_offset)
    _, reward_val = split_heldout(clips, cfg.seed)  # the reward's held-out quarter: neither model fits on it
    heldout = concat_clips(own_val, reward_val)
    # Its own seed for its initial weights and batches; the run's global RNG is left as it was (the pre-training
    # after it draws the same noise with the judge on or off).
    with torch.random.fork_rng(devices=[]), progress_bar(console) as bar:
        torch.manual_seed(cfg.seed + j.seed_offset)
        judge = SuccessReward(VideoSuccessConfig(frames=d.frames, size=d.size, **JUDGE_ARCH))
        job = bar.add_task("held-out judge", total=j.steps, status="")
        judge.fit(train, steps=j.steps, seed=cfg.seed + j.seed_offset, progress=lambda i, s: bar.update(job, advance=1))
    record: dict[str, Any] = {"kind": "judge", "train_clips": len(train), "heldout_clips": len(heldout),
                              "arch": {k: list(v) if isinstance(v, tuple) else v for k, v in JUDGE_ARCH.items()},
                              "seed": cfg.seed + j.seed_offset}  # fmt: skip
    p_judge = judge.predict(heldout)
    y = heldout.success.float()
    metrics = judge.calibration_figure(heldout, run.root / "judge_calibration.png")
    record.update({f"judge/{k}": v for k, v in metrics.items()})
    record["judge/accuracy"] = float(((p_judge > 0.5).float() == y).float().mean())
    reward = success_model_of(rewards)
    if reward is not None:
        p_reward = reward.predict(heldout)
        record.update({f"reward/{k}": v for k, v in reward.evaluate(heldout).items()})
        record["reward/accuracy"] = float(((p_reward > 0.5).float() == y).float().mean())
        record["agreement"] = float(((p_judge > 0.5) == (p_reward > 0.5)).float().mean())
        record["correlation"] = float(torch.corrcoef(torch.stack([p_judge, p_reward]))[0, 1])
    run.log(record)
    shown = f"held-out judge: AUC {metrics['auc']:.2f}, accuracy {record['judge/accuracy']:.2f} on {len(heldout)} sim clips neither model saw"
    if reward is not None:
        shown += f" (the reward: AUC {record['reward/auc']:.2f}, accuracy {record['reward/accuracy']:.2f}; they agree on {record['agreement']:.0%})"
    console.print(shown)
    judge.save(folder)
    return judge


def success_model_of(rewards: RewardSet) -> SuccessReward | None:
    """The run's success reward, when it trains on one."""
    return next((r for r in rewards.rewards if isinstance(r, SuccessReward)), None)


# ----------------------------------------------------------------------------------------------------------------
# 4. The pre-trained generator
# ----------------------------------------------------------------------------------------------------------------


def pretrained_generator(cfg: VideoTrainConfig, clips: VideoClips | None, run: Run, console: Console):
    """Load the generator pre-trained in this run folder, or build it and pre-train it on the sim clips."""
    from policies.video.generator import VideoGenerator

    folder = run.root / PRETRAINED_DIR
    if folder.exists():
        return place(VideoGenerator.from_pretrained(folder, torch_dtype=torch_dtype(cfg)), cfg)
    if cfg.model.path:
        gen = load_generator(cfg.model.path, cfg)
    else:
        gen = place(VideoGenerator.from_preset(
            cfg.model.preset, seed=cfg.seed, num_frames=cfg.data.frames, height=cfg.data.size, width=cfg.data.size
        ), cfg)  # fmt: skip
    record: dict[str, Any] = {"kind": "pretrain", "steps": cfg.pretrain.steps}
    if cfg.pretrain.steps and clips is not None:
        p = cfg.pretrain
        with progress_bar(console) as bar:
            job = bar.add_task("pre-training", total=p.steps, status="")

            def on_step(step: int, loss: float) -> None:
                bar.update(job, advance=1, **({"status": f"loss {loss:.4f}"} if step % 20 == 0 else {}))

            record.update(pretrain(gen, clips.videos, clips.prompts, steps=p.steps, lr=p.lr, batch_size=p.batch_size,
                                   seed=cfg.seed, cfg_dropout=p.cfg_dropout, on_step=on_step))  # fmt: skip
    gen.save_pretrained(folder)
    run.log(record)
    return gen


def torch_dtype(cfg: VideoTrainConfig) -> torch.dtype:
    return getattr(torch, cfg.model.dtype)


def place(gen: Any, cfg: VideoTrainConfig) -> Any:
    """The generator on `model.device` in `model.dtype`."""
    return gen.to(device=torch.device(cfg.model.device), dtype=torch_dtype(cfg))


def load_generator(path: str | Path, cfg: VideoTrainConfig) -> Any:
    """A generator folder (ours, or a real Wan checkpoint) at the run's video shape: data.frames × data.size².

    The sim clips, the pre-training and the success reward all use that shape, so it overrides what the folder
    says (a real Wan folder would otherwise sample 81 × 480 × 832); a shape the model's VAE or patches cannot take
    is refused with the reason."""
    from policies.video.generator import VideoGenerator

    shape = dict(num_frames=cfg.data.frames, height=cfg.data.size, width=cfg.data.size)
    gen = VideoGenerator.from_pretrained(path, torch_dtype=torch_dtype(cfg), **shape)
    try:
        gen.check_shape(cfg.data.frames, cfg.data.size, cfg.data.size)
    except ValueError as e:
        raise ValueError(f"{path} cannot generate the run's data.frames={cfg.data.frames} × data.size={cfg.data.size}: {e}") from e
    return place(gen, cfg)


def pretrain(
    gen: Any,
    videos: torch.Tensor,
    prompts: list[str],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    cfg_dropout: float = 0.1,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Plain conditional flow matching of the base transformer (before any adapter) on clips (N, F, C, H, W).

    A share `cfg_dropout` of the prompts is replaced by the negative (empty) prompt, so that the unconditional
    branch that classifier-free guidance needs is learnt too: without it, CFG rollouts (VideoAWR's reference,
    the guided teachers) extrapolate from an untrained prediction and come out as noise.
    """
    with torch.no_grad():
        latents = torch.cat([gen.encode_video(videos[i : i + 32]) for i in range(0, len(videos), 32)])
        embeds = gen.encode_prompts(prompts)
        empty = gen.negative_prompt_embeds(1)
    params = gen.base_parameters()
    for q in params:
        q.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1), eta_min=lr * 0.1)
    g = torch.Generator().manual_seed(seed)
    losses = []
    gen.train()
    for step in range(steps):
        idx = torch.randint(0, len(latents), (min(batch_size, len(latents)),), generator=g)
        drop = (torch.rand(len(idx), generator=g) < cfg_dropout).to(embeds.device)
        emb = torch.where(drop[:, None, None], empty, embeds[idx])
        loss = gen.flow_loss({"x0": latents[idx], "prompt_embeds": emb}).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    gen.eval()
    for q in params:
        q.requires_grad_(False)
    k = max(1, min(50, len(losses) // 10))
    return {
        "clips": len(videos),
        "prompts": len(set(prompts)),
        "loss_first": float(np.mean(losses[:k])) if losses else float("nan"),
        "loss_last": float(np.mean(losses[-k:])) if losses else float("nan"),
    }


# ----------------------------------------------------------------------------------------------------------------
# Teachers (AFD, OPSD): another generator, or a folder of videos
# ----------------------------------------------------------------------------------------------------------------


def load_teacher_clips(folder: str | Path, *, frames: int, size: int) -> dict[str, torch.Tensor]:
    """A black-box teacher as a folder of MP4s, each with a sibling `.txt` holding its prompt:
    {prompt: clips (N, frames, 3, size, size) in [0, 1]} (frames spread over the video, area-resized)."""
    import cv2

    from kinema.media import read_mp4

    root = Path(folder)
    videos = sorted(root.glob("*.mp4"))
    if not videos:
        raise FileNotFoundError(f"train.afd.teacher_videos: no .mp4 file in {root}")
    out: dict[str, list[torch.Tensor]] = {}
    for path in videos:
        prompt_file = path.with_suffix(".txt")
        if not prompt_file.is_file():
            raise FileNotFoundError(f"teacher video {path.name} has no prompt file {prompt_file.name} beside it")
        raw = read_mp4(path)
        picked = raw[np.round(np.linspace(0, len(raw) - 1, frames)).astype(int)]
        picked = np.stack([cv2.resize(f, (size, size), interpolation=cv2.INTER_AREA) for f in picked])
        out.setdefault(prompt_file.read_text().strip(), []).append(torch.from_numpy(picked).permute(0, 3, 1, 2).float() / 255.0)
    return {p: torch.stack(v) for p, v in out.items()}


def teachers(cfg: VideoTrainConfig) -> tuple[Any | None, dict[str, torch.Tensor] | None]:
    """(teacher generator, teacher clips) as the method's options ask; (None, None) = the guided reference."""
    method = cfg.train.method
    o = getattr(cfg.train, method, None)
    clips = load_teacher_clips(o.teacher_videos, frames=cfg.data.frames, size=cfg.data.size) if method == "afd" and o.teacher_videos else None
    model = None
    if getattr(o, "teacher_path", "") and (method == "afd" and clips is None or method == "opsd" and o.teacher == "model"):
        from policies.video.generator import VideoGenerator

        # The teacher keeps its own shape (AFD resizes its videos; OPSD checks that the latents match).
        model = place(VideoGenerator.from_pretrained(o.teacher_path, torch_dtype=torch_dtype(cfg)), cfg)
    return model, clips


@contextlib.contextmanager
def interrupt_between_rounds(console: Console) -> Iterator[Callable[[], bool]]:
    """Defer Ctrl-C to the end of the current round: yields `pending()`; a second Ctrl-C interrupts at once.

    A round stopped half-way has moved the weights without finishing its updates; saving that would checkpoint a
    state no round boundary ever had. Only the main thread can take signals; elsewhere Ctrl-C is left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    hits = []

    def handler(signum, frame):
        hits.append(signum)
        if len(hits) > 1:
            raise KeyboardInterrupt
        console.print("[yellow]Ctrl-C: stopping after this round (press again to stop now, without saving it)")

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(hits)
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupt_note_before_checkpoint(console: Console, root: Path, *, resuming: bool) -> Iterator[None]:
    """Ctrl-C before post-training's first round (sim videos, success reward, pre-training, the first evaluation):
    there is no checkpoint to resume yet, but every stage already saved in the run folder is read back, so the
    same command picks up from there. Says so, then lets the KeyboardInterrupt through (the CLI exits with 130)."""
    try:
        yield
    except KeyboardInterrupt:
        if resuming:
            console.print(f"[yellow]interrupted while loading {root}; its last checkpoint is unchanged: resume again")
        else:
            done = [name for name in (SIM_DIR, SUCCESS_DIR, PRETRAINED_DIR) if (root / name).exists()]
            kept = f" ({', '.join(done)} kept and reused)" if done else ""
            console.print(f"[yellow]interrupted before the first checkpoint: nothing to resume in {root} yet; "
                          f"run the same command again{kept}")
        raise


# ----------------------------------------------------------------------------------------------------------------
# The whole run
# ----------------------------------------------------------------------------------------------------------------


def stages_before_post_training(
    cfg: VideoTrainConfig, run: Run, state: dict[str, Any], console: Console
) -> tuple[list[str], RewardSet, SuccessReward | None, Any]:
    """2-4: sim videos, rewards, the judge, the pre-trained generator, each read back from the run folder when there:
    (prompts, rewards, judge, generator). The prompts come from the clips, or from `state` when none were read."""
    judge_done = not cfg.judge.enabled or any((run.root / JUDGE_DIR / f).exists() for f in ("config.json", JUDGE_SKIPPED))
    need_clips = not (run.root / PRETRAINED_DIR).exists() or not judge_done or (
        "success" in cfg.rewards.names and not (run.root / SUCCESS_DIR / "config.json").exists()
    )
    clips = sim_clips(cfg, run, console) if need_clips else None
    prompts = sorted(set(clips.prompts)) if clips is not None else state.get("prompts", [])
    rewards = build_rewards(cfg, clips, run, console)
    judge = held_out_judge(cfg, clips, rewards, run, console)
    generator = pretrained_generator(cfg, clips, run, console)
    return prompts, rewards, judge, generator


def train_video(cfg: VideoTrainConfig, *, resume: bool = False, console: Console | None = None) -> Path:
    def split_checks(ranks: int) -> None:  # under torchrun: one data-parallel learner per rank
        if cfg.train.prompts_per_round % ranks:
            raise ValueError(f"train.prompts_per_round {cfg.train.prompts_per_round} does not split over {ranks} ranks "
                             f"(each rolls out whole prompt groups): use a multiple of {ranks}")
        distributed.local_batch_size(cfg.train.batch_size, "train.batch_size")

    started = time.time()
    # 1. Run folder ------------------------------------------------------------------------------------------------
    run, state, console = start_run(cfg, resume=resume, console=console or Console(stderr=True), step_key="round",
                                    split_checks=split_checks)  # fmt: skip
    main = distributed.is_main()
    samples = run.root / "samples"

    # Ctrl-C before the first checkpoint: nothing to resume, but the stages done so far are kept and reused.
    with interrupt_note_before_checkpoint(console, run.root, resuming=resume):
        # 2-4. Sim videos, rewards, the pre-trained generator ------------------------------------------------------
        if main:
            with distributed.alone():  # its fits step alone; the other ranks wait at the barrier
                prompts, rewards, judge, generator = stages_before_post_training(cfg, run, state, console)
        distributed.barrier()
        if not main:  # every stage is in the run folder now: read back
            prompts, rewards, judge, generator = stages_before_post_training(cfg, run, state, console)
        prompts = distributed.broadcast_object(prompts)  # a rank that read no clips has no prompts of its own

        # 5. Post-training -----------------------------------------------------------------------------------------
        teacher, teacher_clips = teachers(cfg)
        if teacher_clips is not None:
            prompts = sorted(teacher_clips)  # AFD on a folder: the student learns the teacher's prompts
        if distributed.world()[1] > 1:
            distributed.broadcast_module(generator)  # rank 0's weights, whether made in memory or read back
            torch.manual_seed(cfg.seed)  # the adapters (and AFD's discriminator) initialised alike on every rank
        trainer = VideoTrainer(cfg, generator, rewards, prompts, teacher=teacher, teacher_clips=teacher_clips, judge=judge)
        latest = state.get("latest_checkpoint")
        if latest:
            trainer.load(run.root / latest)  # every rank the same checkpoint
            console.print(f"resumed {run.root} after {latest} (round {trainer.round})")
        elif not state:  # (a state without a checkpoint: stopped in round 1; the fresh trainer is that start)
            if main:
                with console.status("evaluating the pre-trained generator"):
                    record, videos = trainer.evaluate()
                run.log({"kind": "eval", "stage": "before", "round": 0, **record})
                shown, shown_prompts = trainer.showcase(videos, cfg.eval.videos)
                write_grid(shown, samples / "before.png", prompts=shown_prompts, title="before post-training")
                write_videos_mp4(shown, samples / "before.mp4")
            state = {"round": 0, "prompts": prompts, "latest_checkpoint": None, "elapsed_s": time.time() - started}
            run.save_state(state)

    t = cfg.train
    elapsed0 = state.get("elapsed_s", 0.0)
    # Ctrl-C stops after the current round and saves it; a second Ctrl-C stops at once without a save (the last
    # checkpoint stands, and resume drops the metrics records logged after it).
    with progress_bar(console) as bar, interrupt_between_rounds(console) as interrupted:
        job = bar.add_task(f"post-training ({t.method})", total=t.rounds * t.updates_per_round,
                           completed=trainer.round * t.updates_per_round, status="")  # fmt: skip
        while trainer.round < t.rounds:
            bar.update(job, status=f"round {trainer.round + 1}: rollouts")
            record = trainer.train_round(on_update=lambda: bar.update(job, advance=1))
            bar.update(job, completed=trainer.round * t.updates_per_round)  # an idle round takes no steps
            record["time_s"] = elapsed0 + time.time() - started
            if not main:  # evaluation, the log and checkpoints are rank 0's
                pass
            elif trainer.round % cfg.eval.interval == 0 or trainer.round == t.rounds:
                bar.update(job, status=f"round {trainer.round}: evaluating")
                ev, _ = trainer.evaluate()
                run.log(record)
                run.log({"kind": "eval", "stage": "round", "round": trainer.round, **ev})
                name = f"checkpoints/round-{trainer.round:03d}"
                trainer.save(run.root / name)
                state = {**state, "round": trainer.round, "latest_checkpoint": name, "elapsed_s": record["time_s"], "final_done": False}
                run.save_state(state)
                shown = ", ".join(f"{k.removeprefix('eval/')} {v:.3g}" for k, v in ev.items())
                bar.update(job, status=f"round {trainer.round}: {shown}")
            else:
                run.log(record)
            if interrupted():
                if not main:  # rank 0 saves the round
                    raise KeyboardInterrupt
                # Between rounds: the trainer holds exactly `trainer.round` finished rounds, all logged.
                name = "checkpoints/interrupted"
                trainer.save(run.root / name)
                run.save_state({**state, "round": trainer.round, "latest_checkpoint": name, "elapsed_s": record["time_s"], "final_done": False})
                console.print(f"[yellow]interrupted: saved {run.root / name}; continue with `kinema video train --resume {run.root}`")
                raise KeyboardInterrupt

    # 6. After: evaluation, pictures, report ------------------------------------------------------------------------
    if not main:
        return run.root
    if not state.get("final_done"):
        ev, videos = trainer.evaluate()
        before = next((r for r in run.records() if r.get("kind") == "eval" and r.get("stage") == "before"), None)
        run.log({"kind": "eval", "stage": "after", "round": trainer.round, **ev, **judge_gap(before, ev)})
        shown, shown_prompts = trainer.showcase(videos, cfg.eval.videos)
        write_grid(shown, samples / "after.png", prompts=shown_prompts, title=f"after {t.method}")
        write_videos_mp4(shown, samples / "after.mp4")
        # The deliverable: the generator as evaluated, a diffusers folder stock diffusers loads (atomic).
        export_trainer(trainer, run.root / FINAL_DIR, run_root=run.root, evaluation=ev)
        state["final_done"] = True
        run.save_state(state)
    elif not (run.root / FINAL_DIR / "model_index.json").exists():  # a run finished before exports existed
        export_trainer(trainer, run.root / FINAL_DIR, run_root=run.root)
    records = run.records()
    write_reward_curves(records, run.root / "reward_curves.png")
    write_report(cfg, records, run.root)
    run.close()
    summary = {k: v for k, v in next(r for r in reversed(records) if r.get("stage") == "after").items() if k.startswith("eval/")}
    console.print(f"after {t.method}: {json.dumps({k: round(v, 4) for k, v in summary.items()})}")
    console.print(f"report: {run.root / 'report.md'}")
    console.print(f"post-trained generator (diffusers): {run.root / FINAL_DIR} (see its README.md; `kinema video sample {run.root} --prompt ...`)")
    return run.root


def judge_gap(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, float]:
    """The reward-hacking signal of an evaluation against the one before post-training: for each held-out judge
    score `eval/judge_<name>`, the judge's gain, the gain of the training reward `eval/<name>`, and their gap
    (reward gain − judge gain; well above 0: the reward rose where the judge did not)."""
    out: dict[str, float] = {}
    if not before:
        return out
    for key, value in after.items():
        if not key.startswith("eval/judge_") or key not in before:
            continue
        name = key.removeprefix("eval/judge_")
        out[f"judge/{name}/judge_gain"] = value - before[key]
        reward_key = f"eval/{name}"
        if reward_key in after and reward_key in before:
            out[f"judge/{name}/reward_gain"] = after[reward_key] - before[reward_key]
            out[f"judge/{name}/gap"] = out[f"judge/{name}/reward_gain"] - out[f"judge/{name}/judge_gain"]
    return out
