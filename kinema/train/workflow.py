"""`kinema train`: demonstrations -> SFT -> online RL in rounds -> evaluation and a report.

`train()` reads top to bottom:
    1. set up the run folder (or resume one);
    2. demonstrations (scripted expert, or a LeRobotDataset folder);
    3. the policy and its SFT (the baseline checkpoint), evaluated;
    4. RL rounds: roll out -> update (the method's critics, credit and actor) -> evaluate -> checkpoint;
    5. final evaluation on training templates, held-out paraphrases and held-out objects; curves, videos, report.

What a round does is the method's (`rl.method`, registered in `kinema.train.methods.METHODS`); what the policy is,
the policy type's (`policy.type`, registered in `policies.POLICY_TYPES`).
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from diffusion_rl.credit import idle_steps, return_weights
from diffusion_rl.data import Episode
from diffusion_rl.data.lerobot_v3 import read_episodes
from kinema.common import (
    Run,
    busy_cores_note,
    interrupt_note,
    learning_threads,
    progress_bar,
    read_collected,
    start_run,
    warn_if_other_task,
    write_collected,
)
from kinema.train import distributed
from kinema.train.actor import actor_updates, ema_update, policy_optimizer
from kinema.train.buffer import StepBuffer
from kinema.train.config import TrainConfig
from kinema.train.evaluate import SPLIT_NAMES, ChunkPolicy, EvalResult, evaluate, final_splits, summarize
from kinema.train.methods import METHODS, Learner, RLMethod
from kinema.train.progress import RunPace, RunProgress, planned_work, round_line, start_panel, summary_table
from kinema.train.report import record_video_grid, write_before_after, write_curves, write_diagnostics, write_report
from kinema.train.robot_rounds import RobotRounds
from kinema.train.success import RolloutSuccessModel
from policies import load_policy
from policies.checkpoint import METHOD_FILE, load_checkpoint_config, set_aside
from sim.env import CAMERAS
from sim.experts import ExpertConfig
from sim.rollout import collect_demos, equivalent_instructions
from sim.tasks import SplitNotApplicable, check_task, has_expert


def save_trainer_checkpoint(run: Run, name: str, learner: Learner, method: RLMethod, state: dict) -> Path:
    """The acting policy as the checkpoint (`policies.load_policy`), plus what --resume needs in `trainer.pt`: the
    trained weights, the optimiser, the success model and the method's own critics; and `method.pt` (what
    `kinema eval` reads: a DSRL noise actor, PA-RL's chunk critic for --select)."""
    trainer = io.BytesIO()
    torch.save(
        {"online": learner.policy.state_dict(), "optimizer": learner.optimizer.state_dict(),
         "success_model": learner.success_model.state_dict(), "method": method.state_dict(), "state": state},
        trainer,
    )  # fmt: skip
    path = run.root / "checkpoints" / name
    learner.acting.save_pretrained(str(path), extra_files={"trainer.pt": trainer.getvalue(), METHOD_FILE: method_file(method)})
    return path


def method_file(method: RLMethod) -> bytes:
    """The method's name and state, saved beside every checkpoint's weights (the final one included)."""
    out = io.BytesIO()
    torch.save({"name": method.name, "state": method.export_state()}, out)
    return out.getvalue()


def load_trainer_checkpoint(path: Path, learner: Learner, method: RLMethod) -> None:
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    learner.policy.load_state_dict(trainer["online"])
    learner.optimizer.load_state_dict(trainer["optimizer"])
    if "critics" in trainer:  # written before the methods split: one dict held every method's critics
        learner.success_model.load_state_dict(RolloutSuccessModel.from_legacy_critics(trainer["critics"]))
        method.load_state_dict(method.from_legacy_critics(trainer["critics"]))
    else:
        learner.success_model.load_state_dict(trainer["success_model"])
        method.load_state_dict(trainer["method"])


def _set_aside_interrupted_rollouts(rollouts: Path, last_round: int, console: Console) -> None:
    """Rollouts of a round after the last checkpoint came from a round the kill interrupted: that round runs again,
    so they are renamed `interrupted-round-NNN[-k]` (kept, never deleted, and no longer read as replay)."""
    for stale in sorted(rollouts.glob("round-*")):
        if not stale.name[6:].isdigit() or int(stale.name[6:]) <= last_round:
            continue
        dest = set_aside(stale, f"interrupted-{stale.name}")
        console.print(f"rollouts of the interrupted {stale.name} kept as {dest}; the round runs again")


def evaluate_all(
    policy: Any, cfg: TrainConfig, episodes: int, *, splits: Sequence[str], progress: RunProgress, label: str,
    runner: Callable[[Any], ChunkPolicy] | None = None,
) -> dict[str, EvalResult]:  # fmt: skip
    """`episodes` evaluation episodes on each of `splits`, each with its bar;
    `runner(policy)` acts instead of the policy's plain chunks (the method's `eval_runner`)."""
    out = {}
    for split in splits:
        try:
            with progress.phase(f"{label}: {SPLIT_NAMES[split]} (episodes)", episodes, kind="eval"):
                out[split], _ = evaluate(
                    policy, cfg.task, episodes=episodes, split=split, num_envs=cfg.num_envs, num_workers=cfg.workers,
                    image_size=cfg.policy.image_size, task_config=cfg.task_config or None, seed=cfg.seed,
                    on_episode=lambda ep: progress.advance(),
                    runner=runner(policy) if runner else ChunkPolicy(policy, noise_scale=cfg.eval.noise_scale),
                )  # fmt: skip
        except SplitNotApplicable:
            progress.bar.console.print(f"{SPLIT_NAMES[split]}: not applicable to {cfg.task}")
        except ValueError as err:  # e.g. a task without held-out object combinations
            progress.bar.console.print(f"[yellow]skipping evaluation split {split}: {err}")
    return out


def _eval_record(stage: str, results: dict[str, EvalResult], env_steps: int, round_index: int) -> dict[str, Any]:
    record: dict[str, Any] = {"kind": "eval", "stage": stage, "round": round_index, "env_steps": env_steps}
    for split, res in results.items():
        record.update(res.as_dict(prefix=f"{split}/"))
    return record


def train(cfg: TrainConfig, *, resume: bool = False, console: Console | None = None) -> Path:
    def split_checks(ranks: int) -> None:  # under torchrun: one data-parallel learner per rank
        for name, value in (("sft.batch_size", cfg.sft.batch_size), ("rl.batch_size", cfg.rl.batch_size)):
            distributed.local_batch_size(value, name)

    method_class = METHODS[cfg.rl.method]
    check_task(cfg.task)
    if not cfg.dataset and not has_expert(cfg.task):
        raise ValueError(f"task {cfg.task!r} has no scripted expert to demonstrate it: give demonstrations with --dataset DIR "
                         "(a LeRobotDataset v3 folder: `kinema sim collect --policy ...`, a `kinema deploy --record` "
                         "folder, or an imported one)")

    # 1. Run folder ------------------------------------------------------------------------------------------------
    run, state, console = start_run(cfg, resume=resume, console=console or Console(stderr=True), step_key="env_steps",
                                    split_checks=split_checks)  # fmt: skip
    rng = np.random.default_rng(cfg.seed)
    # Checked before the demos are collected; a resumed run loads its own checkpoint instead.
    init_changes = _check_init_policy(cfg, console) if cfg.init_policy and not state.get("latest_checkpoint") else {}
    cameras = CAMERAS
    latest = state.get("latest_checkpoint")
    start_round = state["round"] + 1 if latest else 1
    pace = RunPace(planned_work(cfg, method_class, start_round=start_round, fresh=not latest, final_done=state.get("final_done", False)))
    console.print(start_panel(cfg, method_class, run.root, latest, pace, start_round=start_round))
    for note in (cfg.policy.advice(), busy_cores_note(cfg.learner_threads)):
        if note:
            console.print(f"[yellow]note: {note}[/yellow]")
    bar = progress_bar(console, transient=True)  # what stays on screen is the lines and the table at the end
    progress = RunProgress(bar, pace)
    bar.start()
    try:
        return _train(cfg, run, state, method_class, init_changes, cameras, rng, progress, console)
    finally:
        bar.stop()
        if cfg.rollout.backend == "ray":
            from kinema.train.ray_rollout import shutdown

            shutdown()


def _train(
    cfg: TrainConfig, run: Run, state: dict[str, Any], method_class: type[RLMethod], init_changes: dict[str, Any],
    cameras: tuple[str, ...], rng: np.random.Generator, progress: RunProgress, console: Console,
) -> Path:  # fmt: skip
    latest = state.get("latest_checkpoint")

    # 2. Demonstrations ------------------------------------------------------------------------------------------------
    demo_dir = run.root / "demos"
    demo_seeds = range(cfg.seed * 10_000, cfg.seed * 10_000 + cfg.demos.episodes)
    demo_options = dataclasses.asdict(cfg.demos)
    for key in ("weighting", "temperature", "idle", "instructions"):  # how the demos are drawn, not how they were collected
        del demo_options[key]
    if demo_options["source"] == "scripted":  # as runs from before demos.source recorded their settings
        del demo_options["source"]
    for key, default in (("perturb", 0.0), ("approach", "gate")):  # as runs from before these options
        if demo_options[key] == default:
            del demo_options[key]
    demo_settings = {"demos": demo_options, "task_config": cfg.task_config, "image_size": cfg.policy.image_size}
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
    elif not distributed.is_main():
        demos = distributed.broadcast_object(None)  # rank 0's, collected or read once
    elif (collected := read_collected(demo_dir, task=cfg.task, seeds=demo_seeds, settings=demo_settings)) is not None:
        demos = collected
        progress.pace.planned["demo"] = 0  # collected by an earlier start of this run
    else:
        with progress.phase("demonstrations (episodes)", cfg.demos.episodes, kind="demo"):
            demos = collect_demos(
                cfg.task, cfg.demos.episodes, seeds=demo_seeds,
                expert=ExpertConfig(noise=cfg.demos.noise, perturb=cfg.demos.perturb, approach=cfg.demos.approach,
                                    hesitation=cfg.demos.hesitation, wrong_grasp=cfg.demos.wrong_grasp,
                                    operator=cfg.demos.source),
                num_envs=cfg.num_envs, num_workers=cfg.workers, image_size=cfg.policy.image_size,
                config=cfg.task_config or None, on_episode=lambda ep: progress.advance(),
            )  # fmt: skip
        demos = write_collected(demo_dir, demos, settings=demo_settings)
    if not cfg.dataset and distributed.is_main():
        distributed.broadcast_object(demos)
    demo_success = float(np.mean([e.outcome for e in demos])) if demos else 0.0
    demos = [ep for ep in demos if ep.outcome]  # imitate successes only
    if not demos:
        raise ValueError("no successful demonstration to imitate (every demo episode failed)")
    # The demonstrator's steps to success: what a policy that beats its demonstrator on efficiency is measured against.
    demo_steps = summarize(demos, "demos").steps_to_success
    demo_weights, weighting = demo_step_weights(demos, cfg)  # by each episode's steps as the demonstrator took them
    if cfg.demos.idle == "drop":
        demos, demo_weights, weighting["idle_steps_dropped"] = without_idle_steps(demos, demo_weights)
    demo_buffer = StepBuffer.from_episodes(demos, cameras, image_size=cfg.policy.image_size)
    if cfg.demos.instructions == "equivalent":
        choices = equivalent_instructions(cfg.task, demos, cfg.task_config or None)
        demo_buffer = demo_buffer.with_instructions(choices, np.random.default_rng([cfg.seed, 23]))
        console.print(f"demonstrations imitated under {np.mean([len(c) for c in choices]):.1f} equivalent instructions each")
    run.log({"kind": "demos", "episodes": len(demos), "steps": len(demo_buffer), "success": demo_success,
             "steps_to_success": demo_steps, **weighting})  # fmt: skip

    if getattr(cfg.policy, "vision_encoder", "") == "patchify_grounded" and demo_buffer.where is None:
        console.print("[yellow]note: these demonstrations carry no pixel labels (privileged.target_pixels.<camera>, "
                      "recorded with sim demos); the grounded encoder's locator then learns only through the actions"
                      "[/yellow]")  # fmt: skip

    # 3. Policy and SFT ------------------------------------------------------------------------------------------------
    aux_dim = demo_buffer.aux.shape[1] if (demo_buffer.aux is not None and cfg.sft.aux_weight > 0) else 0
    policy = cfg.policy.make(cameras=cameras, aux_dim=aux_dim, tasks=[cfg.task], stats=demo_buffer.stats())
    aux_dim = policy.config.aux_dim
    distributed.broadcast_module(policy)  # every rank starts from rank 0's weights
    # `policy` trains; `acting` (its average, or itself when the decay is 0) collects rollouts, is evaluated and saved.
    decay = cfg.policy.ema_decay if method_class.acts_with_average else 0.0
    sft_steps = 0
    if latest:
        acting = load_policy(run.root / latest)
        policy = copy.deepcopy(acting)  # its trained weights come from trainer.pt below
        optimizer = policy_optimizer(policy, cfg.rl.lr, cfg.sft.weight_decay)
    else:
        if cfg.init_policy:
            # Branch from an existing SFT checkpoint: every method of a comparison starts from the same policy.
            policy = load_policy(cfg.init_policy)
            for key, value in init_changes.items():  # read by the policy at each use: no rebuild needed
                setattr(policy.config, key, value)
            seen = list(policy.config.extra.get("tasks", []))
            policy.config.extra["tasks"] = seen if cfg.task in seen else [*seen, cfg.task]
        else:
            sft_steps = cfg.sft.steps
        acting = copy.deepcopy(policy).requires_grad_(False) if decay else policy
        optimizer = policy_optimizer(policy, cfg.sft.lr, cfg.sft.weight_decay)
    if policy.scales_initial_noise:  # its checkpoints act, deployed, as this run evaluates them
        for model in (policy, acting):
            model.config.inference_noise_scale = cfg.eval.noise_scale
    # The critics read the policy's features: their width is the policy's (a resumed one's, as saved).
    success_model = RolloutSuccessModel(policy.config.hidden_dim, seed=cfg.seed)
    learner = Learner(cfg, run, policy, acting, optimizer, demo_buffer, rng, decay, success_model, demo_weights=demo_weights)
    method = method_class(learner)
    if distributed.world()[1] > 1:  # critics built alike on every rank; from here each draws its own augmentation and noise
        torch.manual_seed(cfg.seed + 7919 * distributed.world()[0])
    if latest:
        load_trainer_checkpoint(run.root / latest, learner, method)
        if not decay:
            learner.acting = policy
        learner.env_steps, learner.actor_step, start_round = state["env_steps"], state["actor_step"], state["round"] + 1
        console.print(f"resumed {run.root} after {latest} (round {state['round']})")
        _set_aside_interrupted_rollouts(run.root / "rollouts", state["round"], console)
    else:
        start_round = 1
        with learning_threads(cfg):
            sft(learner, sft_steps, aux_weight=cfg.sft.aux_weight if aux_dim else 0.0, progress=progress, console=console)
        if cfg.eval.baseline and cfg.robot.sim_eval and distributed.is_main():
            results = evaluate_all(acting, cfg, cfg.eval.episodes, splits=final_splits(cfg), progress=progress, label="SFT baseline")
            run.log(_eval_record("sft", results, 0, 0))
            _print_eval(console, "SFT", results)
            record_video_grid(acting, cfg, run.root / "videos", "before")
        state = {"round": 0, "env_steps": 0, "actor_step": 0, "latest_checkpoint": "checkpoints/sft"}
        if distributed.is_main():
            save_trainer_checkpoint(run, "sft", learner, method, state)
            run.save_state(state)
        distributed.barrier()  # a method's prepare() may read checkpoints/sft

    # 4. RL rounds -----------------------------------------------------------------------------------------------------
    rounds = cfg.rl.rounds if method.has_rounds else 0
    method.prepare()
    learner.replay = [
        read_episodes(run.root / "rollouts" / f"round-{r:03d}")
        for r in range(max(1, start_round - method.replay_rounds()), start_round)
        if (run.root / "rollouts" / f"round-{r:03d}" / "meta" / "info.json").exists()
    ]
    # With a robot, the rounds' episodes run on it through one policy node, each round's checkpoint swapped in.
    robot = RobotRounds(cfg, run.root, console) if cfg.robot.config and start_round <= rounds else None
    try:
        if robot is not None:
            robot.start(run.root / state["latest_checkpoint"])
        for r in range(start_round, rounds + 1):
            record: dict[str, Any] = {"kind": "round", "round": r, "method": method.name}
            rollouts = robot.roll_out(method, r, record, progress) if robot is not None else method.roll_out(r, record, progress)
            with learning_threads(cfg):
                method.update(rollouts, record, progress)
            learner.actor_step += cfg.rl.updates_per_round
            run.log(record)
            if not distributed.is_main():  # evaluation, checkpoints and the report are rank 0's
                continue
            results = {}
            if cfg.robot.sim_eval:
                results = evaluate_all(learner.acting, cfg, cfg.eval.round_episodes, splits=["train"], progress=progress, label=f"round {r}: evaluation", runner=method.eval_runner)
            # The estimate of the time left, kept so that its honesty can be checked against when the run ended.
            run.log({**_eval_record("round", results, learner.env_steps, r), "run/seconds_left_estimate": round(progress.pace.seconds_left(), 1)})
            console.print(round_line(r, rounds, record, results, run.records()[-1].get("cpu_s")))
            state = {"round": r, "env_steps": learner.env_steps, "actor_step": learner.actor_step, "latest_checkpoint": f"checkpoints/round-{r:03d}"}
            path = save_trainer_checkpoint(run, f"round-{r:03d}", learner, method, state)
            run.save_state(state)
            if robot is not None and r < rounds:
                console.print(f"round {r}: the robot now acts with {path} ({robot.swap(path)})")
    except KeyboardInterrupt:
        if not distributed.is_main():
            raise
        path = save_trainer_checkpoint(run, "interrupted", learner, method, state)
        console.print(f"[yellow]interrupted: the policy so far is in {path}; continue with `kinema train --resume {run.root}`")
        raise
    finally:
        if robot is not None:
            robot.close()  # the node stops commanding; the recorder commits what it has

    # 5. Final evaluation and report ------------------------------------------------------------------------------------
    if not distributed.is_main():
        return run.root
    if rounds and not state.get("final_done"):
        if cfg.robot.sim_eval:
            results = evaluate_all(learner.acting, cfg, cfg.eval.episodes, splits=final_splits(cfg), progress=progress, label="final evaluation", runner=method.eval_runner)
            run.log(_eval_record("final", results, learner.env_steps, rounds))
            _print_eval(console, f"after RL ({method.name})", results)
            for extra in method.final_evaluations(learner.acting, progress):
                run.log({**extra, "env_steps": learner.env_steps, "round": rounds})
            record_video_grid(learner.acting, cfg, run.root / "videos", "after", runner=method.eval_runner(learner.acting))
        learner.acting.save_pretrained(str(run.root / "checkpoints" / "final"), extra_files={METHOD_FILE: method_file(method)})
        state["final_done"] = True
        run.save_state(state)
    records = run.records()
    write_curves(records, run.root / "curves.png")
    write_diagnostics(records, run.root / "diagnostics.png")
    write_before_after(run.root / "videos")
    write_report(cfg, records, run.root)
    run.close()
    console.print(summary_table(records))
    console.print(f"report: {run.root / 'report.md'}")
    return run.root


def demo_step_weights(demos: list[Episode], cfg: TrainConfig) -> tuple[np.ndarray | None, dict[str, float]]:
    """This run's weight of every demonstration step (`demos.weighting`; None: uniform), and what the weighting
    does: the demos' mean steps to success under the episode weights, and the effective number of episodes."""
    if cfg.demos.weighting == "uniform":
        return None, {}
    steps = torch.tensor([ep.steps_to_success or len(ep) for ep in demos])
    w = return_weights(steps, temperature=cfg.demos.temperature).double()
    stats = {"weighted_steps_to_success": float((w * steps).sum() / w.sum()),
             "effective_episodes": float(w.sum() ** 2 / (w**2).sum())}  # fmt: skip
    return np.repeat(w.numpy(), [len(ep) for ep in demos]), stats


def without_idle_steps(
    demos: list[Episode], step_weights: np.ndarray | None
) -> tuple[list[Episode], np.ndarray | None, int]:  # fmt: skip
    """`demos.idle drop`: the demos with their idle steps cut out (`diffusion_rl.credit.idle_steps` on the recorded
    end-effector pose and gripper opening, kinema's `observation.state` layout), each remaining step keeping its
    weight; and how many steps were cut."""
    for ep in demos:
        if (dim := ep.observations["observation.state"].shape[1]) != 8:
            raise ValueError("demos.idle drop reads the end-effector pose (0:7) and gripper opening (7) from "
                             f"observation.state, kinema's (8,) layout; these demos' state is ({dim},): use demos.idle keep")
    kept = []
    for ep in demos:
        state = torch.tensor(ep.observations["observation.state"], dtype=torch.float64)
        kept.append(~idle_steps(state[:, :3], state[:, 3:7], state[:, 7]).numpy())
    weights = None if step_weights is None else step_weights[np.concatenate(kept)]
    return [ep.select(k) for ep, k in zip(demos, kept)], weights, int(sum((~k).sum() for k in kept))


def sft(learner: Learner, steps: int, *, aux_weight: float, progress: RunProgress, console: Console) -> None:
    """Supervised flow matching on the demonstrations (a cosine schedule down to rl.lr), the acting average warming
    up alongside; then the optimiser is set to rl.lr for the rounds."""
    cfg, run = learner.cfg, learner.run
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(learner.optimizer, max(steps, 1), eta_min=cfg.rl.lr)
    with progress.phase("SFT (steps)", steps, kind="sft"), interrupt_note(console, "SFT", run.root):
        done = [0]

        def sft_step() -> None:
            schedule.step()
            done[0] += 1
            if learner.decay:  # warm-up of the average: early weights are noise, do not let them linger
                ema_update(learner.acting, learner.policy, min(learner.decay, (1 + done[0]) / (10 + done[0])))
            progress.advance()

        stats = actor_updates(
            learner.policy, learner.optimizer, steps=steps, batch_size=cfg.sft.batch_size, demos=learner.demos,
            replay=None, replay_weights=None, demo_fraction=1.0, aux_weight=aux_weight, rng=learner.rng, on_step=sft_step,
            demo_weights=learner.demo_weights,
        )  # fmt: skip
    run.log({"kind": "sft", "steps": steps, "init_policy": cfg.init_policy, **stats})
    for group in learner.optimizer.param_groups:
        group["lr"] = cfg.rl.lr


def _check_init_policy(cfg: TrainConfig, console: Console) -> dict[str, Any]:
    """`init_policy` must be the policy the config describes (config.yaml is the run's record), checked from its
    config.json before any demo is collected. Architecture fields must match; the others (execution and training
    options such as policy.n_action_steps) are returned, to be applied to the loaded policy. A task it never saw is
    allowed and said so."""
    config_class = cfg.policy.config_class()
    saved = config_class.from_dict(load_checkpoint_config(cfg.init_policy))
    fields = cfg.policy.policy_fields()
    wanted = config_class(**fields)
    differ = [k for k in fields if getattr(saved, k) != getattr(wanted, k)]
    # The backbone is loaded from the checkpoint's own path: another path in the config cannot be applied afterwards.
    if fixed := [k for k in differ if k in config_class.ARCHITECTURE_FIELDS or k == "backbone_path"]:
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


def _print_eval(console: Console, label: str, results: dict[str, EvalResult]) -> None:
    parts = [f"{SPLIT_NAMES[split]} {res.success:.0%} ± {res.success_se:.0%} (n={res.episodes}"
             + (f", {res.wrong_target:.0%} wrong target)" if res.wrong_target else ")") for split, res in results.items()]
    console.print(f"[bold]{label}[/bold] success — " + "; ".join(parts))
