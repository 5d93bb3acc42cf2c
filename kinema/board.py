"""TensorBoard scalars beside a run's metrics.jsonl (`--tensorboard true`): the same records, live, in RUN_DIR/tensorboard.

metrics.jsonl stays the record of truth; this is a view of it. Each numeric field of a record becomes the scalar
`<kind>/<stage>/<field>` (`<kind>/<field>` when the record has no stage), e.g. `eval/round/train/success` or
`round/actor/loss`, at the record's step: `env_steps` for `kinema train`, `round` for `kinema video train`.

A resumed run redoes the work after its last checkpoint and logs it again. The view is then rebuilt from the records
the resume keeps, so that the first attempt's points past the checkpoint are gone rather than drawn twice (TensorBoard's
purge step would not do: its Rust data server, the default reader, ignores it), and a run resumed with
`--tensorboard true` shows its whole history.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

BOARD_DIR = "tensorboard"
NOT_SCALARS = ("time", "kind", "stage", "round")


def require_tensorboard() -> None:
    """Fail before any work is done, not after hours of training, when the package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ImportError(
            "--tensorboard true needs the tensorboard package: pip install 'kinema[tensorboard]' "
            "(or run without --tensorboard; metrics.jsonl holds the same records)"
        ) from None


def record_step(record: dict[str, Any], step_key: str, last: int) -> int:
    """The record's step; records without one (demos, SFT, pre-training) sit at the last step seen."""
    value = record.get(step_key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else last


def record_scalars(record: dict[str, Any], step_key: str) -> dict[str, float]:
    prefix = "/".join(str(record[k]) for k in ("kind", "stage") if k in record)
    out = {}
    for key, value in record.items():
        if key in NOT_SCALARS or key == step_key or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[f"{prefix}/{key}" if prefix else key] = float(value)
    return out


class Board:
    """One SummaryWriter for the run, opened on the first record."""

    def __init__(self, root: Path, step_key: str) -> None:
        require_tensorboard()
        self.dir = root / BOARD_DIR
        self.step_key = step_key
        self.step = 0
        self._writer = None

    def resumed_after(self, kept: list[dict[str, Any]]) -> None:
        """The records the resumed run keeps (metrics.jsonl, the record of truth): the view is rebuilt from them."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.step = 0
        for record in kept:
            self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir))
        self.step = record_step(record, self.step_key, self.step)
        for tag, value in record_scalars(record, self.step_key).items():
            self._writer.add_scalar(tag, value, self.step, walltime=record.get("time"))
        self._writer.flush()  # records come once a round: a kill must not lose one

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
