"""One configuration of the race trained end to end over a real slow link, against the race's composition.

`lordo bench race` composes minutes to a target perplexity from two measurements: the steady-state seconds per step
over the throttled link (`lordo bench link`, about a hundred steps) and the steps the configuration's sweep run
needed (its curve, on the simulator). This trains the same configuration with M gloo workers in a network
namespace whose loopback holds the rate (lordo.link), until its validation perplexity reaches the target (then it
is stopped), and sets beside each other, on this machine and in this one run:

- ``measured_s``: the training seconds the run took to reach the target (interpolated between the evaluation that
  reached it and the one before, in log perplexity, as the race interpolates steps);
- ``composed_s``: the race's figure for it: the sweep run's steps to the target times this run's own steady-state
  seconds per step (between its first and its last synchronisation before the target);
- the run's own steps to the target against the sweep run's (does the simulator's curve carry over to gloo?).

Evaluations are outside the training seconds in both. A ratio within 15 % confirms the composition.

    python benchmarks/race_confirm.py --config results/long-stagnation/base.json --set 'strategy.name="lordo"' \\
        --set optim.lr=0.003 --runs results/long-stagnation/name-lordo__lr-0.003__seed-0 --rate 100 --target 60 \\
        --json benchmarks/results/race-confirm-lordo.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lordo.bench.race import steps_to
from lordo.bench.timing import machine
from lordo.link import ThrottledLink, end_process_group


def rows_of(metrics: Path) -> list[dict[str, Any]]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def curve(rows: list[dict[str, Any]], x: str) -> list[tuple[float, float]]:
    return [(float(r[x]), float(r["val_ppl"])) for r in rows if "val_ppl" in r and x in r]


def steady_s_per_step(rows: list[dict[str, Any]], before_step: float) -> float | None:
    """Seconds per step between the first and the last synchronisation before ``before_step``."""
    syncs = [r for r in rows if r.get("synced") and "train_s" in r and r["step"] <= before_step]
    if len(syncs) < 2 or syncs[-1]["step"] == syncs[0]["step"]:
        return None
    return (syncs[-1]["train_s"] - syncs[0]["train_s"]) / (syncs[-1]["step"] - syncs[0]["step"])


def train_until(argv: list[str], link: ThrottledLink, metrics: Path, target: float, timeout_s: float) -> list[dict[str, Any]]:
    """Run ``argv`` in the namespace until an evaluation reaches ``target`` (then SIGTERM: the workers save and
    stop), the run ends, or ``timeout_s`` passes; returns the metrics rows."""
    log = metrics.parent.parent / "train.log"  # its stderr, read only if it fails: a pipe left unread could fill
    with log.open("w") as err:
        proc = subprocess.Popen(link.command(argv), stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if any(r.get("val_ppl", float("inf")) <= target and r["step"] > 0 for r in rows_of(metrics)):
                break
            time.sleep(2.0)
        if proc.poll() is None:
            end_process_group(proc, grace_s=60.0)
    finally:
        link.end_processes()
    if proc.returncode not in (0, -15, 143) and not rows_of(metrics):
        raise SystemExit(f"the run failed (exit {proc.returncode}): {log.read_text()[-2000:]}")
    return rows_of(metrics)


def confirm(args: argparse.Namespace) -> dict[str, Any]:
    sweep_rows = rows_of(Path(args.runs) / "metrics.jsonl")
    sweep_steps = steps_to(curve(sweep_rows, "step"), args.target)  # type: ignore[arg-type]
    if sweep_steps is None:
        raise SystemExit(f"{args.runs} never reaches perplexity {args.target}")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = [sys.executable, "-m", "lordo.cli", "train", "--config", args.config, "--out", str(out),
                "--set", 'dist.backend="gloo"', "--set", "train.checkpoint_every=0",
                *[x for kv in args.set for x in ("--set", kv)]]
        t0 = time.monotonic()
        with ThrottledLink(args.rate) as link:
            rows = train_until(argv, link, out / "metrics.jsonl", args.target, args.timeout)
        wall = time.monotonic() - t0
    measured_s = steps_to(curve(rows, "train_s"), args.target)  # type: ignore[arg-type]
    own_steps = steps_to(curve(rows, "step"), args.target)  # type: ignore[arg-type]
    steady = steady_s_per_step(rows, own_steps if own_steps is not None else float("inf"))
    composed_s = None if steady is None else sweep_steps * steady
    return {"machine": machine(), "command": "python benchmarks/race_confirm.py " + " ".join(sys.argv[1:]),
            "rate_mbit": args.rate, "target_ppl": args.target, "sweep_run": args.runs,
            "sweep_steps_to_target": sweep_steps, "run_steps_to_target": own_steps,
            "steady_s_per_step": steady, "composed_s": composed_s, "measured_s": measured_s,
            "measured_vs_composed": measured_s / composed_s if measured_s and composed_s else None,
            "wall_s_with_start_and_evaluations": wall,
            "curve": [(r["step"], r.get("train_s"), r["val_ppl"]) for r in rows if "val_ppl" in r]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the sweep's base config (its base.json)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the sweep point's settings")
    p.add_argument("--runs", required=True, help="the sweep run whose curve the race uses (a folder with metrics.jsonl)")
    p.add_argument("--rate", type=float, default=100.0, help="the link's rate in Mbit/s (default 100)")
    p.add_argument("--target", type=float, default=60.0, help="validation perplexity to reach (default 60)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the run may take (default 1800)")
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    res = confirm(args)
    print(json.dumps({k: v for k, v in res.items() if k != "curve"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
