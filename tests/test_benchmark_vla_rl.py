"""benchmarks/vla_rl.py's machinery at a tiny budget: runs in parallel subprocesses, finished runs reused, a run
killed before its first checkpoint set aside and trained again, and so an SFT with the arms that branched from it.
(What it measures is in the README, not here.)"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import cli_in_process
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "vla_rl.py"
# On top of the benchmark's --quick budget: smaller still, no env worker processes.
TINIER = ["--demos.episodes", "4", "--sft.steps", "6", "--rl.updates_per_round", "4", "--rl.habc.critic_steps", "5",
          "--rl.awr.critic_steps", "5", "--rl.ppo.critic_steps", "5",
          "--eval.episodes", "2", "--eval.round_episodes", "2", "--rl.episodes_per_round", "2", "--workers", "0",
          "--num_envs", "2", "--task_config", '{"horizon": 30}']  # fmt: skip


def benchmark_module():
    if "vla_rl_benchmark" not in sys.modules:
        spec = importlib.util.spec_from_file_location("vla_rl_benchmark", BENCH)
        sys.modules["vla_rl_benchmark"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
        spec.loader.exec_module(sys.modules["vla_rl_benchmark"])
    return sys.modules["vla_rl_benchmark"]


def run_benchmark(*args: str, in_process: bool = False) -> subprocess.CompletedProcess:
    """`python benchmarks/vla_rl.py ARGS`; in_process: its main() in this process, without a fresh interpreter's
    imports (2-5 s), the exit status and output as the subprocess gives them (an uncaught error: 1 and its traceback)."""
    if not in_process:
        return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=600)
    return cli_in_process.in_process(lambda: benchmark_module().main(), [str(BENCH), *args])


def bench(out: Path, *args: str, in_process: bool = True) -> dict:
    done = run_benchmark("--quick", "--out", str(out), *TINIER, *args, in_process=in_process)  # args last: theirs win
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_parallel_runs_reuse_and_killed_runs_trained_again(tmp_path: Path):
    out = tmp_path / "bench"
    # As a user runs it (a subprocess, its runs in parallel subprocesses); the later invocations run in this process,
    # and their runs one after another in it.
    first = bench(out, "--methods", "sft_continued,sft_long", "--jobs", "2", in_process=False)
    runs = tmp_path / "bench_quick" / "drawer-s0"
    assert first["_meta"]["runs_trained"] == 3 and first["_meta"]["jobs"] == 2
    assert {p.name for p in (tmp_path / "bench_quick" / "logs").iterdir()} == {"drawer-s0-sft.log", "drawer-s0-sft_continued.log", "drawer-s0-sft_long.log"}
    assert json.loads((runs / "sft_continued" / "state.json").read_text())["final_done"]
    assert first["sft_continued"]["success"] is not None and first["_meta"]["task_run_minutes"]["drawer"] > 0
    cpu = first["_meta"]["cpu_minutes_per_run"]["drawer"]
    assert cpu["sft"] > 0 and cpu["sft_continued"] > 0 and "sft_then_habc" not in cpu  # no habc arm ran
    # The other control, imitation on a fresh schedule: an SFT from scratch on the same demos with the SFT's steps
    # plus every round's updates (the continued control's gradient steps in all), compared on the same episodes.
    import yaml

    sft_cfg, long_cfg = (yaml.safe_load((runs / m / "config.yaml").read_text()) for m in ("sft", "sft_long"))
    assert long_cfg["sft"]["steps"] == sft_cfg["sft"]["steps"] + sft_cfg["rl"]["rounds"] * sft_cfg["rl"]["updates_per_round"]
    assert not long_cfg["init_policy"] and long_cfg["dataset"] == str(runs / "sft" / "demos")
    assert first["sft_long"]["success"] is not None and "sft_long" in first["per_task"]["drawer"]
    assert first["sft_continued"]["paired_vs_sft_long"]["n"] == 2  # both evaluated on the same 2 episodes

    # An awr run killed before its first checkpoint (config written, no state): set aside, trained afresh; the SFT
    # and the control are reused, and the control's figures are the same as before.
    (runs / "awr").mkdir()
    (runs / "awr" / "config.yaml").write_text((runs / "sft_continued" / "config.yaml").read_text())
    second = bench(out, "--methods", "sft_continued,awr")
    assert second["_meta"]["runs_trained"] == 1
    assert (runs / "awr-interrupted" / "config.yaml").is_file()
    assert json.loads((runs / "awr" / "state.json").read_text())["final_done"]
    without_sft_long = {k: v for k, v in first["sft_continued"].items() if k != "paired_vs_sft_long"}  # not in this call's arms
    assert second["sft_continued"] == without_sft_long and second["sft"] == first["sft"]

    # An SFT killed after its evaluation but before its checkpoint's state was written: set aside with the arms
    # that branched from it (they belong to another SFT), and everything trained again.
    (runs / "sft" / "state.json").unlink()
    third = bench(out, "--methods", "sft_continued,awr")
    assert third["_meta"]["runs_trained"] == 3
    assert {"sft-interrupted", "sft_continued-interrupted", "awr-interrupted-2"} <= {p.name for p in runs.iterdir()}
    assert all(json.loads((runs / m / "state.json").read_text()).get("final_done") for m in ("sft_continued", "awr"))

    # An arm evaluated from zero noise beside the reused SFT (evaluated from sampled noise): the SFT row is that
    # checkpoint evaluated again from zero noise on the same episodes, once; arms at two scales are refused.
    fourth = bench(out, "--methods", "habc", "--eval.noise_scale", "0")
    kept = json.loads((runs / "sft" / "eval-sft-noise0.json").read_text())
    sft_record = next(json.loads(line) for line in (runs / "sft" / "metrics.jsonl").read_text().splitlines() if '"stage": "sft"' in line and '"eval"' in line)
    assert fourth["_meta"]["runs_trained"] == 1 and fourth["per_task"]["drawer"]["eval_noise_scale"] == 0.0
    assert kept["noise_scale"] == 0.0 and kept["train/seeds"] == sft_record["train/seeds"]
    assert fourth["sft"]["success"] == kept["train/success"]
    mixed = run_benchmark("--quick", "--out", str(out), *TINIER, "--methods", "sft_continued,habc", in_process=True)
    assert mixed.returncode != 0 and "different eval.noise_scale" in mixed.stderr

    # --start: the arms branch from the control's final checkpoint, whose final evaluation is the `sft` row and whose
    # CPU minutes, with its SFT's, are the start's budget.
    staged = bench(tmp_path / "staged", "--methods", "awr", "--start", str(runs.parent / "{task}-s{seed}" / "sft_continued"))
    assert staged["_meta"]["runs_trained"] == 1 and staged["_meta"]["start"].endswith("{task}-s{seed}/sft_continued")
    assert staged["sft"]["success"] == third["sft_continued"]["success"]
    config = (tmp_path / "staged_quick" / "drawer-s0" / "awr" / "config.yaml").read_text()
    assert f"init_policy: {runs / 'sft_continued' / 'checkpoints' / 'final'}" in config
    assert f"dataset: {runs / 'sft' / 'demos'}" in config
    clash = run_benchmark("--quick", "--out", str(out), "--methods", "sft_continued", "--start",
                          str(runs.parent / "{task}-s{seed}" / "sft_continued"), *TINIER, in_process=True)  # fmt: skip
    assert clash.returncode == 2 and "is also where an arm of this --out trains" in clash.stderr
    per_task = third["per_task"]["drawer"]
    assert per_task["awr"]["success"] == third["awr"]["success"] and per_task["awr"]["cpu_minutes"] > 0
    assert per_task["best_rl_arm"] == "awr"
    assert per_task["best_rl_margin_over_control"] == pytest.approx(third["awr"]["success"] - third["sft_continued"]["success"])
    assert 0 < per_task["demos"]["success"] <= 1 and per_task["demos"]["steps_to_success"] > 0
    cpu_start = staged["_meta"]["cpu_minutes_per_run"]["drawer"]["sft"]
    assert cpu_start == pytest.approx(third["_meta"]["cpu_minutes_per_run"]["drawer"]["sft"] + third["_meta"]["cpu_minutes_per_run"]["drawer"]["sft_continued"], abs=0.02)

    # Both demonstration regimes in one invocation: the scripted runs are reused, the teleoperator's train in folders
    # of their own from demos of their own (a longer horizon: the teleoperator is slower), reported under regimes.
    both = bench(out, "--methods", "sft_continued", "--demos", "scripted,teleop", "--task_config", '{"horizon": 90}')
    assert both["_meta"]["demos"] == ["scripted", "teleop"] and both["_meta"]["runs_trained"] == 2
    assert both["sft_continued"] == third["sft_continued"]
    teleop = both["regimes"]["teleop"]
    assert teleop["sft_continued"]["success"] is not None and teleop["_meta"]["cpu_minutes_per_run"]["drawer"]["sft"] > 0
    assert "source: teleop" in (runs.parent / "drawer-teleop-s0" / "sft" / "config.yaml").read_text()
    assert teleop["per_task"]["drawer"]["demos"]["steps_to_success"] > 1.4 * both["per_task"]["drawer"]["demos"]["steps_to_success"]


def test_an_unknown_arm_is_refused_with_the_valid_ones(tmp_path: Path):
    done = run_benchmark("--methods", "habc,hbac", "--out", str(tmp_path / "bench"), in_process=True)
    assert done.returncode == 2 and "unknown arm(s) hbac; valid: sft_continued" in done.stderr
    assert not (tmp_path / "bench").exists()  # refused before any run starts


def test_a_start_that_is_not_a_finished_run_is_refused(tmp_path: Path):
    (tmp_path / "drawer-s0" / "sft_continued").mkdir(parents=True)
    done = run_benchmark("--tasks", "drawer", "--seeds", "1", "--methods", "habc", "--out", str(tmp_path / "bench"),
                         "--start", str(tmp_path / "{task}-s{seed}" / "sft_continued"), "--demos", "scripted", in_process=True)  # fmt: skip
    assert done.returncode == 2 and "drawer-s0/sft_continued is not a finished `kinema train` run" in done.stderr
    assert not (tmp_path / "bench").exists()


def test_demo_regimes_are_checked_before_any_run(tmp_path: Path):
    def refused(*args: str) -> str:
        done = run_benchmark("--tasks", "drawer", "--out", str(tmp_path / "bench"), *args, in_process=True)
        assert done.returncode == 2
        return done.stderr

    assert "--demos: 'scripted,human' is not a list of distinct regimes; valid: scripted, teleop" in refused("--demos", "scripted,human")
    assert "with several --demos regimes the start must name {regime}" in refused("--start", str(tmp_path / "{task}-s{seed}"))
    assert not (tmp_path / "bench").exists()


def test_video_policy_options_and_generator_are_checked_before_any_run(tmp_path: Path):
    def refused(*args: str) -> str:
        done = run_benchmark("--tasks", "drawer", "--policies", "vla,video", "--out", str(tmp_path / "bench"), *args, in_process=True)
        assert done.returncode == 2
        return done.stderr

    assert "--video-set takes KEY=VALUE (a video policy option, e.g. action_head=expert, or a dotted kinema train key, e.g. sft.batch_size=16); got 'expert'" in refused("--video-set", "expert")
    missing = str(tmp_path / "gen-{task}")
    assert f"--video-generator: {tmp_path / 'gen-drawer'} is not a `kinema video train` run (no final/)" in refused("--video-generator", missing)
    assert not (tmp_path / "bench").exists()
    vla_rl = benchmark_module()
    assert vla_rl._video_options(["action_head=expert", "action_gradients=stop"], None) == [
        "--policy.action_head", "expert", "--policy.action_gradients", "stop"]


def test_arms_without_their_control_are_warned_of(tmp_path: Path):
    def stderr(methods: str) -> str:  # refused afterwards by a bad --demos, so that nothing trains
        done = run_benchmark("--tasks", "drawer", "--out", str(tmp_path / "bench"), "--methods", methods, "--demos", "human",
                             in_process=True)  # fmt: skip
        assert done.returncode == 2 and "--demos: 'human'" in done.stderr
        return done.stderr

    assert "none of the controls sft_continued, sft_continued_rwr, sft_long: the JSON will have no best_rl_margin_over_control" in stderr("nft")
    assert "warning" not in stderr("sft_long,nft")  # a fresh SFT at equal steps is a control too
    assert "best_hil_margin_over_hg_dagger" in stderr("sft_continued,habc_hil_ir")
    assert "warning" not in stderr("sft_continued,nft") and "warning" not in stderr("sft_continued,hg_dagger,habc_hil_ir")
    assert "warning" not in stderr("sft_continued")


def test_task_entry_gives_the_margins_over_each_control():
    """best_rl_margin_over_control is over the RL arms only (not HG-DAgger, an imitation arm) against the better
    continued-SFT control, and
    best_hil_margin_over_hg_dagger over the human-in-the-loop arms only, against the better HG-DAgger with the same
    human."""
    vla_rl = benchmark_module()

    def row(success: float) -> dict:
        return {"success": [success], "heldout": [], "steps": [50.0], "gain": []}

    rows = {"sft": row(0.2), "sft_continued": row(0.3), "habc": row(0.35), "hg_dagger": row(0.6), "habc_hil": row(0.5),
            "habc_hil_ir": row(0.7)}  # fmt: skip
    entry = vla_rl.task_entry(rows, [{"success": 1.0, "steps_to_success": 60.0}], {})
    assert entry["best_rl_arm"] == "habc_hil_ir" and entry["best_rl_margin_over_control"] == pytest.approx(0.4)
    assert entry["best_hil_arm"] == "habc_hil_ir" and entry["best_hil_margin_over_hg_dagger"] == pytest.approx(0.1)
    assert entry["hil_control_arm"] == "hg_dagger"
    assert entry["habc"]["demos_steps_ratio"] == pytest.approx(1.2)
    # with HG-DAgger on the corrections only beside it, the margin is over the better of the two
    entry = vla_rl.task_entry(rows | {"hg_dagger_correction": row(0.65)}, [], {})
    assert entry["hil_control_arm"] == "hg_dagger_correction" and entry["best_hil_margin_over_hg_dagger"] == pytest.approx(0.05)
    assert entry["best_rl_arm"] == "habc_hil_ir"  # an imitation arm, never the best RL arm
    del rows["hg_dagger"]
    assert "best_hil_margin_over_hg_dagger" not in vla_rl.task_entry(rows, [], {})
    assert set(vla_rl.HIL_ARMS) == {"habc_hil", "habc_hil_ir", "habc_hil_ir_correction", "habc_nocredit", "recap_hil"}
    # with return-weighted imitation beside the uniform control, the margin is over the better of the two
    rows |= {"sft_continued_rwr": row(0.55), "habc_rwr": row(0.6)}
    entry = vla_rl.task_entry(rows, [], {})
    assert entry["control_arm"] == "sft_continued_rwr" and entry["best_rl_margin_over_control"] == pytest.approx(0.15)
    assert set(vla_rl.RWR_ARMS) == {"habc_rwr", "nft_speed_rwr"}
