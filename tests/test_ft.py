"""Fault tolerance over torchft (gloo, CPU): workers that fail, inside or between synchronisations, without
stopping the others; a restarted worker recovers from a peer and ends holding exactly what they hold."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import lordo
from lordo.comm.torch_dist import CommError
from lordo.errors import ConfigError

torchft = pytest.importorskip("torchft")
import ft_worker  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402

from lordo.comm.ft import TorchFTCommunicator  # noqa: E402

WORKER = Path(__file__).with_name("ft_worker.py")
STEPS, K = 48, 4


@pytest.fixture(scope="module")
def lighthouse():
    # stragglers that heartbeat are waited for (a restarted worker joins the round it asked for); the dead stop
    # heartbeating and are dropped after 1.5 s
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1500)
    yield server.address()
    server.shutdown()


def run_workers(lighthouse: str, out: Path, workers: int, failing: dict | None = None, width: int = 32,
                **options) -> dict:
    """Start ``workers`` workers; with ``failing`` (settings for the last one: die_at / die_in_round_at) that one
    is killed, started again once it died, and the others wait for it at step 30 so that it rejoins."""
    out.mkdir(parents=True)
    base = dict(workers=workers, lighthouse=lighthouse, min_workers=2, strategy="lordo", sync_every=K, steps=STEPS,
                out=str(out), width=width, options=options)
    logs = []

    def start(replica: int, incarnation: int, **extra) -> subprocess.Popen:
        log = open(out / f"log-{replica}-{incarnation}.txt", "w")
        logs.append(log)
        cfg = json.dumps(dict(base, replica=replica, incarnation=incarnation, **extra))
        return subprocess.Popen([sys.executable, str(WORKER), cfg], stdout=log, stderr=subprocess.STDOUT)

    hold = {"wait_at": 30, "wait_for": f"started-{workers - 1}-1"} if failing else {}
    procs = [start(r, 0, **hold) for r in range(workers - 1)] + [start(workers - 1, 0, **(failing or {}))]
    codes = {}
    try:
        if failing:
            codes["killed"] = procs[-1].wait(timeout=180)
            # it joins once the others wait at step 30: always at the round of step 32
            procs[-1] = start(workers - 1, 1, join_after=[f"held-{r}" for r in range(workers - 1)])
        codes["final"] = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    tails = "\n".join(f.name + ": " + f.read_text()[-1500:] for f in sorted(out.glob("log-*")))
    assert codes["final"] == [0] * workers, tails
    return {"codes": codes, "results": [json.loads((out / f"result-{r}.json").read_text()) for r in range(workers)]}


@pytest.fixture(scope="module")
def runs(lighthouse, tmp_path_factory):
    """Four runs of 48 steps, K = 4, 3 workers: the third killed between synchronisations (step 14) or inside
    one (step 16, after its first collective), then restarted; without error feedback, killed at step 14 and
    uninterrupted."""
    root = tmp_path_factory.mktemp("ft")
    return {
        "between-rounds": run_workers(lighthouse, root / "a", 3, failing={"die_at": 14}),
        "inside-a-round": run_workers(lighthouse, root / "b", 3, failing={"die_in_round_at": 16}),
        "no-feedback, killed": run_workers(lighthouse, root / "c", 3, failing={"die_at": 14}, error_feedback=False),
        "no-feedback": run_workers(lighthouse, root / "d", 3, error_feedback=False),
    }


@pytest.mark.parametrize("case", ["between-rounds", "inside-a-round"])
def test_a_killed_worker_leaves_the_others_going_and_recovers_from_them(runs, case):
    run = runs[case]
    assert run["codes"]["killed"] == -9
    first, *others = run["results"]
    # every worker ends with the same model and the same bases, the restarted one included
    for other in others:
        assert other["params"] == first["params"] and other["bases"] == first["bases"]
    assert all(bool(torch.isfinite(torch.tensor(p)).all()) for p in first["params"])
    restarted = run["results"][2]
    back = restarted["start"]
    assert back >= 32 and back % K == 0  # it resumed at the others' step, once they had passed the hold at 30
    rounds = {r["step"]: r for r in first["rounds"] if r["kind"] == "sync"}
    # the membership is on record: 3, 2 from the round it died in, 3 again after the round it recovered in
    assert [rounds[s]["contributors"] for s in (12, 16, back - K, back, back + K)] == [3, 2, 2, 2, 3]
    assert rounds[16]["attempts"] == (2 if case == "inside-a-round" else 1)  # a failed round ran again without it
    recovered = restarted["rounds"][0]
    assert recovered["kind"] == "recovered:sync" and recovered["contributors"] == 2  # it took part, gave nothing


def test_a_failed_round_run_again_equals_one_the_worker_never_reached(runs):
    # killed inside round 16 (its first collective done) or before it: the survivors' round 16 is the same
    assert runs["inside-a-round"]["results"][0]["after_16"] == runs["between-rounds"]["results"][0]["after_16"]


def test_the_recovered_run_ends_where_an_uninterrupted_one_does(runs):
    # the one deliberate difference: the restarted worker owes no error feedback of its own (it starts with
    # none), so compare without error feedback: 3 workers, of which one missed steps 14 to 32, against 3 throughout
    killed, whole = (runs[name]["results"][0]["val_loss"] for name in ("no-feedback, killed", "no-feedback"))
    assert abs(killed - whole) / whole < 0.01, (killed, whole)


def test_a_killed_worker_recovers_the_lean_state_from_the_others(lighthouse, tmp_path):
    """With ``memory = "lean"`` (a layer wide enough for its state to be held in 8 bits: anchor, E, low-rank
    moments) the restarted worker takes the others' codes as they are and ends holding what they hold."""
    run = run_workers(lighthouse, tmp_path / "lean", 3, failing={"die_at": 14}, width=256, memory="lean")
    assert run["codes"]["killed"] == -9
    first, *others = run["results"]
    assert first["held_compact"] == ["error_feedback.codes", "exp_avg.codes", "exp_avg_sq.codes"]
    assert run["results"][2]["start"] >= 32
    for other in others:
        assert other["params"] == first["params"] and other["bases"] == first["bases"]
        # averaged at the last round: the same codes, up to the float32 rounding by which the averaged moments of
        # workers differ after a recovery in float32 runs too (about 1e-10 here; one code step would be about 1e-5)
        for got, want in zip(other["lowrank_exp_avg"], first["lowrank_exp_avg"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-8)
    assert all(bool(torch.isfinite(torch.tensor(p)).all()) for p in first["params"])


def test_torchft_runs_the_simulators_strategy_code(runs):
    # the uninterrupted run on torchft against the same three replicas simulated in one process
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)))
    opt = lordo.distributed(models, "lordo", backend="sim", lr=1e-2, rank=4, sync_every=K, error_feedback=False)
    for step in range(1, STEPS + 1):
        for replica, model in enumerate(models):
            x, y = ft_worker.batch(replica, step)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    opt.finish()
    for mine, theirs in zip(models[0].parameters(), runs["no-feedback"]["results"][0]["params"], strict=True):
        torch.testing.assert_close(mine.detach(), torch.tensor(theirs), rtol=1e-4, atol=1e-5)


def test_strategies_that_communicate_every_step_are_refused(lighthouse):
    comm = TorchFTCommunicator(2, 0, lighthouse=lighthouse, min_workers=1)
    try:
        for name in ("ddp", "lowrank-ddp"):
            with pytest.raises(ConfigError, match=f"strategy '{name}' communicates at every step"):
                lordo.distributed(nn.Linear(8, 8), name, backend=comm, rank=4)
        with pytest.raises(ConfigError, match=r"sync_exp_avg_every / sync_exp_avg_sq_every \(moment_periods\) average moments between"):
            lordo.distributed(nn.Linear(8, 8), "local-adam", backend=comm, average_moments="all",
                              sync_exp_avg_sq_every=8)
        with pytest.raises(ConfigError, match=r"strategy.compress = 'int4' gathers quantised shards"):
            lordo.distributed(nn.Linear(8, 8), "lordo", backend=comm, rank=4, compress="int4")
        model = nn.Linear(8, 8)
        opt = lordo.distributed(model, "lordo", backend=comm, rank=4)
        model(torch.ones(2, 8)).sum().backward()
        with pytest.raises(CommError, match=r"call join\(\) once before the first step"):
            opt.step()
        with pytest.raises(CommError, match=r"communicates only in the synchronisations' rounds"):
            opt.average_into(nn.Linear(8, 8))
    finally:
        comm.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 2, "replica": 2}, r"replica must be an integer in 0 .. 1 \(workers - 1\), got 2"),
    ({"workers": 2, "replica": 0, "min_workers": 3}, r"min_workers \(3\) cannot exceed workers \(2\)"),
    ({"workers": 0, "replica": 0}, r"workers must be an integer >= 1, got 0"),
])
def test_bad_settings_are_clear_errors(kwargs, message, lighthouse):
    with pytest.raises(ConfigError, match=message):
        TorchFTCommunicator(lighthouse=lighthouse, **kwargs)


def test_without_a_lighthouse_the_error_says_how_to_start_one(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match=r"needs a Lighthouse: set \$TORCHFT_LIGHTHOUSE"):
        TorchFTCommunicator(2, 0)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    with pytest.raises(ConfigError, match=r"needs \$REPLICA_GROUP_ID"):
        lordo.distributed(nn.Linear(8, 8), "lordo", backend="torchft")


@pytest.mark.parametrize("address, message", [
    ("localhost", r"must look like http://HOST:PORT, got 'localhost'"),
    ("ftp://localhost:29510", r"must look like http://HOST:PORT"),
    ("http://localhost:notaport", r"must look like http://HOST:PORT"),
])
def test_a_malformed_lighthouse_address_is_refused_at_once(address, message):
    with pytest.raises(ConfigError, match=message):
        TorchFTCommunicator(2, 0, lighthouse=address)


def test_an_unreachable_lighthouse_is_named_within_seconds():
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"no Lighthouse answers at http://127.0.0.1:{port} .*start one there with "
                                          rf"`torchft_lighthouse --min_replicas 1 --bind \[::\]:{port}`"):
        TorchFTCommunicator(2, 0, lighthouse=f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 10


def test_num_replica_groups_that_contradicts_the_workers_is_refused(monkeypatch, lighthouse):
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", lighthouse)
    monkeypatch.setenv("REPLICA_GROUP_ID", "0")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "2")
    with pytest.raises(ConfigError, match=r"\$NUM_REPLICA_GROUPS = 2 but dist.workers = 3"):
        TorchFTCommunicator.from_env(workers=3)


def test_a_worker_with_other_settings_cannot_join(lighthouse):
    """What a joining worker compares with the state it receives: the settings that shape the trajectory,
    named when they differ (an lr 6.7x the others' joined silently before)."""
    comm = TorchFTCommunicator(2, 0, lighthouse=lighthouse)
    try:
        lordo.distributed(nn.Linear(8, 8), "lordo", backend=comm, rank=4, lr=0.02)
        run = json.loads(json.dumps(comm.settings))
        comm._check_settings(json.loads(json.dumps(run)))  # the same: nothing to say
        run["optim"]["lr"] = 0.003
        with pytest.raises(ConfigError, match=r"settings differ from those of the run it joins:\n  optim.lr: 0.003 in "
                                              r"the run, 0.02 now"):
            comm._check_settings(run)
    finally:
        comm.close()


def test_a_lighthouse_that_dies_mid_run_stops_the_worker_with_one_line_naming_it():
    """The Lighthouse is every worker's single point of failure: its loss (the process killed) is said in one
    line at the next round (a raw TimeoutError from torchft's client after its quorum timeout before)."""
    server, address = _lighthouse_process(1, join_timeout_ms=100)
    comm = None
    try:
        comm = TorchFTCommunicator(1, 0, lighthouse=address, quorum_timeout_s=3.0)
        model = nn.Linear(8, 8)
        opt = lordo.distributed(model, "local-adam", backend=comm, sync_every=2, lr=1e-2)
        assert opt.join() == 0
        server.kill()
        server.wait()
        with pytest.raises(CommError, match=rf"no quorum for the sync round after step 2: the Lighthouse at "
                                            rf"{re.escape(address)} did not answer \(.*start a Lighthouse and every "
                                            rf"worker again with the same commands"):
            for _ in range(2):
                model(torch.randn(4, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        lordo.replicas.LIVE.discard(opt)  # it cannot finish (no Lighthouse): no end-of-run warning for it
    finally:
        server.kill()
        if comm is not None:
            comm.close(clean=False)


def test_workers_that_start_with_other_settings_are_refused(tmp_path):
    """Two workers starting together, one at another learning rate: both refuse at join."""
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1500)
    try:
        base = dict(workers=2, lighthouse=server.address(), min_workers=2, strategy="lordo", sync_every=K, steps=8,
                    out=str(tmp_path), incarnation=0)
        procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(dict(base, replica=r, lr=lr))],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r, lr in ((0, 1e-2), (1, 2e-2))]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        server.shutdown()
    for p, text in zip(procs, outputs):
        assert p.returncode != 0 and "the workers start with different settings" in text, text[-2000:]


def test_two_workers_with_the_same_replica_index_are_refused(tmp_path):
    """W1: two workers started with the same REPLICA_GROUP_ID (replica 0 twice; the run has workers 0 and 1) would
    train on the same data shard: both refuse at the start, naming the variable."""
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1500)
    try:
        base = dict(workers=2, lighthouse=server.address(), min_workers=2, strategy="lordo", sync_every=K, steps=8,
                    out=str(tmp_path), incarnation=0)
        procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(dict(base, replica=0))],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        server.shutdown()
    for p, text in zip(procs, outputs):
        assert p.returncode != 0 and "another worker started as replica 0 too ($REPLICA_GROUP_ID=0)" in text, text[-2000:]


def test_a_worker_that_joins_late_under_a_taken_replica_index_is_refused_and_the_run_goes_on(tmp_path):
    """A second worker started as replica 0 while replica 0 trains (min_workers 1: the first started alone) would
    join by recovery and train on the same shard: it refuses, naming the variable; the first finishes."""
    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1500)
    try:
        base = dict(workers=2, lighthouse=server.address(), min_workers=1, strategy="lordo", sync_every=K, steps=24,
                    out=str(tmp_path))
        first = subprocess.Popen([sys.executable, str(WORKER), json.dumps(dict(base, replica=0, incarnation=0,
                                  wait_at=10, wait_for="started-0-1"))],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while not (tmp_path / "held-0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        late = subprocess.Popen([sys.executable, str(WORKER), json.dumps(dict(base, replica=0, incarnation=1))],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        late_text = late.communicate(timeout=180)[0]
        first_text = first.communicate(timeout=180)[0]
    finally:
        server.shutdown()
    assert late.returncode != 0, late_text[-2000:]
    assert "another worker is already running as replica 0 ($REPLICA_GROUP_ID=0)" in late_text, late_text[-2000:]
    assert first.returncode == 0, first_text[-2000:]
    assert json.loads((tmp_path / "result-0.json").read_text())["start"] == 0


def test_the_example_trains_two_workers(lighthouse, data_dir):
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "NUM_REPLICA_GROUPS": "2", "TORCHFT_MIN_REPLICAS": "2",
           "OMP_NUM_THREADS": "1"}
    script = Path(__file__).resolve().parents[1] / "examples" / "fault_tolerant.py"
    procs = [subprocess.Popen([sys.executable, str(script), "--steps", "24", "--sync-every", "8", "--rank", "4",
                               "--data-dir", str(data_dir)], env={**env, "REPLICA_GROUP_ID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    losses = {float(re.search(r"val loss ([0-9.]+)", o).group(1)) for o in outs}
    assert len(losses) == 1 and math.isfinite(losses.pop())  # both workers end with the same model
    assert "5 rounds, 0 run again, workers per round [2, 2, 2, 2, 2]" in outs[0]  # start, initial basis, 3 syncs


def test_torchft_s_diloco_loop_with_lordo_inside_recovers_a_killed_worker(lighthouse, data_dir, tmp_path):
    """examples/torchft_diloco.py: torchft's own DiLoCo loop (a Manager, an inner AdamW, an outer SGD, `with
    DiLoCo(...)`), the import switched to lordo.torchft.LoRDO. Three workers; one is killed mid-run and started
    again with the same command: it recovers from the others and all three end with the same model."""
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "NUM_REPLICA_GROUPS": "3", "OMP_NUM_THREADS": "1"}
    script = Path(__file__).resolve().parents[1] / "examples" / "torchft_diloco.py"

    def start(replica: int) -> subprocess.Popen:
        log = open(tmp_path / f"log-{replica}.txt", "a")
        return subprocess.Popen([sys.executable, str(script), "--steps", "240", "--sync-every", "8", "--rank", "4",
                                 "--data-dir", str(data_dir)], env={**env, "REPLICA_GROUP_ID": str(replica)},
                                stdout=log, stderr=subprocess.STDOUT)

    procs = [start(r) for r in range(3)]
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "step   32" not in (tmp_path / "log-2.txt").read_text():
            time.sleep(0.05)
        procs[2].kill()
        assert procs[2].wait(timeout=30) == -9
        procs[2] = start(2)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = [(tmp_path / f"log-{r}.txt").read_text() for r in range(3)]
    assert codes == [0, 0, 0], "\n".join(text[-2000:] for text in logs)
    losses = {float(re.search(r"val loss ([0-9.]+)", text).group(1)) for text in logs}
    assert len(losses) == 1 and math.isfinite(losses.pop())  # one model on every worker, the restarted one's too
    # the example builds its scheduler before the block, as torchft's loop does: no warning that step() was overridden
    assert not any("has been overridden after learning rate scheduler" in text for text in logs)
    seen = [int(x) for x in re.search(r"workers per round \[([0-9, ]+)\]", logs[0]).group(1).split(", ")]
    # the start round: the Manager's init_sync (torchft's default) gives the others worker 0's start state, so worker
    # 0 alone contributes to it; then three workers, two while one is down, three again
    assert seen[0] == 1 and seen[1:4] == [3, 3, 3] and 2 in seen and seen[-1] == 3


def test_torchft_s_loop_refuses_two_workers_with_one_replica_group_id(data_dir, tmp_path):
    """The lordo.torchft route over the user's own Manager: two workers started with REPLICA_GROUP_ID=0 (a run of
    two) both refuse at the start, naming the variable, instead of training on one shard."""
    server = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=30000, heartbeat_timeout_ms=1500)
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": server.address(), "NUM_REPLICA_GROUPS": "2", "OMP_NUM_THREADS": "1",
           "REPLICA_GROUP_ID": "0"}
    script = Path(__file__).resolve().parents[1] / "examples" / "torchft_diloco.py"
    try:
        procs = [subprocess.Popen([sys.executable, str(script), "--steps", "16", "--sync-every", "8", "--rank", "4",
                                   "--data-dir", str(data_dir)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for _ in range(2)]
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        server.shutdown()
    for p, text in zip(procs, outputs):
        assert p.returncode != 0 and "another worker started as replica 0 too ($REPLICA_GROUP_ID=0)" in text, text[-2000:]


NANO = ["--model", "nano", "--set", "train.batch_size=4", "--set", "train.eval_batches=2", "--set", "train.eval_every=1000",
        "--set", "schedule.warmup_steps=2", "--set", "strategy.sync_every=8", "--set", "strategy.rank=4",
        "--set", "train.log_every=8"]


def test_lordo_train_goes_on_without_a_killed_worker_and_takes_it_back(lighthouse, data_dir, tmp_path):
    env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "TORCHFT_MIN_REPLICAS": "2", "OMP_NUM_THREADS": "1",
           "TORCHFT_QUORUM_TIMEOUT_SEC": "90"}  # a worker left waiting for a quorum fails instead of hanging

    def start(replica: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "lordo.cli", "train", *NANO, "--steps", "300", "--workers", "3", "--backend",
               "torchft", "--data-dir", str(data_dir), "--out", str(tmp_path / f"w{replica}")]
        log = open(tmp_path / f"log-{replica}.txt", "a")
        return subprocess.Popen(cmd, env={**env, "REPLICA_GROUP_ID": str(replica)}, stdout=log, stderr=subprocess.STDOUT)

    procs = [start(r) for r in range(3)]
    try:
        metrics = tmp_path / "w2" / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not (metrics.exists() and '"step": 24,' in metrics.read_text()):
            time.sleep(0.05)
        procs[2].kill()  # SIGKILL, between two synchronisations or inside one
        assert procs[2].wait(timeout=30) == -9
        procs[2] = start(2)  # the same command: it recovers from the others
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join(f.read_text()[-2000:] for f in sorted(tmp_path.glob("log-*")))
    assert codes == [0, 0, 0], logs
    models = [torch.load(tmp_path / f"w{r}" / "model.pt") for r in range(3)]
    for other in models[1:]:
        assert all(torch.equal(models[0][k], other[k]) for k in models[0])  # one model, the restarted worker's too
    summaries = [json.loads((tmp_path / f"w{r}" / "summary.json").read_text()) for r in range(3)]
    resumed = summaries[2]["resumed_from_step"]
    assert 24 < resumed < 300 and resumed % 8 == 0, logs
    assert f"recovered from a peer: continuing at step {resumed}" in (tmp_path / "log-2.txt").read_text()
    seen = [r["contributors"] for r in summaries[0]["rounds"]]
    assert seen[:3] == [3, 3, 3] and 2 in seen and seen[-1] == 3  # 3 workers, then 2, then 3 again
    rows = [json.loads(line) for line in (tmp_path / "w0" / "metrics.jsonl").read_text().splitlines()]
    assert {row["workers"] for row in rows if "workers" in row} == {2, 3}
    assert math.isfinite(summaries[0]["val_loss"])


@pytest.mark.parametrize("override, message", [
    ("train.on_nonfinite=\"skip\"", r"needs train.on_nonfinite = \"stop\""),
    ("train.precision=\"fp16-mixed\"", r"does not take train.precision = \"fp16-mixed\""),
    ("dist.ranks_per_worker=2", r"runs one process per worker"),
])
def test_trainer_settings_that_would_desynchronise_rounds_are_refused(override, message):
    from lordo.config import build_config

    with pytest.raises(ConfigError, match=message):
        build_config(None, ["dist.backend=\"torchft\"", override])


def _lighthouse_process(min_replicas: int, join_timeout_ms: int = 30000) -> tuple[subprocess.Popen, str]:
    """A Lighthouse in a process of its own (so that it can be killed), and its address once it listens."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = (f"from torchft._torchft import LighthouseServer; import time; server = LighthouseServer(bind='[::]:{port}', "
             f"min_replicas={min_replicas}, join_timeout_ms={join_timeout_ms}, heartbeat_timeout_ms=1500); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", serve])
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


def test_a_run_that_lost_its_lighthouse_resumes_from_its_checkpoints_and_ends_as_an_uninterrupted_one(data_dir, tmp_path):
    """Every worker stops when the Lighthouse dies; started again (the same commands, a new Lighthouse), each
    resumes from its checkpoint of the same step and the run ends with the uninterrupted run's model. Workers
    whose newest checkpoints are of different steps refuse to start, naming the step."""
    settings = [*NANO, "--steps", "96", "--workers", "3", "--backend", "torchft", "--data-dir", str(data_dir),
                "--set", "schedule.kind=constant", "--set", "train.checkpoint_every=20"]

    def run(out: str, lighthouse: str, kill_lighthouse: subprocess.Popen | None = None, log: str = "") -> list[int]:
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lighthouse, "TORCHFT_MIN_REPLICAS": "3", "OMP_NUM_THREADS": "1",
               "TORCHFT_QUORUM_TIMEOUT_SEC": "20"}  # the quorum of 3 waits for the slowest to start
        procs = [subprocess.Popen([sys.executable, "-m", "lordo.cli", "train", *settings, "--out", str(tmp_path / out / f"w{r}")],
                                  env={**env, "REPLICA_GROUP_ID": str(r)}, stdout=open(tmp_path / f"{log or out}-{r}.txt", "a"),
                                  stderr=subprocess.STDOUT) for r in range(3)]
        try:
            if kill_lighthouse is not None:
                checkpoints = tmp_path / out / "w0" / "checkpoints"
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and len(list(checkpoints.glob("step-*"))) < 2:
                    time.sleep(0.02)
                kill_lighthouse.kill()
            return [p.wait(timeout=240) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()

    logs = lambda out: "\n".join(f.read_text()[-1500:] for f in sorted(tmp_path.glob(f"{out}-*.txt")))  # noqa: E731
    first, address = _lighthouse_process(3)
    try:
        assert run("run", address, kill_lighthouse=first) == [2, 2, 2], logs("run")
    finally:
        first.kill()
    assert "did not answer" in logs("run") and "this worker resumes from its checkpoint" in logs("run")
    saved = [sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run" / f"w{r}" / "checkpoints").glob("step-*"))
             for r in range(3)]
    assert saved[0] and saved[0] == saved[1] == saved[2] and saved[0][-1] < 96 and saved[0][-1] % 8 == 0, saved
    assert len(saved[0]) == 2, saved
    second, address = _lighthouse_process(3)
    try:
        newest = tmp_path / "run" / "w1" / "checkpoints" / f"step-{saved[1][-1]:08d}"
        newest.rename(tmp_path / "aside")  # worker 1 would resume one checkpoint earlier than worker 0
        assert run("run", address, log="mismatch") == [2, 2, 2], logs("mismatch")
        (tmp_path / "aside").rename(newest)
        assert run("run", address) == [0, 0, 0], logs("run")
        assert run("reference", address) == [0, 0, 0], logs("reference")
    finally:
        second.kill()
    assert logs("mismatch").count("the workers start at different steps") == 3, logs("mismatch")
    assert f"this one at step {saved[0][-1]}" in logs("mismatch")
    resumed = [(tmp_path / f"run-{r}.txt").read_text() for r in range(3)]
    assert all(f"at step {saved[0][-1]}" in text for text in resumed), logs("run")  # both resumed from it
    reference = torch.load(tmp_path / "reference" / "w0" / "model.pt")
    for r in range(3):
        model = torch.load(tmp_path / "run" / f"w{r}" / "model.pt")
        assert all(torch.equal(model[k], reference[k]) for k in reference)


@pytest.mark.parametrize("kwargs, message", [
    ({"outer_optimizer": "two"}, r"outer_optimizer: one per fragment, and LoRDO has one fragment .* a list of 2"),
    ({"fragment_update_alpha": 0.5}, r"fragment_sync_delay, fragment_update_alpha and should_quantize are streaming"),
    ({"should_quantize": True}, r"fragment_sync_delay, fragment_update_alpha and should_quantize are streaming"),
])
def test_torchft_s_diloco_arguments_lordo_cannot_honour_are_named(kwargs, message):
    """Every keyword of torchft's DiLoCo is accepted; those lordo cannot honour are refused by name before a Manager
    is used (none is needed to be told)."""
    from lordo.torchft import LoRDO

    model = nn.Linear(8, 8)
    inner = torch.optim.AdamW(model.parameters())
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    if kwargs.get("outer_optimizer") == "two":
        kwargs = {**kwargs, "outer_optimizer": [outer, outer]}
    arguments = {"outer_optimizer": outer, **kwargs}
    with pytest.raises(ConfigError, match=message):
        LoRDO(object(), [model], inner, sync_every=8, backup_device=None, pin_memory=True, use_bucketization=False,
              bucket_cap_mb=None, **arguments)
