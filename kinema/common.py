"""Plumbing that `kinema train` and `kinema video train` (and the CLI) share: the run folder with its metrics log and
resumable state, the cache of collected episodes, progress bars, interrupt notes, the help formatter and the config
loader (typed dataclasses from YAML with dotted overrides; an unknown key is an error listing the valid ones).

It imports no workflow and no CLI module, so that both can import it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import draccus
import torch
import yaml
from draccus.utils import DecodingError
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from diffusion_rl.data import Episode
from diffusion_rl.data.lerobot_v3 import read_episodes, write_episodes
from kinema.board import Board
from kinema.cputime import CpuClock
from kinema.paths import read_yaml, resolve_shipped_yaml
from policies.checkpoint import atomic_file, write_text_atomic

T = TypeVar("T")
STATE_FILE = "state.json"


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


class FollowerRun(Run):
    """A rank > 0's view of the run folder under torchrun (`kinema train`, `kinema video train`): it reads
    it; rank 0 alone writes."""

    def __init__(self, root: Path, console: Console) -> None:
        self.root, self.console, self.board = root, console, None

    def log(self, record: dict[str, Any]) -> None:
        pass

    def save_state(self, state: dict[str, Any]) -> None:
        pass

    def resume(self) -> dict[str, Any]:
        return self.state()

    def close(self) -> None:
        pass


def start_run(
    cfg: Any, *, resume: bool, console: Console, step_key: str, split_checks: Callable[[int], None] | None = None,
) -> tuple[Run, dict[str, Any], Console]:  # fmt: skip
    """How both trainers (`kinema train`, `kinema video train`) start: under torchrun one learner per rank
    (`split_checks(world size)` refuses batches that do not split over the ranks), rank 0 speaking for the run;
    torch's threads and seed; the run folder, which rank 0 alone makes and checks (a fresh start refuses a folder
    that holds a run, `--resume` one that holds none, and drops the metrics records its last checkpoint does not
    cover) and writes config.yaml to. Returns (the run, the state every rank resumes from, this rank's console)."""
    from kinema.train import distributed

    if distributed.init_from_env():
        rank, size = distributed.world()
        if split_checks is not None:
            split_checks(size)
        if rank:
            console = Console(file=io.StringIO())  # rank 0 speaks for the run
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if distributed.is_main():
        run = Run(cfg.run_dir(), console, tensorboard=cfg.tensorboard, step_key=step_key)
        if not resume and run.state():
            raise FileExistsError(f"{run.root} already holds a run; pass --resume to continue it, or choose another --out")
        state = run.resume() if resume else {}
        if resume and not state:
            raise FileNotFoundError(f"nothing to resume in {run.root}: no {STATE_FILE} (start it without --resume)")
        write_text_atomic(run.root / "config.yaml", dump_config(cfg))
    else:
        run, state = FollowerRun(cfg.run_dir(), console), {}
    return run, distributed.broadcast_object(state), console  # the others wait here while rank 0 checks the folder


@contextlib.contextmanager
def learning_threads(cfg: Any) -> Iterator[None]:
    """Learning while the env workers wait (SFT, a round's features, success-model refit and updates) on
    `cfg.learner_threads` torch threads, a step 1.45x as fast on 2 threads as on 1 here; then back to `cfg.threads`
    for rollouts and evaluations, where a second intra-op thread spins against the env workers."""
    torch.set_num_threads(cfg.learner_threads or available_threads())
    try:
        yield
    finally:
        torch.set_num_threads(cfg.threads)


def busy_cores_note(learner_threads: int, *, load: float | None = None, cores: int | None = None) -> str | None:
    """What to say when a run starts on a busy machine (None: its learner fits in the cores the load leaves free): its
    learner would take every core (`learner_threads` 0) or more than are free, and two learners on shared cores ran
    7-11x slower a step than one alone here. `load` (default: the 1-minute load average) and `cores` (the cores this process may use)."""
    load = os.getloadavg()[0] if load is None and hasattr(os, "getloadavg") else (load or 0.0)
    cores = cores or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    busy = math.floor(load)  # a core counts as busy at a whole unit of load: the average lags work that just ended
    free = max(1, cores - busy)
    if busy < 1 or (learner_threads or cores) <= free:
        return None
    return (f"the CPUs are busy before this run starts (1-minute load {load:.1f} on {cores} cores): its learner's "
            f"{learner_threads or cores} threads would share them with the other work, each step several times slower; "
            "give each run side by side --learner_threads 1, or run them one at a time")


def available_threads() -> int:
    """OMP_NUM_THREADS where it is set (torchrun sets 1 for several ranks on one machine; the test workers and
    `vla_rl.py --jobs` too), else the cores this process may run on."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


@contextlib.contextmanager
def interrupt_note(console: Console, stage: str, root: Path):
    """Ctrl-C before the first checkpoint: say plainly that there is nothing to resume yet."""
    try:
        yield
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted during {stage}, before the first checkpoint: nothing in {root} to resume yet")
        raise


class RemainingColumn(TimeRemainingColumn):
    """Time left: a task's own `eta` text where it sets one (an estimate rich cannot make from its rate), else rich's."""

    def render(self, task):  # noqa: ANN001, ANN201 (rich's signature)
        if task.fields.get("eta"):
            return Text(task.fields["eta"], style="progress.remaining")
        return super().render(task)


class LoggedProgress(Progress):
    """rich's bars; where the console is no terminal (a log file, `nohup`), where bars draw nothing, each task
    prints a line at every tenth of its total instead, with its time left (a task added with `log=False`: never)."""

    def __init__(self, *columns: Any, **kwargs: Any) -> None:
        super().__init__(*columns, **kwargs)
        self._tenths: dict[TaskID, int] = {}

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._log(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._log(task_id)

    def reset(self, task_id: TaskID, **kwargs: Any) -> None:
        super().reset(task_id, **kwargs)
        self._tenths.pop(task_id, None)

    def _log(self, task_id: TaskID) -> None:
        if self.console.is_terminal:
            return
        task = self._tasks[task_id]
        if not task.total or task.total < 10 or not task.fields.get("log", True) or not task.completed:
            return
        tenths = int(10 * task.completed // task.total)
        if tenths <= self._tenths.get(task_id, 0):
            return
        self._tenths[task_id] = tenths
        elapsed = task.elapsed or 0.0
        left = elapsed / task.completed * max(task.total - task.completed, 0)
        self.console.print(f"{Text.from_markup(task.description).plain}: {task.completed:g}/{task.total:g} · "
                           f"{minutes(elapsed)} elapsed · ~{minutes(left)} left", highlight=False)  # fmt: skip


def minutes(seconds: float) -> str:
    """A duration as a person reads it: seconds below a minute and a half, else whole minutes."""
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def progress_bar(console: Console | None = None, *, transient: bool = False) -> Progress:
    """Bars with a description, count, elapsed and remaining time, and a status text (`status=` when adding a task);
    `transient` ones vanish when they stop. In a log file, lines at each tenth instead (`LoggedProgress`)."""
    return LoggedProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        RemainingColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        transient=transient,
    )


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every plain option's --help states its default, unless it is required or has none (None, "")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.required or action.default in (None, "") or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _valid_keys(cls: type, prefix: str = "") -> dict[str, list[str]]:
    """Per dotted prefix, the valid field names (nested dataclasses recurse; a choice group, such as `policy`, has
    `type` and the fields of every registered choice: which of them a config may set depends on its type)."""
    out = {prefix: [f.name for f in dataclasses.fields(cls)]}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if isinstance(default, draccus.ChoiceRegistry):
            names = ["type"]
            for choice in _choice_base(type(default)).get_known_choices().values():
                names += [g.name for g in dataclasses.fields(choice) if g.name not in names]
            out[f"{prefix}{f.name}."] = names
        elif dataclasses.is_dataclass(default):
            out.update(_valid_keys(type(default), f"{prefix}{f.name}."))
    return out


def _choice_base(cls: type) -> type:
    """The class a choice group registers its choices on (`PolicyOptions` for `VLAOptions`)."""
    return next(c for c in cls.__mro__ if draccus.ChoiceRegistry in c.__bases__)


def _choice_groups(cls: type, prefix: str = "") -> dict[str, type]:
    """Per dotted prefix of a choice group (`policy.`), its registry base class."""
    out: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
        if isinstance(default, draccus.ChoiceRegistry):
            out[f"{prefix}{f.name}."] = _choice_base(type(default))
        elif dataclasses.is_dataclass(default):
            out.update(_choice_groups(type(default), f"{prefix}{f.name}."))
    return out


def _group_data(data: Any, prefix: str) -> Any:
    for part in filter(None, prefix.split(".")):
        data = data.get(part) if isinstance(data, dict) else None
    return data


def _check_choice_keys(data: Any, overrides: list[str], config_class: type) -> None:
    """Each choice group's keys, from the file and the command line, against the fields of the type chosen (the
    last `--policy.type`, else the file's, else the group's default): another type's option is refused by name."""
    for prefix, base in _choice_groups(config_class).items():
        given = _group_data(data, prefix)
        keys = {k: "in the config file" for k in (given if isinstance(given, dict) else {})}
        chosen = given.get("type") if isinstance(given, dict) and "type" in given else base.default_choice_name()
        for i, arg in enumerate(overrides):  # --policy.type video | --policy.type=video; the last one wins
            dotted, sep, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
            if dotted.startswith(prefix) and "." not in dotted[len(prefix):]:
                keys[dotted[len(prefix):]] = "on the command line"
            if dotted == f"{prefix}type" and (sep or i + 1 < len(overrides)):
                chosen = value if sep else overrides[i + 1]
        known = base.get_known_choices()
        if chosen not in known:
            raise ValueError(f"{prefix}type {chosen!r} is not known; valid: {', '.join(known)}")
        own = {f.name for f in dataclasses.fields(known[chosen])} | {"type"}
        for key, source in keys.items():
            if key not in own:
                owners = [name for name, c in known.items() if key in {f.name for f in dataclasses.fields(c)}]
                raise ValueError(f"{prefix}{key}: not an option of {prefix}type {chosen!r} ({source}; its options: "
                                 f"{', '.join(sorted(own - {'type'}))}); it is one of {prefix}type {' or '.join(owners)}")  # fmt: skip


def _drop_other_choices_defaults(data: Any, config_class: type) -> None:
    """A config file written when a choice group was one union of every type's fields (an older run's config.yaml):
    the other types' fields at their defaults say nothing, and are dropped so that the file loads as it ran."""
    for prefix, base in _choice_groups(config_class).items():
        given = _group_data(data, prefix)
        if not isinstance(given, dict):
            continue
        known = base.get_known_choices()
        chosen = known.get(given.get("type", base.default_choice_name()))
        if chosen is None:
            continue
        own = {f.name for f in dataclasses.fields(chosen)}
        defaults = {f.name: f.default for c in known.values() for f in dataclasses.fields(c) if f.name not in own}
        for key in [k for k in given if k in defaults and given[k] == defaults[k]]:
            del given[key]


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
    config_path: str | None, overrides: list[str], resume: str | None, *, config_class: type[T]
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
    old, new = _flatten(_migrated(read_yaml(saved) or {}, config_class)[0]), _flatten(draccus.encode(after))
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
    config_path: str | None = None, overrides: list[str] | None = None, *, config_class: type[T]
) -> T:
    """A config (any dataclass config of kinema's) from an optional YAML file (a path, or a
    shipped name) plus `--a.b value` / `--a.b=value` overrides. An unknown key is an error listing the valid ones."""
    valid = _valid_keys(config_class)
    renamed = getattr(config_class, "RENAMED_KEYS", {})
    data: Any = {}
    with contextlib.ExitStack() as stack:
        if config_path:
            path = resolve_config_path(config_path)
            config_path = str(path)
            raw = read_yaml(path) or {}
            data, _ = _migrated(raw, config_class)
            _check_keys(data, valid, "", f" in {path}")
            if data != raw:  # a file an older kinema wrote (an older run's config.yaml): read it as migrated
                tmp = stack.enter_context(tempfile.TemporaryDirectory())
                config_path = str(Path(tmp) / path.name)
                Path(config_path).write_text(yaml.safe_dump(data, sort_keys=False))
        for arg in overrides or []:
            if arg.startswith("--"):
                dotted = arg[2:].split("=", 1)[0]
                if dotted in renamed:
                    raise ValueError(f"config key {dotted!r} is now {renamed[dotted]!r}; pass --{renamed[dotted]}")
                *parents, leaf = dotted.split(".")
                prefix = "".join(p + "." for p in parents)
                if prefix not in valid or leaf not in valid[prefix]:
                    level = valid.get(prefix, valid[""])
                    raise ValueError(f"unknown config key {dotted!r} on the command line; valid keys here: {', '.join(level)}")
                if f"{dotted}." in valid:  # draccus would fail on it with a message that names neither key nor fix
                    keys = ", ".join(f"--{dotted}.{k}" for k in valid[f"{dotted}."])
                    raise ValueError(f"--{dotted} is a group of config keys, not one value; set its keys: {keys}")
        _check_choice_keys(data, list(overrides or []), config_class)
        return _parse(config_class, config_path, overrides)


def _migrated(data: Any, config_class: type) -> tuple[Any, list[str]]:
    """`data` with keys an older kinema wrote under other names moved to their new ones (the config class's
    `RENAMED_KEYS`, old dotted key -> new; then its `migrate(data, old_names)` for what a rename alone cannot say),
    and the old names found."""
    if not isinstance(data, dict):
        return data, []
    data = json.loads(json.dumps(data))  # a deep copy; YAML values are JSON values
    _drop_other_choices_defaults(data, config_class)
    renamed = getattr(config_class, "RENAMED_KEYS", {})
    found = []
    for old, new in renamed.items():
        *parents, leaf = old.split(".")
        holder = data
        for part in parents:
            holder = holder.get(part) if isinstance(holder, dict) else None
        if not isinstance(holder, dict) or leaf not in holder:
            continue
        value = holder.pop(leaf)
        *new_parents, new_leaf = new.split(".")
        target = data
        for part in new_parents:
            target = target.setdefault(part, {})
        target.setdefault(new_leaf, value)
        found.append(old)
    if found and hasattr(config_class, "migrate"):
        config_class.migrate(data, found)
    return data, found


def _parse(config_class: type[T], config_path: str | None, overrides: list[str] | None) -> T:
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


def config_keys_help(config_class: type) -> str:
    """Every dotted config key with its default, for `kinema train --help` (or another config's command); a choice
    group's keys per type."""
    lines = ["config keys (defaults):"]
    groups = _choice_groups(config_class)
    for prefix, names in _valid_keys(config_class).items():
        obj: Any = config_class()
        for part in filter(None, prefix.split(".")):
            obj = getattr(obj, part)
        if prefix in groups:
            known = groups[prefix].get_known_choices()
            lines.append(f"  {prefix}type={obj.type!r} (one of {', '.join(known)}); each type's own keys:")
            for name, choice in known.items():
                example = choice()
                values = [f"{prefix}{f.name}={getattr(example, f.name)!r}" for f in dataclasses.fields(choice)]
                lines.append(f"    {name}: " + "  ".join(values))
            continue
        values = [f"{prefix}{n}={getattr(obj, n)!r}" for n in names if not dataclasses.is_dataclass(getattr(obj, n))]
        lines.append("  " + "  ".join(values))
    return "\n".join(lines)


def dump_config(config: Any) -> str:
    return draccus.dump(config)
