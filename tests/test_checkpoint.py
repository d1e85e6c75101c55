"""Nothing lost: checkpoints, resume, signals, worker failure and bad input."""

import errno
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import lordo.train.checkpoint as ckpt_module
from lordo.cli import main
from lordo.comm import SimCommunicator
from lordo.config import build_config
from lordo.errors import ConfigError, NonFiniteError
from lordo.train.checkpoint import Checkpointer, CheckpointError, read_tensor_file
from lordo.train.loop import train
from lordo.train.metrics import TIMING_FIELDS

BASE = ["model.preset=nano", "train.batch_size=4", "train.eval_batches=2", "train.eval_every=7",
        "schedule.warmup_steps=2", "dist.workers=2", "strategy.sync_every=4", "strategy.rank=4",
        "train.checkpoint_every=5", "train.log_every=3"]


def cfg_for(data_dir, strategy, steps=14, extra=()):
    return build_config(overrides=[*BASE, f'strategy.name="{strategy}"', f"train.steps={steps}",
                                   f"data.dir={json.dumps(str(data_dir))}", *extra])


def quiet_train(cfg, out):
    return train(cfg, out, log=lambda _: None, stream=open(os.devnull, "w"))


def model_of(out):
    return torch.load(Path(out) / "model.pt", weights_only=True)


def metrics_of(out):
    return Path(out, "metrics.jsonl").read_text()


def untimed_metrics(out):
    """The rows without their measured times (TIMING_FIELDS), which no two runs share."""
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_FIELDS} for line in metrics_of(out).splitlines()]


def assert_same_model(a, b, exact=True):
    ma, mb = model_of(a), model_of(b)
    for k in ma:
        if exact:
            assert torch.equal(ma[k], mb[k]), k
        else:
            torch.testing.assert_close(ma[k], mb[k], rtol=1e-5, atol=1e-6)


def rewind(src, dst, keep_step):
    """A copy of a finished run that stopped after ``keep_step`` (later checkpoints and results removed)."""
    shutil.copytree(src, dst)
    for d in Path(dst, "checkpoints").iterdir():
        if int(d.name.split("-")[1]) > keep_step:
            shutil.rmtree(d)
    for f in ("model.pt", "summary.json"):
        Path(dst, f).unlink()


@pytest.mark.parametrize("strategy, extra", [("ddp", ()), ("local-adam", ()), ("lordo", ()),
                                             ("lordo", ("strategy.sync_delay=3",)),  # step 10: the round of 8 in flight
                                             ("lordo", ('optim.inner="muon"',))],  # MuonAdamW's resume: test_muon.py
                         ids=["ddp", "local-adam", "lordo", "lordo-delayed", "lordo-muon"])
def test_resume_between_syncs_equals_uninterrupted_bitwise(data_dir, tmp_path, strategy, extra):
    cfg = cfg_for(data_dir, strategy, extra=extra)
    full = tmp_path / "full"
    quiet_train(cfg, full)
    assert sorted(d.name for d in (full / "checkpoints").iterdir()) == ["step-00000010", "step-00000014"]
    rewind(full, tmp_path / "resumed", keep_step=10)  # step 10: between the syncs at 8 and 12
    summary = quiet_train(cfg, tmp_path / "resumed")
    assert summary["resumed_from_step"] == 10
    assert_same_model(full, tmp_path / "resumed")
    assert untimed_metrics(full) == untimed_metrics(tmp_path / "resumed")
    full_summary = json.loads((full / "summary.json").read_text())
    for key in ("val_loss", "comm_bytes_total", "comm_by_collective", "optimizer_state_bytes"):
        assert summary[key] == full_summary[key]


def test_a_stop_inside_a_logging_window_logs_what_the_uninterrupted_run_logs(data_dir, tmp_path):
    """W5: a run saved (and stopped) at step 10, inside the logging window 9..12, logs the same train_loss as a run
    that never saved there: the open window travels as it is, not folded into another float."""
    plain = cfg_for(data_dir, "lordo", extra=("train.checkpoint_every=0", "train.log_every=4"))
    quiet_train(plain, tmp_path / "plain")
    saving = cfg_for(data_dir, "lordo", extra=("train.checkpoint_every=10", "train.log_every=4"))
    quiet_train(saving, tmp_path / "full")
    rewind(tmp_path / "full", tmp_path / "resumed", keep_step=10)
    quiet_train(saving, tmp_path / "resumed")
    rows = untimed_metrics(tmp_path / "plain")
    assert [r for r in rows if r["step"] == 12 and "train_loss" in r]  # the window across the stop is logged
    assert untimed_metrics(tmp_path / "full") == rows
    assert untimed_metrics(tmp_path / "resumed") == rows


def test_resume_on_gloo_equals_uninterrupted(data_dir, tmp_path):
    args = ["train", "--model", "nano", "--steps", "14", "--strategy", "lordo", "--workers", "2", "--backend", "gloo",
            "--data-dir", str(data_dir)] + sum((["--set", s] for s in BASE if not s.startswith(("model.", "dist."))), [])
    run = lambda out: subprocess.run([sys.executable, "-m", "lordo.cli", *args, "--out", str(out)],
                                     capture_output=True, text=True, timeout=300)
    done = run(tmp_path / "full")
    assert done.returncode == 0, done.stderr[-2000:]
    rewind(tmp_path / "full", tmp_path / "resumed", keep_step=10)
    done = run(tmp_path / "resumed")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resuming from" in done.stderr + done.stdout
    assert_same_model(tmp_path / "full", tmp_path / "resumed", exact=False)


def test_sigterm_saves_then_resume_finishes_identically(data_dir, tmp_path):
    # one thread in every run: the resume runs in this process, whose torch thread count earlier tests may have set,
    # and a step's float sums depend on it (bitwise equality needs the same count)
    cli = [sys.executable, "-m", "lordo.cli", "train", "--model", "nano", "--steps", "150", "--strategy", "local-adam",
           "--data-dir", str(data_dir), "--set", "train.threads=1"] + sum((["--set", s] for s in BASE
                                                                          if not s.startswith("model.")), [])
    out = tmp_path / "run"
    proc = subprocess.Popen([*cli, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until training is under way
        if (out / "metrics.jsonl").exists() and len(metrics_of(out).splitlines()) > 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM after step" in err and "lordo train --resume" in err
    assert "val_ppl" in err and "loss nan" not in err  # evaluations off the logging steps print no loss
    stopped_at = int(err.split("after step ")[1].split(";")[0])
    assert 0 < stopped_at < 150
    assert (out / "checkpoints" / f"step-{stopped_at:08d}" / "meta.json").exists()
    assert main(["train", "--resume", str(out), "--set", "train.steps=150"]) == 0
    full = tmp_path / "full"
    assert subprocess.run([*cli, "--out", str(full)], capture_output=True).returncode == 0
    assert_same_model(full, out)


def _children(pid):
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint(data_dir, tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    train_args = ["-m", "lordo.cli", "train", "--model", "nano", "--steps", "150", "--strategy", "lordo",
                  "--data-dir", str(data_dir)] + sum((["--set", s] for s in BASE if not s.startswith(("model.", "dist."))), [])
    out = tmp_path / "killed"
    proc = subprocess.Popen([str(torchrun), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                             *train_args, "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out / "checkpoints" / "step-00000010").exists():
        time.sleep(0.05)
    workers = [c for c in _children(proc.pid)]
    assert len(workers) == 2, "torchrun should run two worker processes"
    os.kill(workers[1], signal.SIGKILL)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log[-3000:]
    assert "resuming from" in log
    reference = tmp_path / "reference"
    # torchrun runs each worker on one thread; so does the reference, for the same float reduction order
    assert main(["train", *train_args[3:], "--workers", "2", "--backend", "sim", "--set", "train.threads=1",
                 "--out", str(reference)]) == 0
    assert_same_model(reference, out, exact=False)


def test_corrupt_or_truncated_newest_checkpoint_falls_back_to_the_previous(data_dir, tmp_path):
    cfg = cfg_for(data_dir, "lordo")
    quiet_train(cfg, tmp_path / "full")
    for damage in ("flip", "truncate"):
        run = tmp_path / damage
        rewind(tmp_path / "full", run, keep_step=14)
        victim = run / "checkpoints" / "step-00000014" / "worker-00001.pt"
        raw = victim.read_bytes()
        victim.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]) if damage == "flip" else raw[: len(raw) // 2])
        with pytest.warns(RuntimeWarning, match=r"step-00000014/worker-00001.pt is corrupt or truncated"):
            summary = quiet_train(cfg, run)
        assert summary["resumed_from_step"] == 10
        assert_same_model(tmp_path / "full", run)
        # the earlier checkpoint was only read: still intact
        Checkpointer(run, SimCommunicator(2), 2).load_latest()


def test_every_checkpoint_damaged_is_a_clear_error(data_dir, tmp_path):
    cfg = cfg_for(data_dir, "ddp", steps=6)
    quiet_train(cfg, tmp_path)
    for f in (tmp_path / "checkpoints").glob("*/shared.pt"):
        f.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning), pytest.raises(CheckpointError, match=r"every checkpoint is damaged: .*shared.pt is corrupt"):
        quiet_train(cfg, tmp_path)


def test_resume_with_different_settings_is_refused_with_the_differences(data_dir, tmp_path):
    quiet_train(cfg_for(data_dir, "lordo", steps=6), tmp_path)
    with pytest.raises(ConfigError, match=r"(?s)holds a checkpoint of a different run.*model.d_model: 32 in the checkpoint, 48 now"
                                          r".*strategy.name: 'lordo' in the checkpoint, 'ddp' now"):
        quiet_train(cfg_for(data_dir, "ddp", steps=6, extra=["model.d_model=48"]), tmp_path)
    with pytest.raises(ConfigError, match=r"workers: 2 in the checkpoint, 3 now"):
        quiet_train(cfg_for(data_dir, "lordo", steps=6, extra=["dist.workers=3"]), tmp_path)
    # more steps is a legitimate change: the run continues
    assert quiet_train(cfg_for(data_dir, "lordo", steps=8), tmp_path)["resumed_from_step"] == 6


def nan_at(monkeypatch, call):
    """Make the n-th forward pass (1-based, counting every worker) return a NaN loss."""
    from lordo.model.gpt import GPT

    original, calls = GPT.forward, {"n": 0}

    def forward(self, idx, targets=None):
        logits, loss = original(self, idx, targets)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] == call:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)


def test_nan_loss_stops_naming_the_step_and_the_last_checkpoint(data_dir, tmp_path, monkeypatch):
    nan_at(monkeypatch, call=2 * 7 + 2)  # step 8, worker 1
    with pytest.raises(NonFiniteError, match=r"loss is not finite at step 8 .*last good checkpoint: .*step-00000005"):
        quiet_train(cfg_for(data_dir, "local-adam"), tmp_path)
    Checkpointer(tmp_path, SimCommunicator(2), 2).load_latest()


def test_nan_loss_can_be_skipped(data_dir, tmp_path, monkeypatch):
    nan_at(monkeypatch, call=2 * 3 + 1)
    summary = quiet_train(cfg_for(data_dir, "lordo", extra=["train.on_nonfinite=skip"]), tmp_path)
    assert summary["skipped_steps"] == 1
    rows = [json.loads(line) for line in metrics_of(tmp_path).splitlines()]
    assert all(torch.isfinite(torch.tensor(r["val_loss"])) for r in rows if "val_loss" in r)


def test_nonfinite_pseudo_gradient_stops_at_the_sync(data_dir, tmp_path, monkeypatch):
    from lordo.strategies.local_adam import LocalUpdateStrategy

    original = LocalUpdateStrategy.synchronise

    def synchronise(self, final=False):
        if self.syncs == 1:  # worker 1 arrives at the second sync with a poisoned parameter
            with torch.no_grad():
                self.workers[1].params[0].view(-1)[0] = float("inf")
        return original(self, final)

    monkeypatch.setattr(LocalUpdateStrategy, "synchronise", synchronise)
    with pytest.raises(NonFiniteError, match=r"pseudo-gradient is not finite at synchronisation 2 \(after optimizer step 8\)"
                                             r".*last good checkpoint: .*step-00000005"):
        quiet_train(cfg_for(data_dir, "lordo"), tmp_path)


def test_disk_full_while_saving_keeps_the_previous_checkpoint(data_dir, tmp_path, monkeypatch):
    original = ckpt_module.atomic_write

    def failing(path, data):
        if "step-00000010" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, data)

    monkeypatch.setattr(ckpt_module, "atomic_write", failing)
    with pytest.raises(CheckpointError, match=r"could not save the checkpoint of step 10 .*No space left on device; "
                                              r"nothing was committed or pruned, the previous checkpoint .*step-00000005 "
                                              r"is intact"):
        quiet_train(cfg_for(data_dir, "lordo"), tmp_path)
    assert [d.name for d in (tmp_path / "checkpoints").iterdir()] == ["step-00000005"]
    monkeypatch.setattr(ckpt_module, "atomic_write", original)
    assert quiet_train(cfg_for(data_dir, "lordo"), tmp_path)["resumed_from_step"] == 5


def test_fuzzed_checkpoint_files_and_config_files_give_clear_errors(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "x.pt"
    from io import BytesIO

    buf = BytesIO()
    torch.save({"model": {"w": torch.ones(3)}, "step": 3}, buf)
    valid = buf.getvalue()
    errors = 0
    for i in range(60):
        kind = i % 3
        if kind == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        elif kind == 1:
            data = valid[: rng.randint(0, len(valid) - 1)]
        else:
            data = bytearray(valid)
            for _ in range(4):
                data[rng.randrange(len(data))] = rng.getrandbits(8)
            data = bytes(data)
        path.write_bytes(data)
        # a matching checksum, so the bytes themselves reach torch.load
        path.with_name("x.pt.sha256").write_text(hashlib.sha256(data).hexdigest())
        try:  # anything but a CheckpointError naming the file (or a clean load) fails the test
            read_tensor_file(path)
        except CheckpointError as exc:
            assert str(path) in str(exc)
            errors += 1
    assert errors >= 40
    config, errors = tmp_path / "c.toml", 0
    for _ in range(60):
        config.write_bytes(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))))
        try:
            build_config(config)
        except ConfigError as exc:
            assert str(config) in str(exc)
            errors += 1
    assert errors >= 55


def test_a_config_written_before_a_field_existed_resumes_with_its_old_behaviour():
    from lordo.train.resume_settings import config_differences

    current = build_config(overrides=['strategy.name="lordo"', 'strategy.error_feedback_after_qh="keep"']).to_dict()
    older = json.loads(json.dumps(current))
    del older["strategy"]["error_feedback_after_qh"], older["strategy"]["basis_iterations"], older["train"]["eval_model"]
    assert config_differences(older, current) == []
    current["strategy"]["error_feedback_after_qh"] = "remove"
    assert config_differences(older, current) == ["strategy.error_feedback_after_qh: 'keep' in the checkpoint, 'remove' now"]
    # saved before lowrank_term, average_error_feedback and basis_method = auto existed: the same computation
    current = build_config(overrides=['strategy.name="lordo"']).to_dict()
    older = json.loads(json.dumps(current))
    del older["strategy"]["lowrank_term"], older["strategy"]["average_error_feedback"]
    older["strategy"]["basis_method"] = "subspace"  # the explicit default of that time
    assert current["strategy"]["basis_method"] == "auto" and config_differences(older, current) == []
    older["strategy"]["name"] = current["strategy"]["name"] = "lordo-local"  # auto is svd for it now: a change
    assert config_differences(older, current) == ["strategy.basis_method: 'subspace' in the checkpoint, 'svd' now"]


def test_stray_folders_beside_the_checkpoints_are_ignored_with_a_warning(data_dir, tmp_path):
    """A backup copy (step-N.bak) or a folder made by hand (step-zzz) under checkpoints/ is not a checkpoint:
    the resume warns once, naming them, and continues from the newest real one, bit for bit."""
    cfg = cfg_for(data_dir, "lordo")
    full = tmp_path / "full"
    quiet_train(cfg, full)
    rewind(full, tmp_path / "resumed", keep_step=10)
    checkpoints = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(checkpoints / "step-00000010", checkpoints / "step-00000010.bak")
    (checkpoints / "step-zzz").mkdir()
    with pytest.warns(RuntimeWarning, match=r"not checkpoints \(step-N\): step-00000010.bak, step-zzz"):
        summary = quiet_train(cfg, tmp_path / "resumed")
    assert summary["resumed_from_step"] == 10
    assert_same_model(full, tmp_path / "resumed")
    assert (checkpoints / "step-zzz").is_dir() and (checkpoints / "step-00000010.bak").is_dir()  # not ours to delete


def test_a_full_disk_while_writing_the_final_model_names_the_file_and_keeps_the_checkpoint(data_dir, tmp_path, monkeypatch):
    import lordo.files as files_module
    from lordo.errors import WriteError

    original = files_module.os.replace

    def full(src, dst):
        if str(dst).endswith("model.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(src, dst)

    monkeypatch.setattr(files_module.os, "replace", full)
    with pytest.raises(WriteError, match=r"could not write .*model.pt: No space left on device; the checkpoint .*"
                                         r"step-00000014 is intact: free space and rerun with --resume"):
        quiet_train(cfg_for(data_dir, "lordo"), tmp_path)
    assert not (tmp_path / "model.pt").exists() and not list(tmp_path.glob(".model.pt.tmp-*"))
    monkeypatch.setattr(files_module.os, "replace", original)
    assert quiet_train(cfg_for(data_dir, "lordo"), tmp_path)["resumed_from_step"] == 14
    assert (tmp_path / "model.pt").exists() and json.loads((tmp_path / "summary.json").read_text())["steps"] == 14


def test_resume_without_a_checkpoint_suggests_a_command_that_can_work(tmp_path, capsys):
    """With neither a checkpoint nor config.json, the suggestion names the user's own config, not a
    config.json that does not exist; with a config.json, that one."""
    from lordo.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["train", "--resume", str(empty)]) == 2
    err = capsys.readouterr().err
    assert f"start the run again with: lordo train --config YOUR_CONFIG.toml --out {empty}" in err
    (empty / "config.json").write_text(json.dumps({"train": {"steps": 3}}))
    assert main(["train", "--resume", str(empty)]) == 2
    assert f"lordo train --config {empty / 'config.json'} --out {empty}" in capsys.readouterr().err


@pytest.mark.parametrize("override, key", [("train.batch_size=100000000", "train.batch_size (100000000)"),
                                           ("model.d_model=262144", "model.d_model (262144)")])
def test_settings_far_beyond_the_memory_are_refused_before_allocating(data_dir, tmp_path, override, key):
    with pytest.raises(ConfigError, match=rf"this run needs at least [\d,.]+ GiB on cpu .* but the machine has "
                                          rf"[\d,.]+ GiB; lower .*{re.escape(key)}"):
        quiet_train(cfg_for(data_dir, "lordo", extra=[override, "model.n_heads=4"]), tmp_path)
    assert not (tmp_path / "model.pt").exists()


def test_an_allocator_refusal_is_a_message_not_a_traceback(monkeypatch, capsys):
    import lordo.cli as cli

    def refuse(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: not enough memory: you tried "
                           "to allocate 1099511627776 bytes.")

    monkeypatch.setattr(cli, "_train", refuse)
    assert cli.main(["train", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "lordo: error: out of memory ([enforce fail at alloc_cpu.cpp:121]" in err and "lower train.batch_size" in err
    monkeypatch.setattr(cli, "_train", lambda args: (_ for _ in ()).throw(RuntimeError("a bug, not memory")))
    with pytest.raises(RuntimeError, match="a bug, not memory"):  # other errors are not hidden
        cli.main(["train", "--steps", "1"])


def test_the_last_good_checkpoint_named_in_messages_is_an_intact_one(data_dir, tmp_path):
    """A newest checkpoint damaged on disk is not "the last good checkpoint" a message names (a resume would
    skip it too): the newest one whose files match their checksums is."""
    from lordo.train.checkpoint import Checkpointer

    quiet_train(cfg_for(data_dir, "lordo", steps=10, extra=["train.checkpoint_every=5"]), tmp_path)
    shared = tmp_path / "checkpoints" / "step-00000010" / "shared.pt"
    shared.write_bytes(shared.read_bytes()[:-10])
    checkpoints = Checkpointer(tmp_path, None, keep=2)
    assert checkpoints.latest_step_name().endswith("step-00000010")
    assert checkpoints.latest_intact_name().endswith("step-00000005")
    (tmp_path / "checkpoints" / "step-00000005" / "meta.json").write_text("{")
    assert checkpoints.latest_intact_name() is None


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_keeps_elapsed_eta_and_the_last_validation_on_screen():
    """Off a terminal: plain lines with elapsed time and ETA, the last val_ppl carried on every line; on a
    terminal: a tqdm bar whose postfix keeps the last val_ppl, each evaluation also written as its own line."""
    from lordo.train.metrics import Progress

    plain = io.StringIO()
    progress = Progress(10, plain, every=5)
    progress.update(5, "loss 3.000", val_ppl=40.0, force=True)
    progress.update(10, "loss 2.500")
    lines = plain.getvalue().splitlines()
    assert re.fullmatch(r"step  5/10  loss 3.000  val_ppl 40.0  \[00:0\d elapsed, ETA 00:0\d\]", lines[0]), lines
    assert lines[1].startswith("step 10/10  loss 2.500  val_ppl 40.0  [") and "ETA 00:00]" in lines[1]
    screen = _Terminal()
    progress = Progress(10, screen, every=5)
    progress.update(4, "loss 3.100", val_ppl=41.5)
    progress.update(6, "loss 3.000")
    progress.close()
    text = screen.getvalue()
    assert "step 4/10  val_ppl 41.50\n" in text  # the evaluation as a line that stays
    assert "step 6/10" in text and "loss 3.000  val_ppl 41.5" in text and "<" in text  # bar: elapsed<remaining


def test_launch_mistakes_are_named_before_any_process_starts(monkeypatch, capsys):
    from lordo.cli import main

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    assert main(["train", "--backend", "sim", "--workers", "2", "--steps", "1"]) == 2
    assert "simulates every worker in one process, but torchrun started 2 processes" in capsys.readouterr().err
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key)
    if not torch.cuda.is_available():
        assert main(["train", "--backend", "nccl", "--workers", "2", "--steps", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("needs CUDA GPUs and torch sees none") == 1 and "starting" not in err


def test_a_config_of_the_first_format_resumes_as_it_ran():
    """tests/data/config_2026-11-30.json is a run's config.json as lordo wrote it on 2026-11-30, before most of
    today's fields: filled in the way ``lordo train --resume`` fills it, it differs from nothing, and a field
    added without saying how an older run behaved (resume_settings.ADDED_FIELDS) fails here."""
    from lordo.train.resume_settings import config_differences, with_added_fields

    path = Path(__file__).parent / "data" / "config_2026-11-30.json"
    saved = json.loads(path.read_text())
    filled = with_added_fields({k: v for k, v in saved.items() if k != "derived"})
    resumed = build_config(tree=filled).to_dict()
    assert config_differences(saved, resumed) == []
    assert resumed["strategy"]["error_feedback_after_qh"] == "keep"  # the default then, "remove" now
    # built from the file alone, today's defaults apply where the fields are missing: a different run, said
    assert "strategy.error_feedback_after_qh: 'keep' in the checkpoint, 'remove' now" in config_differences(
        saved, build_config(path).to_dict())


def test_progress_speaks_inside_a_step_longer_than_its_cadence():
    """The cadence was checked at step ends, so a slow step (a synchronisation over a slow link) left a minute of
    silence; a line now says which step is running once the cadence has passed."""
    from lordo.train.metrics import Progress

    plain = io.StringIO()
    progress = Progress(10, plain, every=5, at_least_s=0.2)
    progress.update(3, "loss 3.000 (at step 3)", force=True)
    time.sleep(0.7)  # step 4 takes long
    progress.close()
    lines = plain.getvalue().splitlines()
    assert lines[0].startswith("step  3/10  loss 3.000 (at step 3)")
    assert len(lines) >= 2 and all(line.startswith("step  3/10  (step 4 running)  [") for line in lines[1:]), lines
