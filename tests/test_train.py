import json
import math
import re
import subprocess
import sys

import pytest

from lordo.cli import main
from lordo.config import build_config
from lordo.train.loop import train
from lordo.train.metrics import TIMING_FIELDS

NANO = ["model.preset=nano", "train.batch_size=8", "train.eval_batches=4", "schedule.warmup_steps=5"]


def run_nano(data_dir, out, steps=40, extra=()):
    cfg = build_config(overrides=NANO + [f"train.steps={steps}", f"train.eval_every={steps // 2}",
                                         f"data.dir={json.dumps(str(data_dir))}", *extra])
    return train(cfg, out, log=lambda _: None, stream=open("/dev/null", "w"))


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_loss_falls_on_nano(data_dir, tmp_path):
    summary = run_nano(data_dir, tmp_path, steps=60, extra=["optim.lr=1e-2"])
    rows = read_metrics(tmp_path)
    initial = rows[0]["val_loss"]
    assert initial == pytest.approx(math.log(4096), abs=0.3)
    assert summary["val_loss"] < initial - 1.0


def test_same_seed_same_metrics(data_dir, tmp_path):
    run_nano(data_dir, tmp_path / "a", steps=20)
    run_nano(data_dir, tmp_path / "b", steps=20)
    run_nano(data_dir, tmp_path / "c", steps=20, extra=["train.seed=1"])
    a, b, c = ([{k: v for k, v in row.items() if k not in TIMING_FIELDS} for row in read_metrics(tmp_path / d)]
               for d in "abc")
    assert a == b  # all but the measured times
    assert a != c


def test_train_threads_hold_for_the_run_and_the_callers_count_comes_back(data_dir, tmp_path, monkeypatch):
    import torch

    import lordo.train.loop as loop

    seen = []
    real_run = loop.Trainer.run
    monkeypatch.setattr(loop.Trainer, "run", lambda self: (seen.append(torch.get_num_threads()), real_run(self))[1])
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    run_nano(data_dir, tmp_path / "a", steps=6, extra=[f"train.threads={wanted}"])
    assert seen == [wanted] and torch.get_num_threads() == before
    from lordo.errors import ConfigError, DataError

    with pytest.raises(DataError, match="corpus archive .* is missing"):  # a run that fails gives the count back too
        run_nano(tmp_path / "no-corpus", tmp_path / "b", steps=6, extra=[f"train.threads={wanted}"])
    assert torch.get_num_threads() == before
    with pytest.raises(ConfigError, match="train.device is 'cuda'"):  # and one that fails before its communicator
        run_nano(data_dir, tmp_path / "c", steps=6, extra=[f"train.threads={wanted}", 'train.device="cuda"'])
    assert torch.get_num_threads() == before


def test_cli_run_writes_the_three_files(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    # the defaults run at any length: lordo, with a warm-up of min(50, steps // 10) = 2 steps here
    code = main(["train", "--model", "nano", "--steps", "20", "--out", str(out), "--data-dir", str(data_dir),
                 "--set", "train.eval_every=10"])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["preset"] == "nano" and config["train"]["steps"] == 20
    rows = read_metrics(out)
    assert {"step", "tokens", "train_loss", "lr"} <= set(rows[-1])
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in evals)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("val_loss", "val_ppl", "steps", "tokens", "wall_s", "tokens_per_s", "params", "optimizer_state_bytes"):
        assert key in summary
    assert summary["tokens"] == 20 * 16 * 64  # steps x default batch_size x nano seq_len
    assert summary["strategy"] == "lordo"
    assert set(summary["optimizer_state_bytes"]) == {"lowrank_moments", "full_rank_moments", "bases", "error_feedback", "anchor"}
    assert "val perplexity" in capsys.readouterr().out


def test_cli_reports_config_errors_without_traceback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "lordo.cli", "train", "--set", "optim.lr=-1", "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip() == "lordo: error: optim.lr must be >= 0, got -1.0"


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["data", "--help"], ["data", "prepare", "--help"]])
def test_help_explains_options(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: lordo" in out
    if argv[0] == "train":
        assert "--set KEY=VALUE" in out and "optim.lr" in out


def test_cli_gloo_workers_match_the_simulator(data_dir, tmp_path):
    """`lordo train --backend gloo --workers 2` starts two processes; they must train exactly what the
    simulator trains, and count the same bytes. One thread everywhere: a step's float sums depend on the count."""
    common = ["train", "--model", "nano", "--steps", "12", "--strategy", "local-adam", "--workers", "2",
              "--sync-every", "5", "--data-dir", str(data_dir), "--set", "schedule.warmup_steps=2",
              "--set", "train.eval_every=6", "--set", "train.eval_batches=2", "--set", "train.threads=1"]
    done = subprocess.run([sys.executable, "-m", "lordo.cli", *common, "--backend", "gloo", "--out", str(tmp_path / "gloo")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done: local-adam with 2 worker(s)") == 1  # one summary for the job
    assert main([*common, "--backend", "sim", "--out", str(tmp_path / "sim")]) == 0
    import torch

    gloo, sim = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("gloo", "sim"))
    assert gloo.keys() == sim.keys()
    for k in sim:
        torch.testing.assert_close(gloo[k], sim[k], rtol=1e-5, atol=1e-6)
    s_gloo, s_sim = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("gloo", "sim"))
    assert s_gloo["communicator"] == "TorchDistCommunicator" and s_sim["communicator"] == "SimCommunicator"
    for key in ("comm_bytes_total", "comm_calls", "comm_by_collective", "ddp_comm_bytes", "tokens"):
        assert s_gloo[key] == s_sim[key]
    n = s_sim["params"]
    # syncs at steps 5 and 10, a final one at 12, plus the initial broadcast: 4 payloads of the full model
    assert s_sim["comm_bytes_total"] == 4 * 4 * n
    assert s_sim["ddp_comm_bytes"] == 13 * 4 * n
    assert s_sim["comm_ratio_to_ddp"] == pytest.approx(4 / 13)
    rows = read_metrics(tmp_path / "sim")
    assert rows[-1]["comm_bytes"] == s_sim["comm_bytes_total"]


def test_cli_lordo_run_logs_diagnostics_at_every_sync(data_dir, tmp_path):
    out = tmp_path / "lordo"
    assert main(["train", "--model", "nano", "--steps", "12", "--strategy", "lordo", "--workers", "2", "--rank", "4",
                 "--omega", "0.9", "--sync-every", "4", "--data-dir", str(data_dir), "--out", str(out),
                 "--set", "schedule.warmup_steps=2", "--set", "train.eval_batches=2", "--set", "train.log_every=5",
                 "--set", "train.eval_every=6"]) == 0
    rows = read_metrics(out)
    # evaluations between syncs score the workers' average, at syncs (and at the end) the one synced model
    assert [(r["step"], r["eval_model"]) for r in rows if "val_loss" in r] == [(0, "synced"), (6, "average"), (12, "synced")]
    assert all(0 <= r["error_feedback_norm"] < 10 for r in rows if "basis_overlap" in r)
    syncs = [r for r in rows if "basis_overlap" in r]
    assert [r["step"] for r in syncs] == [4, 8, 12]
    assert all(0 <= r["basis_overlap"] <= 1 + 1e-6 and 0 <= r["residual_energy"] <= 1 for r in syncs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["basis_overlap_mean"] == pytest.approx(sum(r["basis_overlap"] for r in syncs) / 3)
    assert set(summary["optimizer_state_bytes"]) == {"lowrank_moments", "full_rank_moments", "bases", "error_feedback", "anchor"}
    config = json.loads((out / "config.json").read_text())
    assert config["strategy"]["rank"] == 4 and config["strategy"]["omega"] == 0.9


def test_tensorboard_log_holds_the_jsonl_numbers(data_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="the tb extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    code = main(["train", "--model", "nano", "--steps", "8", "--out", str(out), "--data-dir", str(data_dir),
                 "--workers", "2", "--strategy", "lordo", "--rank", "4", "--sync-every", "4", "--log", "tensorboard",
                 "--set", "train.eval_every=4", "--set", "schedule.warmup_steps=2", "--set", "train.log_every=2"])
    assert code == 0
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = read_metrics(out)
    for key in ("val_loss", "val_ppl", "train_loss", "lr", "comm_bytes", "basis_overlap"):
        logged = [(e.step, e.value) for e in events.Scalars(key)]
        expected = [(r["step"], r[key]) for r in rows if key in r]  # every row's numbers, step 0's included
        assert [s for s, _ in logged] == [s for s, _ in expected], key
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6), key


def test_a_compiled_optimizer_step_trains_as_the_eager_one(data_dir, tmp_path):
    """``optim.compile_step``: the same run (2 simulated workers, a synchronisation at step 4, a basis
    refresh) with the low-rank step batched and compiled ends at the eager per-matrix run's losses."""
    import torch
    from torch._dynamo.utils import counters

    common = ["dist.workers=2", "dist.backend=\"sim\"", "strategy.sync_every=4", "strategy.rank=4", "train.log_every=1"]
    eager = run_nano(data_dir, tmp_path / "eager", steps=8, extra=common)
    torch._dynamo.reset()
    counters.clear()
    compiled = run_nano(data_dir, tmp_path / "compiled", steps=8, extra=common + ["optim.compile_step=true"])
    assert counters["stats"]["unique_graphs"] >= 1  # the step did run compiled (the model is not)
    rows = [[r["train_loss"] for r in read_metrics(tmp_path / d) if "train_loss" in r] for d in ("eager", "compiled")]
    assert len(rows[0]) == 8 and rows[0] == pytest.approx(rows[1], rel=1e-4)
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)


def test_the_done_line_of_a_resumed_run_says_how_long_it_trained_in_all(capsys, tmp_path):
    """A run resumed near its end took seconds in this process but trained for its whole length: the line
    says both (it said "2000 steps in 71s" beside tokens/s computed over every step before)."""
    from lordo.cli import _print_summary

    s = {"strategy": "lordo", "workers": 1, "steps": 2000, "tokens": 8_192_000, "wall_s": 71.4, "train_s": 2257.0,
         "tokens_per_s": 3630.0, "val_ppl": 43.7, "unigram_val_ppl": 568.8, "val_loss": 3.777, "resumed_from_step": 1901}
    _print_summary(s, tmp_path)
    assert "8,192,000 tokens in 2257s of training (71s in this run, resumed at step 1901)" in capsys.readouterr().out
    _print_summary(dict(s, resumed_from_step=0, wall_s=2290.0), tmp_path)
    assert "8,192,000 tokens in 2290s (3,630 tokens/s while training)" in capsys.readouterr().out


def test_progress_prints_a_plain_line_when_due_whatever_log_every_is(data_dir, tmp_path, monkeypatch):
    """Off a terminal a line at least every Progress.AT_LEAST_S seconds (here 0: every step), also between metrics
    rows, carrying the optimizer state measured from its tensors against AdamW's."""
    import io

    from lordo.train.metrics import Progress

    monkeypatch.setattr(Progress, "AT_LEAST_S", 0.0)
    stream = io.StringIO()
    cfg = build_config(overrides=['model.preset="nano"', "train.steps=6", "train.log_every=100", "train.eval_every=100",
                                  f'data.dir="{data_dir}"', "dist.workers=2"])
    train(cfg, tmp_path / "run", log=lambda _: None, stream=stream)
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [f"{s}/6" for s in range(1, 7)]
    assert all(re.search(r"state [\d.]+ MiB \(\d\.\d\dx AdamW\)", line) for line in lines), lines
