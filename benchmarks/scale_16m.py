"""The paper-16m table (docs/results.md, "Two scales") on one machine with a GPU, inside a fixed time.

    PYTHONPATH=src python3 benchmarks/scale_16m.py OUT_DIR [--deadline-s 540] [--jobs 15]
                       [--table sweeps/scale-16m.toml] [--results results/scale-16m]

Every configuration of sweeps/scale-16m.toml's setting runs as its own ``lordo train`` process, many at a time
on one GPU (the runs are small: bound by kernel launches, not by the GPU's arithmetic):

1. probe: each configuration that sweeps/scale-16m.toml does not hold yet (the CPU probes picked the rates of
   those it holds) at its best learning rate on micro and at half and twice it, seed 0, PROBE_STEPS steps
   (warm-up and cosine over those steps); the lowest validation loss picks the rate;
2. main: each configuration at its picked rate, seed 0 for all first, then seed 1, in the setting of
   sweeps/scale-16m.toml's base (1,000 steps, warm-up 100, bfloat16 autocast), so that its runs compare with the
   CPU table's; ``--main-steps N`` changes the step count.

Each finished run's config.json, metrics.jsonl and summary.json go into OUT_DIR/scale-16m.tar.gz as
<phase>/<run>/, rewritten after every run, so a stop at the deadline loses only the runs in flight.
OUT_DIR/plan.json records the rates picked and the step count chosen, with the timings that chose them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

PROBE_STEPS = 200
# name -> (micro's best rate, overrides): docs/results.md sections 2, 11 and 13
CONFIGS = {
    "ddp": (3e-3, ['strategy.name="ddp"']),
    "ddp-muon": (3e-3, ['strategy.name="ddp"', 'optim.inner="muon"']),
    "lowrank-ddp": (3e-3, ['strategy.name="lowrank-ddp"']),
    "local-adam": (3e-3, ['strategy.name="local-adam"']),
    "local-adam-muon": (1e-2, ['strategy.name="local-adam"', 'optim.inner="muon"']),
    "lordo": (3e-3, ['strategy.name="lordo"']),
    "lordo-global-noqh": (6e-3, ['strategy.name="lordo-global-noqh"']),
    "lordo-local": (3e-3, ['strategy.name="lordo-local"']),
    "lordo-int4": (3e-3, ['strategy.name="lordo"', 'strategy.compress="int4"']),
    "lordo-muon-r16": (3e-3, ['strategy.name="lordo"', 'optim.inner="muon"']),
    "lordo-muon-r64": (1e-2, ['strategy.name="lordo"', 'optim.inner="muon"', "strategy.rank=64"]),
    # lordo's lean state (sweeps/memory.toml's), at the rate picked for lordo: a paired comparison, not probed
    "lordo-lean": (3e-3, ['strategy.name="lordo"', 'strategy.anchor_dtype="int8"', 'strategy.error_feedback_dtype="int8"',
                          'strategy.moments_dtype="int8"']),
}
FOLLOWS = {"lordo-lean": "lordo"}  # configurations that take another's picked rate instead of probing
ROOT = Path(__file__).resolve().parents[1]
# a configuration's identity in the table's cases: strategy, inner optimizer, compression, rank
KEYS = ("strategy.name", "optim.inner", "strategy.compress", "strategy.rank")


def _identity(overrides: list[str]) -> tuple:
    given = dict(o.split("=", 1) for o in overrides)
    defaults = {"optim.inner": '"auto"', "strategy.compress": '"none"', "strategy.rank": "16"}
    return tuple(json.loads({**defaults, **given}.get(k, "null")) for k in KEYS)


def table_setting(table_file: Path, results: Path) -> tuple[dict[tuple, float], list[str], int]:
    """The CPU table's (``table_file``, its runs in ``results``) best rate of each configuration it has run, its base
    settings as overrides (the device and threads left to this script), and its step count."""
    from lordo.config import tomllib
    from lordo.experiments.runs import read_runs
    from lordo.experiments.tables import best_rate

    table = tomllib.loads(table_file.read_text())
    # a configuration's pick is the rate the README's table takes from its finished runs (the best on the seeds every
    # rate ran: the table also holds 1,000-step checks of some probe picks); before any has finished, the rate the
    # table file runs it at, if one; a configuration with none or several is probed here
    listed: dict[tuple, set[float]] = {}
    for c in table["case"]:
        listed.setdefault(tuple(c[k] for k in KEYS), set()).add(float(c["optim.lr"]))
    picks = {key: next(iter(rates)) for key, rates in listed.items() if len(rates) == 1}
    runs: dict[tuple, list] = {}
    for run in read_runs(results):
        runs.setdefault(tuple(run["values"][k] for k in KEYS), []).append(run)
    picks.update({key: float(best_rate(rs)[0]["values"]["optim.lr"]) for key, rs in runs.items()})
    base = [f"{section}.{key}={json.dumps(value)}" for section, values in table["base"].items()
            for key, value in values.items() if key not in ("threads", "device", "checkpoint_every")]
    return picks, base, int(table["base"]["train"]["steps"])


# the setting of every run: paper-16m (d 256, 4 layers, seq 256) at 4 sequences per worker and step, so a worker's
# step reads 1,024 tokens as micro's 8 x 128 do, and 2,000 steps read the same 8.2M tokens as the micro table
BASE = ['model.preset="paper-16m"', "train.batch_size=4", "train.eval_every=100", "train.threads=1",
        'train.device="cuda"', 'train.precision="fp32"', "train.checkpoint_every=0", "train.log_every=10",
        "strategy.sync_every=32", "strategy.rank=16", "dist.workers=4", 'dist.backend="sim"',
        'optim.muon_ns_dtype="float32"']


class Runner:
    def __init__(self, out: Path, work: Path, deadline: float, jobs: int) -> None:
        self.out, self.work, self.deadline, self.jobs = out, work, deadline, jobs
        self.lock = threading.Lock()
        self.done: dict[str, dict] = {}

    def run(self, phase: str, name: str, overrides: list[str]) -> dict | None:
        folder = self.work / phase / name
        cmd = [sys.executable, "-m", "lordo.cli", "train", "--out", str(folder), "--data-dir", "data"]
        for o in [*BASE, *overrides]:
            cmd += ["--set", o]
        left = self.deadline - time.time()
        if left < 20:
            return None
        t0 = time.time()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            print(f"[{phase}] {name}: stopped at the deadline", flush=True)
            return None
        summary_file = folder / "summary.json"
        if done.returncode != 0 or not summary_file.exists():
            print(f"[{phase}] {name}: failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}", flush=True)
            (self.out / "failures.log").open("a").write(f"{phase}/{name}\n{' '.join(cmd)}\n{done.stderr[-3000:]}\n\n")
            return None
        summary = json.loads(summary_file.read_text())
        keep = self.work / "keep" / phase / name
        keep.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "metrics.jsonl", "summary.json"):
            shutil.copy(folder / f, keep / f)
        print(f"[{phase}] {name}: val_ppl {summary['val_ppl']:.2f} in {time.time() - t0:.0f} s", flush=True)
        with self.lock:
            self.done[f"{phase}/{name}"] = summary
            self.pack()
        return summary

    def pack(self) -> None:
        tmp = self.out / "scale-16m.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for phase in ("probe", "main"):
                if (self.work / "keep" / phase).exists():
                    tar.add(self.work / "keep" / phase, arcname=phase)
            for f in ("plan.json", "failures.log"):
                if (self.out / f).exists():
                    tar.add(self.out / f, arcname=f)
        os.replace(tmp, self.out / "scale-16m.tar.gz")

    def many(self, phase: str, jobs: list[tuple[str, list[str]]]) -> dict[str, dict | None]:
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.jobs) as pool:
            futures = {name: pool.submit(self.run, phase, name, o) for name, o in jobs}
            return {name: f.result() for name, f in futures.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--deadline-s", type=float, default=540.0, help="seconds from now when everything must be done")
    ap.add_argument("--jobs", type=int, default=15, help="probe runs at a time")
    ap.add_argument("--main-jobs", type=int, default=22, help="main runs at a time (default 22: one wave)")
    ap.add_argument("--smoke", action="store_true", help="a few steps of the nano model on the CPU: checks the script")
    ap.add_argument("--main-steps", type=int, default=0, help="the main phase's step count (0: the CPU table's)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated configurations")
    ap.add_argument("--table", type=Path, default=ROOT / "sweeps" / "scale-16m.toml", help="the CPU table's sweep file")
    ap.add_argument("--results", type=Path, default=ROOT / "results" / "scale-16m", help="the CPU table's runs")
    args = ap.parse_args()
    unknown = sorted(set(k for k in args.configs.split(",") if k) - set(CONFIGS))
    if unknown:
        ap.error(f"--configs: unknown configuration(s) {', '.join(unknown)}; allowed: {', '.join(CONFIGS)}")
    if not args.table.is_file():
        ap.error(f"--table: no sweep file at {args.table}")
    global PROBE_STEPS
    if args.smoke:
        BASE[:] = [o for o in BASE if not o.startswith(("model.preset", "train.device"))]
        BASE.extend(['model.preset="nano"', 'train.device="cpu"', "train.eval_batches=2", "train.eval_every=5"])
        PROBE_STEPS = 6
    start = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/scale-16m-work")
    shutil.rmtree(work, ignore_errors=True)
    runner = Runner(args.out, work, start + args.deadline_s, args.jobs)
    configs = {k: CONFIGS[k] for k in args.configs.split(",") if k}
    plan: dict = {"started": start, "probe_steps": PROBE_STEPS, "base": BASE}

    cpu_picks, table_base, table_steps = table_setting(args.table, args.results)
    on_cpu = {name: cpu_picks[key] for name, (_, o) in configs.items() if (key := _identity(o)) in cpu_picks}
    probes = []
    for name, (lr, overrides) in configs.items():
        if name in FOLLOWS or name in on_cpu:
            continue
        for factor in (0.5, 1.0, 2.0):
            rate = float(f"{lr * factor:.3g}")
            probes.append((f"{name}__lr-{rate:g}", [*overrides, f"optim.lr={rate}", f"train.steps={PROBE_STEPS}",
                                                    f"schedule.warmup_steps={PROBE_STEPS // 10}", "train.seed=0"]))
    t0 = time.time()
    found = runner.many("probe", probes)
    probe_s = time.time() - t0
    picked = {}
    for name, (lr, _) in configs.items():
        losses = {k.split("__lr-")[1]: s["val_loss"] for k, s in found.items() if s and k.startswith(name + "__")}
        picked[name] = on_cpu.get(name, float(min(losses, key=lambda k: losses[k])) if losses else lr)
        plan.setdefault("probe_losses", {})[name] = losses
    for name, leader in FOLLOWS.items():
        if name in configs:
            picked[name] = picked.get(leader, configs[name][0])
    plan.update(picked=picked, picked_on_cpu=sorted(on_cpu), probe_s=probe_s)
    if args.smoke:  # the nano model and its evaluations stay
        table_base = [o for o in table_base if not o.startswith(("model.", "train.eval_every"))]
    steps = args.main_steps or (6 if args.smoke else table_steps)
    runner.jobs = args.main_jobs
    plan.update(main_steps=steps, main_base=table_base)
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1))
    print(json.dumps(plan, indent=1), flush=True)

    main_runs = []
    for seed in (0, 1):
        for name, (_, overrides) in configs.items():
            main_runs.append((f"{name}__seed-{seed}", [*table_base, *overrides, f"optim.lr={picked[name]}",
                                                       f"train.steps={steps}", f"schedule.warmup_steps={min(100, steps // 10)}",
                                                       f"train.seed={seed}"]))
    runner.many("main", main_runs)
    plan["total_s"] = time.time() - start
    (args.out / "plan.json").write_text(json.dumps(plan, indent=1))
    runner.pack()
    return 0


if __name__ == "__main__":
    sys.exit(main())
