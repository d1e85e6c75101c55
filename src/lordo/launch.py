"""Start M local worker processes for a torch.distributed backend (what ``lordo train --workers M
--backend gloo`` does when torchrun is not the launcher) and fail fast when one of them dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from .errors import LordoError, Stopped


class WorkerFailed(LordoError):
    """A worker process exited with an error; the others were stopped."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(command: list[str], workers: int, poll_s: float = 0.1, grace_s: float = 10.0,
                 out: str | None = None) -> None:
    """Run ``command`` as ``workers`` processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT). Returns when all exit 0; if one fails, stops the rest and raises.

    SIGTERM and SIGINT sent to this launcher go to every worker (they run in their own session, so a
    terminal's Ctrl-C reaches them once, through here); the workers finish their step, save a checkpoint
    and exit, and the launcher then raises :class:`Stopped` with the signal's exit status."""
    port = free_port()
    threads = max(1, (os.cpu_count() or 1) // workers)
    procs = []
    for rank in range(workers):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(workers),
            LOCAL_WORLD_SIZE=str(workers),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            LORDO_LAUNCHED="1",
        )
        env.setdefault("OMP_NUM_THREADS", str(threads))  # M processes share the cores
        procs.append(subprocess.Popen(command, env=env, start_new_session=True))
    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _wait(procs, workers, received, poll_s, grace_s, out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait(procs: list[subprocess.Popen], workers: int, received: list[int], poll_s: float, grace_s: float,
          out: str | None) -> None:
    while True:
        codes = [p.poll() for p in procs]
        if received and all(c is not None for c in codes):  # every worker stopped after the signal
            name = signal.Signals(received[0]).name
            where = f"lordo train --resume {out}" if out else "lordo train --resume OUT"
            raise Stopped(f"stopped by {name}: the workers saved a checkpoint; continue with: {where}", 128 + received[0])
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and not received:
            rank, code = failed[0]
            _stop(procs, grace_s)
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise WorkerFailed(f"worker {rank} of {workers} {how}; the other workers were stopped")
        if all(c == 0 for c in codes):
            return
        time.sleep(poll_s)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker_command(argv: list[str]) -> list[str]:
    """The command a launched worker runs: this same ``lordo`` invocation."""
    return [sys.executable, "-m", "lordo.cli", *argv]
