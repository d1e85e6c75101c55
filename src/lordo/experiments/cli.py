"""``lordo sweep``, ``lordo report`` and ``lordo plot``: their parsers and what they run."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import ConfigError


def add_parsers(sub) -> None:
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


def _sweep_status(sweep) -> int:
    """Print where each point of ``sweep`` stands (lordo sweep --status) and the counts; runs nothing."""
    from .sweep import minutes_left, sweep_status

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
    from .sweep import load_sweep, run_sweep

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
    from .report import write_pooled, write_report

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
    from .tables import write_table

    if args.dirs or args.paired:
        raise ConfigError("lordo report --table takes its folders from the spec file: give no DIR and no --paired")
    if args.out is not None and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a folder: give the markdown file to write")
    text = write_table(args.table, args.out)
    print(f"wrote {args.out}" if args.out is not None else text, end="\n" if args.out is not None else "")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from .plots import plot_runs

    print(f"wrote {plot_runs(args.runs, args.out)}")
    return 0
