"""``lordo bench``'s parser and dispatch."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from ..errors import ConfigError
from .basis import basis_benchmark
from .memory import memory_benchmark, within
from .runs import STRATEGIES, runs_benchmark, wire_benchmark
from .step import step_benchmark
from .timing import print_table, write_json


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lordo bench", description=(sys.modules[__package__].__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True, metavar="BENCH")
    s = sub.add_parser("step", help="optimizer step: lordo vs AdamW (fused, foreach) and the GaLore peers")
    s.add_argument("--preset", default="small", help="model shape preset whose matrices are stepped (default small)")
    s.add_argument("--d-model", type=int, help="a custom width instead of the preset's (e.g. 768 for a 125M shape)")
    s.add_argument("--layers", type=int, help="a custom depth (with --d-model)")
    s.add_argument("--rank", type=int, help="default: min(p, q)/8 of the smallest low-rank matrix")
    s.add_argument("--rounds", type=int, default=30, help="timed steps per optimizer, interleaved (default 30)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    s.add_argument("--no-peers", action="store_true", help="leave out the GaLore packages (the bench extra)")
    s.add_argument("--compiled", action="store_true",
                   help="also time the step compiled with torch.compile (row 'lordo, compiled'; compiles first)")
    b = sub.add_parser("basis", help="basis refresh: exact SVD vs warm-started subspace iteration on real pseudo-gradients")
    b.add_argument("--preset", default="micro", help="model shape preset of the short run (default micro)")
    b.add_argument("--rank", type=int, default=16, help="r (default 16)")
    b.add_argument("--steps", type=int, default=32, help="training steps (two synchronisations)")
    b.add_argument("--iters", type=int, default=1, help="subspace iterations (the optimizer uses 1)")
    b.add_argument("--rounds", type=int, default=20, help="timed refreshes per method (default 20)")
    b.add_argument("--device", default="cpu", help="where the bases are computed (the run that supplies them trains on the CPU)")
    w = sub.add_parser("wire", help="steady-state bytes sent per step of every strategy and compression, against ddp")
    w.add_argument("--preset", default="micro", help="model shape preset (default micro)")
    w.add_argument("--rank", type=int, default=16, help="r (default 16)")
    w.add_argument("--workers", default="2,4,8", help="comma-separated worker counts")
    m = sub.add_parser("memory", help="optimizer state of every strategy and the peer optimizers, measured from the live "
                       "tensors after real steps, against AdamW's (r = min(p, q)/8)")
    m.add_argument("--shapes", default="micro,paper-16m,d768x12",
                   help="comma-separated presets or dMODELxLAYERS shapes (vocabulary 32000 for the latter)")
    m.add_argument("--device", default="cpu", help="cpu or cuda (default cpu; on cuda the allocator's growth is read too)")
    m.add_argument("--no-peers", action="store_true", help="leave out AdamW, 8-bit AdamW and the GaLore peers")
    m.add_argument("--workers", type=int, default=2, metavar="M",
                   help="M: the strategies run as worker 0 of M (its shards of a compressed round are 1/M of the model; "
                   "default 2)")
    m.add_argument("--rows", nargs="+", default=None, metavar="TEXT",
                   help="only the strategy rows whose name contains one of these texts (e.g. 'int4 anchor' 'lordo --lean "
                   "('), or is a text after '=' ('=lordo': that row alone); default: every row")
    r = sub.add_parser("runs", help="memory, peak RSS, tokens/s and bytes per step of every strategy (short runs)")
    r.add_argument("--preset", default="micro", help="model shape preset (default micro)")
    r.add_argument("--steps", type=int, default=64, help="training steps per run (default 64)")
    r.add_argument("--rank", type=int, default=16, help="r (default 16)")
    r.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    r.add_argument("--batch-size", type=int, default=8, help="sequences per worker and step (default 8)")
    r.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies (default: all but diloco)")
    r.add_argument("--repeats", type=int, default=2, help="runs per strategy, round-robin (median tokens/s)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run (repeatable)")
    tp = sub.add_parser("throughput", help="tokens/s of training in float32, bfloat16 autocast, torch.compile, both, and the "
                        "lean optimizer state, at "
                        "1 and 2 threads (short runs, round-robin)")
    tp.add_argument("--preset", default="paper-16m", help="model shape preset (default paper-16m)")
    tp.add_argument("--strategy", default="lordo", help="strategy (default lordo)")
    tp.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    tp.add_argument("--warmup", type=int, default=10, help="steps left out of the timing (compiling; default 10)")
    tp.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts (default 1,2)")
    tp.add_argument("--repeats", type=int, default=2, help="runs per setting, round-robin (median tokens/s)")
    tp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    tp.add_argument("--settings", default="all", help="comma-separated settings to run, fp32 among them (the reference "
                    "of every ratio): fp32, bf16, fp32-compiled, bf16-compiled, lean (default all)")
    from .link import add_parser as add_link

    k = add_link(sub)
    rc = sub.add_parser("race", help="minutes to target perplexities over a link: a link measurement's step times x each "
                        "configuration's steps to the target in its sweep runs")
    rc.add_argument("file", metavar="RACE.toml", help="the race file (benchmarks/race-micro.toml is one)")
    rc.add_argument("--rates", help="Mbit/s, comma-separated (default: the race file's); a rate the link file does not hold "
                    "is modelled")
    rc.add_argument("--compute-s-per-step", type=float, metavar="S",
                    help="your own compute time of a step (seconds, e.g. on a GPU): every cell modelled from it and the "
                         "bytes each configuration sends")
    rc.add_argument("--plot", metavar="FILE.png", help="also draw perplexity against minutes, a panel per rate")
    for q in (s, b, w, m, r, k, tp, rc):
        q.add_argument("--json", metavar="FILE", help="also write the numbers to FILE (JSON); without it they are printed only")
        q.add_argument("--data-dir", default="data", help="data folder (default ./data)")
    return ap


def main(argv: list[str]) -> int:
    args = make_parser().parse_args(argv)
    out = Path(args.json) if args.json else None
    try:
        device = torch.device(getattr(args, "device", "cpu"))
    except RuntimeError:
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device")
    if args.what == "race":
        from .race import plot_race, print_race, race

        rates = None
        if args.rates:
            try:
                rates = [float(x) for x in args.rates.split(",") if x.strip()]
            except ValueError:
                rates = []
            if not rates or min(rates) <= 0 or not all(math.isfinite(r) for r in rates):
                raise ConfigError(f"--rates lists rates in Mbit/s > 0, comma-separated; got {args.rates!r}")
        if args.compute_s_per_step is not None and not (math.isfinite(args.compute_s_per_step) and args.compute_s_per_step > 0):
            raise ConfigError(f"--compute-s-per-step must be a number of seconds > 0, got {args.compute_s_per_step}")
        res = race(Path(args.file), rates, args.compute_s_per_step)
        print_race(res)
        if args.plot:
            res["plot"] = str(plot_race(res, Path(args.plot)))
        _write(out, res)
        return 0
    if args.what == "link":
        from .link import main as link_main

        link_main(args, out, write_json, print_table)
        return 0
    if args.what == "step":
        res = step_benchmark(args.preset, args.rank, args.rounds, device, args.d_model, args.layers, not args.no_peers,
                             compiled=args.compiled)
        _write(out, res)
    elif args.what == "basis":
        res = basis_benchmark(args.preset, args.rank, args.steps, args.rounds, args.data_dir, args.iters, device)
        _write(out, res)
    elif args.what == "memory":
        if args.workers < 2:
            raise ConfigError(f"--workers must be >= 2 (a round exchanges between workers), got {args.workers}")
        shapes: list[tuple[str, int | None, int | None]] = []
        for item in (x for x in args.shapes.split(",") if x):
            if item.startswith("d") and "x" in item:
                d, layers = item[1:].split("x")
                shapes.append(("micro", int(d), int(layers)))
            else:
                shapes.append((item, None, None))
        res = memory_benchmark(shapes, device, peers=not args.no_peers, log=lambda m: print(m, file=sys.stderr, flush=True),
                               only=args.rows, workers=args.workers)
        columns = [("shape", "shape", "s"), ("name", "optimizer", "s"), ("measured_bytes", "measured B", ","),
                   ("accounted_bytes", "accounted B", ","), ("total_vs_adamw", "× AdamW", ".2f"),
                   ("device_vs_adamw", "on device × AdamW", ".2f"), ("peak_vs_adamw", "peak × AdamW", ".2f")]
        if device.type == "cuda":
            columns += [("cuda_allocated_growth", "allocator growth B", ","), ("cuda_measured_hosted", "measured, hosted B", ",")]
        print_table("optimizer state one worker holds, measured from its tensors after real steps (r = min(p, q)/8)",
                    res["rows"], columns)
        print(f"peak: the most the optimizer and the strategy held at once over a synchronisation and the step after it "
              f"(where a delayed round lands), every op of the steps and of a round's thread followed (the state before "
              f"them plus what they allocated, memtrack.py; a peer optimizer's: its second step's); the codec's tables, once "
              f"per process: {res['codec_tables_bytes']:,} B")
        off = within(res["rows"])
        if off:
            print(f"accounted and measured differ by more than 2 %: {', '.join(off)}", file=sys.stderr)
    elif args.what == "throughput":
        from .throughput import SETTING_KEYS, throughput_benchmark

        threads = tuple(int(x) for x in args.threads.split(",") if x)
        if args.steps <= args.warmup + 5 or not threads or min(threads) < 1:
            raise ConfigError(f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) by more than 5, and --threads "
                              f"list counts >= 1, got {args.threads!r}")
        settings = SETTING_KEYS if args.settings == "all" else tuple(x for x in args.settings.split(",") if x)
        if "fp32" not in settings or set(settings) - set(SETTING_KEYS):
            raise ConfigError(f"--settings lists some of {', '.join(SETTING_KEYS)} (or all), fp32 among them: it is the "
                              f"reference of every ratio; got {args.settings!r}")
        extra = tuple(x for kv in args.set for x in ("--set", kv)) + ("--data-dir", args.data_dir)
        res = throughput_benchmark(args.preset, args.strategy, args.steps, args.warmup, threads, args.repeats, extra,
                                   settings)
        print_table(f"training tokens/s, {args.preset}, {args.strategy}, {args.steps} steps ({args.warmup} left out), "
                    f"{args.repeats} runs per setting round-robin; ratio = median / fp32 at {threads[0]} thread(s)",
                    res["rows"], [("name", "setting", "s"), ("tokens_per_s", "tokens/s", ",.0f"), ("ratio", "× fp32", ".2f")])
        _write(out, res)
    elif args.what == "wire":
        worlds = tuple(int(x) for x in args.workers.split(",") if x)
        if not worlds or min(worlds) < 2:
            raise ConfigError(f"--workers must list worker counts >= 2, got {args.workers!r}")
        res = wire_benchmark(args.preset, args.rank, worlds)
        print_table(f"steady-state bytes sent per step and worker ({args.preset}, r = {args.rank}, K = 32; simulator, "
                    "wire model of gloo's collectives)", res["rows"],
                    [("workers", "M", "d"), ("name", "strategy", "s"), ("wire_per_step", "sent B/step", ",.0f"),
                     ("payload_per_step", "payload B/step", ",.0f"), ("less_than_ddp", "× less than ddp", ".1f")])
        _write(out, res)
    else:
        import tempfile

        strategies = tuple(x for x in args.strategies.split(",") if x)
        extra = tuple(x for kv in args.set for x in ("--set", kv)) + ("--data-dir", args.data_dir)
        with tempfile.TemporaryDirectory() as tmp:
            res = runs_benchmark(args.preset, args.steps, args.rank, args.workers, args.batch_size, Path(tmp), strategies,
                                 extra, args.repeats)
        print_table(f"short runs ({args.preset}, {args.workers} simulated workers, {args.steps} steps, batch {args.batch_size}, "
                    f"r = {args.rank}), {args.repeats} per strategy round-robin in child processes; tokens/s: median",
                    res["rows"], [("name", "strategy", "s"), ("state_bytes", "optimizer state B", ","),
                                  ("state_ratio", "× AdamW", ".2f"), ("peak_rss_bytes", "peak RSS B", ","),
                                  ("rss_ratio", "× ddp", ".2f"), ("tokens_per_s", "tokens/s", ",.0f"),
                                  ("tokens_per_s_ratio", "× ddp", ".2f"), ("comm_bytes_per_step", "bytes/step", ",.0f"),
                                  ("bytes_less", "× less than ddp", ".1f")])
        _write(out, res)
    if args.what == "memory":
        _write(out, res)
    return 0


def _write(out: Path | None, res: dict) -> None:
    """The numbers into ``--json FILE`` if given (a benchmark writes nothing into the checkout on its own)."""
    if out is not None:
        write_json(out, res)  # says where
