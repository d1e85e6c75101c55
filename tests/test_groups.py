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
            # the mean of two halves' gradients, rounded otherwise than the whole batch's: seven Adam-normalised
            # steps carry that to ~1e-6 on some BLAS builds; a worker that did not average its ranks is off by ~lr
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if rank in (0, 2):  # the workers' leaders carry the traffic between workers: the same as one rank's
            assert ledger == single[rank // 2][1][1]
    _, _, intra = grouped[0][1]
    n = sum(p.numel() for p in tiny_model().parameters())
    assert intra["all_reduce:gradient"]["calls"] == 7 and intra["all_reduce:gradient"]["bytes"] == 7 * 4 * n
    assert intra["broadcast:between_workers"]["calls"] > 0  # the leader shares each sync's result with its rank


def train_and_resume(data_dir, out, *settings):
    """8 steps (checkpoints at 4 and 8), then the run resumed to 10; returns the summaries."""
    cmd = [sys.executable, "-m", "lordo.cli", "train", "--model", "nano", "--steps", "8", "--workers", "2", "--backend",
           "gloo", "--data-dir", str(data_dir), "--out", str(out), "--set", "dist.ranks_per_worker=2",
           "--set", "train.batch_size=2", "--set", "train.eval_batches=2", "--set", "strategy.sync_every=4",
           "--set", "strategy.rank=4", "--set", "train.checkpoint_every=4", "--set", "train.eval_every=3",
           # an outer step with momentum: the resumed anchor and momentum matter (plain averaging cancels the anchor)
           "--set", "strategy.outer_lr=0.7", "--set", "strategy.outer_momentum=0.9", *settings]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads((out / "summary.json").read_text())
    done = subprocess.run([sys.executable, "-m", "lordo.cli", "train", "--resume", str(out), "--set", "train.steps=10"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return first, json.loads((out / "summary.json").read_text())


def test_lordo_train_with_worker_groups_runs_and_resumes(data_dir, tmp_path):
    out = tmp_path / "run"
    summary, resumed = train_and_resume(data_dir, out)
    assert summary["workers"] == 2 and summary["ranks_per_worker"] == 2
    assert summary["tokens"] == 8 * 4 * 2 * 64  # steps x processes x batch x sequence length
    assert summary["intra_worker_wire_bytes_total"] > 0
    files = sorted(p.name for p in (out / "checkpoints" / "step-00000008").iterdir() if p.suffix == ".pt")
    assert files == ["shared.pt", "worker-00000.pt", "worker-00001.pt"]
    assert resumed["resumed_from_step"] == 8
    # the same workers with their model sharded over their 2 ranks (FSDP2): the same model at step 8 and,
    # resumed from each rank's own checkpoint file, at step 10
    whole = torch.load(out / "model.pt")
    sharded_out = tmp_path / "sharded"
    at_8, _ = train_and_resume(data_dir, sharded_out, "--set", "dist.shard=true")
    assert at_8["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    files = sorted(p.name for p in (sharded_out / "checkpoints" / "step-00000008").iterdir() if p.suffix == ".pt")
    assert files == ["shared.pt"] + [f"worker-0000{w}-shard-00{s}.pt" for w in (0, 1) for s in (0, 1)]
    for key, value in torch.load(sharded_out / "model.pt").items():  # the whole model, gathered
        torch.testing.assert_close(value, whole[key], rtol=1e-5, atol=1e-6)

    def evaluations(folder):  # between synchronisations: the workers' average, in a spare model
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["eval_model"], r["val_loss"]) for r in rows if "val_loss" in r]

    assert [e[:2] for e in evaluations(sharded_out)] == [e[:2] for e in evaluations(out)]
    assert "average" in {e[1] for e in evaluations(out)}
    assert [e[2] for e in evaluations(sharded_out)] == pytest.approx([e[2] for e in evaluations(out)], rel=1e-5)


def test_worker_groups_need_torch_distributed():
    with pytest.raises(lordo.ConfigError, match="ranks_per_worker > 1 needs torch.distributed"):
        lordo.distributed([tiny_model(), tiny_model()], "lordo", backend="sim", ranks_per_worker=2)
