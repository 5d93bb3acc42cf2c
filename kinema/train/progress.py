"""What `kinema train` shows while it runs: one bar per phase with its count (episodes, steps, updates), and a run
line whose time left is estimated from the run's own pace.

The estimate counts the work still planned in units (demonstration episodes, SFT steps, evaluation episodes, rollout
episodes, rounds of critic and actor updates) and prices each unit at what that kind has cost so far in this run;
before a kind has been measured, at a rough prior for this kind of CPU. It is refreshed whenever a phase ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rich.panel import Panel
from rich.progress import Progress, TaskID
from rich.table import Table

from kinema.common import minutes

KINDS = ("demo", "sft", "eval", "rollout", "update")
# Seconds per unit before the run has measured any (the default run on a 2-core CPU, 12-06 night: the tiny VLA,
# 64 px cameras, 2 env workers, SFT and updates on both cores): the first minutes' estimate only. "update" is a
# whole round's critics and actor updates, priced per actor update. An evaluation episode renders a quarter of the
# frames a rollout records.
PRIORS = {"demo": 0.3, "sft": 0.07, "eval": 0.27, "rollout": 0.55, "update": 0.13}
SHARED = {"eval": "rollout", "rollout": "eval"}  # until one is measured, the other's pace stands in for it


@dataclass
class RunPace:
    """Units planned and done per kind, and the seconds the done ones took."""

    planned: dict[str, float]
    done: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    started: float = field(default_factory=time.monotonic)

    def add(self, kind: str, units: float, seconds: float) -> None:
        self.done[kind] += units
        self.seconds[kind] += seconds

    def rate(self, kind: str) -> float:
        """Seconds per unit: measured in this run, else its kin's measured pace scaled as their priors are, else
        the prior."""
        for k in (kind, SHARED.get(kind)):
            if k and self.done.get(k):
                return self.seconds[k] / self.done[k] * PRIORS[kind] / PRIORS[k]
        return PRIORS[kind]

    def seconds_left(self) -> float:
        return sum(max(0.0, self.planned.get(k, 0.0) - self.done[k]) * self.rate(k) for k in KINDS)

    def describe_left(self) -> str:
        left = self.seconds_left()
        measured = any(self.done.values())
        return f"~{minutes(left)} left" + ("" if measured else " (rough: nothing measured yet)")


class RunProgress:
    """The run line and a phase bar on one rich `Progress`; `phase()` times a phase and feeds the pace."""

    def __init__(self, bar: Progress, pace: RunPace) -> None:
        self.bar, self.pace = bar, pace
        self.run_task: TaskID = bar.add_task("run (% of estimate)", total=100, status="", eta=pace.describe_left(), log=False)
        self.task: TaskID | None = None

    def refresh(self) -> None:
        elapsed = time.monotonic() - self.pace.started
        share = elapsed / max(elapsed + self.pace.seconds_left(), 1e-9)
        self.bar.update(self.run_task, completed=round(100 * share), eta=self.pace.describe_left())

    @contextmanager
    def phase(self, name: str, total: int, *, kind: str | None = None, units: float | None = None) -> Iterator[RunProgress]:
        """A bar named `name` counting to `total`; on exit, its time goes to `kind` as `units` (default `total`)."""
        if self.task is None:
            self.task = self.bar.add_task(name, total=total, status="")
        else:
            self.bar.reset(self.task, total=total, description=name, status="")
        start = time.monotonic()
        try:
            yield self
        finally:
            self.bar.update(self.task, completed=total)
            if kind is not None:
                self.pace.add(kind, total if units is None else units, time.monotonic() - start)
            self.refresh()

    def advance(self, n: int = 1) -> None:
        if self.task is not None:
            self.bar.advance(self.task, n)

    def status(self, text: str) -> None:
        if self.task is not None:
            self.bar.update(self.task, status=text)


def planned_work(cfg, method_class, *, start_round: int, fresh: bool, final_done: bool) -> dict[str, float]:
    """The units of work a start of `kinema train` has ahead of it (a resumed one: from `start_round` on)."""
    splits = 3 if cfg.eval.heldout else 1
    rounds_left = max(0, cfg.rl.rounds - start_round + 1) if method_class.has_rounds else 0
    final = method_class.has_rounds and cfg.rl.rounds > 0 and not final_done
    return {
        "demo": cfg.demos.episodes if fresh and not cfg.dataset else 0,
        "sft": cfg.sft.steps if fresh and not cfg.init_policy else 0,
        "eval": (cfg.eval.episodes * splits if fresh and cfg.eval.baseline else 0)
        + rounds_left * cfg.eval.round_episodes + (cfg.eval.episodes * splits if final else 0),
        "rollout": rounds_left * cfg.rl.episodes_per_round if method_class.rolls_out else 0,
        "update": rounds_left * cfg.rl.updates_per_round,
    }


def start_panel(cfg, method_class, root, latest: str | None, pace: RunPace, *, start_round: int) -> Panel:
    """What the run will do, where it writes, and how long it should take: shown before anything starts."""
    o = cfg.rl
    lines = [f"[bold]run folder[/bold]  {root}" + (f"  (resumed after {latest})" if latest else "")]
    plan = []
    if pace.planned["demo"]:
        plan.append(f"{cfg.demos.episodes} demonstrations")
    elif cfg.dataset:
        plan.append(f"demonstrations from {cfg.dataset}")
    if pace.planned["sft"]:
        plan.append(f"SFT {cfg.sft.steps} steps")
    if method_class.has_rounds and o.rounds:
        per_round = ([f"{o.episodes_per_round} rollouts"] if method_class.rolls_out else []) + [
            f"{o.updates_per_round} actor updates", f"{cfg.eval.round_episodes} evaluation episodes"]
        plan.append(f"rounds {start_round}–{o.rounds} of {method_class.name} × ({', '.join(per_round)})")
        splits = "3 splits" if cfg.eval.heldout else "the training split"
        plan.append(f"final evaluation: {cfg.eval.episodes} episodes on {splits}")
    lines.append("[bold]plan[/bold]  " + " · ".join(plan))
    left = pace.seconds_left()
    lines.append(f"[bold]estimate[/bold]  about {left / 60:.0f} min (rough until the run has measured its own pace; "
                 "the run line below keeps it current)")
    return Panel("\n".join(lines), title=f"kinema train: {cfg.task}, {cfg.rl.method}, seed {cfg.seed}", expand=False)


def round_line(r: int, rounds: int, record: dict[str, Any], results: dict[str, Any], cpu_s: float | None) -> str:
    """The line a round leaves on screen."""
    parts = [f"[bold]round {r}/{rounds}[/bold]"]
    if "rollout/success" in record:
        parts.append(f"rollouts {record['rollout/success']:.0%} (n={record.get('rollout/episodes', '?')})")
    if record.get("rollout/takeover_rate"):
        parts.append(f"takeovers {record['rollout/takeover_rate']:.2f}/rollout")
    if "robot/seconds" in record:  # the rollouts ran on a robot (kinema train --robot)
        parts.append(f"{record['robot/seconds']:.0f} s on the robot")
    if "train" in results:
        res = results["train"]
        parts.append(f"evaluation {res.success:.0%} ± {res.success_se:.0%} (n={res.episodes})")
    if cpu_s is not None:
        parts.append(f"{cpu_s / 60:.1f} CPU-min so far")
    return " · ".join(parts)


def summary_table(records: list[dict[str, Any]]) -> Table:
    """Every evaluation of the run, and each round's rollouts, as a table at the end."""
    table = Table(title="kinema train: results", show_lines=False)
    for column in ("stage", "rollout success", "takeovers / rollout", "evaluation (training templates)", "steps to success", "CPU-min"):
        table.add_column(column)
    rounds = {r["round"]: r for r in records if r.get("kind") == "round"}
    demos = next((r for r in records if r.get("kind") == "demos"), None)
    if demos and demos.get("steps_to_success"):  # the demonstrator's, to read the policy's against
        table.add_row("demonstrations", "–", "–", f"{demos['success']:.0%} of collected", f"{demos['steps_to_success']:.1f}", "–")
        if demos.get("weighted_steps_to_success"):  # demos.weighting return: what the run imitates
            table.add_row("weighted demos", "–", "–", f"{demos['effective_episodes']:.1f} effective episodes",
                          f"{demos['weighted_steps_to_success']:.1f}", "–")  # fmt: skip
        if demos.get("idle_steps_dropped") is not None:  # demos.idle drop: the pauses cut out
            table.add_row("less idle", "–", "–", f"{demos['idle_steps_dropped']} idle steps cut out",
                          f"{demos['steps'] / demos['episodes']:.1f} per episode", "–")  # fmt: skip
    for rec in records:
        if rec.get("kind") != "eval":
            continue
        stage = {"sft": "SFT", "final": "final"}.get(rec["stage"], f"round {rec['round']}")
        rnd = rounds.get(rec["round"]) if rec["stage"] == "round" else None
        rollout = f"{rnd['rollout/success']:.0%} (n={rnd.get('rollout/episodes', '?')})" if rnd and "rollout/success" in rnd else "–"
        takeovers = f"{rnd['rollout/takeover_rate']:.2f}" if rnd and rnd.get("rollout/takeover_rate") is not None else "–"
        evaluation = (f"{rec['train/success']:.0%} ± {rec['train/success_se']:.0%} (n={rec['train/episodes']})"
                      if "train/success" in rec else "–")  # fmt: skip
        cpu = f"{rec['cpu_s'] / 60:.1f}" if rec.get("cpu_s") is not None else "–"
        steps = f"{rec['train/steps_to_success']:.1f}" if rec.get("train/steps_to_success") else "–"
        table.add_row(stage, rollout, takeovers, evaluation, steps, cpu)
    return table
