"""Where a run's numbers go: ``metrics.jsonl`` (always, main process only), TensorBoard (optional), and a
progress line on the terminal."""

from __future__ import annotations

import json
import math
import os
import threading
import time
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


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    """The run's progress: on a terminal a tqdm bar (elapsed, ETA, the step's numbers and the last validation
    perplexity kept on it; every evaluation also printed as a line of its own, so none is overwritten); off a
    terminal (logs, CI, pipes) plain lines with elapsed time and ETA, every ``every`` steps, at evaluations, and
    at least every ``at_least_s`` seconds, also inside a step that takes longer (a line saying which step is
    running, from a thread)."""

    AT_LEAST_S = 30.0  # the longest a run stays silent off a terminal

    def __init__(self, total: int, stream: TextIO, every: int, start: int = 0, at_least_s: float | None = None,
                 enabled: bool = True) -> None:
        self.total, self.stream, self.every, self.start = total, stream, every, start
        self.at_least_s = self.AT_LEAST_S if at_least_s is None else at_least_s
        self.tty = enabled and hasattr(stream, "isatty") and stream.isatty()
        self.t0 = self.last = time.monotonic()
        self.val_ppl: float | None = None
        self.step = start
        self.bar = None
        self._lock, self._closed = threading.Lock(), threading.Event()
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, file=stream, unit="step", dynamic_ncols=True, leave=True,
                            bar_format="step {n_fmt}/{total_fmt} {bar:20} [{elapsed}<{remaining}]{postfix}")
        elif enabled and self.at_least_s > 0:  # (0: every step prints a line already)
            threading.Thread(target=self._heartbeat, name="lordo-progress", daemon=True).start()

    def update(self, step: int, text: str, val_ppl: float | None = None, force: bool = False) -> None:
        if val_ppl is not None:
            self.val_ppl = val_ppl
        kept = f"  val_ppl {self.val_ppl:.1f}" if self.val_ppl is not None else ""
        self.step = step
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(text + kept, refresh=True)
            if val_ppl is not None:
                self.bar.write(f"step {step}/{self.total}  val_ppl {val_ppl:.2f}", file=self.stream)
            return
        now = time.monotonic()
        if force or step % self.every == 0 or step == self.total or now - self.last >= self.at_least_s:
            self._line(f"{text}{kept}", step)

    def _line(self, text: str, step: int) -> None:
        with self._lock:
            now = time.monotonic()
            elapsed, done = now - self.t0, step - self.start
            eta = elapsed / done * (self.total - step) if done > 0 else 0.0
            print(f"step {step:>{len(str(self.total))}}/{self.total}  {text}  [{_clock(elapsed)} elapsed, "
                  f"ETA {_clock(eta)}]", file=self.stream, flush=True)
            self.last = now

    def _heartbeat(self) -> None:
        """A line when a step keeps the run silent for ``at_least_s`` (a slow step, a synchronisation over a slow
        link): the cadence holds inside steps, not only at their ends."""
        while not self._closed.wait(min(1.0, max(self.at_least_s / 4, 0.05))):
            if time.monotonic() - self.last >= self.at_least_s and self.step < self.total:
                try:
                    self._line(f"(step {self.step + 1} running)", self.step)
                except (OSError, ValueError):  # the stream went away
                    return

    def close(self) -> None:
        self._closed.set()
        if self.bar is not None:
            self.bar.close()
