"""Tokens/s of the same run on torchft and on gloo, side by side on this machine: M ``lordo train --backend
torchft`` workers started as docs/multi-node.md says (one command per worker, a Lighthouse, each worker its
share of the cores with ``--set train.threads=CORES/M``) against ``lordo train --workers M --backend gloo``.
The two alternate, ``--repeats`` times each, so a load that comes and goes hits both; the ratio is of medians.

    python benchmarks/torchft_vs_gloo.py --json benchmarks/results/torchft-vs-gloo.json

Needs the ``ft`` extra (torchft). Each worker's tokens/s is its summary.json's (its own tokens over its
training seconds); a run's figure is the mean over its workers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LORDO = [sys.executable, "-m", "lordo.cli", "train"]


def run_args(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--strategy", "lordo", "--steps", str(args.steps), "--set",
            f"strategy.sync_every={args.sync_every}", "--set", f"strategy.rank={args.rank}", "--set",
            f"train.eval_every={args.steps}", "--set", "train.checkpoint_every=0", "--data-dir", args.data_dir]


def tokens_per_s(folder: Path) -> float:
    return json.loads((folder / "summary.json").read_text())["tokens_per_s"]


def gloo(args: argparse.Namespace, out: Path) -> float:
    done = subprocess.run([*LORDO, *run_args(args), "--workers", str(args.workers), "--backend", "gloo", "--out",
                           str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=args.timeout_s)
    if done.returncode:
        raise SystemExit(f"the gloo run failed:\n{done.stderr[-2000:]}")
    return tokens_per_s(out)


def torchft(args: argparse.Namespace, out: Path) -> float:
    lighthouse_bin = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    port = 29500 + os.getpid() % 400
    lighthouse = subprocess.Popen([lighthouse_bin, "--min_replicas", str(args.workers), "--join_timeout_ms", "10000",
                                   "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    try:
        time.sleep(1.0)
        procs = []
        for replica in range(args.workers):
            env = dict(os.environ, TORCHFT_LIGHTHOUSE=f"http://localhost:{port}", TORCHFT_MIN_REPLICAS=str(args.workers),
                       REPLICA_GROUP_ID=str(replica))
            cmd = [*LORDO, *run_args(args), "--workers", str(args.workers), "--backend", "torchft", "--set",
                   f"train.threads={threads}", "--out", str(out / f"worker-{replica}")]
            out.mkdir(parents=True, exist_ok=True)
            with open(out / f"log-{replica}.txt", "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log))
        codes = [p.wait(timeout=args.timeout_s) for p in procs]
        if any(codes):
            tails = "\n".join((out / f"log-{r}.txt").read_text()[-1500:] for r in range(args.workers))
            raise SystemExit(f"a torchft worker failed (exit codes {codes}):\n{tails}")
        return statistics.mean(tokens_per_s(out / f"worker-{r}") for r in range(args.workers))
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="nano")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--sync-every", type=int, default=8)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--data-dir", default="data")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", help="write the measurements here")
    args = p.parse_args(argv)
    rows: dict[str, list[float]] = {"gloo": [], "torchft": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, fn in (("gloo", gloo), ("torchft", torchft)):
                rows[name].append(fn(args, Path(tmp) / f"{name}-{i}"))
                print(f"repeat {i}: {name:8s} {rows[name][-1]:9.0f} tokens/s per worker", flush=True)
    medians = {name: statistics.median(values) for name, values in rows.items()}
    ratio = medians["gloo"] / medians["torchft"]
    print(f"median tokens/s per worker: gloo {medians['gloo']:.0f}, torchft {medians['torchft']:.0f}; "
          f"gloo / torchft = {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "tokens_per_s": rows, "median": medians,
                                               "gloo_over_torchft": ratio, "cpus": os.cpu_count()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
