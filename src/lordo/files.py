"""Files a later command reads (summary.json, config.json, metrics.jsonl, sweep indexes), written so that a
crash leaves the old file or the whole new one, and read so that a damaged one is named, not a traceback."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import WriteError


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one. A failed write (a full
    disk) leaves no partial file and raises :class:`~lordo.errors.WriteError` (an ``OSError``) naming the file
    and the cause."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise WriteError(f"could not write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def waiting_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on the file ``path`` (created if missing), waiting for whoever holds it:
    two processes building one thing (a prepared corpus) take turns, and the second finds the first's result.
    The kernel drops the lock when its holder dies, so it is never stale. No lock where ``fcntl`` is missing."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def write_json(path: Path, value: Any) -> None:
    atomic_write(path, (json.dumps(value, indent=2) + "\n").encode())


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if the file is missing, empty, cut short or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return value if isinstance(value, dict) and value else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file; lines that do not parse (one cut short by a kill) are left out with a
    warning naming the file and how many."""
    rows, damaged = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            damaged += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            damaged += 1
    if damaged:
        warnings.warn(f"{path}: {damaged} damaged line(s) left out (a write cut short?)", RuntimeWarning, stacklevel=2)
    return rows
