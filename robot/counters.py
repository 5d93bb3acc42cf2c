"""Counters that several threads update (transport callbacks, the control loop, a status reader), and the one
rate-limited logger of rejected inputs that the policy node, the recorder and the sim robot share."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterator


class Counters:
    """A thread-safe Counter: `add` is atomic, and whole-table reads (`snapshot`, `dict(c)`, `==`) see one
    consistent table, never one that another thread is changing mid-iteration."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> int:
        """Add `n` to `key`; returns the new count."""
        with self._lock:
            self._counts[key] += n
            return self._counts[key]

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def get(self, key: str, default: int = 0) -> int:
        with self._lock:
            return self._counts.get(key, default)

    def keys(self):
        return self.snapshot().keys()

    def values(self):
        return self.snapshot().values()

    def items(self):
        return self.snapshot().items()

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._counts

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Counters):
            other = other.snapshot()
        return isinstance(other, dict) and self.snapshot() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.snapshot()!r})"


class RejectionLog(Counters):
    """Rejected inputs, counted per reason, with the latest detail per reason (`last_reason`).

    Logs the first rejection of each reason, then every `every`-th: a flood of bad messages at the control rate must
    not flood the log, and a person still sees that it goes on.
    """

    def __init__(self, logger: logging.Logger, what: str = "rejected message", every: int = 100) -> None:
        super().__init__()
        self.logger, self.what, self.every = logger, what, every
        self.last_reason: dict[str, str] = {}

    def reject(self, reason: str, detail: str) -> int:
        with self._lock:
            self._counts[reason] += 1
            n = self._counts[reason]
            self.last_reason[reason] = detail
        if n == 1 or n % self.every == 0:
            self.logger.warning("%s (%s, %d so far): %s", self.what, reason, n, detail)
        return n


__all__ = ["Counters", "RejectionLog"]
