"""What a run needs around its steps: the device and precision, the output folder and its lock, the stop
signals, the evaluation, and :class:`RunState` (what a checkpoint restores besides models and optimizer)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError
from .lock import OutputLock


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but torch sees no CUDA device; use 'cpu' or 'auto'")
    return torch.device(name)


BF16_MATRIX_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with bfloat16 dot products


def muon_precision_note(cfg: Config, device: torch.device, cpuinfo: str | None = None) -> str | None:
    """A hint when Muon's Newton–Schulz runs in bfloat16 on a CPU that lists no bfloat16 matrix instructions
    (``cpuinfo``: /proc/cpuinfo's text, read when None; where it cannot be read nothing is said)."""
    o = cfg.optim
    if o.inner != "muon" or o.muon_ns_dtype != "bfloat16" or device.type != "cpu":
        return None
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[-1].split()}
    if not flags or flags & set(BF16_MATRIX_FLAGS):
        return None
    return ("note: Muon's Newton-Schulz iteration runs in bfloat16 (torch's), and this CPU has no bfloat16 matrix "
            "instructions (no avx512_bf16 or amx_bf16): --set optim.muon_ns_dtype=\"float32\" made full-rank Muon's "
            "step 10.9x faster and LoRDO's Muon form's 1.7x on such a CPU (docs/performance.md)")


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, device: torch.device) -> float:
    """Mean cross-entropy over the fixed validation batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        _, loss = model(x.to(device), y.to(device))
        total += float(loss)
    model.train(was_training)
    return total / len(batches)


PRECISIONS = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}  # autocast dtypes


def resolve_precision(name: str, device: torch.device) -> str:
    return ("bf16-mixed" if device.type == "cuda" else "fp32") if name == "auto" else name


def output_folder(cfg: Config, out_dir: str | Path | None, comm) -> Path:
    """``out_dir``, or (None) ``runs/<preset>-<strategy>-<time>`` named by the main process for every process."""
    if out_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out_dir = comm.share_text(str(Path("runs") / f"{cfg.model.preset}-{cfg.strategy.name}-{stamp}"))
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"the output folder {out} is a file; give --out a folder")
    return out


@contextlib.contextmanager
def locked_output(out: Path, comm):
    """Hold ``out``'s lock (the main process) for the run; every process fails if it cannot be taken."""
    lock, problem = OutputLock(out), None
    if comm.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except (ConfigError, OSError) as exc:
            problem = exc if isinstance(exc, ConfigError) else ConfigError(f"cannot use the output folder {out}: {exc}")
    (failed,) = comm.agree([problem is not None])
    if failed:
        raise problem if problem is not None else ConfigError(f"the output folder {out} is unusable (see worker 0)")
    try:
        yield
    finally:
        lock.release()


class SignalFlag:
    """Remembers SIGTERM/SIGINT so that the loop can finish the step, save a checkpoint and exit."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C does not wait for the checkpoint
        self.signum = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclass
class RunState:
    """What a checkpoint restores besides the models, samplers and optimizer."""

    step: int = 0  # optimizer steps done
    train_s: float = 0.0  # seconds spent in training steps (not in evaluations or checkpoints)
    skipped: int = 0  # steps skipped for a non-finite loss
    val_loss: float = float("nan")  # the latest evaluation
    loss_sum: float = 0.0  # the train_loss of the next metrics row averages over this window
    loss_n: int = 0
    diagnostics: dict[str, list[float]] = field(default_factory=dict)  # per-sync values for summary.json
    schedule_steps: int = 0  # the length the lr schedule was laid out for: fixed at the run's start
    skipped_in_a_row: int = 0

    @classmethod
    def from_checkpoint(cls, meta: dict[str, Any], shared: dict[str, Any]) -> RunState:
        window = shared["loss_window"]
        # older checkpoints lack schedule_steps: their run's train.steps laid the schedule out
        schedule = int(shared.get("schedule_steps", meta["config"]["train"]["steps"]))
        return cls(step=int(meta["step"]), train_s=float(shared["train_s"]), skipped=int(shared["skipped"]),
                   val_loss=float(shared["val_loss"]), loss_sum=float(window[0]), loss_n=int(window[1]),
                   diagnostics={k: list(v) for k, v in shared["diagnostics"].items()}, schedule_steps=schedule,
                   skipped_in_a_row=int(shared.get("skipped_in_a_row", 0)))

    def to_checkpoint(self) -> dict[str, Any]:
        return {"train_s": self.train_s, "skipped": self.skipped, "diagnostics": self.diagnostics,
                "val_loss": self.val_loss, "loss_window": [self.loss_sum, self.loss_n],
                "schedule_steps": self.schedule_steps, "skipped_in_a_row": self.skipped_in_a_row}
