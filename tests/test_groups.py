"""A worker made of several ranks (dist.ranks_per_worker): synchronous inside, LoRDO between workers. On gloo,
4 processes as 2 workers x 2 ranks train the same model as 2 processes with twice the batch each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lordo

from harness import batch, run_gloo, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def worker_of_ranks(ranks_per_worker: int, steps: int):
    rank = int(os.environ["RANK"])
    model = tiny_model()
    opt = lordo.distributed(model, "lordo", lr=1e-2, rank=2, sync_every=3, backend="gloo", timeout_s=60,
                            ranks_per_worker=ranks_per_worker)
    worker, member = rank // ranks_per_worker, rank % ranks_per_worker
    part = 4 // ranks_per_worker
    try:
        for step in range(steps):
            x, y = batch(worker, step, size=4)  # the worker's 4 sequences, split between its ranks
            model(x[member * part:(member + 1) * part], y[member * part:(member + 1) * part])[1].backward()
            opt.step()
        opt.finish()
        intra = opt.comm.intra_ledger.table() if opt.comm.intra_ledger else {}
        return [p.detach().clone() for p in model.parameters()], opt.ledger.table(), intra
    finally:
        opt.close()


def test_two_workers_of_two_ranks_equal_two_workers_of_one_at_twice_the_batch():
    single = run_gloo(worker_of_ranks, 2, 1, 7)
    grouped = run_gloo(worker_of_ranks, 4, 2, 7)
    assert all(status == "ok" for status, _ in [*single.values(), *grouped.values()]), (single, grouped)
    reference = single[0][1][0]
    for rank in range(4):
        params, ledger, intra = grouped[rank][1]
        for a, b in zip(params, reference):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # the mean of two halves' gradients, rounded
        if rank in (0, 2):  # the workers' leaders carry the traffic between workers: the same as one rank's
            assert ledger == single[rank // 2][1][1]
    _, _, intra = grouped[0][1]
    n = sum(p.numel() for p in tiny_model().parameters())
    assert intra["all_reduce:gradient"]["calls"] == 7 and intra["all_reduce:gradient"]["bytes"] == 7 * 4 * n
    assert intra["broadcast:between_workers"]["calls"] > 0  # the leader shares each sync's result with its rank


def test_lordo_train_with_worker_groups_runs_and_resumes(data_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "lordo.cli", "train", "--model", "nano", "--steps", "8", "--workers", "2", "--backend",
           "gloo", "--data-dir", str(data_dir), "--out", str(out), "--set", "dist.ranks_per_worker=2",
           "--set", "train.batch_size=2", "--set", "train.eval_batches=2", "--set", "strategy.sync_every=4",
           "--set", "strategy.rank=4", "--set", "train.checkpoint_every=4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["ranks_per_worker"] == 2
    assert summary["tokens"] == 8 * 4 * 2 * 64  # steps x processes x batch x sequence length
    assert summary["intra_worker_wire_bytes_total"] > 0
    files = sorted(p.name for p in (out / "checkpoints" / "step-00000008").iterdir() if p.suffix == ".pt")
    assert files == ["shared.pt", "worker-00000.pt", "worker-00001.pt"]
    done = subprocess.run([sys.executable, "-m", "lordo.cli", "train", "--resume", str(out), "--set", "train.steps=10"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 8


def test_worker_groups_need_torch_distributed():
    with pytest.raises(lordo.ConfigError, match="ranks_per_worker > 1 needs torch.distributed"):
        lordo.distributed([tiny_model(), tiny_model()], "lordo", backend="sim", ranks_per_worker=2)
