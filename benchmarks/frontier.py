"""Perplexity against bytes on the wire, one point per setting, from finished ``lordo train`` runs: the frontier
of the compressed synchronisations (docs/results.md). Reads each run's config.json and summary.json; runs that
differ only in their seed are one point (mean ± std over seeds).

    python benchmarks/frontier.py results/long-stagnation results/long-compress results/basis-frontier \
        --only optim.lr=0.003 --only strategy.name=lordo,local-adam --out results/basis-frontier/plots/frontier.png

Arguments are sweep folders (every ``*/summary.json`` under them) or run folders. Bytes are per worker and
step: "steady" leaves out what a run sends once (the initial broadcast of the model, the first gradient of the
low-rank matrices for the initial basis), "whole run" keeps it; each against what ``ddp`` would have sent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from lordo.experiments.report import tag_wire, wire_totals

ONE_TIME = ("broadcast:init", "all_reduce:initial_basis_gradient")
# the settings that make a point, besides the strategy, with their defaults (a default is not shown)
SHOWN = (("optim.lr", None), ("strategy.compress", "none"), ("strategy.compress_dense", "int8"),
         ("strategy.compress_density", 0.015625), ("strategy.compress_bits", 2), ("strategy.compress_fullrank", "dense"),
         ("strategy.sync_delay", 0), ("strategy.sync_exp_avg_every", 0), ("strategy.sync_exp_avg_sq_every", 0),
         ("strategy.lowrank_term", "adam"), ("strategy.average_error_feedback", False))
SPARSE = ("sparse", "basis")  # the codecs whose compress_* fields mean something


def field(config: dict[str, Any], key: str) -> Any:
    section, name = key.split(".")
    return config.get(section, {}).get(name)


def label(config: dict[str, Any]) -> str:
    parts = [str(field(config, "strategy.name"))]
    sparse = field(config, "strategy.compress") in SPARSE
    for key, default in SHOWN:
        value = field(config, key)
        if value is None or value == default or (key.startswith("strategy.compress_") and not sparse):
            continue
        parts.append(f"{key.split('.')[1]}={value}")
    return ", ".join(parts)


def bytes_per_step(summary: dict[str, Any]) -> dict[str, float]:
    """Wire bytes per worker and step, with and without the one-time sends, and ddp's for the same run."""
    steps = summary["steps"]
    total, ddp = wire_totals(summary)
    once = sum(tag_wire(summary, tag) for tag in ONE_TIME)
    init = tag_wire(summary, "broadcast:init")
    return {"steady": (total - once) / steps, "whole": total / steps,
            "ddp_steady": (ddp - init) / steps, "ddp_whole": ddp / steps}


def runs_under(paths: list[str]) -> list[Path]:
    found = []
    for p in map(Path, paths):
        here = [p] if (p / "summary.json").exists() else sorted(s.parent for s in p.glob("*/summary.json"))
        if not here:
            sys.exit(f"{p}: no summary.json in it or in its folders")
        found += here
    return found


def matches(config: dict[str, Any], only: list[str]) -> bool:
    for condition in only:
        key, _, allowed = condition.partition("=")
        if str(field(config, key)) not in allowed.split(","):
            return False
    return True


def points(paths: list[str], only: list[str]) -> list[dict[str, Any]]:
    grouped: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for run in runs_under(paths):
        config = json.loads((run / "config.json").read_text())
        if not matches(config, only):
            continue
        grouped.setdefault(label(config), []).append((field(config, "train.seed"), json.loads((run / "summary.json").read_text())))
    rows = []
    for name, seeded in grouped.items():
        seeded.sort(key=lambda s: s[0])
        if len({seed for seed, _ in seeded}) < len(seeded):
            sys.exit(f"{name}: two runs with the same seed; name the folders to read")
        ppl = [s["val_ppl"] for _, s in seeded]
        sent = bytes_per_step(seeded[0][1])
        rows.append({"point": name, "seeds": [seed for seed, _ in seeded], "val_ppl": ppl,
                     "mean": statistics.mean(ppl), "std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0,
                     **sent, "x_ddp_steady": sent["ddp_steady"] / sent["steady"],
                     "x_ddp_whole": sent["ddp_whole"] / sent["whole"]})
    return sorted(rows, key=lambda r: -r["steady"])


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| point | val ppl per seed | mean ± std | wire bytes / step, steady (whole run) | × less than ddp, steady "
             "(whole run) |", "|---|---|---|---|---|"]
    for r in rows:
        per_seed = " / ".join(f"{p:.2f}" for p in r["val_ppl"])
        lines.append(f"| {r['point']} | {per_seed} | {r['mean']:.2f} ± {r['std']:.2f} | {r['steady']:,.0f} "
                     f"({r['whole']:,.0f}) | {r['x_ddp_steady']:.1f} ({r['x_ddp_whole']:.1f}) |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ax.errorbar(r["steady"], r["mean"], yerr=r["std"] or None, marker="o", capsize=3, label=r["point"])
    ax.set(xscale="log", xlabel="wire bytes per worker and step (steady state)", ylabel="validation perplexity",
           title="perplexity against bytes on the wire (mean ± std over seeds)")
    ax.legend(fontsize=7)
    save_figure(fig, out)


def save_figure(fig: Any, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")


def run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments this script and benchmarks/versus.py share: the runs to read, the filter and the outputs."""
    parser.add_argument("paths", nargs="+", help="sweep folders or run folders of lordo train")
    parser.add_argument("--only", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                        help="keep the runs whose config has one of these values (repeatable)")
    parser.add_argument("--out", type=Path, help="write the plot to this PNG")
    parser.add_argument("--json", type=Path, help="write the rows to this JSON file")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_arguments(parser)
    args = parser.parse_args(argv)
    rows = points(args.paths, args.only)
    print(table(rows))
    if args.out:
        plot(rows, args.out)
        print(f"wrote {args.out}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
