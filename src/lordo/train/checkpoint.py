"""Checkpoints that survive crashes: atomic files with checksums, the last k kept, corrupt ones skipped.

Layout under ``<out>/checkpoints/``::

    step-00000120/
        meta.json              step, world size, resolved config, the files below with their byte sizes
        shared.pt              what every worker holds alike: strategy shared state (anchor, outer momentum,
                               counters), ledger totals, timers, RNG state; written once, by worker 0's process
        worker-00000.pt        one per worker: its model, its optimizer state (moments, bases, error
        worker-00001.pt        feedback), its data position; written by the process that hosts it
        *.pt.sha256            the checksum of each file

Every file is written to a temporary name, fsynced and renamed; the folder is assembled as
``step-N.partial`` and renamed to ``step-N`` only when every process has written its files, so a crash at
any moment leaves either the previous checkpoint or the new one, never a half-written one that looks whole.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import LordoError

FORMAT = 2  # 2: the outer optimizer's state_dict replaces the outer momentum list (1 still loads)
READABLE_FORMATS = (1, 2)


class CheckpointError(LordoError):
    """A checkpoint cannot be written or read."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _save_tensor_file(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    atomic_write(path, data)
    atomic_write(path.with_name(path.name + ".sha256"), hashlib.sha256(data).hexdigest().encode() + b"\n")


def _load_tensor_file(path: Path) -> Any:
    """Read a checkpoint file, checking it against its checksum; raise CheckpointError naming the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    try:
        expected = path.with_name(path.name + ".sha256").read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} has no .sha256 beside it") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated (checksum mismatch)")
    try:
        with warnings.catch_warnings():  # garbage makes torch warn about odd pickle protocols before failing
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # garbage that happens to match its checksum file
        raise CheckpointError(f"checkpoint file {path} cannot be read: {type(exc).__name__}: {exc}") from None


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def worker_file(rank: int) -> str:
    return f"worker-{rank:05d}.pt"


class Checkpointer:
    """Writes and finds the checkpoints of one run, for the workers hosted by this process."""

    def __init__(self, out: Path, comm, keep: int) -> None:
        self.root = Path(out) / "checkpoints"
        self.comm = comm
        self.keep = keep

    # ------------------------------------------------------------------------------------------------ write

    def save(self, step: int, config: dict, shared: dict, workers: list[dict]) -> Path:
        """Collective: every process calls it at the same step with its hosted workers' states."""
        final = step_dir(self.root, step)
        partial = final.with_name(final.name + ".partial")
        error: Exception | None = None
        try:
            if self.comm.is_main:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            self.comm.barrier()
            for rank, state in zip(self.comm.local_ranks, workers, strict=True):
                _save_tensor_file(partial / worker_file(rank), state)
            if self.comm.is_main:
                _save_tensor_file(partial / "shared.pt", shared)
        except OSError as exc:
            error = exc
        self.comm.barrier()
        if self.comm.is_main:
            try:
                if error is not None:
                    raise error
                meta = {
                    "format": FORMAT,
                    "step": step,
                    "world_size": self.comm.world_size,
                    "files": ["shared.pt"] + [worker_file(r) for r in range(self.comm.world_size)],
                    "config": config,
                }
                atomic_write(partial / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
                if final.exists():
                    shutil.rmtree(final)
                os.replace(partial, final)
                _fsync_dir(self.root)
            except OSError as exc:
                shutil.rmtree(partial, ignore_errors=True)
                previous = self.latest_step_name()
                raise CheckpointError(
                    f"could not save the checkpoint of step {step} to {final}: {exc}; "
                    + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists")
                ) from exc
            self._prune()
        elif error is not None:
            raise CheckpointError(f"could not save worker files of step {step} to {partial}: {error}") from error
        return final

    def _prune(self) -> None:
        complete = self.complete_dirs()
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------- read

    def complete_dirs(self) -> list[Path]:
        """Checkpoint folders that were completely written (renamed from .partial), oldest first."""
        if not self.root.is_dir():
            return []
        dirs = [d for d in self.root.iterdir() if d.is_dir() and d.name.startswith("step-") and not d.name.endswith(".partial")]
        return sorted(dirs, key=lambda d: d.name)

    def latest_step_name(self) -> str | None:
        dirs = self.complete_dirs()
        return str(dirs[-1]) if dirs else None

    def has_checkpoint(self) -> bool:
        return bool(self.complete_dirs())

    @staticmethod
    def read_meta(folder: Path) -> dict:
        try:
            meta = json.loads((folder / "meta.json").read_text())
            int(meta["step"]), int(meta["world_size"]), dict(meta["config"])
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {folder} has no meta.json") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {folder}/meta.json is corrupt ({exc})") from None
        if meta.get("format") not in READABLE_FORMATS:
            raise CheckpointError(f"checkpoint {folder} was written in another format ({meta.get('format')!r})")
        return meta

    def load_latest(self, check_meta=None) -> tuple[dict, dict, list[dict]]:
        """(meta, shared state, states of this process's workers) of the newest intact checkpoint.

        A corrupt newest checkpoint is reported (warning, naming the file) and the previous one is used.
        ``check_meta(meta)`` runs before any file is read; what it raises (a config mismatch) propagates."""
        dirs = self.complete_dirs()
        if not dirs:
            raise CheckpointError(f"no checkpoint in {self.root}")
        problems = []
        for folder in reversed(dirs):
            try:
                meta = self.read_meta(folder)
                if check_meta is not None:
                    check_meta(meta)
                shared = _load_tensor_file(folder / "shared.pt")
                workers = [_load_tensor_file(folder / worker_file(r)) for r in self.comm.local_ranks]
            except CheckpointError as exc:
                problems.append(str(exc))
                warnings.warn(f"{exc}; trying an earlier checkpoint", RuntimeWarning, stacklevel=2)
                continue
            return meta, shared, workers
        raise CheckpointError("every checkpoint is damaged: " + "; ".join(problems))


# fields that may change when a run is resumed; every other field must match the checkpoint's config
RESUMABLE_CHANGES = {
    ("train", "steps"),
    ("train", "eval_every"),
    ("train", "eval_batches"),
    ("train", "eval_model"),
    ("train", "log_every"),
    ("train", "log"),
    ("train", "device"),
    ("train", "compile"),
    ("train", "threads"),
    ("train", "checkpoint_every"),
    ("train", "keep_checkpoints"),
    ("train", "on_nonfinite"),
    ("data", "dir"),
    ("dist", "backend"),
    ("dist", "timeout_s"),
    ("comm", "latency_s"),
    ("comm", "bandwidths_gbit"),
}


# fields added after checkpoints were first written, with the value that behaves as lordo did before them
ADDED_FIELDS = {
    ("strategy", "error_feedback_after_qh"): "keep",
    ("strategy", "basis_iterations"): 1,
    ("train", "eval_model"): "worker0",
    ("train", "precision"): "fp32",
}


def config_differences(saved: dict, current: dict) -> list[str]:
    """Fields (section.key: saved → current) that differ and may not change on resume. A field the saved
    config lacks because it was added later counts as the value that behaves as before (``ADDED_FIELDS``)."""
    out = []
    for section, body in current.items():
        if section == "derived" or not isinstance(body, dict):
            continue
        for key, value in body.items():
            old = saved.get(section, {}).get(key, ADDED_FIELDS.get((section, key), "<missing>"))
            if old != value and (section, key) not in RESUMABLE_CHANGES:
                out.append(f"{section}.{key}: {old!r} in the checkpoint, {value!r} now")
    return out
