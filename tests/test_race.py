"""``lordo bench race``: minutes to a target perplexity, composed from a link measurement's step times and sweep runs'
curves, against values computed here by hand."""

from __future__ import annotations

import json
import math

import pytest

from lordo.bench.race import race, steps_to
from lordo.cli import main


def write_run(root, name, values, curve, *, workers=4, steps=400, wire=0):
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "val_ppl": p}) + "\n" for s, p in curve))
    (folder / "summary.json").write_text(json.dumps({
        "val_ppl": curve[-1][1], "workers": workers, "steps": steps, "comm_calls": 10, "comm_wire_bytes_total": wire,
        "ddp_comm_wire_bytes": 1, "comm_by_collective": {}}))
    index = root / "sweep.json"
    points = json.loads(index.read_text())["points"] if index.exists() else []
    index.write_text(json.dumps({"points": [*points, {"dir": str(folder), "values": values}]}))


def link_file(path):
    path.write_text(json.dumps({"command": "lordo bench link ...", "latency_s": {"fast": 0.01}, "rows": [
        {"variant": "fast", "rate_mbit": None, "steady_s_per_step": 0.5},
        {"variant": "fast", "rate_mbit": 100.0, "steady_s_per_step": 0.6}]}))


@pytest.fixture
def race_file(tmp_path):
    runs = tmp_path / "runs"
    # "fast": perplexity 100 at step 100, 40 at step 200, 30 at step 300 (two seeds, the second one slower)
    write_run(runs, "fast-s0", {"name": "fast", "optim.lr": 0.003, "train.seed": 0}, [(0, 1000), (100, 100), (200, 40), (300, 30)])
    write_run(runs, "fast-s1", {"name": "fast", "optim.lr": 0.003, "train.seed": 1}, [(0, 1000), (100, 100), (200, 50), (400, 40)])
    # "slow": never below 60; no link row of its own: modelled from fast's compute time and its own bytes
    write_run(runs, "slow-s0", {"name": "slow", "optim.lr": 0.003, "train.seed": 0}, [(0, 1000), (200, 80), (400, 61)],
              wire=10**6 * 400 // 8)  # 10**6 bits per step per worker: 4·10**6 bits on the shared medium
    link_file(tmp_path / "link.json")
    spec = tmp_path / "race.toml"
    spec.write_text('[race]\nlink = "link.json"\ntargets = [60, 40]\nrates = [100]\n'
                    '[[config]]\nlabel = "fast"\nruns = ["runs"]\nwhere = { "name" = "fast" }\nvariant = "fast"\n'
                    '[[config]]\nlabel = "slow"\nruns = ["runs"]\nwhere = { "name" = "slow" }\ncompute_from = "fast"\n')
    return spec


def test_steps_to_a_target_interpolate_in_log_perplexity_between_evaluations():
    curve = [(0, 1000.0), (100, 100.0), (200, 40.0)]
    assert steps_to(curve, 100.0) == 100.0
    assert steps_to(curve, 63.2455532) == pytest.approx(150.0)  # sqrt(100·40): half way in log perplexity
    assert steps_to(curve, 39.0) is None


def test_the_race_composes_step_times_and_steps_to_each_target(race_file):
    res = race(race_file)
    fast, slow = res["rows"]
    assert fast["step_time"] == "measured" and fast["s_per_step"] == 0.6
    t60_s0 = 100 + 100 * math.log(100 / 60) / math.log(100 / 40)  # step at which seed 0 reaches 60
    t60_s1 = 100 + 100 * math.log(100 / 60) / math.log(100 / 50)
    assert fast["seeds"]["0"]["minutes"]["60"] == pytest.approx(t60_s0 * 0.6 / 60)
    assert fast["seeds"]["1"]["minutes"]["40"] == pytest.approx(400 * 0.6 / 60)
    assert fast["mean_minutes"]["60"] == pytest.approx((t60_s0 + t60_s1) / 2 * 0.6 / 60)
    # modelled: fast's unthrottled 0.5 s + 10 calls / 400 steps at no latency of its own + 4·10**6 bits at 100 Mbit/s
    assert slow["step_time"] == "modelled" and slow["s_per_step"] == pytest.approx(0.5 + 4e6 / 100e6)
    assert slow["mean_minutes"] == {"60": None, "40": None}  # never reached: said, not a number


def test_a_user_s_own_step_time_models_every_cell(race_file):
    res = race(race_file, rates=[1000.0], compute_s=0.1)
    assert {r["step_time"] for r in res["rows"]} == {"modelled"}
    fast = res["rows"][0]
    assert fast["s_per_step"] == pytest.approx(0.1 + 10 / 400 * 0.01)  # its link latency per call, no bytes recorded
    assert fast["seeds"]["1"]["minutes"]["40"] == pytest.approx(400 * fast["s_per_step"] / 60)


def test_the_race_command_prints_writes_and_says_what_is_missing(race_file, tmp_path, capsys):
    out = tmp_path / "race.json"
    assert main(["bench", "race", str(race_file), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "slow" in printed and "– / –" in printed and "measured" in printed and "modelled" in printed
    assert json.loads(out.read_text())["rows"][0]["label"] == "fast"
    race_file.write_text(race_file.read_text().replace('runs = ["runs"]\nwhere = { "name" = "slow" }',
                                                       'runs = ["gone"]\nwhere = { "name" = "slow" }'))
    assert main(["bench", "race", str(race_file)]) == 2
    err = capsys.readouterr().err
    assert "slow: results folder" in err and "gone does not exist (run its sweep)" in err
    assert main(["bench", "race", str(race_file), "--rates", "0"]) == 2
    assert "--rates lists rates in Mbit/s > 0" in capsys.readouterr().err
