"""Where a run's numbers go: ``metrics.jsonl`` (always, main process only), TensorBoard (optional), and a
progress line on the terminal."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, TextIO

from ..errors import ConfigError

# the row fields that are measured times (seconds in training steps, of which waiting for collectives): the
# only ones that differ between two runs of the same settings, a resumed one and its uninterrupted twin
TIMING_FIELDS = ("train_s", "comm_blocked_s")


def rewrite_metrics(path: Path, upto: int) -> None:
    """Keep the rows of steps <= ``upto`` (those written after the checkpoint are redone on resume)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a row cut short by the crash, and everything after it
    path.write_text("".join(k + "\n" for k in kept))


class MetricsWriter:
    """One JSON row per call to :meth:`write`, flushed at once (a crash loses at most the row being written);
    with ``tensorboard`` also a scalar per numeric field. In a process that is not the main one, a sink."""

    def __init__(self, out: Path, main: bool, start: int, tensorboard: bool) -> None:
        self.path = out / "metrics.jsonl"
        if main and start:
            rewrite_metrics(self.path, start)  # the rows after the checkpoint are redone
        self.file = open(self.path, "a" if start else "w") if main else open(os.devnull, "w")
        self.board = _tensorboard(out, start) if main and tensorboard else None

    def write(self, row: dict[str, Any]) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.board is not None:
            for key, value in row.items():
                if key not in ("step", "synced") and isinstance(value, (int, float)) and math.isfinite(value):
                    self.board.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def _tensorboard(out: Path, start: int):
    """A TensorBoard writer into OUT/tensorboard; on resume, events after the checkpoint's step are dropped."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ModuleNotFoundError:
        raise ConfigError("train.log = tensorboard needs the tensorboard package: pip install 'lordo[tb]'") from None
    return SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)


class Progress:
    """A self-updating line on a terminal; plain periodic lines otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, stream: TextIO, every: int) -> None:
        self.total, self.stream, self.every = total, stream, every
        self.tty = stream.isatty()

    def update(self, step: int, text: str, force: bool = False) -> None:
        line = f"step {step:>{len(str(self.total))}}/{self.total}  {text}"
        if self.tty:
            self.stream.write("\r\033[K" + line)
            if step == self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif force or step % self.every == 0 or step == self.total:
            print(line, file=self.stream, flush=True)
