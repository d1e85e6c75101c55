"""The benchmarks run (tiny sizes, a couple of rounds) and write what they print; their numbers are not
checked here: speed targets live in the benchmarks' own output (docs/performance.md), never in tests."""

import json

from lordo.cli import main


def test_step_and_basis_benchmarks_run_and_write_json(tmp_path, data_dir, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--preset", "nano", "--rank", "4", "--rounds", "4", "--compiled", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    names = {r["name"] for r in res["rows"]}
    assert {"AdamW foreach", "lordo (LowRankQHAdam)", "lordo, compiled", "2 rank-r GEMMs per matrix alone (floor)"} <= names
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
    assert len(lines) == 4
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


def test_the_memory_benchmark_keeps_the_committed_table_for_its_default_shapes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "memory", "--shapes", "nano"]) == 0
    written = list((tmp_path / "benchmarks" / "results").iterdir())
    assert [p.name for p in written] == ["memory-nano.json"]  # not memory.json, the default shapes' table
    rows = json.loads(written[0].read_text())["rows"]
    plain = next(r for r in rows if r["name"] == "lordo")
    assert plain["shape"] == "nano" and plain["device_bytes"] > 0


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
