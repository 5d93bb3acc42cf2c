"""A run's CPU clock counts the processes under it: live workers, reaped ones, and workers of a forkserver."""

import json
import multiprocessing as mp
import time

from rich.console import Console

from kinema.cputime import CpuClock, tree_cpu_seconds
from kinema.common import Run


def _burn(seconds: float, done=None) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    if done is not None:
        done.set()
        time.sleep(30)  # stays alive until terminated: a live worker


def test_counts_a_live_child_and_a_reaped_one():
    before = tree_cpu_seconds()
    ctx = mp.get_context("fork")
    done = ctx.Event()
    live = ctx.Process(target=_burn, args=(0.4, done), daemon=True)
    live.start()
    assert done.wait(20)
    assert 0.35 <= tree_cpu_seconds() - before < 0.75  # the child is still alive: its own time is read, once
    live.terminate()
    live.join()
    assert 0.35 <= tree_cpu_seconds() - before < 0.75  # reaped: now in this process's children times, once


def _burn_and_report(seconds: float, conn) -> None:
    _burn(seconds)
    conn.send(time.process_time())  # all this worker spent: its start-up (it imports this module) and the burn
    conn.close()


def test_counts_workers_of_a_forkserver():
    """Env workers (sim.vector) come from a forkserver: children of a child, reaped by it. The clock must count what
    the worker itself measured it spent, start-up included, and not much more (the server's fork and the worker's
    exit). Measured against the worker's own account, not against another worker's start-up: under load two
    start-ups (torch's import) differ by tenths of a second, which once failed a test that subtracted them."""
    ctx = mp.get_context("forkserver")

    def child_cpu(burn: float) -> tuple[float, float]:
        clock = CpuClock()
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_burn_and_report, args=(burn, send))
        proc.start()
        own = receive.recv()
        proc.join()
        return clock.seconds(), own

    child_cpu(0.0)  # the server's own start-up is not what is measured
    counted, own = child_cpu(1.0)
    assert own >= 1.0 and own - 0.05 <= counted <= own + 0.5, (counted, own)


def test_run_records_carry_cpu_seconds_across_a_resume(tmp_path):
    run = Run(tmp_path, Console(quiet=True))
    _burn(0.3)
    run.log({"kind": "round", "round": 1})
    run.save_state({"round": 1})
    _burn(0.2)
    run.log({"kind": "round", "round": 2})  # after the checkpoint: dropped by the resume
    first, dropped = run.records()
    assert 0.15 <= dropped["cpu_s"] - first["cpu_s"]

    resumed = Run(tmp_path, Console(quiet=True))
    resumed.resume()
    resumed.log({"kind": "round", "round": 2})
    kept, redo = resumed.records()
    assert kept == first
    # The resumed run starts from the kept record's spend, not from zero and not from the dropped one's.
    assert 0.25 <= first["cpu_s"] <= redo["cpu_s"] < dropped["cpu_s"]
    assert [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
