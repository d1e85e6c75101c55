"""Sweeps: grid expansion, resume after interruption, failed points recorded."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lordo.errors import ConfigError
from lordo.experiments.sweep import load_sweep, run_sweep

NANO_BASE = """
[base.model]
preset = "nano"
[base.train]
steps = 3
batch_size = 4
eval_batches = 2
[base.schedule]
warmup_steps = 1
[base.data]
dir = "{data}"
"""


def write(tmp_path, text):
    f = tmp_path / "s.toml"
    f.write_text(text)
    return f


def test_grid_expands_in_file_order(tmp_path):
    f = write(tmp_path, '[sweep]\nname = "g"\n[grid]\n"strategy.name" = ["ddp", "lordo"]\n"strategy.rank" = [8, 16]\n'
                        '"train.seed" = [0, 1]\n')
    sweep = load_sweep(f)
    points = sweep.points()
    assert len(points) == 8
    assert [p.name for p in points[:3]] == ["name-ddp__rank-8__seed-0", "name-ddp__rank-8__seed-1", "name-ddp__rank-16__seed-0"]
    assert points[-1].overrides == ('strategy.name="lordo"', "strategy.rank=16", "train.seed=1")
    assert str(sweep.out).endswith("results/g")


def test_cases_pair_settings_and_multiply_the_grid(tmp_path):
    f = write(tmp_path, '[grid]\n"train.seed" = [0, 1]\n'
                        '[[case]]\n"strategy.name" = "lordo"\n"optim.lr" = 0.003\n'
                        '[[case]]\n"strategy.name" = "ddp"\n"optim.lr" = 0.006\n')
    points = load_sweep(f).points()
    assert [p.name for p in points] == ["name-lordo__lr-0.003__seed-0", "name-lordo__lr-0.003__seed-1",
                                        "name-ddp__lr-0.006__seed-0", "name-ddp__lr-0.006__seed-1"]
    assert points[2].overrides == ('strategy.name="ddp"', "optim.lr=0.006", "train.seed=0")


@pytest.mark.parametrize("text, message", [
    ('[grid]\n"train.seed" = [0]\n[[case]]\n"train.seed" = 1\n', r"case 1 sets \['train.seed'\], which the grid also varies"),
    ('[[case]]\n"optim.lr" = 0.1\n[[case]]\n"train.seed" = 1\n', r"case 2 sets \['train.seed'\] but case 1 sets \['optim.lr'\]"),
    ('case = 3\n', r"\[\[case\]\] must be an array of tables"),
    ('[grid]\n"optim.learning_rate" = [1]\n', r"point learning_rate-1: unknown config key optim.'learning_rate'"),
    ('[grid]\n"optim.lr" = []\n', r"grid key 'optim.lr' must list at least one value"),
    ('[grids]\n', r"unknown tables \['grids'\]"),
    ('[grid]\n"optim.lr" = [-1.0]\n', r"optim.lr must be >= 0"),
])
def test_bad_sweep_files_fail_before_running(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(write(tmp_path, text))


def test_jobs_must_be_a_positive_integer(tmp_path):
    sweep = load_sweep(write(tmp_path, '[grid]\n"train.seed" = [0]\n'), tmp_path / "out")
    with pytest.raises(ConfigError, match="jobs must be an integer >= 1, got 0"):
        run_sweep(sweep, jobs=0)


def test_a_second_sweep_of_a_folder_in_use_is_refused_before_it_touches_a_point(tmp_path):
    """Two `lordo sweep` of one file would run each point twice (the second's runs refused by the run folder's lock)
    and leave failed.json beside points that finish: the second is refused at once, naming the holder."""
    from lordo.train.lock import OutputLock

    sweep = load_sweep(write(tmp_path, '[grid]\n"train.seed" = [0]\n'), tmp_path / "out")
    (tmp_path / "out").mkdir()
    with OutputLock(tmp_path / "out"):  # the first sweep, running
        with pytest.raises(ConfigError, match=r"sweep s: .*out is in use by pid \d+ on .*wait for that sweep to end"):
            run_sweep(sweep, log=lambda _: None)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".lock"]  # no point folder, no failed.json


def test_failed_point_is_recorded_the_sweep_goes_on_and_a_rerun_skips_done_points(tmp_path, data_dir):
    # rank 64 is larger than nano's 32×32 matrices: that point fails at start-up; rank 4 trains
    f = write(tmp_path, NANO_BASE.format(data=data_dir) + '[grid]\n"strategy.name" = ["lordo"]\n"strategy.rank" = [64, 4]\n')
    sweep = load_sweep(f, tmp_path / "out")
    index = run_sweep(sweep, log=lambda _: None, jobs=2)  # both points at once; the index keeps file order
    assert [p["status"] for p in index["points"]] == ["failed", "done"]
    failed = json.loads((tmp_path / "out" / "name-lordo__rank-64" / "failed.json").read_text())
    assert failed["returncode"] == 2 and "strategy.rank must be in [1, 32]" in failed["stderr"]
    summary = tmp_path / "out" / "name-lordo__rank-4" / "summary.json"
    assert json.loads(summary.read_text())["steps"] == 3
    stamp = summary.stat().st_mtime_ns
    logged = []
    index = run_sweep(load_sweep(f, tmp_path / "out"), log=logged.append)
    assert summary.stat().st_mtime_ns == stamp  # not rerun
    assert "[2/2] name-lordo__rank-4: already done" in logged
    assert [p["status"] for p in json.loads((tmp_path / "out" / "sweep.json").read_text())["points"]] == ["failed", "done"]


def test_swept_numbers_average_seeds_per_value_and_line():
    from lordo.experiments.report import swept_numbers

    def run(name, rank, seed, ppl):
        return {"values": {"strategy.name": name, "strategy.rank": rank, "train.seed": seed}, "summary": {"val_ppl": ppl}}

    runs = [run("lordo", 16, 0, 40.0), run("lordo", 16, 1, 44.0), run("lordo", 4, 0, 50.0), run("lordo", 64, 0, 38.0),
            run("lordo-local", 4, 0, 52.0), run("lordo-local", 16, 0, 45.0), run("lordo-local", 64, 0, 41.0)]
    series = swept_numbers(runs)
    assert list(series) == ["strategy.rank"]  # the name is not numeric, the seed is averaged over
    lordo = series["strategy.rank"]["name=lordo"]
    assert lordo[0] == (4, 50.0, 0.0) and lordo[2] == (64, 38.0, 0.0)
    assert lordo[1][:2] == (16, 42.0) and abs(lordo[1][2] - 8 ** 0.5) < 1e-12  # stdev of 40, 44
    assert [x for x, _, _ in series["strategy.rank"]["name=lordo-local"]] == [4, 16, 64]
    assert swept_numbers(runs[:3]) == {}  # two ranks only: no curve to draw
    assert list(swept_numbers(runs[:4])["strategy.rank"]) == [""]  # one strategy: one line, no label


def test_report_draws_perplexity_against_a_swept_number(tmp_path):
    from lordo.experiments.report import write_report

    points = []
    for name in ("lordo", "lordo-local"):
        for rank in (4, 16, 64):
            folder = tmp_path / f"rank-{rank}__name-{name}"
            folder.mkdir()
            summary = {"val_ppl": 40.0 + rank / 8, "val_loss": 3.7, "steps": 10, "comm_bytes_per_step": 100.0,
                       "comm_wire_bytes_total": 1000, "ddp_comm_wire_bytes": 20000, "comm_bytes_total": 1000, "params": 1000,
                       "optimizer_state_bytes": {"moments": 800}}
            (folder / "summary.json").write_text(json.dumps(summary))
            (folder / "metrics.jsonl").write_text(json.dumps({"step": 10, "val_loss": 3.7, "comm_wire_bytes": 1000}) + "\n")
            points.append({"name": folder.name, "dir": str(folder), "status": "done",
                           "values": {"strategy.rank": rank, "strategy.name": name}})
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    report = write_report(tmp_path).read_text()
    png = tmp_path / "plots" / "val_ppl_vs_rank.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "plots/val_ppl_vs_rank.png" in report
    assert "| rank=64, name=lordo-local | 1 | 48.00 |" in report


def test_report_on_a_tiny_sweep_has_the_runs_numbers_and_plots(tmp_path, data_dir):
    f = write(tmp_path, NANO_BASE.format(data=data_dir)
              + '[base.dist]\nworkers = 2\n[base.strategy]\nrank = 4\nsync_every = 2\n'
              + '[grid]\n"strategy.name" = ["lordo"]\n"train.seed" = [0, 1]\n')
    run_sweep(load_sweep(f, tmp_path / "out"), log=lambda _: None)
    from lordo.experiments.report import write_report

    report = write_report(tmp_path / "out").read_text()
    ppl = [json.loads((tmp_path / "out" / f"name-lordo__seed-{s}" / "summary.json").read_text())["val_ppl"] for s in (0, 1)]
    import statistics

    assert f"| name=lordo | 2 | {statistics.mean(ppl):.2f} ± {statistics.stdev(ppl):.2f} |" in report
    for name in ("val_loss_vs_step", "val_loss_vs_bytes", "basis_overlap", "error_feedback", "optimizer_memory"):
        png = tmp_path / "out" / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert f"plots/{name}.png" in report
    # lordo plot: the two runs into one PNG; a folder that is not a run is a clear error
    from lordo.cli import main

    runs = [str(tmp_path / "out" / f"name-lordo__seed-{s}") for s in (0, 1)]
    assert main(["plot", *runs, "--out", str(tmp_path / "two.png")]) == 0
    png = tmp_path / "two.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert not (tmp_path / "x.png").exists()


def test_half_written_results_are_rerun_by_the_sweep_and_left_out_of_the_report(tmp_path, data_dir):
    """An empty summary.json (a kill while writing it, before writes were atomic) is not a finished point: the
    sweep runs it again (it resumes from its final checkpoint); meanwhile the report leaves it out with a warning
    and a metrics line cut short is skipped, not a JSONDecodeError."""
    f = write(tmp_path, NANO_BASE.format(data=data_dir) + '[grid]\n"train.seed" = [0, 1]\n')
    out = tmp_path / "out"
    run_sweep(load_sweep(f, out), log=lambda _: None)
    from lordo.experiments.report import write_report

    (out / "seed-0" / "summary.json").write_text("")
    with (out / "seed-1" / "metrics.jsonl").open("a") as m:
        m.write('{"step": 3, "val_lo')
    with pytest.warns(RuntimeWarning) as caught:
        report = write_report(out).read_text()
    messages = [str(w.message) for w in caught]
    assert any("seed-0/summary.json is empty or damaged" in m for m in messages)
    assert any("metrics.jsonl: 1 damaged line(s) left out" in m for m in messages)
    assert "1 runs;" in report  # seed 1 only
    logged = []
    index = run_sweep(load_sweep(f, out), log=logged.append)
    assert any("seed-0: summary.json is damaged; running the point again" in line for line in logged)
    assert [p["status"] for p in index["points"]] == ["done", "done"]
    assert json.loads((out / "seed-0" / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_sweep_its_running_point_saves_and_no_other_starts(tmp_path, data_dir, signum):
    """Ctrl-C (or SIGTERM) to `lordo sweep`: the running point saves its checkpoint and stops, the sweep exits
    128 + the signal without starting the next points, and says how to continue."""
    text = NANO_BASE.format(data=data_dir).replace("steps = 3", "steps = 2000\nlog_every = 1")
    f = write(tmp_path, text + '[grid]\n"train.seed" = [0, 1, 2]\n')
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "lordo.cli", "sweep", str(f), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "seed-0" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) > 3):
        time.sleep(0.2)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    assert "stopped by" in stderr and "continue with the same command" in stderr
    statuses = [p["status"] for p in json.loads((out / "sweep.json").read_text())["points"]]
    assert statuses == ["stopped", "pending", "pending"]
    assert any((out / "seed-0" / "checkpoints").iterdir())
    assert not (out / "seed-1").exists() and not (out / "seed-2").exists()


def test_plot_styles_give_each_strategy_a_colour_and_each_of_its_points_a_look_of_its_own():
    """15 series (the long-stagnation sweep's size) with matplotlib's 10-colour cycle repeat colours across
    strategies; the report's styles colour by strategy and tell a strategy's points apart by line and marker."""
    pytest.importorskip("matplotlib")
    from lordo.experiments.plots import styles

    strategies = ["ddp"] * 3 + ["local-adam"] * 3 + ["lordo-global-noqh"] * 2 + ["lordo-local"] * 2 + ["lordo"] * 3 \
        + ["lowrank-ddp"] * 2
    labels = [f"{s} {i}" for i, s in enumerate(strategies)]
    got = styles(labels, strategies)
    looks = {(tuple(v["color"]), v["ls"], v["marker"]) for v in got.values()}
    assert len(looks) == len(labels)  # no two series alike
    by_strategy: dict = {}
    for label, s in zip(labels, strategies):
        by_strategy.setdefault(s, set()).add(tuple(got[label]["color"]))
    assert all(len(c) == 1 for c in by_strategy.values())  # one colour per strategy
    assert len({next(iter(c)) for c in by_strategy.values()}) == len(by_strategy)  # a different one each


def test_report_gives_each_configuration_at_its_best_rate(tmp_path):
    """Hand-made runs: lordo at three rates (two seeds at the middle one), ddp at two; the table picks the rate
    of lowest mean perplexity, divides by the best ddp point's, and says when the best is at the grid's edge."""
    from lordo.experiments.report import write_report

    ppl = {("ddp", 0.003): [30.0, 32.0], ("ddp", 0.006): [35.0], ("lordo", 0.0015): [50.0],
           ("lordo", 0.003): [36.0, 38.0], ("lordo", 0.006): [38.5], ("local-adam", 0.003): [40.0],
           ("local-adam", 0.006): [44.0]}
    wire = {"ddp": 20000, "lordo": 1000, "local-adam": 500}
    state = {"ddp": 8000, "lordo": 4000, "local-adam": 12000}
    points = []
    for (name, lr), values in ppl.items():
        for seed, value in enumerate(values):
            folder = tmp_path / f"name-{name}__lr-{lr}__seed-{seed}"
            folder.mkdir()
            summary = {"val_ppl": value, "val_loss": 3.6, "steps": 10, "comm_bytes_per_step": 1.0, "params": 1000,
                       "strategy": name,
                       "comm_wire_bytes_total": wire[name], "ddp_comm_wire_bytes": 20000, "comm_bytes_total": 1,
                       "optimizer_state_bytes": {"moments": state[name]}}
            (folder / "summary.json").write_text(json.dumps(summary))
            points.append({"name": folder.name, "dir": str(folder), "status": "done",
                           "values": {"strategy.name": name, "optim.lr": lr, "train.seed": seed}})
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    table = write_report(tmp_path).read_text().split("## Each configuration at its best learning rate")[1]
    rows = [line for line in table.splitlines() if line.startswith("| name=")]
    assert rows[:3] == [
        "| name=ddp | 0.003 (0.003, 0.006; lowest tried) | 2 | 31.00 ± 1.41 | 1.000 | 1.0000 | 1.00 |",
        "| name=lordo | 0.003 (0.0015, 0.003, 0.006) | 2 | 37.00 ± 1.41 | 1.194 | 0.0500 | 0.50 |",
        "| name=local-adam | 0.003 (0.003, 0.006; lowest tried) | 1 | 40.00 | 1.290 | 0.0250 | 1.50 |",
    ]
    assert "| configuration | lr 0.0015 | lr 0.003 | lr 0.006 |" in table  # then every rate of every configuration
    assert rows[3:] == ["| name=ddp | – | 31.00 | 35.00 |", "| name=lordo | 50.00 | 37.00 | 38.50 |",
                        "| name=local-adam | – | 40.00 | 44.00 |"]


def test_report_without_rates_to_choose_from_has_no_best_rate_table(tmp_path):
    from lordo.experiments.report import write_report

    for name in ("ddp", "lordo"):
        folder = tmp_path / name
        folder.mkdir()
        summary = {"val_ppl": 40.0, "val_loss": 3.7, "steps": 10, "comm_bytes_per_step": 1.0, "params": 1000,
                   "comm_wire_bytes_total": 1000, "ddp_comm_wire_bytes": 20000, "comm_bytes_total": 1,
                   "optimizer_state_bytes": {"moments": 800}}
        (folder / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "sweep.json").write_text(json.dumps({"points": [
        {"name": n, "dir": str(tmp_path / n), "status": "done", "values": {"strategy.name": n}} for n in ("ddp", "lordo")]}))
    assert "best learning rate" not in write_report(tmp_path).read_text()


def _hand_made_run(root, name, values, ppl, config):
    folder = root / name
    folder.mkdir(parents=True)
    summary = {"val_ppl": ppl, "val_loss": 3.6, "steps": 10, "comm_bytes_per_step": 1.0, "params": 1000,
               "strategy": config["strategy"]["name"],
               "comm_wire_bytes_total": 20000 if config["strategy"]["name"] == "ddp" else 1000,
               "ddp_comm_wire_bytes": 20000, "comm_bytes_total": 1, "optimizer_state_bytes": {"moments": 8000}}
    (folder / "summary.json").write_text(json.dumps(summary))
    (folder / "config.json").write_text(json.dumps(config))
    return {"name": name, "dir": str(folder), "status": "done", "values": values}


def test_a_pooled_report_names_each_configuration_with_its_folder(tmp_path):
    """Two folders: one sweeps lordo's rate, the other runs ddp and lordo with Muon inside (set in its base, so not
    among its swept values). Pooled, each configuration is named with its folder and what that folder varied (the
    strategy where it varied nothing but the rate), and divided by the best ddp point of all; a folder whose runs
    trained another model is refused, naming the setting, and so is a run without a config.json."""
    from lordo.errors import LordoError
    from lordo.experiments.report import write_pooled

    def config(name, lr, inner="auto", d_model=128):
        return {"model": {"d_model": d_model}, "train": {"steps": 10, "precision": "fp32"},
                "strategy": {"name": name}, "optim": {"lr": lr, "inner": inner}}

    rates = tmp_path / "rates"
    points = [_hand_made_run(rates, f"lr-{lr}", {"optim.lr": lr}, ppl, config("lordo", lr))
              for lr, ppl in ((0.001, 50.0), (0.003, 44.0))]
    (rates / "sweep.json").write_text(json.dumps({"points": points}))
    muon = tmp_path / "muon"
    points = [_hand_made_run(muon, f"name-{n}", {"strategy.name": n}, ppl, config(n, 0.01, "muon"))
              for n, ppl in (("ddp", 40.0), ("lordo", 46.0))]
    (muon / "sweep.json").write_text(json.dumps({"points": points}))
    text = write_pooled([rates, muon], tmp_path / "pooled.md").read_text()
    best = text.split("best learning rate")[1].split("Mean validation perplexity")[0]
    rows = [line for line in best.splitlines() if line.startswith(("| muon", "| rates"))]
    assert rows == [
        "| muon: name=ddp | 0.01 (0.01) | 1 | 40.00 | 1.000 | 1.0000 | 1.00 |",
        "| rates: name=lordo | 0.003 (0.001, 0.003; highest tried) | 1 | 44.00 | 1.100 | 0.0500 | 1.00 |",
        "| muon: name=lordo | 0.01 (0.01) | 1 | 46.00 | 1.150 | 0.0500 | 1.00 |",
    ]
    assert "| rates: lr=0.001 | 1 | 50.00 | 1.250 |" in text  # the points' table names the folder too
    other = tmp_path / "wide"
    points = [_hand_made_run(other, "name-ddp", {"strategy.name": "ddp"}, 30.0, config("ddp", 0.003, d_model=256))]
    (other / "sweep.json").write_text(json.dumps({"points": points}))
    with pytest.raises(LordoError, match=r"the runs differ in model.d_model \(128: rates/lr-0.001 and 3 more; 256: wide/name-ddp\)"):
        write_pooled([rates, muon, other], tmp_path / "refused.md")
    assert not (tmp_path / "refused.md").exists()
    (muon / "name-lordo" / "config.json").unlink()
    with pytest.raises(LordoError, match="muon/name-lordo has no readable config.json: its settings cannot be compared"):
        write_pooled([rates, muon], tmp_path / "refused.md")


def test_report_of_several_folders_needs_a_file_to_write(tmp_path, capsys):
    from lordo.cli import main

    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "name the file of their pooled report with --out FILE.md" in capsys.readouterr().err


def test_sweep_status_reads_where_each_point_stands_without_running_anything(tmp_path, capsys):
    """Five points made by hand: finished, held by a live run (this process holds its lock), failed, stopped with
    a checkpoint, not begun. --status names each state and the step, and writes nothing into the folders."""
    from lordo.cli import main
    from lordo.train.lock import OutputLock

    f = write(tmp_path, '[sweep]\nname = "st"\n[base.train]\nsteps = 40\n[grid]\n"train.seed" = [0, 1, 2, 3, 4]\n')
    out = tmp_path / "out"
    folders = [out / f"seed-{s}" for s in range(5)]
    for folder in folders[:4]:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"train": {"steps": 40}}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train_s": 6.0 * s}) + "\n" for s in (10, 20, 30)))
    (folders[0] / "summary.json").write_text(json.dumps({"val_ppl": 41.234, "train_s": 3600.0}))
    (folders[2] / "failed.json").write_text(json.dumps({"returncode": 3, "stderr": "boom"}))
    (folders[3] / "checkpoints" / "step-00000020").mkdir(parents=True)
    (folders[3] / "checkpoints" / "step-00000030.partial").mkdir()  # a save cut short is not a checkpoint
    before = sorted(str(p) for p in out.rglob("*"))
    with OutputLock(folders[1]):
        assert main(["sweep", str(f), "--out", str(out), "--status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["[1/5]", "done", "seed-0", "val", "ppl", "41.23"]
    assert lines[1].split()[:11] == ["[2/5]", "running", "seed-1", "step", "30", "of", "40,", "about", "1", "min", "left"]
    assert lines[2].split() == ["[3/5]", "failed", "seed-2", "exit", "3", "(failed.json)"]
    assert " ".join(lines[3].split()) == "[4/5] stopped seed-3 step 30 of 40; resumes from its checkpoint at step 20"
    assert lines[4].split() == ["[5/5]", "queued", "seed-4"]
    # left: the finished point took an hour; seed-1 and seed-3 logged 30 of 40 steps (a quarter left each), seed-4
    # has not begun (all of it), the failed one is not counted: 0.25 + 0.25 + 1 = 1.5 hours
    assert lines[5] == (f"sweep st ({out}): 1 done, 1 running, 1 stopped, 1 failed, 1 queued; about 1.5 hours of "
                        "training left, one point at a time, at the mean pace of its finished points")
    assert sorted(str(p) for p in out.rglob("*")) == sorted([*before, str(folders[1] / ".lock")])  # the lock held here
    # the run ended (its lock file stays, nobody holds it): stopped, resuming from the start (no checkpoint)
    assert main(["sweep", str(f), "--out", str(out), "--status"]) == 0
    assert " ".join(capsys.readouterr().out.splitlines()[1].split()) == "[2/5] stopped seed-1 step 30 of 40; resumes from the start"


def test_report_pairs_every_point_with_a_reference_seed_by_seed(tmp_path):
    """Two settings on seeds 0 and 1 (a third only on seed 0): each seed's perplexity against the reference's on
    that seed, by hand: 40.4 / 40 − 1 = +1.00 %, 49.5 / 50 − 1 = −1.00 %; a point missing a seed shows a dash."""
    from lordo.errors import LordoError
    from lordo.experiments.report import write_report

    ppl = {("float32", 0): 40.0, ("float32", 1): 50.0, ("int8", 0): 40.4, ("int8", 1): 49.5, ("int4", 0): 42.0}
    points = []
    for (dtype, seed), value in ppl.items():
        folder = tmp_path / f"dtype-{dtype}__seed-{seed}"
        folder.mkdir()
        (folder / "summary.json").write_text(json.dumps({
            "val_ppl": value, "val_loss": 3.7, "steps": 10, "comm_bytes_per_step": 1.0, "params": 1000,
            "comm_wire_bytes_total": 1000, "ddp_comm_wire_bytes": 20000, "comm_bytes_total": 1,
            "optimizer_state_bytes": {"moments": 800}}))
        points.append({"name": folder.name, "dir": str(folder), "status": "done",
                       "values": {"strategy.error_feedback_dtype": dtype, "train.seed": seed}})
    (tmp_path / "sweep.json").write_text(json.dumps({"points": points}))
    text = write_report(tmp_path, paired="error_feedback_dtype=float32").read_text()
    rows = text.split("## Paired against error_feedback_dtype=float32")[1].splitlines()
    assert "| error_feedback_dtype=float32 (reference) | 40.00 | 50.00 | – |" in rows
    assert "| error_feedback_dtype=int8 | 40.40 (+1.00 %) | 49.50 (-1.00 %) | +1.00 % |" in rows
    assert "| error_feedback_dtype=int4 | 42.00 (+5.00 %) | – | +5.00 % |" in rows
    assert "--paired 'error_feedback_dtype=float32'" in text  # the command that regenerates it
    with pytest.raises(LordoError, match="--paired 'float32' is not a point of this report; its points are: "
                                         "error_feedback_dtype=float32; error_feedback_dtype=int4; error_feedback_dtype=int8"):
        write_report(tmp_path, paired="float32")


def test_a_reader_that_goes_away_ends_the_listing_quietly(tmp_path):
    """`lordo sweep FILE --dry-run | head -1`: the listing (beyond a pipe's buffer) stops without a traceback."""
    seeds = ", ".join(str(s) for s in range(3000))
    f = write(tmp_path, f'[sweep]\nname = "long"\n[grid]\n"train.seed" = [{seeds}]\n')
    proc = subprocess.Popen([sys.executable, "-m", "lordo.cli", "sweep", str(f), "--out", str(tmp_path / "o"), "--dry-run"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().endswith(b'train.seed=0\n')
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in err and b"Error" not in err, err.decode()[-2000:]


def test_a_point_killed_by_sigterm_before_it_could_save_is_stopped_not_failed(tmp_path, data_dir):
    """A point's process killed by SIGTERM while it starts (its handler not yet installed: exit -15, as when a user
    or the system stops it) left failed.json beside the finished points; it is stopped, to be resumed."""
    text = NANO_BASE.format(data=data_dir).replace("steps = 3", "steps = 2000")
    f = write(tmp_path, text + '[grid]\n"train.seed" = [0, 1]\n')
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "lordo.cli", "sweep", str(f), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    marker, child, deadline = str(out / "seed-0"), None, time.monotonic() + 60
    while child is None and time.monotonic() < deadline:
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline and "train" in cmdline:
                child = int(pid)
                break
    assert child is not None, "the point's process never started"
    os.kill(child, signal.SIGTERM)  # at once: before its own handler is installed
    stdout, stderr = proc.communicate(timeout=120)
    status = json.loads((out / "sweep.json").read_text())["points"][0]["status"]
    assert status == "stopped" and not (out / "seed-0" / "failed.json").exists(), stderr


def test_report_and_plot_give_a_strategy_the_same_colour_whatever_the_order():
    """lordo plot coloured by order of appearance and lordo report by its own order, so one strategy had opposite
    colours in the two; both now take the strategy's fixed colour."""
    pytest.importorskip("matplotlib")
    from lordo.experiments.plots import strategy_colour, styles

    one = styles(["x", "y"], ["lordo", "ddp"])
    other = styles(["y", "x"], ["ddp", "lordo"])
    assert one["x"]["color"] == other["x"]["color"] == strategy_colour("lordo")
    assert one["y"]["color"] == other["y"]["color"] == strategy_colour("ddp") != strategy_colour("lordo")


def test_a_bytes_axis_is_labelled_in_binary_units_at_its_powers_of_ten_only():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lordo.experiments.plots import bytes_axis

    fig, ax = plt.subplots()
    ax.plot([2e5, 3e9], [1, 2])
    bytes_axis(ax)
    fig.canvas.draw()
    major = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    minor = [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
    plt.close(fig)
    assert minor == [] and "95.4 MiB" in major and "9.31 GiB" in major and not any(m.endswith(" B") and
                                                                                     float(m[:-2]) > 1e3 for m in major)
