"""Faults when worker processes disagree (multi-process, gloo): damaged files on one rank, a failed write on
one rank, a signal to the launcher, two runs in one folder, torchrun without --out; and, in one process,
exact resume with a bf16 error-feedback buffer and a diverged model under on_nonfinite = skip."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lordo.errors import NonFiniteError

from test_checkpoint import assert_same_model, cfg_for, model_of, quiet_train

ROOT = Path(__file__).resolve().parents[1]
NANO = ["--model", "nano", "--set", "train.batch_size=4", "--set", "train.eval_batches=2", "--set", "train.eval_every=100",
        "--set", "schedule.warmup_steps=2", "--set", "strategy.sync_every=3", "--set", "strategy.rank=4",
        "--set", "train.log_every=1"]


def lordo_cmd(data_dir, out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "lordo.cli", "train", *NANO, "--data-dir", str(data_dir), "--out", str(out), *extra]


def gloo(data_dir, out, *extra: str, env=None, timeout=300) -> subprocess.CompletedProcess:
    cmd = lordo_cmd(data_dir, out, "--workers", "2", "--backend", "gloo", *extra)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_ranks_agree_on_the_newest_checkpoint_intact_for_all(data_dir, tmp_path):
    out = tmp_path / "run"
    done = gloo(data_dir, out, "--steps", "12", "--set", "train.checkpoint_every=4", "--set", "train.keep_checkpoints=3")
    assert done.returncode == 0, done.stderr[-3000:]
    reference = model_of(out)
    # only rank 1's file of the newest checkpoint is damaged: rank 0 alone would resume from step 12
    (out / "checkpoints" / "step-00000012" / "worker-00001.pt").write_bytes(b"truncated")
    (out / "model.pt").unlink()
    done = subprocess.run([sys.executable, "-m", "lordo.cli", "train", "--resume", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker-00001.pt is corrupt or truncated" in done.stderr
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 8
    for key, value in model_of(out).items():
        assert torch.equal(value, reference[key]), key


FAIL_WRITES = """
import errno, os
if os.environ.get("RANK") == "1" and os.environ.get("FAULT_PATH"):
    _replace = os.replace
    def replace(src, dst, *args, **kwargs):
        if os.environ["FAULT_PATH"] in str(dst):
            raise OSError(errno.ENOSPC, "No space left on device")
        return _replace(src, dst, *args, **kwargs)
    os.replace = replace
"""


def test_a_failed_write_on_one_rank_commits_and_prunes_nothing(data_dir, tmp_path):
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(textwrap.dedent(FAIL_WRITES))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               FAULT_PATH="step-00000008")
    out = tmp_path / "run"
    done = gloo(data_dir, out, "--steps", "12", "--set", "train.checkpoint_every=4", "--set", "train.keep_checkpoints=1",
                env=env)
    assert done.returncode != 0
    assert "could not save the checkpoint of step 8" in done.stderr and "nothing was committed or pruned" in done.stderr
    assert [d.name for d in (out / "checkpoints").iterdir()] == ["step-00000004"]  # the older one was kept
    done = gloo(data_dir, out, "--steps", "12", "--set", "train.checkpoint_every=4", "--set", "train.keep_checkpoints=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 4


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if metrics.exists():
            steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if line.strip()]
            if steps and max(steps) >= step:
                return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} in {metrics} within {timeout}s")


def test_sigterm_to_the_launcher_stops_every_worker_with_a_checkpoint(data_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(lordo_cmd(data_dir, out, "--steps", "2000", "--workers", "2", "--backend", "gloo"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    wait_for_step(out / "metrics.jsonl", 5, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert f"continue with: lordo train --resume {out}" in stderr
    (stopped,) = [d for d in (out / "checkpoints").iterdir()]
    files = sorted(p.name for p in stopped.iterdir())
    assert "worker-00000.pt" in files and "worker-00001.pt" in files
    size = (out / "metrics.jsonl").stat().st_size
    time.sleep(2)
    assert (out / "metrics.jsonl").stat().st_size == size  # no worker trains on
    assert not (out / "summary.json").exists()


def test_a_second_run_into_a_used_folder_is_refused(data_dir, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(lordo_cmd(data_dir, out, "--steps", "2000"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT)
    try:
        wait_for_step(out / "metrics.jsonl", 2, first)
        second = subprocess.run(lordo_cmd(data_dir, out, "--steps", "2000"), capture_output=True, text=True, timeout=120,
                                cwd=ROOT)
        assert second.returncode == 2
        assert f"{out} is in use by pid {first.pid}" in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM


def test_torchrun_without_out_writes_one_folder(data_dir, tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    assert torchrun is not None
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "lordo.cli", "train", *NANO, "--steps", "4",
           "--data-dir", str(data_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (folder,) = list((tmp_path / "runs").iterdir())
    (checkpoint,) = list((folder / "checkpoints").iterdir())
    assert {"worker-00000.pt", "worker-00001.pt", "shared.pt"} <= {p.name for p in checkpoint.iterdir()}


def test_resume_is_exact_with_a_bf16_error_feedback_buffer(data_dir, tmp_path):
    cfg = cfg_for(data_dir, "lordo", extra=['strategy.error_feedback_dtype="bfloat16"'])
    quiet_train(cfg, tmp_path / "full")
    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-00000014")
    for f in ("model.pt", "summary.json"):
        (tmp_path / "resumed" / f).unlink()
    assert quiet_train(cfg, tmp_path / "resumed")["resumed_from_step"] == 10
    assert_same_model(tmp_path / "full", tmp_path / "resumed")


def test_a_diverged_model_under_skip_stops_and_keeps_its_finite_checkpoints(data_dir, tmp_path, monkeypatch):
    from lordo.model.gpt import GPT

    original = GPT.forward

    def diverged_from_step_7(self, idx, targets=None):  # every loss after 6 steps of 2 workers is NaN
        logits, loss = original(self, idx, targets)
        if targets is not None and self.training:
            diverged_from_step_7.calls += 1
            if diverged_from_step_7.calls > 12:
                loss = loss * float("nan")
        return logits, loss

    diverged_from_step_7.calls = 0
    monkeypatch.setattr(GPT, "forward", diverged_from_step_7)
    cfg = cfg_for(data_dir, "lordo", steps=30, extra=["train.on_nonfinite=skip", "train.max_consecutive_skips=4"])
    with pytest.raises(NonFiniteError, match=r"not finite for 4 steps in a row \(up to step 10\).*step-00000005"):
        quiet_train(cfg, tmp_path)
    for folder in (tmp_path / "checkpoints").iterdir():
        state = torch.load(folder / "worker-00000.pt", weights_only=True)
        assert all(bool(torch.isfinite(v).all()) for v in state["model"].values())


KILL_RANK = """
import os
if os.environ.get("RANK") == os.environ.get("KILL_RANK"):
    import lordo.train.loop as loop
    _forward_backward = loop.Trainer._forward_backward
    calls = [0]
    def dying(self, forward, sampler):
        calls[0] += 1
        if calls[0] == int(os.environ["KILL_AT"]):
            os._exit(9)  # as a killed process: no message, no cleanup
        return _forward_backward(self, forward, sampler)
    loop.Trainer._forward_backward = dying
"""


def test_a_killed_rank_of_a_sharded_worker_is_named_by_its_sibling_in_one_line(data_dir, tmp_path):
    """W7: dist.shard = true, 2 workers of 2 ranks; rank 1 (worker 0's second rank) dies mid-step: its sibling,
    inside FSDP2's gathers, says so in one line with where a restart would start, not a raw traceback."""
    (tmp_path / "inject").mkdir()
    (tmp_path / "inject" / "sitecustomize.py").write_text(textwrap.dedent(KILL_RANK))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'inject'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               KILL_RANK="1", KILL_AT="4", OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    done = gloo(data_dir, out, "--steps", "20", "--set", "dist.ranks_per_worker=2", "--set", "dist.shard=true",
                "--set", "dist.timeout_s=60", env=env)
    assert done.returncode != 0
    assert "another rank of this worker stopped answering during the forward/backward" in done.stderr, done.stderr[-3000:]
    assert "This worker has no checkpoint yet: started again, it begins at step 0" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
