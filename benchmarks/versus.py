"""Validation perplexity against one setting, one series per variant, over seeds, from finished ``lordo train``
runs in several folders: the rank and batch-size verdicts of docs/results.md (sections 5 and 8).

    python benchmarks/versus.py results/long-rank results/long-stagnation results/fidelity-local \
        results/fidelity-rank --x strategy.rank --series strategy.name,strategy.basis_method \
        --only optim.lr=0.003 --only train.batch_size=8 --only strategy.name=lordo,lordo-local \
        --out results/fidelity-rank/plots/verdict.png

Each run's config.json gives its x value, its series (the values of the ``--series`` keys; a
``strategy.basis_method`` of ``auto`` is read as what it resolves to for the strategy, so that one computation
is one series) and its seed; runs that differ only in the seed are one point. The same seed of a point found
twice (a run copied into two sweeps' tables) counts once if both runs ended alike, and is an error otherwise.
The table gives each point's perplexity per seed, mean ± std, and each series' gap to the first series (in
alphabetical order) at the same x (positive: worse than the first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import field, matches, run_arguments, runs_under, save_figure  # noqa: E402

from lordo.config import StrategyConfig  # noqa: E402
from lordo.strategies.build import basis_method  # noqa: E402


def series_value(config: dict[str, Any], key: str) -> Any:
    value = field(config, key)
    if key == "strategy.basis_method" and value == "auto":
        return basis_method(StrategyConfig(name=field(config, "strategy.name"), basis_method=value))
    return value


def collect(paths: list[str], x: str, series: list[str], only: list[str]) -> dict[str, dict[Any, dict[int, float]]]:
    """{series label: {x value: {seed: final val ppl}}}."""
    found: dict[str, dict[Any, dict[int, float]]] = {}
    for run in runs_under(paths):
        config = json.loads((run / "config.json").read_text())
        if not matches(config, only):
            continue
        name = ", ".join(str(series_value(config, key)) for key in series)
        seeds = found.setdefault(name, {}).setdefault(field(config, x), {})
        seed, ppl = field(config, "train.seed"), json.loads((run / "summary.json").read_text())["val_ppl"]
        if seed in seeds and abs(seeds[seed] - ppl) > 1e-9 * ppl:
            sys.exit(f"{name} at {x} = {field(config, x)}: seed {seed} twice with different results "
                     f"({seeds[seed]} and {ppl}, the second in {run}); narrow the runs with --only")
        seeds[seed] = ppl
    if not found:
        sys.exit("no run matches the --only conditions")
    return found


def summarise(seeds: dict[int, float]) -> dict[str, Any]:
    ppl = [seeds[s] for s in sorted(seeds)]
    return {"seeds": sorted(seeds), "val_ppl": ppl, "mean": statistics.mean(ppl),
            "std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0}


def rows(found: dict[str, dict[Any, dict[int, float]]]) -> list[dict[str, Any]]:
    """One row per x value: each series' point there (or None) and its gap to the first series."""
    names = sorted(found)
    out = []
    for value in sorted({v for points in found.values() for v in points}):
        cells = {n: summarise(found[n][value]) if value in found[n] else None for n in names}
        first = cells[names[0]]
        gaps = {n: None if first is None or c is None else 100 * (c["mean"] / first["mean"] - 1)
                for n, c in cells.items() if n != names[0]}
        out.append({"x": value, "points": cells, "gap_percent": gaps})
    return out


def table(x: str, table_rows: list[dict[str, Any]]) -> str:
    names = list(table_rows[0]["points"])
    head = [x, *names, *(f"{n} vs {names[0]}" for n in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table_rows:
        cells = [str(r["x"])]
        for n in names:
            c = r["points"][n]
            if c is None:
                cells.append("–")
                continue
            per_seed = " / ".join(f"{p:.2f}" for p in c["val_ppl"])
            cells.append(per_seed if len(c["val_ppl"]) == 1 else f"{per_seed} ({c['mean']:.2f} ± {c['std']:.2f})")
        cells += ["–" if g is None else f"{g:+.1f} %" for g in r["gap_percent"].values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(x: str, table_rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in table_rows[0]["points"]:
        at = [(r["x"], r["points"][n]) for r in table_rows if r["points"][n] is not None]
        seeds = max(len(c["seeds"]) for _, c in at)
        ax.errorbar([v for v, _ in at], [c["mean"] for _, c in at], yerr=[c["std"] for _, c in at], marker="o",
                    capsize=3, label=f"{n} ({seeds} seed{'s' if seeds > 1 else ''} at most)")
    if all(isinstance(r["x"], (int, float)) and r["x"] > 0 for r in table_rows):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["x"] for r in table_rows], [str(r["x"]) for r in table_rows])
    ax.set(xlabel=x, ylabel="validation perplexity", title=f"validation perplexity vs {x} (mean ± std over seeds)")
    ax.legend(fontsize=8)
    save_figure(fig, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    run_arguments(parser)
    parser.add_argument("--x", required=True, metavar="SECTION.KEY", help="the setting on the x axis")
    parser.add_argument("--series", required=True, metavar="SECTION.KEY,...",
                        help="the settings whose values name a series (comma-separated)")
    args = parser.parse_args(argv)
    found = collect(args.paths, args.x, args.series.split(","), args.only)
    table_rows = rows(found)
    print(table(args.x, table_rows))
    if args.out:
        plot(args.x, table_rows, args.out)
        print(f"wrote {args.out}")
    if args.json:
        args.json.write_text(json.dumps(table_rows, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
