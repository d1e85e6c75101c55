"""An exclusive lock on a run's output folder: two runs writing into one folder would resume from each
other's checkpoints and interleave their metrics. The lock is an ``fcntl`` lock on ``OUT/.lock`` held by the
main process for the whole run; the kernel drops it when that process dies, so a lock is never stale."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ..errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no lock
    fcntl = None  # type: ignore[assignment]


class OutputLock:
    """``with OutputLock(out):`` raises ConfigError naming the holder if another process holds ``out``."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> None:
        if fcntl is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(f"{self.path.parent} is in use by {holder}; wait for that run to end or use another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the lock
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def holder(out: Path) -> str | None:
    """Who holds ``out``'s lock now (its ``pid ... on host`` line), or None if no live process does."""
    path = Path(out) / ".lock"
    if fcntl is None or not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # granted unless a run holds it exclusively
    except BlockingIOError:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # closing drops the shared lock, if it was granted
    return None
