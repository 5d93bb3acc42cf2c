"""`kinema sim ...`: list tasks, collect scripted episodes into a dataset, render rollouts to video."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from diffusion_rl.data import Episode, ExecutedBy
from diffusion_rl.data.lerobot_v3 import LeRobotDatasetReader, LeRobotDatasetWriter
from kinema.common import progress_bar
from kinema.media import write_mp4
from sim.env import CAMERAS, CONTROL_HZ
from sim.experts import ExpertConfig
from sim.monitor import MonitorConfig
from sim.rollout import collect as collect_episodes
from sim.rollout import RandomPolicy, make_vector, zero_policy
from sim.tasks import TASKS, VARIANTS, check_task, has_expert, make


def list_tasks(args: argparse.Namespace) -> int:
    console = Console()
    table = Table(title="kinema tasks", show_lines=True)
    table.add_column("task", style="bold")
    table.add_column("horizon")
    table.add_column("training instructions")
    table.add_column("held-out paraphrases")
    for name, cls in TASKS.items():
        cfg = cls.default_config()
        table.add_row(name, str(cfg.horizon), "\n".join(cls.instructions.train), "\n".join(cls.instructions.heldout))
    console.print(table)
    console.print("Harder variants: " + ", ".join(f"{v} ({base} with {cfg})" for v, (base, cfg) in VARIANTS.items()))
    try:
        from sim.robosuite_adapter import ROBOSUITE_TASKS

        console.print("robosuite tasks (no scripted expert: --dataset or --policy): "
                      + ", ".join(f"robosuite/{name}" for name in ROBOSUITE_TASKS))
    except ImportError:
        console.print('robosuite tasks: not installed (pip install -e ".[robosuite]", in a venv of its own: mujoco<=3.9)')
    console.print("Any gymnasium env: --task gym:<registered id> or --task package.module:Class (the contract: "
                  "sim/tasks/external.py); its options: --task-config JSON")
    return 0


def acting_policy(spec: str, seed: int = 0) -> Any:
    """--policy: a checkpoint folder, `zero` (stand still, gripper open) or `random` (uniform, seeded)."""
    if spec == "zero":
        return zero_policy
    if spec == "random":
        return RandomPolicy(seed)
    if not (Path(spec) / "config.json").is_file():
        raise ValueError(f"--policy {spec}: expected a checkpoint folder (with config.json), 'zero' or 'random'")
    from kinema.train.acting import load_acting

    return load_acting(spec).default.make()  # as its method acts, at the noise scale its run evaluated with


def _task_config(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text else None
    except json.JSONDecodeError as err:
        raise ValueError(f"--task-config must be a JSON object, e.g. '{{\"horizon\": 100}}'; got {text!r} ({err})") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"--task-config must be a JSON object; got {text!r}")
    return value


def _expert_config(args: argparse.Namespace) -> ExpertConfig:
    return ExpertConfig(
        noise=args.expert_noise, perturb=getattr(args, "expert_perturb", 0.0), hesitation=getattr(args, "hesitation", 0.0),
        wrong_grasp=getattr(args, "wrong_grasp", 0.0), operator=getattr(args, "demo_source", "scripted"),
    )


def _autopilot(expert: ExpertConfig) -> ExpertConfig:
    """The imperfect stand-in policy for --interventions: a mediocre policy (noisy, often mis-aims its first grasp)."""
    return ExpertConfig(
        noise=max(expert.noise, 0.1), hesitation=max(expert.hesitation, 0.02), wrong_grasp=max(expert.wrong_grasp, 0.3)
    )


def _next_seed(root: str, *, overwrite: bool) -> int:
    """Extending a dataset continues its seeds, so a re-run adds new episodes rather than copies."""
    if overwrite or not (Path(root) / "meta" / "info.json").is_file():
        return 0
    seeds = [row.get("seed") for row in LeRobotDatasetReader(root).meta.episodes]
    seeds = [s for s in seeds if s is not None]
    return max(seeds) + 1 if seeds else 0


def collect(args: argparse.Namespace) -> int:
    check_task(args.task)  # fail fast, listing valid tasks
    task_config = _task_config(args.task_config)
    if args.policy is None and not has_expert(args.task):
        raise ValueError(f"task {args.task!r} has no scripted expert: collect with --policy CKPT|zero|random")
    if args.policy is not None and args.interventions:
        raise ValueError("--interventions needs the scripted autopilot; it cannot be combined with --policy")
    if args.episodes < 1:
        raise ValueError(f"--episodes must be at least 1; got {args.episodes}")
    if args.image_size < 16 or args.image_size % 2:
        raise ValueError(f"--image-size must be an even number >= 16 (H.264 video needs even sizes); got {args.image_size}")
    if args.video and not str(args.video).endswith(".mp4"):
        raise ValueError(f"--video must be an .mp4 file; got {args.video}")
    if args.seed is not None and args.seed < 0:
        raise ValueError(f"--seed must be >= 0; got {args.seed}")
    if args.workers < 0 or args.num_envs < 1:
        raise ValueError(f"--workers must be >= 0 and --num-envs >= 1; got {args.workers} and {args.num_envs}")
    try:
        expert = _expert_config(args)
    except ValueError as err:
        raise ValueError(f"{err} (from --expert-noise/--hesitation/--wrong-grasp)") from None
    env_kwargs = dict(image_size=args.image_size, instructions=args.instructions, objects=args.objects, config=task_config)
    runner = zero_policy  # the expert's wrapper acts; this policy's actions are ignored
    if args.policy is not None:
        vector_kwargs, version = {}, f"policy:{args.policy}"
        runner = acting_policy(args.policy, seed=args.seed or 0)
    elif args.interventions:
        # The human who takes over demonstrates as --demo-source says.
        monitor = MonitorConfig(expert=ExpertConfig(operator=expert.operator))
        vector_kwargs = dict(actor="monitored", monitor=monitor, autopilot=_autopilot(expert))
        version = "autopilot"
    else:
        vector_kwargs = dict(actor="expert", expert=expert)
        version = "expert" if expert.operator == "scripted" else "teleop"
    num_envs = max(1, min(args.num_envs, args.episodes))
    console = Console(stderr=True)
    first_seed = args.seed if args.seed is not None else _next_seed(args.out, overwrite=args.overwrite)
    preview: list[np.ndarray] = []
    kept_seeds: list[int] = []
    stats = {"success": 0, "takeovers": 0, "done": 0, "writing": 0, "interrupted": 0}
    # An existing kinema dataset is extended (so re-running a command adds episodes); --overwrite replaces it.
    mode = "w" if args.overwrite else "a"
    with LeRobotDatasetWriter(args.out, fps=CONTROL_HZ, mode=mode, overwrite=args.overwrite) as writer, progress_bar(console) as bar:
        job = bar.add_task(f"collect {args.task}", total=args.episodes, status="")

        def on_episode(ep: Episode) -> None:
            stats["writing"] = 1
            writer.add_episode(ep)
            stats["writing"] = 0
            kept_seeds.append(ep.seed)
            stats["done"] += 1
            stats["success"] += ep.outcome
            stats["takeovers"] += sum(who == ExecutedBy.HUMAN for _, _, who in ep.segments())
            if args.video and len(preview) < 4 * 150:
                preview.extend(ep.observations["observation.images.agentview"])
            status = f"success {stats['success'] / stats['done']:.0%}"
            if args.interventions:
                status += f", takeovers/episode {stats['takeovers'] / stats['done']:.2f}"
            bar.update(job, advance=1, status=status)

        vector = make_vector(args.task, num_envs, num_workers=min(args.workers, num_envs), **vector_kwargs, **env_kwargs)
        try:
            seeds = range(first_seed, first_seed + args.episodes)
            collect_episodes(vector, runner, seeds, task_id=args.task, policy_version=version, on_episode=on_episode)
        except KeyboardInterrupt:
            if stats["writing"]:  # cut inside an episode's write: the writer drops this run's episodes (it must)
                raise
            stats["interrupted"] = 1  # between episodes: the finished ones are whole, so they are kept (committed)
        finally:
            vector.close()
    if args.video and preview:
        write_mp4(args.video, np.stack(preview), CONTROL_HZ)
    success = f" (success {stats['success'] / stats['done']:.0%})" if stats["done"] else ""
    if stats["interrupted"]:
        # Envs finish out of order: seeds below the last kept one may be missing, and a plain extension (which
        # starts after the dataset's last seed) would never collect them.
        gaps = sorted(set(range(first_seed, max(kept_seeds, default=first_seed - 1) + 1)) - set(kept_seeds))
        after = args.episodes - stats["done"] - len(gaps)  # the seeds past the last kept one
        hints = [f"kinema sim collect --task {args.task} --out {args.out} --episodes {after} (same flags, without "
                 "--overwrite and --seed)"] if after else []  # fmt: skip
        if gaps:
            hints.append(f"seeds {', '.join(map(str, gaps))} were started but not finished: add each with --seed S --episodes 1")
        console.print(
            f"interrupted: kept the {stats['done']} finished episodes in {args.out}{success}. "
            + ("To add the rest: " + "; ".join(hints) if hints else ""),
            style="yellow", markup=False,
        )
        return 130
    console.print(f"wrote {stats['done']} episodes to {args.out}{success}" + (f"; preview {args.video}" if args.video else ""))
    return 0


def render(args: argparse.Namespace) -> int:
    from sim.monitor import DemoWrapper, SimulatedHuman

    if not str(args.out).endswith(".mp4"):
        raise ValueError(f"--out must be an .mp4 file; got {args.out}")
    if args.episodes < 1:
        raise ValueError(f"--episodes must be at least 1; got {args.episodes}")
    check_task(args.task)
    if args.policy is None and not has_expert(args.task):
        raise ValueError(f"task {args.task!r} has no scripted expert: render a policy with --policy CKPT|zero|random")
    if args.policy is not None and args.interventions:
        raise ValueError("--interventions needs the scripted autopilot; it cannot be combined with --policy")
    runner = acting_policy(args.policy, seed=args.seed) if args.policy is not None else None
    env = make(args.task, _task_config(args.task_config), image_size=120, cameras=CAMERAS if args.cameras else ())
    expert = _expert_config(args)
    if runner is not None:
        wrapped = env
    else:
        monitor = MonitorConfig(expert=ExpertConfig(operator=expert.operator))
        wrapped = SimulatedHuman(env, monitor, autopilot=_autopilot(expert)) if args.interventions else DemoWrapper(env, expert)
    frames: list[np.ndarray] = []
    console = Console(stderr=True)
    with progress_bar(console) as bar:
        job = bar.add_task(f"render {args.task}", total=args.episodes * env.config.horizon, status="")
        for e in range(args.episodes):
            obs, _ = wrapped.reset(seed=args.seed + e)
            queue: list[np.ndarray] = []
            for step in range(env.config.horizon):
                if runner is not None and not queue:
                    if hasattr(runner, "about_to_act"):
                        runner.about_to_act([args.seed + e], [step])
                    batch = {k: (v[None] if isinstance(v, np.ndarray) else [v]) for k, v in obs.items()}
                    out = np.asarray(runner(batch), np.float32)
                    queue = list(out[0] if out.ndim == 3 else out)
                action = queue.pop(0) if runner is not None else np.zeros(7, np.float32)
                obs, _, terminated, truncated, info = wrapped.step(action)
                frame = env.render()
                if args.cameras:
                    # 240-pixel overview beside the policy's two 120-pixel views, stacked.
                    side = np.concatenate([obs["observation.images.agentview"], obs["observation.images.wrist"]], axis=0)
                    frame = np.concatenate([frame, side], axis=1)
                if info.get("executed_by") == ExecutedBy.HUMAN:
                    frame = frame.copy()
                    frame[:4], frame[-4:], frame[:, :4], frame[:, -4:] = (220, 30, 30), (220, 30, 30), (220, 30, 30), (220, 30, 30)
                frames.append(frame)
                bar.update(job, advance=1, status="success" if info["is_success"] else "")
                if terminated or truncated:
                    break
    env.close()
    write_mp4(args.out, np.stack(frames), CONTROL_HZ)
    console.print(f"wrote {args.out} ({len(frames)} frames)")
    return 0
