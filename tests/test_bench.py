"""The benchmarks run (tiny sizes, a couple of rounds) and write what they print; their numbers are not
checked here: speed targets live in the benchmarks' own output (docs/performance.md), never in tests."""

import json

from lordo.cli import main


def test_step_and_basis_benchmarks_run_and_write_json(tmp_path, data_dir, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--preset", "nano", "--rank", "4", "--rounds", "4", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    names = {r["name"] for r in res["rows"]}
    assert {"AdamW foreach", "lordo (LowRankQHAdam)", "2 rank-r GEMMs per matrix alone (floor)"} <= names
    assert all(r["median_ms"] > 0 and r["samples"] == 4 for r in res["rows"])
    assert "| optimizer" in capsys.readouterr().out
    out = tmp_path / "basis.json"
    assert main(["bench", "basis", "--preset", "nano", "--rank", "4", "--steps", "4", "--rounds", "2",
                 "--data-dir", str(data_dir), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["energy_exact"]) == len(res["energy_subspace"]) > 0
    # the exact top-r basis captures the most energy any rank-r basis can
    assert all(e >= a - 1e-6 for e, a in zip(res["energy_exact"], res["energy_subspace"]))
