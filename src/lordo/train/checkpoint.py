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
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from ..errors import LordoError
from ..files import atomic_write, fsync_dir
from ..optim.sharded import is_sharded, local

FORMAT = 2  # 2: the outer optimizer's state_dict replaces the outer momentum list (1 still loads)
READABLE_FORMATS = (1, 2)


class CheckpointError(LordoError):
    """A checkpoint cannot be written or read."""


def _intact(folder: Path) -> bool:
    """Whether ``folder``'s meta.json reads and every tensor file matches the checksum beside it."""
    try:
        Checkpointer.read_meta(folder)
        files = sorted(folder.glob("*.pt"))
        for path in files:
            expected = path.with_name(path.name + ".sha256").read_text().strip()
            if hashlib.sha256(path.read_bytes()).hexdigest() != expected:
                return False
    except (CheckpointError, OSError, UnicodeDecodeError):
        return False
    return bool(files)


def _save_tensor_file(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    atomic_write(path, data)
    atomic_write(path.with_name(path.name + ".sha256"), hashlib.sha256(data).hexdigest().encode() + b"\n")


def read_tensor_file(path: Path) -> Any:
    """Read a checkpoint file, checking it against its checksum; raise CheckpointError naming the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except OSError as exc:  # a permission error, a directory in its place, an I/O error
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc.strerror or exc}") from None
    try:
        expected = path.with_name(path.name + ".sha256").read_text().strip()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} has no .sha256 beside it") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"the checksum of {path} cannot be read: {exc}") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated (checksum mismatch)")
    try:
        with warnings.catch_warnings():  # garbage makes torch warn about odd pickle protocols before failing
            warnings.simplefilter("ignore")
            return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # garbage that happens to match its checksum file
        raise CheckpointError(f"checkpoint file {path} cannot be read: {type(exc).__name__}: {exc}") from None


def local_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as this process holds it: of a parameter sharded by FSDP2, this rank's shard."""
    state = model.state_dict()
    return {k: local(v) for k, v in state.items()} if any(is_sharded(v) for v in state.values()) else state


def load_local_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what :func:`local_state` saved (into the shards, for a sharded model)."""
    own = model.state_dict()
    if not any(is_sharded(v) for v in own.values()):
        model.load_state_dict(state)
        return
    if set(own) != set(state):
        raise CheckpointError(f"the checkpoint's model has other tensors: {sorted(set(own) ^ set(state))[:3]}")
    with torch.no_grad():
        for key, value in own.items():
            local(value).copy_(state[key])


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict (a sharded model's shards gathered: a collective of its worker's ranks)."""
    state = model.state_dict()
    if not any(is_sharded(v) for v in state.values()):
        return state
    return {k: v.full_tensor() if is_sharded(v) else v for k, v in state.items()}


STEP_NAME = re.compile(r"step-\d+")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def saved_step_dirs(root: Path) -> tuple[list[Path], list[Path]]:
    """The checkpoint folders under ``root`` that were completely written (step-N, renamed from .partial), oldest
    first, and the other folders named step-* that are not checkpoints (a backup copy, one made by hand)."""
    if not root.is_dir():
        return [], []
    dirs: list[Path] = []
    strays: list[Path] = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step-") and not d.name.endswith(".partial"):
            (dirs if STEP_NAME.fullmatch(d.name) else strays).append(d)
    return sorted(dirs, key=lambda d: int(d.name[5:])), strays


def worker_file(rank: int, shard: int | None = None) -> str:
    """Worker ``rank``'s file; with its model sharded over its ranks, one per rank (``shard``: its position)."""
    return f"worker-{rank:05d}.pt" if shard is None else f"worker-{rank:05d}-shard-{shard:03d}.pt"


class Checkpointer:
    """Writes and finds the checkpoints of one run, for the workers hosted by this process."""

    def __init__(self, out: Path, comm, keep: int) -> None:
        self.root = Path(out) / "checkpoints"
        self.comm = comm
        self.keep = keep
        # a worker sharded over its ranks: every rank writes its shards (position ``shard`` of ``shards``)
        self.shards = comm.ranks_per_worker if getattr(comm, "sharded", False) else None
        self.shard = comm.member if self.shards else None
        self._warned_strays = False

    # ------------------------------------------------------------------------------------------------ write

    def save(self, step: int, config: dict, shared: dict, workers: list[dict], data: dict | None = None) -> Path:
        """Collective: every process calls it at the same step with its hosted workers' states. The checkpoint is
        committed (``step-N.partial`` renamed to ``step-N``, older ones pruned) only when every process wrote
        its files; otherwise nothing is committed or pruned and every process raises."""
        final = step_dir(self.root, step)
        partial = final.with_name(final.name + ".partial")
        error: Exception | None = None
        try:
            if self.comm.is_main:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
            self.comm.barrier()
            for rank, state in zip(self.comm.local_ranks, workers, strict=True):
                if self.comm.writes_worker_files:  # one rank per worker (unless sharded): its ranks hold the same
                    _save_tensor_file(partial / worker_file(rank, self.shard), state)
            if self.comm.is_main:
                _save_tensor_file(partial / "shared.pt", shared)
        except OSError as exc:
            error = exc
        (written_everywhere,) = [not failed for failed in self.comm.agree([error is not None])]
        if written_everywhere and self.comm.is_main:
            try:
                self._commit(step, config, partial, final, data)
            except OSError as exc:
                error = exc
        (failed,) = self.comm.agree([error is not None])
        if failed:
            if self.comm.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            previous = self.latest_step_name()
            why = str(error) if error is not None else "a worker process could not write its files"
            raise CheckpointError(
                f"could not save the checkpoint of step {step} to {final}: {why}; nothing was committed or pruned, "
                + (f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists")
            ) from error
        return final

    def _commit(self, step: int, config: dict, partial: Path, final: Path, data: dict | None) -> None:
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": self.comm.world_size,
            "files": ["shared.pt"] + [worker_file(r, s) for r in range(self.comm.world_size)
                                      for s in (range(self.shards) if self.shards else [None])],
            "config": config,
        }
        if data is not None:
            meta["data"] = data
        atomic_write(partial / "meta.json", (json.dumps(meta, indent=2) + "\n").encode())
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        fsync_dir(self.root)
        self._prune()

    def _prune(self) -> None:
        complete = self.complete_dirs()
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.root.glob("step-*.partial"):  # left by saves that crashed
            shutil.rmtree(stale, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------- read

    def complete_dirs(self) -> list[Path]:
        """Checkpoint folders that were completely written (renamed from .partial), oldest first."""
        dirs, strays = saved_step_dirs(self.root)
        if strays and not self._warned_strays:  # a backup copy (step-N.bak), a folder made by hand: not ours
            warnings.warn(f"ignoring folders in {self.root} that are not checkpoints (step-N): "
                          f"{', '.join(sorted(d.name for d in strays))}", RuntimeWarning, stacklevel=2)
            self._warned_strays = True
        return dirs

    def latest_step_name(self) -> str | None:
        dirs = self.complete_dirs()
        return str(dirs[-1]) if dirs else None

    def latest_intact_name(self) -> str | None:
        """The newest checkpoint whose files all match their checksums (what a resume would load here), for
        messages that name the last good one; None if there is none."""
        for folder in reversed(self.complete_dirs()):
            if _intact(folder):
                return str(folder)
        return None

    def has_checkpoint(self) -> bool:
        return bool(self.complete_dirs())

    @staticmethod
    def read_meta(folder: Path) -> dict:
        try:
            meta = json.loads((folder / "meta.json").read_text())
            int(meta["step"]), int(meta["world_size"]), dict(meta["config"])
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {folder} has no meta.json") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"checkpoint {folder}/meta.json cannot be read: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {folder}/meta.json is corrupt ({exc})") from None
        if meta.get("format") not in READABLE_FORMATS:
            raise CheckpointError(f"checkpoint {folder} was written in another format ({meta.get('format')!r})")
        return meta

    def load_latest(self, check_meta=None) -> tuple[dict, dict, list[dict], Path]:
        """(meta, shared state, states of this process's workers, folder) of the newest checkpoint that is
        intact for every process. Collective: the processes agree on the step, so that all resume from the
        same one; a damaged newest checkpoint (on any process) is reported, naming the file, and an older one
        is tried. ``check_meta(meta)`` runs before any file is read; what it raises (a config mismatch)
        propagates."""
        folders = {int(d.name.split("-")[1]): d for d in self.complete_dirs()}
        candidate = max(folders, default=-1)
        problems: list[str] = []
        while True:
            step = self.comm.agree_min(candidate)  # the newest step no process is known to lack
            if step < 0:
                if problems:
                    raise CheckpointError(f"every checkpoint is damaged: {'; '.join(problems)}")
                raise CheckpointError(f"no checkpoint in {self.root}")
            loaded, problem = None, None
            try:
                loaded = self._load(folders.get(step) or step_dir(self.root, step), check_meta)
            except CheckpointError as exc:
                problem = str(exc)
            (bad,) = self.comm.agree([problem is not None])
            if not bad and loaded is not None:
                return (*loaded, folders[step])
            if problem is not None:
                problems.append(problem)
                warnings.warn(f"{problem}; trying an earlier checkpoint", RuntimeWarning, stacklevel=2)
            candidate = max((s for s in folders if s < step), default=-1)

    def _load(self, folder: Path, check_meta) -> tuple[dict, dict, list[dict]]:
        if not folder.is_dir():
            raise CheckpointError(f"checkpoint {folder} is missing on this machine")
        meta = self.read_meta(folder)
        if check_meta is not None:
            check_meta(meta)
        shared = read_tensor_file(folder / "shared.pt")
        workers = [read_tensor_file(folder / worker_file(r, self.shard)) for r in self.comm.local_ranks]
        return meta, shared, workers
