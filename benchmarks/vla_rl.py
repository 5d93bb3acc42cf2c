"""The headline: RL post-training methods against SFT and the continued-SFT control, at an equal env-step budget.

For each task and seed, one SFT run (demos -> SFT -> evaluation) provides the starting checkpoint; every method
then branches from that same checkpoint and the same demonstrations, through the same `kinema train` code path:

    sft            the SFT checkpoint itself (no RL)
    sft_continued  continued SFT on the demos, same gradient steps (the control arm)
    sft_long       a fresh SFT from scratch on the same demos, its own cosine schedule over the SFT's steps plus every
                   round's updates (equal total gradient steps): imitation nearer its plateau, the other control
    awr            single-critic advantage-weighted regression
    habc           hierarchical advantage weighting (viability + efficiency, gated)
    habc_mc        HABC with Monte-Carlo efficiency targets (our variant)
    habc_n05       HABC with the rollouts' initial flow noise halved (`rl.rollout_noise_scale 0.5`, ours): more
                   successes a round to learn from
    habc_pooled    HABC's loss as written: demos and credit-weighted rollouts in one pool (the habc arm draws half of
                   each batch from the demos)
    habc_hil       HABC with the simulated human in the loop
    habc_hil_ir    the same with intervention reweighting (human steps weighted by g) after 3 rounds: the paper's best
    habc_nogate    ablation: fixed mix instead of the state-adaptive gate
    habc_nocredit  ablation: no intervention-aware credit (with the human in the loop, where it matters)

    flow_ppo       Flow-SDE GRPO on the denoising steps' log-probs (the πRL-style baseline)
    flow_ppo_gae   the same with PPO's critic (GAE advantages) instead of GRPO groups, πRL's other arm
    nft            DiffusionNFT on the action expert: failed rollouts as negatives, not only successes as positives
                   (our application of NFT to the VLA)
    nft_speed      NFT with a success in T steps rewarded γ^(T−1) (γ = 0.98) instead of 1: faster successes count
                   more (ours)
    pa_rl          policy-agnostic RL: rollouts execute the chunk critic's pick among 8 sampled chunks; the picks are
                   distilled into the policy (evaluated at N = 1, the fair comparison)
    pa_rl_refine   the same with PA-RL's local step (3 gradient steps up the critic per sampled chunk) and γ = 0.97
    dsrl           diffusion steering: SAC on the flow sampler's initial noise, the VLA frozen
    residual, residual_wide, residual_calm, residual_calm_ln, residual_calm_clip, residual_calm_ln_clip,
    residual_calm_bc, residual_calm_bc_strong
                   residual RL: SAC on a correction (bound ±0.1, wide ±0.2) added to the frozen VLA's deterministic
                   chunk; it can leave the demonstrations' support (ResiP, Policy Decorator); calm: the actor's
                   initial std 0.3 instead of 1 and SAC's temperature 0.001 instead of 0.1 (ours); ln: with
                   LayerNorm in the critics (RLPD's); clip: TD targets clamped to the returns' range [0, 1] (ours);
                   bc: TD3+BC's term on the actor, weight 0.2 (strong: 1), toward the stored corrections (ours here)
    hg_dagger      HG-DAgger, the control of the habc_hil arms: the same simulated human, its takeovers imitated
                   beside the demos at weight 1, aggregated over rounds
    hg_dagger_correction, habc_hil_ir_correction
                   hg_dagger and habc_hil_ir on the human's correction steps only, without the recovery drive back
                   (`rl.human_steps correction`, ours)
    sft_continued_rwr, habc_rwr, nft_speed_rwr
                   the control, habc and nft_speed with the rounds drawing the demos reward-weighted by their steps to
                   success (`demos.weighting return`, ours; for demos of uneven speed); the RL arms also have
                   paired_vs_sft_continued_rwr

`pa_rl_selection` in the JSON is the pa_rl arm's policy with value-guided selection at N = 8 at inference (V-GPS),
with its batch-1 `latency_ms` beside that of N = 1 (measured interleaved). Its first candidate is the chunk the arm
executes at N = 1 (from zero noise under `--eval.noise_scale 0`), the other seven sampled.

Demonstration regimes (--demos): `scripted` (the clean scripted expert) and `teleop` (a simulated teleoperator:
slower, with pauses, hesitation and detours), each with its own SFTs and arms; the first regime's figures are the
JSON's top level, each other's under `regimes.<name>` with the same keys.

Last line: one JSON object, one entry per method with success, heldout_success, steps_to_success and
gain_over_sft (success points over SFT), each success with its standard error; `per_task.<task>` has per arm
success, heldout_success, steps_to_success, cpu_minutes, demos_steps_ratio (the demonstrations' steps to success
over the arm's: above 1, faster than its demonstrator), wrong_target (the share of training-template episodes that
reached a target the instruction did not name; strict success counts them as failures) and ablated_success (with
`--eval.ablated true`: success when the instruction names no target, which chance bounds), the demonstrations' own
(`demos`), and
best_rl_margin_over_control (the best RL arm's success minus the continued-SFT control's, the arm in best_rl_arm;
with sft_continued_rwr beside sft_continued, minus the better of the two, the one in control_arm),
best_hil_margin_over_hg_dagger (the best human-in-the-loop arm's minus hg_dagger's, in best_hil_arm; with
hg_dagger_correction beside hg_dagger, minus the better of the two, the one in hil_control_arm; each such arm also
has paired_vs_hg_dagger and paired_vs_hg_dagger_correction), and eval_noise_scale (the initial noise every row was evaluated from: a reused SFT evaluated at another is evaluated
again at the arms' on the same episodes, once; arms of one task and seed at different scales are refused);
`_meta.task_run_minutes` is the wall time each task's runs took, summed (whether they ran at once or in turn), and
`_meta.cpu_minutes_per_run` the CPU minutes per run of each arm (env workers included; unlike wall time, not
inflated by runs sharing the CPU), with `sft_then_habc`: the compute HABC needs for a task from nothing.

    python benchmarks/vla_rl.py --quick                       # one task, the headline arms, tiny budget
    python benchmarks/vla_rl.py --tasks drawer --seeds 2      # runs one after another, with a live progress bar
    python benchmarks/vla_rl.py --tasks drawer --seeds 2 --first-seed 2   # seeds 2, 3 (beside a run of 0, 1 on this --out)
    python benchmarks/vla_rl.py --tasks push --demos teleop   # the teleoperator-quality regime alone
    python benchmarks/vla_rl.py --jobs 8 --out runs/bench     # 8 runs at once (logs in runs/bench/logs/)
    python benchmarks/vla_rl.py --tasks push --methods habc,sft_continued --out runs/staged \
        --start 'runs/bench/{task}-s{seed}/sft_continued'     # branch from the control's end: SFT to its plateau, then RL
    python benchmarks/vla_rl.py --tasks drawer --eval.noise_scale 0   # every arm evaluated from zero initial noise

Other options are config overrides for every run (`--rl.rounds 3`, ...). Evaluations sample the initial flow noise
by default; DSRL's actor chooses near-zero noise, which alone is worth about 8 points on drawer, so compare it against
the others at `--eval.noise_scale 0` too.

With `--policies vla,video` the video-diffusion policy (policies/video_policy) joins on the same demonstrations and
env steps, in four forms: its SFT, its SFT with best-of-N planning, RL (`--video-method`, HABC by default) and RL
with planning, beside its own continued-SFT control; the JSON gains `video`, `video_planning` and `latency_ms`
(batch-1 chunk latency of the VLA, the video policy and the video policy with planning).

With `--policies vla,smolvla` a SmolVLA joins the same way (policies/smolvla: LeRobot's architecture; by default the
tiny test fixture's, random, so its SFT trains everything with the demos' normalisation): its SFT, its RL arm
(`--smolvla-method`) and its continued-SFT control, both from its SFT's checkpoint; the JSON gains
`smolvla.<arm>.success` (sft, rl, sft_continued), `smolvla.rl_margin_over_control` (paired) and its latency.
`--policies vla,pi0` does the same for LeRobot's π0 (policies/pi0; `--pi0-method`, `--pi0-checkpoint`; the JSON
gains `pi0.<arm>.success`).

Runs are folders under --out; a finished run is reused and an interrupted one resumed, so a killed benchmark
continues where it stopped and more seeds or methods can be added later.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from kinema.common import load_run_config
from kinema.train.config import TrainConfig
from kinema.train.evaluate import paired_outcome_differences
from kinema.train.workflow import train
from policies.checkpoint import set_aside, write_text_atomic

METHODS: dict[str, list[str]] = {
    "sft_continued": ["--rl.method", "sft_continued"],
    # trained from scratch, not branched: its --sft.steps is the start's SFT steps + rounds x updates (FRESH_ARMS)
    "sft_long": ["--rl.method", "none"],
    "awr": ["--rl.method", "awr"],
    "flow_ppo": ["--rl.method", "flow_ppo"],
    "flow_ppo_gae": ["--rl.method", "flow_ppo", "--rl.ppo.advantage", "gae"],
    "habc": ["--rl.method", "habc"],
    # our variant: V_e regresses on observed steps-to-success instead of the paper's TD target
    "habc_mc": ["--rl.method", "habc", "--rl.habc.efficiency_target", "mc", "--rl.habc.value_scale", "50"],
    "habc_pooled": ["--rl.method", "habc", "--rl.replay_mixing", "pooled"],
    # ours: rollouts from half the initial flow noise, nearer the policy's mode (more successes a round)
    "habc_n05": ["--rl.method", "habc", "--rl.rollout_noise_scale", "0.5"],
    "habc_hil": ["--rl.method", "habc", "--rl.interventions", "true"],
    # the paper's best arm: human steps weighted by the gate (IR) after 3 rounds without
    "habc_hil_ir": [
        "--rl.method", "habc", "--rl.interventions", "true", "--rl.habc.intervention_reweighting", "true",
        "--rl.habc.intervention_reweighting_after", "3",
    ],  # fmt: skip
    # ours: the same on the human's correction steps only, as hg_dagger_correction
    "habc_hil_ir_correction": [
        "--rl.method", "habc", "--rl.interventions", "true", "--rl.habc.intervention_reweighting", "true",
        "--rl.habc.intervention_reweighting_after", "3", "--rl.human_steps", "correction",
    ],  # fmt: skip
    "habc_nogate": ["--rl.method", "habc", "--rl.habc.gate", "fixed_mix"],
    "habc_nocredit": ["--rl.method", "habc", "--rl.interventions", "true", "--rl.habc.intervention_credit", "false"],
    "nft": ["--rl.method", "nft"],
    # ours: the demos keep the control's own loss (augmented flow matching), the rollouts add NFT's pull and push in
    # its velocity form; and with three quarters of every batch from the demos
    "nft_sftloss": ["--rl.method", "nft", "--rl.nft.demo_loss", "flow"],
    "nft_sftloss_d75": ["--rl.method", "nft", "--rl.nft.demo_loss", "flow", "--rl.demo_fraction", "0.75"],
    # our variant: a success in T steps earns gamma^(T-1), so a faster success counts more within the round
    "nft_speed": ["--rl.method", "nft", "--rl.nft.reward", "discounted"],
    "pa_rl": ["--rl.method", "pa_rl"],
    # PA-RL's local step: each sampled chunk climbs the critic before the choice; a shorter horizon (gamma 0.97)
    "pa_rl_refine": ["--rl.method", "pa_rl", "--rl.pa_rl.refine_steps", "3", "--rl.pa_rl.gamma", "0.97"],
    "dsrl": ["--rl.method", "dsrl"],
    # residual RL (ResiP, Policy Decorator): SAC on a bounded correction to the frozen VLA's deterministic chunk;
    # and with a bound of 0.2 (the correction can double a typical action)
    "residual": ["--rl.method", "residual"],
    "residual_wide": ["--rl.method", "residual", "--rl.residual.scale", "0.2"],
    # ours: exploration at a third of SAC's initial spread, so that the first rounds' rollouts stay near the VLA's,
    # and a temperature of 0.001 (not 0.1), so that the entropy bonus does not outweigh a sparse reward's Q
    "residual_calm": ["--rl.method", "residual", "--rl.residual.init_std", "0.3", "--rl.residual.init_alpha", "0.001"],
    # the same with LayerNorm in the critics (RLPD's remedy for Q's extrapolation, which residual_calm's actor exploits)
    "residual_calm_ln": ["--rl.method", "residual", "--rl.residual.init_std", "0.3", "--rl.residual.init_alpha", "0.001",
                         "--rl.residual.critic_layer_norm", "true"],
    # ours: the critics' TD targets clamped to [0, 1] (no return exceeds 1), against the overestimation the calm
    # actor climbed (13x without LayerNorm; Q diverged to 3 with it)
    "residual_calm_clip": ["--rl.method", "residual", "--rl.residual.init_std", "0.3", "--rl.residual.init_alpha", "0.001",
                           "--rl.residual.clip_targets", "true"],
    "residual_calm_ln_clip": ["--rl.method", "residual", "--rl.residual.init_std", "0.3", "--rl.residual.init_alpha", "0.001",
                              "--rl.residual.critic_layer_norm", "true", "--rl.residual.clip_targets", "true"],
    # ours here: TD3+BC's term keeps the calm actor's mean on the stored corrections, against the same climb; 0.2 is
    # TD3+BC's 1/2.5 of |Q| at the ~0.5 the calm critics reached
    "residual_calm_bc": ["--rl.method", "residual", "--rl.residual.init_std", "0.3", "--rl.residual.init_alpha", "0.001",
                         "--rl.residual.bc_weight", "0.2"],
    "residual_calm_bc_strong": ["--rl.method", "residual", "--rl.residual.init_std", "0.3", "--rl.residual.init_alpha", "0.001",
                                "--rl.residual.bc_weight", "1"],
    # Recap (pi*0.6): imitate demos and rollouts alike, conditioned on an improvement indicator from a value of the
    # steps left; and with the simulated human's corrections (always labelled improvements)
    "recap": ["--rl.method", "recap"],
    "recap_hil": ["--rl.method", "recap", "--rl.interventions", "true"],
    # ours: Recap's conditioning on the episode's outcome instead of a value's advantage, guided away from failures
    "recap_outcome": ["--rl.method", "recap", "--rl.recap.labels", "outcome", "--rl.recap.guidance", "2"],
    # ours: the value drawn half from the demos, half from the rollouts
    "recap_balanced": ["--rl.method", "recap", "--rl.recap.value_demo_share", "0.5"],
    # Recap's own mix: every step of the demos and the replay window drawn alike (pooled), not half from each
    "recap_pooled": ["--rl.method", "recap", "--rl.replay_mixing", "pooled"],
    # the control of the human-in-the-loop arms: the same simulated human and takeover budget (the default monitor,
    # as habc_hil and habc_hil_ir), imitating the demos plus the human's segments of every round, no credit weighting
    "hg_dagger": ["--rl.method", "hg_dagger", "--rl.interventions", "true"],
    # ours: HG-DAgger on the human's correction steps only (not the recovery drive back to the last good pose)
    "hg_dagger_correction": ["--rl.method", "hg_dagger", "--rl.interventions", "true", "--rl.human_steps", "correction"],
    # ours, for demos of uneven speed: the rounds draw the demos reward-weighted by their steps to success
    # (demos.weighting return; the SFT they branch from is the benchmark's); the control imitates them so, the RL
    # arms add their credit on the rollouts
    "sft_continued_rwr": ["--rl.method", "sft_continued", "--demos.weighting", "return"],
    "habc_rwr": ["--rl.method", "habc", "--demos.weighting", "return"],
    "nft_speed_rwr": ["--rl.method", "nft", "--rl.nft.reward", "discounted", "--demos.weighting", "return"],
}

BASELINES = ("sft", "sft_continued", "awr", "flow_ppo", "flow_ppo_gae")  # HABC's margin is over the best of these
HEADLINE = ("sft_continued", "awr", "flow_ppo", "habc", "habc_hil")  # with sft, the arms --quick runs by default
CONTROLS = ("sft_continued", "sft_continued_rwr", "sft_long")  # more imitation: continued (uniform, return-weighted) or fresh
FRESH_ARMS = ("sft_long",)  # SFT from scratch at the arms' total gradient steps: evaluated at its "sft" stage
HIL_CONTROLS = ("hg_dagger", "hg_dagger_correction")  # HG-DAgger on every human step, or on the corrections only
NOT_RL = ("sft", *CONTROLS, *HIL_CONTROLS)  # imitation arms: best_rl_margin_over_control is over the others
# RL arms with the simulated human: best_hil_margin_over_hg_dagger is over these, against HG-DAgger with the same human
HIL_ARMS = tuple(m for m in METHODS if "--rl.interventions" in METHODS[m] and m not in NOT_RL)
# RL arms on return-weighted demos: each also has paired_vs_sft_continued_rwr, against imitation weighted alike
RWR_ARMS = tuple(m for m in METHODS if "--demos.weighting" in METHODS[m] and m not in NOT_RL)
PAIRED_AGAINST = ("sft", *CONTROLS, *HIL_CONTROLS)  # each arm's paired_vs_<arm> rows, where both ran
REGIMES = ("scripted", "teleop")  # demos.source of each regime's SFTs (--demos)

QUICK = [
    "--demos.episodes", "8", "--sft.steps", "40", "--sft.batch_size", "16", "--rl.rounds", "1",
    "--rl.episodes_per_round", "4", "--rl.updates_per_round", "10", "--rl.batch_size", "16",
    "--rl.habc.critic_steps", "20", "--rl.awr.critic_steps", "20", "--rl.ppo.critic_steps", "20", "--rl.pa_rl.critic_steps", "20", "--rl.pa_rl.demo_episodes", "4", "--rl.dsrl.sac_steps", "20", "--rl.residual.sac_steps", "20", "--eval.episodes", "6", "--eval.round_episodes", "4", "--eval.heldout", "false",
    "--eval.videos", "0", "--num_envs", "4", "--policy.image_size", "32", "--task_config", '{"horizon": 60}',
    "--workers", "0",  # envs in the run's own process: starting worker processes cost more than the tiny runs (174 s -> 63 s)
]  # fmt: skip


def _records(run: Path) -> list[dict]:
    text = (run / "metrics.jsonl").read_text()
    lines = text.splitlines()
    if lines and not text.endswith("\n"):  # a record torn by a kill mid-write
        lines = lines[:-1]
    return [json.loads(line) for line in lines]


@dataclass
class Job:
    """One `kinema train` run of the benchmark: its folder, base config and overrides (resumed if it has a state)."""

    run: Path
    config: str | None
    overrides: list[str]

    @property
    def name(self) -> str:
        return f"{self.run.parent.name}/{self.run.name}"


def run_jobs(jobs: list[Job], *, jobs_at_once: int, logs: Path) -> None:
    """Train the runs: in this process one after another (jobs_at_once 1, with the live progress bar), or as
    `kinema train` subprocesses, jobs_at_once of them at a time, each logging to logs/<task-seed>-<method>.log."""
    if jobs_at_once <= 1:
        for job in jobs:
            resume = (job.run / "state.json").exists()
            train(load_run_config(job.config, [*job.overrides, "--out", str(job.run)], str(job.run) if resume else None, config_class=TrainConfig), resume=resume)
        return
    logs.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.setdefault("OMP_NUM_THREADS", "1")  # runs side by side: one learner thread each (kinema train's learner_threads)

    stop = threading.Event()  # set on a failure or an interrupt: no further run starts
    running: dict[str, subprocess.Popen] = {}
    lock = threading.Lock()

    def one(job: Job) -> None:
        cmd = [sys.executable, "-m", "kinema.cli", "train"]
        if (job.run / "state.json").exists():
            cmd += ["--resume", str(job.run), *job.overrides]  # as the in-process path: the saved config + overrides
        else:
            cmd += [*(["--config", job.config] if job.config else []), *job.overrides, "--out", str(job.run)]
        log = logs / f"{job.name.replace('/', '-')}.log"
        with open(log, "ab") as fh, lock:
            if stop.is_set():
                return
            # A session of its own: a terminal's Ctrl-C reaches this process only, which forwards one SIGINT.
            proc = running[job.name] = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            print(f"started  {job.name} (log: {log})", flush=True)
        code = proc.wait()
        with lock:
            running.pop(job.name, None)
        if code != 0:
            stop.set()  # the runs already going finish; none starts after a failure
            raise RuntimeError(f"benchmark run {job.name} failed with exit code {code}; see {log}")
        print(f"finished {job.name}", flush=True)

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupted)  # a kill by PID stops the runs too, not only Ctrl-C
    # A shell starts background jobs with SIGINT ignored, and the runs would inherit that through exec and never
    # save on the SIGINT forwarded below: a handled (not ignored) SIGINT here is reset to the default in them.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    pool = ThreadPoolExecutor(max_workers=jobs_at_once)
    futures = [pool.submit(one, job) for job in jobs]
    errors = []
    try:
        for future in futures:
            try:
                future.result()
            except RuntimeError as err:
                errors.append(str(err))
    except BaseException:
        # Ctrl-C or SIGTERM: nothing new starts, and every running `kinema train` gets the SIGINT it saves and
        # exits on (it resumes from its last checkpoint on the next invocation).
        stop.set()
        with lock:
            for proc in running.values():
                proc.send_signal(signal.SIGINT)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)
    pool.shutdown(wait=True)
    if errors:
        raise RuntimeError("; ".join(errors))


def _sft_done(run: Path) -> bool:
    """The SFT checkpoint is saved (state.json follows it) and evaluated."""
    return (
        (run / "state.json").exists() and (run / "metrics.jsonl").exists()
        and any(r.get("kind") == "eval" and r.get("stage") == "sft" for r in _records(run))
    )  # fmt: skip


def _final_done(run: Path) -> bool:
    return (run / "state.json").exists() and bool(json.loads((run / "state.json").read_text()).get("final_done"))


def _run_minutes(run: Path) -> float:
    """Wall minutes of one run: from its start (its config file, rewritten on a resume, or its first record,
    whichever is earlier) to its last metrics record. A resumed run counts its pause too."""
    records = _records(run)
    return (records[-1]["time"] - min((run / "config.yaml").stat().st_mtime, records[0]["time"])) / 60


def _run_cpu_minutes(run: Path, *, chain: bool = False) -> float | None:
    """CPU minutes one run spent, env workers included (its last record's `cpu_s`; None for runs that predate it).
    With `chain`, also those of the runs it branched from (its `init_policy` inside another run's checkpoints)."""
    cpu = _records(run)[-1].get("cpu_s")
    if cpu is None:
        return None
    parent = _run_config(run).get("init_policy") or ""
    if chain and parent and Path(parent).parent.name == "checkpoints" and (Path(parent).parent.parent / "metrics.jsonl").exists():
        before = _run_cpu_minutes(Path(parent).parent.parent, chain=True)
        return None if before is None else cpu / 60 + before
    return cpu / 60


def _run_config(run: Path) -> dict:
    return yaml.safe_load((run / "config.yaml").read_text()) or {}


def _run_dataset(run: Path) -> Path:
    """The demonstrations a run trained on: its `dataset`, or the demos it collected."""
    dataset = _run_config(run).get("dataset") or ""
    return Path(dataset) if dataset else run / "demos"


def _start_run(pattern: str, regime: str, task: str, seed: int, parser: argparse.ArgumentParser) -> Path:
    try:
        run = Path(pattern.format(task=task, seed=seed, regime=regime))
    except (KeyError, IndexError, ValueError) as err:
        parser.error(f"--start {pattern!r}: only {{task}}, {{seed}} and {{regime}} can be filled in ({err})")
    if not _final_done(run):
        parser.error(f"--start: {run} is not a finished `kinema train` run (expected its state.json with the final "
                     "evaluation done, and checkpoints/final)")
    if not (run / "checkpoints" / "final").is_dir():
        parser.error(f"--start: {run} has no checkpoints/final to branch from")
    if _run_config(run).get("task") != task:
        parser.error(f"--start: {run} is a run of task {_run_config(run).get('task')!r}, not {task!r}")
    return run


def final_eval(run: Path, stage: str) -> dict:
    return next(r for r in reversed(_records(run)) if r.get("kind") == "eval" and r.get("stage") == stage)


def _noise_scale(run: Path) -> float:
    return float((_run_config(run).get("eval") or {}).get("noise_scale", 1.0))


def _arms_noise_scale(runs: list[Path]) -> float:
    """The `eval.noise_scale` the arms of one task and seed were evaluated at (one for all, or the rows compare
    different samplers)."""
    scales = {run.name: _noise_scale(run) for run in runs}
    if len(set(scales.values())) > 1:
        raise ValueError(f"the arms under {runs[0].parent} were evaluated at different eval.noise_scale {scales}; "
                         "train them again at one (set them aside, or use another --out)")  # fmt: skip
    return next(iter(scales.values()), 1.0)


def start_eval(run: Path, stage: str, noise_scale: float) -> dict:
    """The start's evaluation record at the arms' `eval.noise_scale`: its own when it was evaluated at that scale,
    else its checkpoint evaluated again on the same episodes and splits from that scale (a reused SFT of an earlier
    benchmark), kept in the run as eval-<stage>-noise<S>.json so that it is done once."""
    record = final_eval(run, stage)
    if _noise_scale(run) == noise_scale:
        return record
    kept = run / f"eval-{stage}-noise{noise_scale:g}.json"
    if kept.exists():
        return json.loads(kept.read_text())
    from kinema.train.acting import load_acting
    from kinema.train.evaluate import SPLITS, evaluate

    cfg = _run_config(run)
    loaded = load_acting(run / "checkpoints" / stage, noise_scale=noise_scale)  # acting as its method acts
    again = {"kind": "eval", "stage": stage, "noise_scale": noise_scale}
    print(f"evaluating {run}/checkpoints/{stage} again from the arms' initial noise × {noise_scale:g}", flush=True)
    for split in [s for s in SPLITS if f"{s}/success" in record]:
        res, _ = evaluate(loaded.policy, cfg["task"], episodes=record[f"{split}/episodes"], split=split, num_envs=cfg["num_envs"],
                          num_workers=cfg["workers"], image_size=cfg["policy"]["image_size"], task_config=cfg.get("task_config") or None,
                          seed=cfg["seed"], runner=loaded.acting.make())  # fmt: skip
        again.update(res.as_dict(prefix=f"{split}/"))
    write_text_atomic(kept, json.dumps(again))  # a kill mid-write leaves no half record to be read as one
    return again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one task, the headline arms, tiny budget (about a minute)")
    parser.add_argument("--tasks", default="drawer,push,pick_place")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per task: --first-seed, the next, ...")
    parser.add_argument(
        "--first-seed", type=int, default=0,
        help="the first seed; the JSON covers this invocation's seeds (for invocations side by side on one --out; "
        "--seeds N from 0 then reuses their runs and pools them)",
    )
    parser.add_argument("--methods", default=None,
                        help=f"arms, comma-separated (default: all of {', '.join(METHODS)}; with --quick: {', '.join(HEADLINE)})")
    parser.add_argument(
        "--demos", default=None, metavar="REGIMES",
        help="demonstration regimes, comma-separated, each with SFTs and arms of its own: scripted (the clean expert) "
        "and teleop (a simulated teleoperator: slower, pauses, hesitates, detours). Default: scripted,teleop; with "
        "--quick: scripted. The first regime's figures are the JSON's top level, each other's under regimes.<name>",
    )
    parser.add_argument(
        "--config", default="{task}_habc",
        help="base config of each task's runs: a YAML path or shipped name; {task} is replaced by the task "
        "(default: the shipped <task>_habc.yaml, which sets the demo count and SFT budget that place SFT at 20-60%%)",
    )
    parser.add_argument(
        "--start", default="", metavar="RUN",
        help="branch every arm from this finished run instead of the benchmark's own SFT: a run folder with {task} "
        "and {seed} (and {regime} with several regimes), e.g. runs/bench_vla_rl/{task}-s{seed}/sft_continued (a "
        "two-stage protocol: imitation to its plateau first, so that the control has little left to gain). Its final "
        "checkpoint is the start, its final evaluation the `sft` row, and its CPU minutes with those of the runs it "
        "branched from the start's budget",
    )
    parser.add_argument("--out", default="runs/bench_vla_rl")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs trained at once, as subprocesses (1: one after another in this process). SFTs first, "
                        "then every method; each run uses one torch thread plus its env workers, so about cores / 2")
    parser.add_argument("--policies", default="vla", help="vla, and video (the video policy's four forms), smolvla or pi0")
    parser.add_argument("--video-method", default="habc", help="the video policy's RL arm (its control is sft_continued)")
    parser.add_argument("--planning", type=int, default=4, help="candidate chunks of the video policy's planning forms")
    parser.add_argument("--video-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a video policy option for its runs, as --policy.KEY VALUE (repeatable), e.g. action_head=expert; "
                        "a dotted KEY is another kinema train key of the video runs alone, e.g. sft.batch_size=16")
    parser.add_argument("--video-generator", default="", metavar="pretrain|RUN",
                        help="the video policy's trunk: empty, a tiny random Wan; 'pretrain', a `kinema video train` "
                        "pre-training (no post-training rounds) on each task's videos, in <out>/<task>-video_generator, its "
                        "CPU minutes counted in the video SFT's; or a run folder ({task} replaced)")
    parser.add_argument("--smolvla-method", default="habc", help="the SmolVLA's RL arm (its control is sft_continued)")
    fixture = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smolvla"
    parser.add_argument("--smolvla-checkpoint", default=str(fixture / "tiny-smolvla"),
                        help="the SmolVLA the smolvla arms start from (default: the tiny test fixture, random weights)")
    parser.add_argument("--smolvla-vlm-path", default=str(fixture / "tiny-smolvlm"))
    parser.add_argument("--pi0-method", default="habc", help="the pi0's RL arm (its control is sft_continued)")
    parser.add_argument("--pi0-checkpoint", default=str(fixture.parent / "pi0" / "tiny-pi0"),
                        help="the pi0 the pi0 arms start from (default: the tiny test fixture, random weights)")
    args, overrides = parser.parse_known_args()
    if unknown := set(args.policies.split(",")) - {"vla", "video", *LEROBOT_KINDS}:
        parser.error(f"--policies: unknown {sorted(unknown)}; valid: vla, video, {', '.join(LEROBOT_KINDS)}")
    tasks = ["drawer"] if args.quick else args.tasks.split(",")
    video_options = _video_options(args.video_set, parser)
    named_generators = {task: Path(args.video_generator.format(task=task)) for task in tasks} if args.video_generator not in ("", "pretrain") else {}
    if named_generators:
        if missing := [str(r) for r in named_generators.values() if not (r / "final").is_dir() and not (r / "transformer").is_dir()]:
            parser.error(f"--video-generator: {missing[0]} is not a `kinema video train` run (no final/) nor a generator folder")
    if args.seeds < 1 or args.first_seed < 0:
        parser.error(f"--seeds must be >= 1 and --first-seed >= 0; got {args.seeds} and {args.first_seed}")
    if args.quick and args.first_seed:
        parser.error("--quick runs seed 0 alone; --first-seed does not apply")
    seeds = [0] if args.quick else list(range(args.first_seed, args.first_seed + args.seeds))
    methods = (args.methods or ",".join(HEADLINE if args.quick else METHODS)).split(",")
    if unknown := [m for m in methods if m not in METHODS]:
        parser.error(f"--methods: unknown arm(s) {', '.join(unknown)}; valid: {', '.join(METHODS)}")
    for arms, controls, margin in ((set(METHODS) - set(NOT_RL), CONTROLS, "best_rl_margin_over_control"),
                                   (set(HIL_ARMS), HIL_CONTROLS, "best_hil_margin_over_hg_dagger")):  # fmt: skip
        if arms & set(methods) and not set(controls) & set(methods):
            print(f"vla_rl: warning: --methods has none of the controls {', '.join(controls)}: the JSON will have no "
                  f"{margin} (add one; a finished run is reused)", file=sys.stderr)  # fmt: skip
    regimes = (args.demos or ("scripted" if args.quick else ",".join(REGIMES))).split(",")
    if unknown := [r for r in regimes if r not in REGIMES] or len(set(regimes)) < len(regimes):
        parser.error(f"--demos: {args.demos!r} is not a list of distinct regimes; valid: {', '.join(REGIMES)}")
    if args.start and len(regimes) > 1 and "{regime}" not in args.start:
        parser.error("--start: with several --demos regimes the start must name {regime} (each regime branches from its own)")
    base_overrides = (QUICK if args.quick else []) + overrides
    out = Path(args.out + ("_quick" if args.quick else ""))
    started = time.time()

    # 1. Runs: per regime, one SFT per task and seed, then every method from it. A finished run is reused and an
    # interrupted one resumed, so a killed benchmark continues where it stopped.
    configs = {task: args.config.format(task=task) if args.config else None for task in tasks}
    sft_jobs, arm_jobs = [], []
    starts = {(regime, task, seed): _start_run(args.start, regime, task, seed, parser) if args.start else
              _task_dir(out, regime, task, seed) / "sft" for regime in regimes for task in tasks for seed in seeds}  # fmt: skip
    arm_runs = {(_task_dir(out, r, task, seed) / m).resolve() for r in regimes for task in tasks for seed in seeds for m in methods}
    if args.start and (clash := [run for run in starts.values() if run.resolve() in arm_runs]):
        parser.error(f"--start: {clash[0]} is also where an arm of this --out trains; give the arms another --out")
    for regime in regimes:
        for task in tasks:
            for seed in seeds:
                base = starts[regime, task, seed]
                start_checkpoint, demos = (base / "checkpoints" / "final", _run_dataset(base)) if args.start else (
                    base / "checkpoints" / "sft", base / "demos")  # fmt: skip
                common = [*base_overrides, "--task", task, "--seed", str(seed), "--demos.source", regime]
                if not args.start and not _sft_done(base):
                    if base.exists():  # an SFT killed before its checkpoint and evaluation: it has no round to resume
                        set_aside(base, f"{base.name}-interrupted")
                        for arm in base.parent.iterdir():  # arms branched from that SFT do not belong to the new one
                            if arm.is_dir() and arm.name in METHODS:
                                set_aside(arm, f"{arm.name}-interrupted")
                    sft_jobs.append(Job(base, configs[task], [*common, "--rl.method", "none"]))
                for method in methods:
                    run = _task_dir(out, regime, task, seed) / method
                    if method in FRESH_ARMS:
                        if args.start:
                            parser.error(f"--methods {method}: an SFT from scratch cannot branch from --start; leave it out")
                        if not _sft_done(run):
                            if run.exists():
                                set_aside(run, f"{run.name}-interrupted")
                            arm_jobs.append(Job(run, configs[task], [*common, *METHODS[method], "--sft.steps",
                                                                     str(_equal_steps(configs[task], common)), "--dataset", str(demos)]))  # fmt: skip
                        continue
                    if not _final_done(run):
                        if run.exists() and not (run / "state.json").exists():  # killed before its first checkpoint
                            set_aside(run, f"{run.name}-interrupted")
                        arm_jobs.append(Job(run, configs[task], [
                            *common, *METHODS[method], "--init_policy", str(start_checkpoint), "--dataset", str(demos),
                            "--eval.baseline", "false",
                        ]))  # fmt: skip
    run_jobs(sft_jobs, jobs_at_once=args.jobs, logs=out / "logs")
    video = "video" in args.policies.split(",")
    if video:  # the video policy's SFT on the VLA's demonstrations, then its arms beside the VLA's
        generators = named_generators or _video_generators(out, tasks, pretrain=args.video_generator == "pretrain", quick=args.quick)
        arm_jobs += _video_jobs(out, regimes[0], tasks, seeds, starts, configs, base_overrides, args.video_method, args.start,
                                args.jobs, video_options, generators)  # fmt: skip
    lerobot = {kind: LEROBOT_KINDS[kind](args) for kind in LEROBOT_KINDS if kind in args.policies.split(",")}
    for kind, (method, checkpoint, language) in lerobot.items():
        arm_jobs += _lerobot_jobs(kind, out, regimes[0], tasks, seeds, starts, configs, base_overrides, method, args.start,
                                  args.jobs, checkpoint, language)  # fmt: skip
    run_jobs(arm_jobs, jobs_at_once=args.jobs, logs=out / "logs")

    # 2. The tables, from the runs' metrics: the first regime's at the top level, each other's under regimes.<name>.
    blocks = {}
    for regime in regimes:
        print(f"\n[{regime} demonstrations]")
        blocks[regime], run_minutes, cpu_minutes = regime_summary(
            out, regime, tasks, seeds, methods, {(t, s): starts[regime, t, s] for t in tasks for s in seeds},
            from_start=bool(args.start),
        )  # fmt: skip
        if regime != regimes[0]:
            blocks[regime]["_meta"] = {"task_run_minutes": run_minutes, "cpu_minutes_per_run": cpu_minutes}
        else:
            first_minutes, first_cpu = run_minutes, cpu_minutes
    summary = blocks[regimes[0]]
    if video:  # on the first regime's demonstrations
        summary.update(_video_summary(out, regimes[0], tasks, seeds, starts, args.video_method, args.planning, summary["per_task_success"],
                                      generators))  # fmt: skip
    for kind, (method, _, _) in lerobot.items():
        summary.update(_lerobot_summary(kind, out, regimes[0], tasks, seeds, starts, method, summary["per_task_success"]))
    if len(regimes) > 1:
        summary["regimes"] = {r: blocks[r] for r in regimes[1:]}
    # Wall minutes of this invocation (runs finished earlier and reused count zero), with the jobs it ran at once.
    summary["_meta"] = {"tasks": tasks, "seeds": len(seeds), "first_seed": seeds[0], "quick": args.quick, "jobs": args.jobs, "start": args.start or "sft",
                        "demos": regimes, "runs_trained": len(sft_jobs) + len(arm_jobs),
                        "minutes": round((time.time() - started) / 60, 1), "task_run_minutes": first_minutes,
                        "cpu_minutes_per_run": first_cpu}  # fmt: skip
    print(json.dumps(summary))


def _equal_steps(config: str | None, overrides: list[str]) -> int:
    """The gradient steps of a branched arm in all: its start's SFT steps plus every round's actor updates."""
    from kinema.common import load_config
    from kinema.train.config import TrainConfig

    cfg = load_config(config, overrides, config_class=TrainConfig)
    return cfg.sft.steps + cfg.rl.rounds * cfg.rl.updates_per_round


def _task_dir(out: Path, regime: str, task: str, seed: int) -> Path:
    """The folder of a task and seed's runs: the scripted regime where the benchmark always kept them."""
    return out / (f"{task}-s{seed}" if regime == "scripted" else f"{task}-{regime}-s{seed}")


def regime_summary(
    out: Path, regime: str, tasks: list[str], seeds: list[int], methods: list[str], starts: dict[tuple[str, int], Path], *,
    from_start: bool,
) -> tuple[dict, dict[str, float], dict[str, dict[str, float]]]:  # fmt: skip
    """One regime's figures: per arm pooled over tasks and seeds, and per task (`per_task`); with the wall minutes
    of each task's runs and the CPU minutes per run of each arm."""
    rows: dict[str, dict[str, list]] = {m: {"success": [], "heldout": [], "steps": [], "gain": []} for m in ["sft", *methods]}
    # Per arm, per-seed outcome differences (training templates) against SFT and against the control, pooled over
    # tasks and seeds: every arm of a task and seed is evaluated on the same seeds with seeded sampling noise.
    paired: dict[str, dict[str, list[np.ndarray]]] = {m: {against: [] for against in PAIRED_AGAINST} for m in methods}
    per_task: dict[str, dict[str, list]] = {}  # task -> method -> [train success] over seeds
    per_task_rows: dict[str, dict[str, dict[str, list]]] = {}  # task -> method -> the rows, per task
    demo_rows: dict[str, list[dict]] = {}  # task -> the demos record of each seed's start
    run_minutes: dict[str, float] = {}  # task -> the wall minutes its runs took, summed
    cpu_minutes: dict[str, dict[str, float]] = {}  # task -> arm -> CPU minutes per run, mean over seeds
    noise_scales: dict[str, float] = {}  # task -> the eval.noise_scale every row of it was evaluated at
    for task in tasks:
        def run_of(seed: int, m: str) -> Path:
            return starts[task, seed] if m == "sft" else _task_dir(out, regime, task, seed) / m

        runs = [run_of(seed, m) for seed in seeds for m in ["sft", *methods]]
        run_minutes[task] = round(sum(_run_minutes(r) for r in runs), 1)
        for m in ["sft", *methods]:
            spent = [c for seed in seeds if (c := _run_cpu_minutes(run_of(seed, m), chain=m == "sft")) is not None]
            if spent:
                cpu_minutes.setdefault(task, {})[m] = round(float(np.mean(spent)), 2)
        if {"sft", "habc"} <= cpu_minutes.get(task, {}).keys():  # HABC's budget for the task: its SFT, then its RL
            cpu_minutes[task]["sft_then_habc"] = round(cpu_minutes[task]["sft"] + cpu_minutes[task]["habc"], 2)
        task_rows = per_task_rows[task] = {m: {"success": [], "heldout": [], "steps": [], "gain": []} for m in ["sft", *methods]}
        for seed in seeds:
            demo_rows.setdefault(task, []).append(next((r for r in _records(starts[task, seed]) if r.get("kind") == "demos"), {}))
            scale = noise_scales[task] = _arms_noise_scale([_task_dir(out, regime, task, seed) / m for m in methods])
            sft = start_eval(starts[task, seed], "final" if from_start else "sft", scale)
            for target in (rows, task_rows):
                _add(target["sft"], sft, sft)
            _add_task(per_task, task, "sft", sft)
            finals = {m: final_eval(_task_dir(out, regime, task, seed) / m, "sft" if m in FRESH_ARMS else "final") for m in methods}
            for method in methods:
                run = _task_dir(out, regime, task, seed) / method
                final = finals[method]
                for target in (rows, task_rows):
                    _add(target[method], final, sft)
                paired[method]["sft"].append(paired_outcome_differences(sft, final, "train"))
                for control in (c for c in ("sft_continued", "sft_long") if c in finals and method != c):
                    paired[method][control].append(paired_outcome_differences(finals[control], final, "train"))
                for control in (c for c in HIL_CONTROLS if c in finals and method in HIL_ARMS):  # against the same human
                    paired[method][control].append(paired_outcome_differences(finals[control], final, "train"))
                if "sft_continued_rwr" in finals and method in RWR_ARMS:  # against imitation of the same weighted demos
                    paired[method]["sft_continued_rwr"].append(paired_outcome_differences(finals["sft_continued_rwr"], final, "train"))
                takeovers = [r["rollout/takeover_rate"] for r in _records(run) if r.get("kind") == "round" and r.get("rollout/takeover_rate") is not None]
                if "--rl.interventions" in METHODS[method] and len(takeovers) >= 2:
                    rows[method].setdefault("takeover", []).append((takeovers[0], takeovers[-1]))
                _add_task(per_task, task, method, final)

    summary: dict = {}
    print(f"\n{'method':<15} {'success':>14} {'held-out':>14} {'steps':>8} {'gain (pts)':>12}")
    for method, r in rows.items():
        entry = {
            "success": _mean(r["success"]),
            "success_se": _pooled_se(r["success"]),
            "heldout_success": _mean(r["heldout"]),
            "heldout_success_se": _pooled_se(r["heldout"]),
            "steps_to_success": _mean([s for s in r["steps"] if s is not None]),
            "gain_over_sft": None if method == "sft" else _mean(r["gain"]),
        }
        for against in PAIRED_AGAINST:  # paired by evaluation seed: mean difference, its s.e., n
            diffs = np.concatenate(paired.get(method, {}).get(against) or [np.zeros(0)])
            if len(diffs) > 1:
                entry[f"paired_vs_{against}"] = {"diff": round(float(diffs.mean()), 4), "n": len(diffs),
                                                 "se": round(float(diffs.std(ddof=1) / math.sqrt(len(diffs))), 4)}
        if r.get("takeover"):  # the simulated human: takeovers per rollout in the first and the last round
            first, last = (float(np.mean(v)) for v in zip(*r["takeover"]))
            entry.update(takeover_rate_first_round=round(first, 3), takeover_rate_last_round=round(last, 3),
                         takeover_fall=round(first / max(last, 1e-9), 2))  # fmt: skip
        summary[method] = entry
        gain = "" if entry["gain_over_sft"] is None else f"{100 * entry['gain_over_sft']:+.1f}"
        steps = entry["steps_to_success"] or float("nan")
        print(
            f"{method:<15} {_pct(entry['success'], entry['success_se']):>14} "
            f"{_pct(entry['heldout_success'], entry['heldout_success_se']):>14} {steps:>8.1f} {gain:>12}"
        )
    # Per task: mean success over seeds, and HABC's margin over the best baseline (the control included).
    by_task: dict[str, dict] = {}
    for task, entries in per_task.items():
        by_task[task] = {m: round(float(np.mean(v)), 4) for m, v in entries.items()}
        baselines = [by_task[task][m] for m in BASELINES if m in by_task[task]]
        if "habc" in by_task[task] and baselines:
            by_task[task]["habc_margin_over_best_baseline"] = round(by_task[task]["habc"] - max(baselines), 4)
        print(f"{task:<12} " + "  ".join(f"{m} {100 * v:.0f}" for m, v in by_task[task].items() if m != "habc_margin_over_best_baseline")
              + (f"  | HABC - best baseline {100 * by_task[task]['habc_margin_over_best_baseline']:+.0f} pts" if "habc_margin_over_best_baseline" in by_task[task] else ""))
    summary["per_task_success"] = by_task
    if "pa_rl" in methods:  # value-guided selection at N on the pa_rl arm's final policy, per run
        picks = [(task, r) for task in tasks for seed in seeds for r in _records(_task_dir(out, regime, task, seed) / "pa_rl")
                 if r.get("kind") == "selection_eval"]  # fmt: skip
        if picks:
            summary["pa_rl_selection"] = {
                "num_samples": picks[0][1]["num_samples"],
                "margin": picks[0][1].get("margin", 0.0),  # rl.pa_rl.eval_margin (0: V-GPS's argmax)
                "success": _mean([r["train/success"] for _, r in picks]),
                "success_se": _pooled_se([(r["train/success"], r["train/episodes"]) for _, r in picks]),
                "latency_ms": round(float(np.mean([r["latency_ms"] for _, r in picks])), 2),
                "latency_ms_n1": round(float(np.mean([r["latency_ms_n1"] for _, r in picks])), 2),
                "per_task_success": {task: _mean([r["train/success"] for t, r in picks if t == task]) for task in tasks},
            }
            # Against the same policy at N = 1 (its final evaluation), paired by evaluation seed.
            diffs = np.concatenate([paired_outcome_differences(final_eval(_task_dir(out, regime, task, seed) / "pa_rl", "final"), r, "train")
                                    for task in tasks for seed in seeds for r in _records(_task_dir(out, regime, task, seed) / "pa_rl")
                                    if r.get("kind") == "selection_eval"])  # fmt: skip
            if len(diffs) > 1:
                summary["pa_rl_selection"]["paired_vs_n1"] = {"diff": round(float(diffs.mean()), 4), "n": len(diffs),
                                                              "se": round(float(diffs.std(ddof=1) / math.sqrt(len(diffs))), 4)}
    summary["per_task"] = {task: task_entry(per_task_rows[task], demo_rows[task], cpu_minutes.get(task, {})) for task in tasks}
    for task, entry in summary["per_task"].items():  # the task's own selection figures beside its arms
        entry["eval_noise_scale"] = noise_scales[task]
        mine = [r for t, r in picks if t == task] if "pa_rl" in methods else []
        if mine:
            entry["pa_rl_selection"] = {"success": _mean([r["train/success"] for r in mine]),
                                        "latency_ms": round(float(np.mean([r["latency_ms"] for r in mine])), 2)}
    return summary, run_minutes, cpu_minutes


def task_entry(rows: dict[str, dict[str, list]], demos: list[dict], cpu: dict[str, float]) -> dict:
    """One task's figures: per arm success, held-out success, steps to success (successful episodes), CPU minutes
    per run and the demonstrations' steps to success over the arm's (above 1: faster than its demonstrator); the
    demonstrations' own; the best RL arm's margin over the continued-SFT control; and the best human-in-the-loop
    arm's margin over HG-DAgger, their control."""
    demo_steps = _mean([d["steps_to_success"] for d in demos if d.get("steps_to_success")])
    out: dict = {"demos": {"success": _mean([d["success"] for d in demos if "success" in d]), "steps_to_success": demo_steps}}
    for arm, r in rows.items():
        steps = _mean([s for s in r["steps"] if s is not None])
        out[arm] = {"success": _mean(r["success"]), "heldout_success": _mean(r["heldout"]), "steps_to_success": steps,
                    "cpu_minutes": cpu.get(arm), "wrong_target": _mean(r.get("wrong_target", [])),
                    "ablated_success": _mean(r.get("ablated", [])),
                    "demos_steps_ratio": round(demo_steps / steps, 3) if demo_steps and steps else None}  # fmt: skip
    rl_arms = [a for a in rows if a not in NOT_RL and out[a]["success"] is not None]
    if "sft_continued" in rows and rl_arms:
        best = max(rl_arms, key=lambda a: out[a]["success"])
        controls = [c for c in CONTROLS if c in rows and out[c]["success"] is not None]
        control = max(controls, key=lambda c: out[c]["success"])  # the stronger imitation, when both ran
        out["best_rl_margin_over_control"] = round(out[best]["success"] - out[control]["success"], 4)
        out["best_rl_arm"], out["control_arm"] = best, control
    hil_arms = [a for a in rows if a in HIL_ARMS and out[a]["success"] is not None]
    hil_controls = [c for c in HIL_CONTROLS if c in rows and out[c]["success"] is not None]
    if hil_controls and hil_arms:
        best = max(hil_arms, key=lambda a: out[a]["success"])
        control = max(hil_controls, key=lambda c: out[c]["success"])  # the stronger HG-DAgger, when both ran
        out["best_hil_margin_over_hg_dagger"] = round(out[best]["success"] - out[control]["success"], 4)
        out["best_hil_arm"], out["hil_control_arm"] = best, control
    return out


# ----- the video-diffusion policy (--policies vla,video) ----------------------------------------------------------------
VIDEO_ARMS = ("video_sft", "video_rl", "video_sft_continued")


def _video_options(pairs: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """--video-set KEY=VALUE ... as the video runs' --policy.KEY VALUE overrides; a dotted KEY (sft.batch_size=16) is
    any other `kinema train` key of those runs alone."""
    options = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            parser.error(f"--video-set takes KEY=VALUE (a video policy option, e.g. action_head=expert, or a dotted "
                         f"kinema train key, e.g. sft.batch_size=16); got {pair!r}")  # fmt: skip
        options += [f"--{key}" if "." in key else f"--policy.{key}", value]
    return options


def _video_generators(out: Path, tasks, *, pretrain: bool, quick: bool) -> dict[str, Path]:
    """--video-generator pretrain: each task's pre-trained trunk (`kinema video train` on the task's scripted videos,
    pre-training only: no post-training rounds, no judge) in <out>/<task>-video_generator, trained unless a finished
    one is there; {} without pretrain."""
    if not pretrain:
        return {}
    from kinema.common import load_run_config
    from kinema.video.config import VideoTrainConfig
    from kinema.video.workflow import train_video

    runs = {}
    for task in tasks:
        run = out / f"{task}-video_generator"
        if not (run / "final" / "transformer").is_dir():
            budget = ["--pretrain.steps", "40", "--data.episodes", "16"] if quick else []
            overrides = ["--data.task", task, "--train.rounds", "0", "--judge.enabled", "false", *budget, "--out", str(run)]
            resume = (run / "state.json").exists()
            train_video(load_run_config(None, overrides, str(run) if resume else None, config_class=VideoTrainConfig), resume=resume)
        runs[task] = run
    return runs


def _video_jobs(out: Path, regime: str, tasks, seeds, starts, configs, overrides, method, start, jobs_at_once,
                options: list[str], generators: dict[str, Path]) -> list[Job]:  # fmt: skip
    """Its SFT (trained here, before the arms) on the VLA SFT's demonstrations (of `regime`), then its RL arm and its
    control; `options` (--policy.KEY VALUE) and each task's generator apply to all three."""
    if start:
        raise SystemExit("--policies video branches from the benchmark's own SFT; drop --start")
    return _other_policy_jobs(out, regime, tasks, seeds, starts, configs, overrides, method, jobs_at_once, prefix="video",
                              policy=["--policy.type", "video", *options], sft=[], branch=lambda ckpt: ["--init_policy", str(ckpt)],
                              task_options={task: ["--policy.generator_path", str(run)] for task, run in generators.items()})  # fmt: skip


# --policies KIND for LeRobot's flow VLAs: (RL arm, checkpoint, the options that locate its language side) from the args
LEROBOT_KINDS = {
    "smolvla": lambda args: (args.smolvla_method, args.smolvla_checkpoint, ["--policy.vlm_path", args.smolvla_vlm_path]),
    "pi0": lambda args: (args.pi0_method, args.pi0_checkpoint, []),
}


def _lerobot_jobs(kind: str, out: Path, regime: str, tasks, seeds, starts, configs, overrides, method, start, jobs_at_once,
                  checkpoint: str, language: list[str]) -> list[Job]:  # fmt: skip
    """A LeRobot flow VLA (`kind`: smolvla, pi0) from `checkpoint` (by default the tiny test fixture: random, so
    everything trains and the stats are the demos'), SFT on the VLA SFT's demonstrations, then its RL arm and its
    control, each from the SFT's checkpoint."""
    if start:
        raise SystemExit(f"--policies {kind} branches from the benchmark's own SFT; drop --start")
    policy = ["--policy.type", kind, *language]
    sft = ["--policy.checkpoint", checkpoint, "--policy.trainable", "all", "--policy.normalization", "dataset"]
    return _other_policy_jobs(out, regime, tasks, seeds, starts, configs, overrides, method, jobs_at_once, prefix=kind,
                              policy=policy, sft=sft, branch=lambda ckpt: ["--policy.checkpoint", str(ckpt)])  # fmt: skip


def _other_policy_jobs(out: Path, regime: str, tasks, seeds, starts, configs, overrides, method, jobs_at_once, *, prefix: str,
                       policy: list[str], sft: list[str], branch, task_options: dict[str, list[str]] | None = None) -> list[Job]:  # fmt: skip
    """Another policy type beside the VLA on the VLA SFT's demonstrations (of `regime`): its SFT (trained here, before
    the arms: `<prefix>_sft`), then its RL arm (`<prefix>_rl`) and its control (`<prefix>_sft_continued`), both
    branched from that SFT's checkpoint by `branch(checkpoint)`. task_options: more overrides of one task's runs."""
    sfts = []
    for task in tasks:
        for seed in seeds:
            run = _task_dir(out, regime, task, seed) / f"{prefix}_sft"
            if not _sft_done(run):
                if run.exists():
                    set_aside(run, f"{prefix}_sft-interrupted")
                sfts.append(Job(run, configs[task], [*overrides, *policy, *(task_options or {}).get(task, []), *sft, "--task", task, "--seed", str(seed), "--rl.method",
                                                     "none", "--dataset", str(starts[regime, task, seed] / "demos")]))  # fmt: skip
    run_jobs(sfts, jobs_at_once=jobs_at_once, logs=out / "logs")
    arms = []
    for task in tasks:
        for seed in seeds:
            base = _task_dir(out, regime, task, seed) / f"{prefix}_sft"
            for name, arm in ((f"{prefix}_rl", method), (f"{prefix}_sft_continued", "sft_continued")):
                run = _task_dir(out, regime, task, seed) / name
                if not _final_done(run):
                    if run.exists() and not (run / "state.json").exists():
                        set_aside(run, f"{name}-interrupted")
                    arms.append(Job(run, configs[task], [
                        *overrides, *policy, *(task_options or {}).get(task, []), *METHODS[arm], "--task", task, "--seed", str(seed), *branch(base / "checkpoints" / "sft"),
                        "--dataset", str(starts[regime, task, seed] / "demos"), "--eval.baseline", "false",
                    ]))  # fmt: skip
    return arms


def _lerobot_summary(kind: str, out: Path, regime: str, tasks, seeds, starts, method, by_task) -> dict:
    """<kind>.<arm>.success (sft, rl, sft_continued) with held-out success, the RL arm's margin over its control,
    CPU-minutes per run, and batch-1 chunk latency beside the VLA's."""
    from kinema.train.evaluate import ChunkPolicy, batch1_latency_ms
    from policies import load_policy

    arms = {"sft": (f"{kind}_sft", "sft"), "rl": (f"{kind}_rl", "final"), "sft_continued": (f"{kind}_sft_continued", "final")}
    rows = {arm: {"success": [], "heldout": [], "cpu": []} for arm in arms}
    paired = []
    for task in tasks:
        for seed in seeds:
            root = _task_dir(out, regime, task, seed)
            records = {arm: final_eval(root / run, checkpoint) for arm, (run, checkpoint) in arms.items()}
            for arm, rec in records.items():
                rows[arm]["success"].append((rec["train/success"], rec["train/episodes"]))
                held = [rec[f"{s}/success"] for s in ("heldout_instructions", "heldout_objects") if f"{s}/success" in rec]
                if held:
                    rows[arm]["heldout"].append(float(np.mean(held)))
                rows[arm]["cpu"].append(_run_cpu_minutes(root / arms[arm][0]) or 0.0)
                by_task[task].setdefault(f"{kind}_{arm}", []).append(rec["train/success"])
            paired.append(records["rl"]["train/success"] - records["sft_continued"]["train/success"])
    for task in tasks:
        for arm in arms:
            by_task[task][f"{kind}_{arm}"] = round(float(np.mean(by_task[task][f"{kind}_{arm}"])), 4)
    vla = load_policy(starts[regime, tasks[0], seeds[0]] / "checkpoints" / "sft")
    other = load_policy(_task_dir(out, regime, tasks[0], seeds[0]) / f"{kind}_sft" / "checkpoints" / "sft")
    task_config = _run_config(_task_dir(out, regime, tasks[0], seeds[0]) / f"{kind}_sft").get("task_config") or None
    latency = {}
    for name, policy in (("vla", vla), (kind, other)):
        latency.update({name: round(ms, 1) for name, ms in batch1_latency_ms({name: ChunkPolicy(policy)}, tasks[0],
                                                                               image_size=policy.config.image_size, task_config=task_config).items()})  # fmt: skip
    summary = {arm: {"success": _mean(r["success"]), "success_se": _pooled_se(r["success"]),
                     "heldout_success": _mean(r["heldout"]), "cpu_minutes": round(float(np.mean(r["cpu"])), 1)}
               for arm, r in rows.items()}  # fmt: skip
    summary.update({"method": method, "rl_margin_over_control": round(float(np.mean(paired)), 4),
                    "rl_margin_over_control_se": round(float(np.std(paired, ddof=1) / math.sqrt(len(paired))), 4) if len(paired) > 1 else None,
                    "latency_ms": latency})  # fmt: skip
    print(f"{kind} ({method}): SFT {_pct(summary['sft']['success'], summary['sft']['success_se'])}, RL "
          f"{_pct(summary['rl']['success'], summary['rl']['success_se'])}, control "
          f"{_pct(summary['sft_continued']['success'], summary['sft_continued']['success_se'])}; latency {latency}")
    return {kind: summary}


def _planned_eval(run: Path, checkpoint: str, candidates: int) -> dict:
    """The run's final-evaluation episodes again (same seeds: paired), acting with best-of-N planning."""
    from kinema.train.acting import load_acting
    from kinema.train.evaluate import evaluate

    cfg = _run_config(run)
    loaded = load_acting(run / "checkpoints" / checkpoint, select=candidates)
    res, _ = evaluate(loaded.policy, cfg["task"], episodes=cfg["eval"]["episodes"], split="train", num_envs=cfg["num_envs"],
                      num_workers=cfg["workers"], image_size=cfg["policy"]["image_size"], task_config=cfg.get("task_config") or None,
                      seed=cfg["seed"], runner=loaded.selection.make())  # fmt: skip
    return res.as_dict(prefix="train/")


def _video_summary(out: Path, regime: str, tasks, seeds, starts, method, candidates, by_task, generators: dict[str, Path]) -> dict:
    """video / video_planning / latency_ms entries, and per task the video forms next to the VLA's. The video SFT's
    CPU minutes include its task's generator pre-training (a run trained here or named)."""
    from kinema.train.evaluate import ChunkPolicy, SelectChunkPolicy, batch1_latency_ms
    from policies import load_policy

    rows = {k: [] for k in ("sft", "rl", "control", "sft_planning", "rl_planning")}
    sft_cpu, pretrain_cpu = [], []
    for task in tasks:
        pretrain = (_run_cpu_minutes(generators[task]) or 0.0) if task in generators and (generators[task] / "metrics.jsonl").exists() else 0.0
        pretrain_cpu.append(pretrain)
        for seed in seeds:
            root = _task_dir(out, regime, task, seed)
            sft_cpu.append(pretrain + (_run_cpu_minutes(root / "video_sft") or 0.0))
            forms = {
                "sft": final_eval(root / "video_sft", "sft"),
                "rl": final_eval(root / "video_rl", "final"),
                "control": final_eval(root / "video_sft_continued", "final"),
                "sft_planning": _planned_eval(root / "video_sft", "sft", candidates),
                "rl_planning": _planned_eval(root / "video_rl", "final", candidates),
            }
            for k, rec in forms.items():
                rows[k].append((rec["train/success"], rec["train/episodes"]))
                by_task[task].setdefault(f"video_{k}", [])
                by_task[task][f"video_{k}"].append(rec["train/success"])
    for task in tasks:
        for k in rows:
            by_task[task][f"video_{k}"] = round(float(np.mean(by_task[task][f"video_{k}"])), 4)
        if "sft" in by_task[task]:
            by_task[task]["video_sft_planning_minus_vla_sft"] = round(by_task[task]["video_sft_planning"] - by_task[task]["sft"], 4)
    mean = {k: _mean(v) for k, v in rows.items()}
    root = _task_dir(out, regime, tasks[0], 0)
    task_config = _run_config(root / "video_rl").get("task_config") or None
    vla, video = load_policy(starts[regime, tasks[0], 0] / "checkpoints" / "sft"), load_policy(root / "video_sft" / "checkpoints" / "sft")
    runners = {"vla": (vla, ChunkPolicy(vla)), "video": (video, SelectChunkPolicy(video, None, num_samples=1)),
               "video_planning": (video, SelectChunkPolicy(video, None, num_samples=candidates))}  # fmt: skip
    latency = {}
    for size in {policy.config.image_size for policy, _ in runners.values()}:  # measured together where they see one observation
        same = {name: runner for name, (policy, runner) in runners.items() if policy.config.image_size == size}
        latency.update({name: round(ms, 1) for name, ms in batch1_latency_ms(same, tasks[0], image_size=size, task_config=task_config).items()})
    print(f"video policy ({method}): SFT {_pct(mean['sft'], _pooled_se(rows['sft']))}, SFT+planning(N={candidates}) "
          f"{_pct(mean['sft_planning'], _pooled_se(rows['sft_planning']))}, RL {_pct(mean['rl'], _pooled_se(rows['rl']))}, "
          f"RL+planning {_pct(mean['rl_planning'], _pooled_se(rows['rl_planning']))}, control {_pct(mean['control'], _pooled_se(rows['control']))}; "
          f"latency {latency}")
    return {
        "video": {"method": method, "success": mean["rl"], "success_se": _pooled_se(rows["rl"]), "sft_success": mean["sft"],
                  "sft_success_se": _pooled_se(rows["sft"]), "gain_over_sft": mean["rl"] - mean["sft"],
                  "continued_sft_success": mean["control"], "gain_over_continued_sft": mean["rl"] - mean["control"],
                  "sft_cpu_minutes": round(float(np.mean(sft_cpu)), 1), "pretrain_cpu_minutes": round(float(np.mean(pretrain_cpu)), 1)},
        "video_planning": {"candidates": candidates, "success": mean["rl_planning"], "success_se": _pooled_se(rows["rl_planning"]),
                           "sft_success": mean["sft_planning"], "sft_success_se": _pooled_se(rows["sft_planning"])},
        "latency_ms": latency,
    }


def _add(row: dict[str, list], record: dict, sft: dict) -> None:
    row["success"].append((record["train/success"], record["train/episodes"]))
    held = [(record[f"{s}/success"], record[f"{s}/episodes"]) for s in ("heldout_instructions", "heldout_objects") if f"{s}/success" in record]
    if held:
        row["heldout"].append((float(np.mean([h[0] for h in held])), sum(h[1] for h in held)))
    row["steps"].append(record.get("train/steps_to_success"))
    row["gain"].append(record["train/success"] - sft["train/success"])
    if record.get("train/wrong_target") is not None:
        row.setdefault("wrong_target", []).append((record["train/wrong_target"], record["train/episodes"]))
    if "ablated_instructions/success" in record:  # runs with --eval.ablated true
        row.setdefault("ablated", []).append((record["ablated_instructions/success"], record["ablated_instructions/episodes"]))


def _add_task(per_task: dict[str, dict[str, list]], task: str, method: str, record: dict) -> None:
    per_task.setdefault(task, {}).setdefault(method, []).append(record["train/success"])


def _mean(values: list) -> float | None:
    vals = [v[0] if isinstance(v, tuple) else v for v in values]
    return float(np.mean(vals)) if vals else None


def _pooled_se(values: list[tuple[float, int]]) -> float | None:
    """Standard error of the mean success over runs, each a binomial estimate on n episodes."""
    if not values:
        return None
    var = sum(p * (1 - p) / max(n, 1) for p, n in values) / len(values) ** 2
    return math.sqrt(var)


def _pct(p: float | None, se: float | None) -> str:
    return "–" if p is None else f"{100 * p:.0f} ± {100 * (se or 0):.0f}%"


if __name__ == "__main__":
    main()
