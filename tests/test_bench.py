"""The benchmarks run (tiny sizes, a couple of rounds) and write what they print; their numbers are not
checked here: speed targets live in the benchmarks' own output (docs/performance.md), never in tests."""

import json

import pytest

from lordo.cli import main


def test_step_and_basis_benchmarks_run_and_write_json(tmp_path, data_dir, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--preset", "nano", "--rank", "4", "--rounds", "4", "--compiled", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    names = {r["name"] for r in res["rows"]}
    assert {"AdamW foreach", "lordo (LowRankQHAdam)", "lordo, compiled", "2 rank-r GEMMs per matrix alone (floor)"} <= names
    assert {f"{form}, NS {dtype}" for form in ("lordo, Muon form (LowRankMuon)", "torch Muon + AdamW (MuonAdamW)")
            for dtype in ("bfloat16", "float32")} <= names
    assert all(r["median_ms"] > 0 and r["samples"] == 4 for r in res["rows"])
    assert "| optimizer" in capsys.readouterr().out
    out = tmp_path / "basis.json"
    assert main(["bench", "basis", "--preset", "nano", "--rank", "4", "--steps", "4", "--rounds", "2",
                 "--data-dir", str(data_dir), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["energy_exact"]) == len(res["energy_subspace"]) > 0
    # the exact top-r basis captures the most energy any rank-r basis can
    assert all(e >= a - 1e-6 for e, a in zip(res["energy_exact"], res["energy_subspace"]))


def test_the_gpu_script_is_valid_shell_and_its_commands_parse():
    """benchmarks/gpu.sh runs only where a GPU is; here: its shell syntax, every ``lordo bench`` line against
    the parser, and every ``--set`` against the configuration."""
    import shlex
    import subprocess
    from pathlib import Path

    from lordo.bench import make_parser
    from lordo.config import build_config

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    text = script.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith("lordo bench")]
    assert len(lines) == 6
    for line in lines:
        argv = shlex.split(line)[2:]
        args = make_parser().parse_args(argv)
        assert args.json and "cuda" in args.json
        assert getattr(args, "device", "cuda") == "cuda" or any("cuda" in s for s in args.set)
        if getattr(args, "set", None):
            build_config(overrides=args.set)


def test_a_bad_device_is_refused_by_name(capsys):
    for bad in ("gpu", "mps"):
        assert main(["bench", "step", "--preset", "nano", "--device", bad]) != 0
        assert f"--device must be cpu, cuda or cuda:N, got {bad!r}" in capsys.readouterr().err


def test_the_memory_benchmark_prints_unless_asked_to_write_and_measures_what_it_accounts(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "memory", "--shapes", "nano", "--no-peers", "--rows", "=lordo"]) == 0
    assert list(tmp_path.iterdir()) == []  # printed only: nothing written into the working directory
    assert "| nano  | lordo " in capsys.readouterr().out
    assert main(["bench", "memory", "--shapes", "nano", "--no-peers", "--json", "mine.json"]) == 0
    rows = json.loads((tmp_path / "mine.json").read_text())["rows"]
    plain = next(r for r in rows if r["name"] == "lordo")
    assert plain["shape"] == "nano" and plain["device_bytes"] == plain["measured_bytes"] > 0
    for r in rows:  # the accounting from shapes agrees with the tensors (step counters aside)
        assert r["accounted_bytes"] == pytest.approx(r["measured_bytes"], rel=0.02), r["name"]
    lean = next(r for r in rows if r["name"].startswith("lordo --lean (int8"))
    assert lean["measured_bytes"] < 0.6 * plain["measured_bytes"]
    names = {r["name"] for r in rows}  # r = 64 is wider than nano's 32-wide matrices: left out, not an error
    assert "lordo, LoRDO's Muon form" in names and "lordo, LoRDO's Muon form, r = 64" not in names


def test_the_memory_benchmark_measures_the_rows_asked_for_and_names_them_all_when_none_matches(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "memory", "--shapes", "d64x1", "--no-peers", "--rows", "int4 anchor", "lordo --lean (int8",
                 "--json", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"lordo --lean (int8 anchor, E, full-rank and low-rank moments)", "lordo --lean, int4 anchor",
                         "lordo, lean with int4 E and int4 anchor"}
    int8, int4 = (rows[n]["by_category"]["anchor"] for n in ("lordo --lean (int8 anchor, E, full-rank and low-rank moments)",
                                                            "lordo --lean, int4 anchor"))
    assert int4 < 0.7 * int8  # 0.56 bytes an element against 1.02 for the matrices; small tensors stay float32
    assert main(["bench", "memory", "--shapes", "d64x1", "--no-peers", "--rows", "=lordo", "--json", str(out)]) == 0
    assert [r["name"] for r in json.loads(out.read_text())["rows"]] == ["lordo"]  # '=': that name alone
    assert main(["bench", "memory", "--shapes", "d64x1", "--no-peers", "--workers", "4", "--rows",
                 "=lordo --lean, int4 rounds, sync_delay 1", "--json", str(out)]) == 0
    at4 = json.loads(out.read_text())
    assert at4["workers"] == 4 and at4["rows"][0]["peak_bytes"] >= at4["rows"][0]["measured_bytes"] > 0
    capsys.readouterr()
    assert main(["bench", "memory", "--shapes", "d64x1", "--no-peers", "--rows", "no such row"]) != 0
    err = capsys.readouterr().err
    assert "--rows 'no such row' matches no row" in err and "lordo --lean, int4 anchor" in err
    assert main(["bench", "memory", "--shapes", "d64x1", "--no-peers", "--workers", "1"]) != 0
    assert "--workers must be >= 2" in capsys.readouterr().err


def test_host_overhead_benchmark_compares_source_trees(tmp_path):
    """benchmarks/host_overhead.py times each tree in its own process and prints their ratio to the first."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "host_overhead.py"), str(root / "src"), str(root / "src"),
                           "--repeats", "1"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(f"| {root / 'src'} |")]
    assert len(rows) == 2 and rows[0].endswith("| 1.00 |")
    assert float(rows[1].split("|")[2]) > 0


def test_the_frontier_groups_seeds_and_leaves_the_one_time_bytes_out(tmp_path, capsys):
    """benchmarks/frontier.py: runs that differ only in the seed are one point; bytes per step without the
    initial broadcast and the initial basis's gradient, against ddp's without its broadcast (hand-set values)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "frontier.py"
    spec = importlib.util.spec_from_file_location("frontier", path)
    frontier = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(frontier)
    table = {"broadcast:init": {"calls": 1, "bytes": 100, "wire": 150},
             "all_reduce:initial_basis_gradient": {"calls": 1, "bytes": 40, "wire": 50},
             "all_gather:pseudo_gradient_basis": {"calls": 3, "bytes": 600, "wire": 800}}
    for seed, ppl in ((0, 40.0), (1, 42.0)):
        run = tmp_path / "sweep" / f"seed-{seed}"
        run.mkdir(parents=True)
        config = {"strategy": {"name": "lordo", "compress": "basis", "compress_density": 0.125},
                  "optim": {"lr": 0.003}, "train": {"seed": seed}}
        (run / "config.json").write_text(json.dumps(config))
        (run / "summary.json").write_text(json.dumps({
            "steps": 10, "workers": 4, "val_ppl": ppl, "comm_by_collective": table,
            "comm_wire_bytes_total": 1000, "ddp_comm_wire_bytes": 10150}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"strategy": {"name": "ddp"}, "optim": {"lr": 0.006}, "train": {"seed": 0}}))
    (other / "summary.json").write_text("{}")
    research = tmp_path / "sweep" / "research"  # the research code's step: a point of its own, not a third seed
    research.mkdir()
    (research / "config.json").write_text(json.dumps({"strategy": {"name": "lordo", "compress": "basis", "compress_density": 0.125,
                                                                   "lowrank_term": "momentum"},
                                                      "optim": {"lr": 0.003}, "train": {"seed": 0}}))
    (research / "summary.json").write_text(json.dumps({"steps": 10, "workers": 4, "val_ppl": 50.0, "comm_by_collective": table,
                                                       "comm_wire_bytes_total": 1000, "ddp_comm_wire_bytes": 10150}))
    rows = frontier.points([str(tmp_path / "sweep"), str(other)], ["optim.lr=0.003"])
    research_row = next(r for r in rows if r["point"].endswith("lowrank_term=momentum"))
    assert research_row["val_ppl"] == [50.0] and len(rows) == 2
    rows = [r for r in rows if r is not research_row]
    row = rows[0]
    assert row["point"] == "lordo, lr=0.003, compress=basis, compress_density=0.125"
    assert row["seeds"] == [0, 1] and row["val_ppl"] == [40.0, 42.0] and row["mean"] == 41.0
    assert abs(row["std"] - 2 ** 0.5) < 1e-12
    assert row["steady"] == 80 and row["whole"] == 100  # (1000 - 150 - 50) / 10 and 1000 / 10
    assert row["x_ddp_steady"] == 12.5 and row["x_ddp_whole"] == 10.15  # (10150 - 150) / 10 / 80, 10150 / 1000
    frontier.main([str(tmp_path / "sweep"), "--only", "strategy.name=lordo", "--json", str(tmp_path / "rows.json")])
    assert "| lordo, lr=0.003, compress=basis, compress_density=0.125 | 40.00 / 42.00 | 41.00 ± 1.41 | 80 (100) | 12.5 (10.2) |" \
        in capsys.readouterr().out
    assert json.loads((tmp_path / "rows.json").read_text())[0]["steady"] == 80
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty: no summary.json"):  # named even after a folder that has runs
        frontier.points([str(tmp_path / "sweep"), str(tmp_path / "empty")], [])


def test_versus_reads_auto_as_what_it_resolves_to_and_counts_a_copied_run_once(tmp_path, capsys):
    """benchmarks/versus.py: lordo with basis_method auto and subspace is one series (auto resolves to subspace
    for lordo, to svd for lordo-local); a seed found in two folders with the same result counts once, with a
    different result it is an error; the gap is against the first series at the same x (hand-set values)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("versus", bench / "versus.py")
        versus = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(versus)
    finally:
        sys.path.remove(str(bench))

    def run(folder: str, name: str, method: str, rank: int, seed: int, ppl: float) -> None:
        path = tmp_path / folder / f"{name}-{method}-{rank}-{seed}"
        path.mkdir(parents=True)
        config = {"strategy": {"name": name, "basis_method": method, "rank": rank}, "train": {"seed": seed}}
        (path / "config.json").write_text(json.dumps(config))
        (path / "summary.json").write_text(json.dumps({"val_ppl": ppl}))

    run("a", "lordo", "subspace", 4, 0, 40.0)
    run("b", "lordo", "auto", 4, 1, 42.0)
    run("b", "lordo", "subspace", 4, 0, 40.0)  # the same run, in a second table
    run("a", "lordo-local", "auto", 4, 0, 44.1)
    run("a", "lordo-local", "svd", 4, 1, 43.9)
    run("a", "lordo-local", "subspace", 8, 0, 39.0)
    found = versus.collect([str(tmp_path / "a"), str(tmp_path / "b")], "strategy.rank",
                           ["strategy.name", "strategy.basis_method"], [])
    assert found == {"lordo, subspace": {4: {0: 40.0, 1: 42.0}}, "lordo-local, svd": {4: {0: 44.1, 1: 43.9}},
                     "lordo-local, subspace": {8: {0: 39.0}}}
    rows = versus.rows(found)
    assert [r["x"] for r in rows] == [4, 8]
    assert rows[0]["points"]["lordo, subspace"]["mean"] == 41.0
    assert abs(rows[0]["gap_percent"]["lordo-local, svd"] - 100 * (44.0 / 41.0 - 1)) < 1e-9
    assert rows[1]["points"]["lordo, subspace"] is None and rows[1]["gap_percent"]["lordo-local, subspace"] is None
    versus.main([str(tmp_path / "a"), str(tmp_path / "b"), "--x", "strategy.rank", "--series", "strategy.name",
                 "--only", "strategy.name=lordo"])
    assert "| 4 | 40.00 / 42.00 (41.00 ± 1.41) |" in capsys.readouterr().out
    run("c", "lordo", "subspace", 4, 0, 40.5)
    with pytest.raises(SystemExit, match="seed 0 twice with different results"):
        versus.collect([str(tmp_path / "a"), str(tmp_path / "c")], "strategy.rank", ["strategy.name"], [])


def test_the_gpu_table_script_takes_the_cpu_tables_picks_and_setting(tmp_path, data_dir):
    """benchmarks/scale_16m.py --smoke (the nano model on the CPU), against the real sweep file and a results folder
    holding only the table's finished ddp runs: a configuration that the results hold (ddp) takes the rate the
    README's table takes (its best) without probing, one they do not hold and the file lists at two rates
    (lordo-local) is probed at three rates, and the main runs take the table's setting (bfloat16 autocast) so that
    they compare with the CPU table's. The table's own progress does not change what this test sees."""
    import shutil
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    from lordo.config import tomllib
    from lordo.experiments.runs import read_runs

    root = Path(__file__).resolve().parents[1]
    table = tomllib.loads((root / "sweeps" / "scale-16m.toml").read_text())
    assert len({c["optim.lr"] for c in table["case"] if c["strategy.name"] == "lordo-local"}) == 2
    results = tmp_path / "cpu-runs"
    ddp_runs = [r for r in read_runs(root / "results" / "scale-16m")
                if r["values"]["strategy.name"] == "ddp" and r["values"]["optim.inner"] == "auto"]
    for r in ddp_runs:
        shutil.copytree(root / "results" / "scale-16m" / r["name"], results / r["name"])
    (results / "sweep.json").write_text(json.dumps({"points": [{"dir": r["name"], "values": r["values"]}
                                                               for r in ddp_runs]}))
    assert len(ddp_runs) >= 2
    # the table's rule: the lowest mean over the seeds that every rate ran
    by_rate: dict[float, dict[int, float]] = {}
    for r in ddp_runs:
        by_rate.setdefault(r["values"]["optim.lr"], {})[r["values"]["train.seed"]] = r["summary"]["val_ppl"]
    common = set.intersection(*(set(seeds) for seeds in by_rate.values()))
    ddp_rate = min(by_rate, key=lambda lr: sum(by_rate[lr][s] for s in common) / len(common))
    env = {**__import__("os").environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "benchmarks/scale_16m.py", str(out), "--smoke", "--configs",
                           "ddp,lordo-local", "--deadline-s", "400", "--jobs", "2", "--main-jobs", "2",
                           "--results", str(results)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["picked_on_cpu"] == ["ddp"] and plan["picked"]["ddp"] == ddp_rate
    assert len(plan["probe_losses"]["lordo-local"]) == 3 and not plan["probe_losses"]["ddp"]
    with tarfile.open(out / "scale-16m.tar.gz") as tar:
        names = tar.getnames()
        config = json.load(tar.extractfile("main/ddp__seed-1/config.json"))
    assert {"main/ddp__seed-0/summary.json", "main/lordo-local__seed-1/summary.json"} <= set(names)
    assert config["train"]["precision"] == table["base"]["train"]["precision"] and config["optim"]["lr"] == ddp_rate


def test_the_gpu_table_script_names_a_bad_configuration(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "benchmarks/scale_16m.py", str(tmp_path), "--configs", "ddp,lordo-globl"],
                          cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--configs: unknown configuration(s) lordo-globl; allowed: ddp," in done.stderr


@pytest.mark.slow  # each setting is a `lordo train` child process
def test_the_throughput_benchmark_runs_the_settings_asked_for_against_fp32(tmp_path, data_dir):
    out = tmp_path / "throughput.json"
    assert main(["bench", "throughput", "--preset", "nano", "--steps", "12", "--warmup", "2", "--threads", "1",
                 "--repeats", "1", "--settings", "fp32,lean", "--data-dir", str(data_dir), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["fp32, 1 thread", "fp32, lean state, 1 thread"]
    assert rows[0]["ratio"] == 1.0 and all(r["tokens_per_s"] > 0 for r in rows)
    for bad in ("lean", "fp32,fp16"):  # the reference missing; a setting that does not exist
        assert main(["bench", "throughput", "--preset", "nano", "--settings", bad]) == 2
    from lordo.bench.throughput import SETTINGS
    from lordo.config import build_config

    for key, _, overrides in SETTINGS:  # every setting is a valid configuration of lordo (the one not run above too)
        assert build_config(overrides=['strategy.name="lordo"', *overrides]).train.precision in ("fp32", "bf16-mixed"), key


def test_the_merge_screen_changes_only_the_landing(tmp_path, data_dir, monkeypatch):
    """benchmarks/overlap_merges.py (docs/results.md section 10): ``keep`` leaves lordo's landing as it is (the
    same losses as an unpatched run), every other merge changes what the steps after a landing see, and
    ``--stop-at`` ends the run after that step."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_merges.py"
    spec = importlib.util.spec_from_file_location("overlap_merges", path)
    screen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screen)
    # rounds sent at steps 4 and 8 land at 6 and 10; the run stops after step 10 of 12
    tiny = ["--model", "nano", "--steps", "12", "--sync-every", "4", "--set", "strategy.sync_delay=2", "--set",
            "train.eval_every=100", "--set", "schedule.warmup_steps=2", "--set", "train.batch_size=2",
            "--data-dir", str(data_dir)]

    def losses(out: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}

    assert main(["train", *screen.SETTING, "--out", str(tmp_path / "plain"), *tiny]) == 0
    plain = losses(tmp_path / "plain")
    assert max(plain) == 12
    seen = {}
    for merge in screen.MERGES:
        with monkeypatch.context() as m:
            for name in ("send", "apply_round", "step"):  # put lordo's own back after this merge
                m.setattr(screen.Strategy, name, getattr(screen.Strategy, name))
            m.setattr(sys, "argv", ["overlap_merges.py", "--merge", merge, "--out", str(tmp_path / merge),
                                    "--stop-at", "10", *tiny])
            assert screen.main() == 0, merge
        seen[merge] = losses(tmp_path / merge)
        assert max(seen[merge]) == 10, merge
    assert seen["keep"] == {s: v for s, v in plain.items() if s <= 10}
    for merge in screen.MERGES[1:]:
        assert seen[merge][10] != seen["keep"][10], merge


def test_race_confirm_trains_over_a_link_until_the_target_beside_the_race_s_composition(tmp_path, data_dir):
    """benchmarks/race_confirm.py: a simulated sweep run's curve, then the same setting on 2 gloo workers in a
    throttled namespace stopped at the target. The gloo run's curve is the simulator's (the same steps to the
    target), the composition is a finite figure beside the measured one, and the namespace is gone afterwards."""
    import subprocess
    import sys

    from lordo import link

    if link.unavailable():
        pytest.skip(link.unavailable())
    base = tmp_path / "base.json"
    # 64 steps: the target (perplexity 1,500) falls between the evaluations at steps 16 and 32
    base.write_text(json.dumps({"model": {"preset": "nano"}, "train": {"steps": 64, "batch_size": 4, "eval_every": 16},
                                "schedule": {"warmup_steps": 4}, "strategy": {"sync_every": 8, "rank": 4},
                                "data": {"dir": str(data_dir)}, "dist": {"workers": 2, "backend": "sim"}}))
    assert main(["train", "--config", str(base), "--out", str(tmp_path / "sweep")]) == 0
    out = tmp_path / "confirm.json"
    done = subprocess.run([sys.executable, "benchmarks/race_confirm.py", "--config", str(base), "--runs",
                           str(tmp_path / "sweep"), "--rate", "100", "--target", "1500", "--timeout", "300",
                           "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["run_steps_to_target"] == pytest.approx(res["sweep_steps_to_target"], rel=1e-6)
    assert res["measured_s"] > 0 and res["composed_s"] > 0 and 0 < res["measured_vs_composed"] < 10
    assert max(step for step, _, _ in res["curve"]) < 64  # stopped at the target, before the run's end
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if n.startswith(link.PREFIX)]
