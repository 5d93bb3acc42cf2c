"""CPU time of a run: this process and every process under it (env workers, the forkserver they come from).

Wall-clock minutes on a shared machine say more about the neighbours than about the run; CPU seconds are the
budget a run actually used. `time.process_time()` sees this process only, and `RUSAGE_CHILDREN` only children
already waited for, while env workers live for a whole collection under a forkserver: so the live process tree is
walked, and each process counts its own time plus that of the children it has reaped. (psutil reports reaped
children's time on Linux only: elsewhere a worker's time is lost once it exits.)
"""

from __future__ import annotations

import psutil


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its descendants, live ones and reaped ones."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # ended between the listing and the read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class CpuClock:
    """CPU seconds spent on one run: since the clock started, plus what a resumed run had spent before."""

    def __init__(self) -> None:
        self.start = tree_cpu_seconds()
        self.carried = 0.0

    def carry(self, seconds: float) -> None:
        """A resume: the kept records had already spent `seconds`."""
        self.carried = seconds

    def seconds(self) -> float:
        return self.carried + tree_cpu_seconds() - self.start
