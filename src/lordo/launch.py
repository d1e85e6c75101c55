"""Start M local worker processes for a torch.distributed backend (what ``lordo train --workers M
--backend gloo`` does when torchrun is not the launcher) and fail fast when one of them dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from .errors import LordoError, Stopped


class WorkerFailed(LordoError):
    """A worker process exited with an error; the others were stopped."""


def die_with_parent(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process dies, even by SIGKILL
    (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), so no worker trains on without its launcher. SIGTERM makes a
    training process save a checkpoint and stop. Linux sends it when the *thread* that started the child ends:
    start children from a thread that outlives them (the main thread, or a pool's worker thread, as the sweep
    does)."""
    parent = os.getpid()

    def arm() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            return
        if os.getppid() != parent:  # the parent died before the call: act as if it had been armed
            os.kill(os.getpid(), int(sig))

    return arm if sys.platform.startswith("linux") else None


def host_store(timeout_s: float = 300.0):
    """The rendezvous store, hosted by this launcher on a port the system picks and held for the whole run,
    as torch's elastic agent hosts it for torchrun's workers (they join it as clients when
    ``TORCHELASTIC_USE_AGENT_STORE`` is set). Nothing can take the port between choosing and binding it."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


def launch_local(command: list[str], workers: int, poll_s: float = 0.1, grace_s: float = 10.0,
                 out: str | None = None, ranks_per_worker: int = 1) -> None:
    """Run ``command`` as ``workers`` processes with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT). Returns when all exit 0; if one fails, stops the rest and raises.

    SIGTERM and SIGINT sent to this launcher go to every worker (they run in their own session, so a
    terminal's Ctrl-C reaches them once, through here); the workers finish their step, save a checkpoint
    and exit, and the launcher then raises :class:`Stopped` with the signal's exit status; so it does when the
    workers themselves were sent the signal (a scheduler's SIGTERM). ``workers`` counts processes; with
    ``ranks_per_worker`` > 1 messages name a failed process's worker and rank."""
    store = host_store()  # kept open until every worker has exited
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
            MASTER_PORT=str(store.port),
            TORCHELASTIC_USE_AGENT_STORE="True",
            LORDO_LAUNCHED="1",
        )
        env.setdefault("OMP_NUM_THREADS", str(threads))  # M processes share the cores
        procs.append(subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=die_with_parent()))
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
        _wait(procs, _Names(workers, ranks_per_worker), received, poll_s, grace_s, out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        del store


class _Names:
    """How messages call process ``rank``: "worker 2 of 4", or "process 3 of 4 (worker 1, rank 1 of 2)"."""

    def __init__(self, processes: int, ranks_per_worker: int) -> None:
        self.processes, self.ranks = processes, max(1, ranks_per_worker)

    def of(self, rank: int) -> str:
        if self.ranks == 1:
            return f"worker {rank} of {self.processes}"
        return f"process {rank} of {self.processes} (worker {rank // self.ranks}, rank {rank % self.ranks} of {self.ranks})"

    @property
    def others(self) -> str:
        return "the other workers" if self.ranks == 1 else "the other processes"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _wait(procs: list[subprocess.Popen], names: _Names, received: list[int], poll_s: float, grace_s: float,
          out: str | None) -> None:
    where = f"lordo train --resume {out}" if out else "lordo train --resume OUT"
    while True:
        codes = [p.poll() for p in procs]
        if received and all(c is not None for c in codes):  # every worker stopped after the signal
            name = signal.Signals(received[0]).name
            raise Stopped(f"stopped by {name}: the workers saved a checkpoint; continue with: {where}", 128 + received[0])
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed and not received:
            rank, code = failed[0]
            stop = _stop_signal(code)
            if stop is not None and _all_stopped(procs, grace_s):  # the signal reached every worker (a scheduler)
                raise Stopped(f"stopped by {stop.name} (sent to the workers): they saved a checkpoint; continue with: "
                              f"{where}", code)
            if stop is None:  # the others usually fail on their own at once, saying what they saw: let them
                _let_report(procs, REPORT_S)
            _stop(procs, grace_s)
            if stop is not None:
                how = f"was stopped by {stop.name} alone"
            else:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            raise WorkerFailed(f"{names.of(rank)} {how}; {names.others} were stopped")
        if all(c == 0 for c in codes):
            return
        time.sleep(poll_s)


REPORT_S = 3.0  # how long the others may take to end on their own after a worker failed, before they are stopped


def _let_report(procs: list[subprocess.Popen], seconds: float) -> None:
    """Wait until every process has ended or ``seconds`` have passed: a peer that lost the failed worker in a
    collective says so in its own line (which worker, where a restart starts), which a SIGTERM would cut short."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)


def _stop_signal(code: int) -> signal.Signals | None:
    """The signal a worker that exited with ``code`` was stopped by after saving (it exits with 128 + it)."""
    for sig in STOP_SIGNALS:
        if code == 128 + sig:
            return sig
    return None


def _all_stopped(procs: list[subprocess.Popen], grace_s: float) -> bool:
    """Whether every worker ends within ``grace_s`` by a stop signal (or cleanly): a signal sent to all of them."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            code = p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        if code != 0 and _stop_signal(code) is None:
            return False
    return True


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
