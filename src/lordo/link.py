"""A slow link that is real, on one machine: a network namespace whose loopback is rate-limited.

``ThrottledLink(rate_mbit)`` makes a namespace (``ip netns add``), brings its loopback up with MTU 1500 and,
for a rate, adds a token-bucket filter (``tc qdisc ... tbf``) to it; commands run inside it with
:meth:`ThrottledLink.command`. Processes inside talk over the namespace's own 127.0.0.1, so every byte any
of them sends crosses the one bucket: a **shared medium** of the given rate for all workers together (one
site uplink, not a switched network where each worker has a link of its own). MTU 1500 matters: at the
loopback's default 64 KiB the filter lets several times the rate through. The namespace is deleted on exit,
also after an error or Ctrl-C; namespaces a killed run left behind are deleted by the next one.

Needs root and iproute2 (``ip``, ``tc``); :func:`unavailable` says in one line why not, when not.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from types import TracebackType

from .errors import LordoError

PREFIX = "lordo-link-"


class LinkError(LordoError):
    """The throttled link cannot be made here (no root, no iproute2) or a command to make it failed."""


def unavailable() -> str | None:
    """Why a throttled link cannot be made on this machine, or None if it can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "a throttled link needs root (network namespaces and tc); run as root or skip the link benchmark"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"a throttled link needs iproute2 ({' and '.join(missing)} not found): apt-get install iproute2"
    return None


def _run(*args: str) -> str:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise LinkError(f"`{' '.join(args)}` failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def remove_stale() -> list[str]:
    """Delete this tool's namespaces whose process is gone (a run killed before it could clean up)."""
    removed = []
    for line in _run("ip", "netns", "list").splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _run("ip", "netns", "delete", name)
            removed.append(name)
    return removed


def end_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to the process group ``proc`` leads (started with ``start_new_session=True``; a launcher forwards it:
    the workers save and exit), SIGKILL if it is still there after ``grace_s`` seconds."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


class ThrottledLink:
    """``with ThrottledLink(100) as link: subprocess.run(link.command(["lordo", "train", ...]))``.

    ``rate_mbit``: the token bucket's rate in Mbit/s (None: the namespace unthrottled, for the baseline);
    ``burst_kbit``: its bucket (32 KiB by default, small next to a round's megabytes)."""

    _count = 0

    def __init__(self, rate_mbit: float | None, burst_kb: int = 32, mtu: int = 1500) -> None:
        if rate_mbit is not None and not rate_mbit > 0:
            raise LinkError(f"rate_mbit must be > 0 (or None for no limit), got {rate_mbit!r}")
        self.rate_mbit, self.burst_kb, self.mtu = rate_mbit, burst_kb, mtu
        ThrottledLink._count += 1
        self.name = f"{PREFIX}{os.getpid()}-{ThrottledLink._count}"
        self.created = False

    def __enter__(self) -> ThrottledLink:
        reason = unavailable()
        if reason:
            raise LinkError(reason)
        remove_stale()
        _run("ip", "netns", "add", self.name)
        self.created = True
        try:
            self._inside("ip", "link", "set", "lo", "up", "mtu", str(self.mtu))
            if self.rate_mbit is not None:
                self._inside("tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{self.rate_mbit:g}mbit",
                             "burst", f"{self.burst_kb}kb", "latency", "400ms")
        except BaseException:
            self.close()
            raise
        return self

    def _inside(self, *args: str) -> str:
        return _run("ip", "netns", "exec", self.name, *args)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def end_processes(self) -> None:
        """Kill whatever still runs in the namespace (a worker that outlived its launcher)."""
        if not self.created:
            return
        pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=30).stdout
        for pid in (int(x) for x in pids.split() if x.isdigit()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        self.end_processes()
        if self.created:
            subprocess.run(["ip", "netns", "delete", self.name], capture_output=True, timeout=30)
            self.created = False

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
