"""The throttled link (a network namespace with a rate-limited loopback) and `lordo bench link` on it.

Needs root and iproute2, as CI's machine has; elsewhere each test skips with the one-line reason."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from lordo import link
from lordo.link import LinkError, ThrottledLink

REASON = link.unavailable()
needs_link = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


TRANSFER = textwrap.dedent("""
    import socket, sys, threading, time
    size = int(sys.argv[1])
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    def sink():
        conn, _ = server.accept()
        got = 0
        while got < size:
            got += len(conn.recv(1 << 16))
        conn.close()
    t = threading.Thread(target=sink)
    t.start()
    client = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    client.sendall(b"x" * size)
    t.join()
    print(time.perf_counter() - t0)
""")


@needs_link
def test_the_namespace_holds_its_rate_and_is_deleted_afterwards():
    """A plain TCP transfer over the namespace's loopback: throttled to about the rate (not a speed target: a
    throttle that let everything through, or the 64 KiB-MTU leak, would move far out of these bounds)."""
    size, rate = 1_500_000, 20.0
    with ThrottledLink(rate) as net:
        assert net.name in namespaces()
        done = subprocess.run(net.command([sys.executable, "-c", TRANSFER, str(size)]), capture_output=True, text=True,
                              timeout=60)
        seconds = float(done.stdout)
    assert net.name not in namespaces()
    measured = size * 8 / seconds / 1e6
    assert 0.5 * rate < measured < 1.3 * rate, measured


@needs_link
def test_the_namespace_is_deleted_on_an_error_and_processes_inside_are_ended():
    with pytest.raises(RuntimeError, match="boom"):
        with ThrottledLink(None) as net:
            sleeper = subprocess.Popen(net.command(["sleep", "60"]))
            time.sleep(0.3)
            raise RuntimeError("boom")
    assert net.name not in namespaces()
    assert sleeper.wait(timeout=10) != 0  # killed with its namespace, not left running


@needs_link
def test_a_namespace_left_by_a_killed_run_is_removed_by_the_next():
    stale = f"{link.PREFIX}999999999-1"  # no such process
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in link.remove_stale()
        assert stale not in namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


def test_without_root_it_refuses_in_one_line(monkeypatch):
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    assert "needs root" in link.unavailable()
    with pytest.raises(LinkError, match="needs root"):
        ThrottledLink(10).__enter__()
    with pytest.raises(LinkError, match="rate_mbit must be > 0"):
        ThrottledLink(0)


@needs_link
def test_bench_link_times_a_tiny_run_over_the_link_and_models_its_collectives(tmp_path, data_dir):
    """Two gloo workers on nano, unthrottled and at 50 Mbit/s, blocking and overlapped: every row measured,
    the shared-medium model within a factor of the measured collective time, no namespace left behind."""
    out = tmp_path / "link.json"
    cmd = [sys.executable, "-m", "lordo.cli", "bench", "link", "--model", "nano", "--workers", "2", "--rates", "none,50",
           "--variants", "lordo", "lordo,sync_delay=2", "--steps", "14", "--sync-every", "4", "--rank", "2",
           "--log-every", "2", "--timeout", "240", "--plot-rate", "50", "--data-dir", str(data_dir), "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert [(r["variant"], r["rate_mbit"]) for r in rows] == [("lordo", None), ("lordo,sync_delay=2", None),
                                                             ("lordo", 50.0), ("lordo,sync_delay=2", 50.0)]
    assert not any("error" in r for r in rows)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["steady_tokens_per_s"] > 0 and 0 < r["steady_utilisation"] <= 1
        assert r["curve"] and r["calls"] > 0
    for r in rows[2:]:
        assert 0.5 < r["measured_vs_model"] < 2.0, r
    overlapped = rows[3]
    assert overlapped["blocked_s"] < overlapped["comm_s"]  # part of its traffic ran behind the steps
    assert (tmp_path / "link-50mbit.png").exists()
    assert link.PREFIX not in namespaces()


@needs_link
def test_sigterm_to_the_benchmark_ends_its_training_and_deletes_the_namespace(tmp_path, data_dir):
    cmd = [sys.executable, "-m", "lordo.cli", "bench", "link", "--model", "nano", "--workers", "2", "--rates", "10",
           "--variants", "lordo", "--steps", "400", "--sync-every", "4", "--rank", "2", "--data-dir", str(data_dir),
           "--json", str(tmp_path / "link.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    mine = f"{link.PREFIX}{proc.pid}-"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
            for n in namespaces().split() if n.startswith(mine)):
        time.sleep(0.2)  # until the training runs inside its namespace
    name = next(n for n in namespaces().split() if n.startswith(mine))
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert name not in namespaces()
    assert not (tmp_path / "link.json").exists()  # nothing half-measured is written
