"""The plots of a results folder (``lordo report``) and of a few runs (``lordo plot``).

Every loss plot gives each strategy one colour and each of its points (rate, seed, setting) its own line style
and marker, keeps the legend beside the axes, and shows the end of the runs zoomed, where the curves that matter
lie close together.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..errors import LordoError
from ..files import read_json, read_jsonl
from .runs import group_key, swept_numbers, wire_rows


def write_plots(root: Path, runs: list[dict[str, Any]]) -> list[Path]:
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise LordoError("plots need matplotlib: pip install 'lordo[report]' (make test installs it)") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = root / "plots"
    folder.mkdir(exist_ok=True)
    written = []
    for draw in (_plot_loss_vs_step, _plot_loss_vs_bytes, _plot_overlap, _plot_feedback, _plot_swept, _plot_memory):
        written += [_save(fig, folder / name) for name, fig in draw(plt, runs)]
    return written


Figures = list[tuple[str, Any]]  # (file name, matplotlib figure)


def _by_point(runs: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Runs grouped by their point without the seed (:func:`_group_key`), in order of first appearance."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(group_key(run), []).append(run)
    return list(groups.items())


STRATEGY_ORDER = ("ddp", "lowrank-ddp", "local-adam", "diloco", "lordo", "lordo-global-noqh", "lordo-local")


def strategy_colour(name: str) -> Any:
    """The one colour of strategy ``name`` in every plot (``lordo report``'s and ``lordo plot``'s alike): tab10's
    colour at its place in :data:`STRATEGY_ORDER` (other names after them)."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    i = STRATEGY_ORDER.index(name) if name in STRATEGY_ORDER else len(STRATEGY_ORDER) + sum(map(ord, name)) % 3
    return cmap(i % cmap.N)


def styles(labels: list[str], strategies: list[str]) -> dict[str, dict[str, Any]]:
    """Matplotlib style of each point: one colour per strategy (:func:`strategy_colour`; per point, when all share
    one strategy), and within a colour a line style and marker per point (its rate, seed or other setting), so that
    no two series look alike."""
    import matplotlib

    by_strategy = len(set(strategies)) > 1
    keys = strategies if by_strategy else labels
    cmap = matplotlib.colormaps["tab10" if len(set(keys)) <= 10 else "tab20"]
    palette = [cmap(i) for i in range(cmap.N)]
    colours = {k: strategy_colour(k) if by_strategy else palette[i % len(palette)]
               for i, k in enumerate(dict.fromkeys(keys))}
    seen: dict[str, int] = {}
    out = {}
    for label, key in zip(labels, keys):
        n = seen.get(key, 0)
        seen[key] = n + 1
        out[label] = {"color": colours[key], "ls": LINE_STYLES[n % len(LINE_STYLES)], "marker": MARKERS[n % len(MARKERS)]}
    return out


def bytes_axis(ax: Any) -> None:
    """A log axis of bytes labelled in KiB / MiB / GiB at its powers of ten only (the minor ticks unlabelled: raw
    byte counts there collided)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def label(value: float, _: Any) -> str:
        for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if value >= size:
                return f"{value / size:.3g} {unit}"
        return f"{value:g} B"

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10))
    ax.xaxis.set_major_formatter(FuncFormatter(label))
    ax.xaxis.set_minor_formatter(NullFormatter())


LINE_STYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "x")


def _point_styles(runs: list[dict[str, Any]]) -> tuple[list[tuple[str, list[dict[str, Any]]]], dict[str, dict[str, Any]]]:
    points = _by_point(runs)
    return points, styles([label for label, _ in points], [group[0]["summary"].get("strategy", "") for _, group in points])


def _mean_band(ax: Any, series: list[dict[float, float]], label: str, style: dict[str, Any]) -> None:
    """The mean over seeds at the x values every seed has, as a line; their range as a band around it."""
    xs = sorted(set.intersection(*(set(s) for s in series)))
    if not xs:
        return
    means = [statistics.mean(s[x] for s in series) for x in xs]
    ax.plot(xs, means, ms=3, label=label if len(series) == 1 else f"{label} (mean of {len(series)})", **style)
    if len(series) > 1:
        ax.fill_between(xs, [min(s[x] for s in series) for x in xs], [max(s[x] for s in series) for x in xs],
                        color=style["color"], alpha=0.15, lw=0)


def _legend_outside(fig: Any, ax: Any) -> None:
    """The legend to the right of the axes, never over the data."""
    if ax.get_lines():
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _zoom(ax: Any, lines: list[tuple[list[float], list[float]]], start: float, stop: float) -> None:
    """Show start <= x <= stop, with the y range of what the lines hold there (the differences that matter at the
    end)."""
    ys = [y for xs, vals in lines for x, y in zip(xs, vals) if x >= start]
    if not ys:
        return
    low, high = min(ys), max(ys)
    pad = 0.05 * (high - low or abs(high) or 1.0)
    ax.set_xlim(start, stop + 0.02 * (stop - start))
    ax.set_ylim(low - pad, high + pad)


def _plot_loss_vs_step(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    """Left: the whole run; right: its last 40 % of steps, with the y range of what the curves hold there."""
    fig, (whole, end) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1]})
    points, style = _point_styles(runs)
    curves = []
    for label, group in points:
        series = [{r["step"]: r["val_loss"] for r in run["metrics"] if "val_loss" in r} for run in group]
        for ax in (whole, end):
            _mean_band(ax, series, label, style[label])
        xs = sorted(set.intersection(*(set(s) for s in series))) if series else []
        curves.append((xs, [statistics.mean(s[x] for s in series) for x in xs]))
    last = max((xs[-1] for xs, _ in curves if xs), default=0)
    _zoom(end, curves, 0.6 * last, last)
    whole.set(xlabel="step", ylabel="validation loss", title="validation loss vs step (band: the seeds' range)")
    end.set(xlabel="step", ylabel="validation loss", title="the last 40 % of steps, zoomed")
    _legend_outside(fig, end)
    fig.tight_layout()
    return [("val_loss_vs_step.png", fig)]


def _plot_loss_vs_bytes(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    points, style = _point_styles(runs)
    for label, group in points:
        # the seeds of a point send the same bytes at the same steps: pair them by step, plot against the mean bytes
        by_step = [wire_rows(run) for run in group]
        steps = sorted(set.intersection(*(set(s) for s in by_step))) if by_step else []
        if not steps:
            continue
        x_of = {st: statistics.mean(s[st][0] for s in by_step) for st in steps}
        _mean_band(ax, [{x_of[st]: s[st][1] for st in steps} for s in by_step], label, style[label])
    bytes_axis(ax)
    ax.set(xlabel="bytes sent per worker (cumulative)", ylabel="validation loss", title="validation loss vs communication")
    _legend_outside(fig, ax)
    fig.tight_layout()
    return [("val_loss_vs_bytes.png", fig)]


def _plot_overlap(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    with_overlap = [run for run in runs if any("basis_overlap" in r for r in run["metrics"])]
    if not with_overlap:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    style = styles([run["name"] for run in with_overlap], [run["summary"].get("strategy", "") for run in with_overlap])
    for run in with_overlap:
        ov = [r["basis_overlap"] for r in run["metrics"] if "basis_overlap" in r]
        ax.plot(range(1, len(ov) + 1), ov, ms=3, label=run["name"], **style[run["name"]])
    ax.set(xlabel="synchronisation round", ylabel="basis overlap (1 = unchanged)", title="basis overlap")
    _legend_outside(fig, ax)
    fig.tight_layout()
    return [("basis_overlap.png", fig)]


def _plot_feedback(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    with_feedback = [run for run in runs if any("error_feedback_norm" in r for r in run["metrics"])]
    if not with_feedback:
        return []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    style = styles([run["name"] for run in with_feedback], [run["summary"].get("strategy", "") for run in with_feedback])
    for run in with_feedback:
        rows = [r for r in run["metrics"] if "error_feedback_norm" in r]
        ax.plot([r["step"] for r in rows], [r["error_feedback_norm"] for r in rows], ms=2, label=run["name"],
                **style[run["name"]])
    ax.set(xlabel="step", ylabel="mean ‖E‖ / ‖W‖ of the low-rank matrices (worker 0)", yscale="log",
           title="error feedback at each synchronisation")
    _legend_outside(fig, ax)
    fig.tight_layout()
    return [("error_feedback.png", fig)]


def _plot_swept(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    """Final validation perplexity against each numeric key the runs vary over (see ``swept_numbers``)."""
    out = []
    for key, series in swept_numbers(runs).items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, points in series.items():
            ax.errorbar([x for x, _, _ in points], [m for _, m, _ in points], yerr=[s for _, _, s in points],
                        marker="o", ms=4, capsize=3, label=label or "runs")
        short = key.split(".")[-1]
        log_x = min(x for pts in series.values() for x, _, _ in pts) > 0
        ax.set(xscale="log" if log_x else "linear", xlabel=key, ylabel="final validation perplexity",
               title=f"validation perplexity vs {short} (mean ± std over seeds)")
        if log_x:
            xs = sorted({x for pts in series.values() for x, _, _ in pts})
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()  # only the swept values are labelled
        ax.legend(fontsize=9)
        out.append((f"val_ppl_vs_{short}.png", fig))
    return out


def _plot_memory(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    categories = sorted({c for run in runs for c in run["summary"]["optimizer_state_bytes"]})
    bottoms = [0.0] * len(runs)
    for cat in categories:
        heights = [run["summary"]["optimizer_state_bytes"].get(cat, 0) / 2**20 for run in runs]
        ax.bar(range(len(runs)), heights, bottom=bottoms, label=cat)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(runs)), [run["name"] for run in runs], rotation=60, ha="right", fontsize=9)
    ax.set(ylabel="MiB per worker", title="optimizer state by category")
    ax.legend(fontsize=9)
    fig.tight_layout()
    return [("optimizer_memory.png", fig)]


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """One PNG for ``lordo plot``: loss against step (left: the training loss of every logged step as a line,
    the validation loss as points on it) and against bytes sent (right: every logged step's cumulative bytes,
    on a log axis that starts at the first byte sent, so a run's first steps are not squeezed onto two dots)."""
    runs = []
    for d in map(Path, run_dirs):
        path = d / "metrics.jsonl"
        if not path.exists():
            raise LordoError(f"{d} has no metrics.jsonl; give output folders of lordo train")
        rows = read_jsonl(path)  # rows cut short by a crash left out
        evals = [r for r in rows if "val_loss" in r]
        if not evals:
            raise LordoError(f"{path} holds no validation loss yet")
        strategy = ((read_json(d / "config.json") or {}).get("strategy") or {}).get("name", d.name or str(d))
        runs.append((d.name or str(d), [r for r in rows if "train_loss" in r], evals, strategy))
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise LordoError("plots need matplotlib: pip install 'lordo[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def sent(r: dict) -> float:
        return r.get("comm_wire_bytes", r.get("comm_bytes", 0))

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [strategy for _, _, _, strategy in runs]
    colours = styles([name for name, _, _, _ in runs], names)  # one colour per strategy, as lordo report's
    for name, trains, evals, _ in runs:
        color = colours[name]["color"]
        if trains:
            left.plot([r["step"] for r in trains], [r["train_loss"] for r in trains], lw=1, alpha=0.6, color=color,
                      label=f"{name}, train")
        left.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], marker="o", ms=4, ls="--", color=color,
                  label=f"{name}, validation")
        train_sent = [r for r in trains if sent(r) > 0]
        if train_sent:
            right.plot([sent(r) for r in train_sent], [r["train_loss"] for r in train_sent], lw=1, alpha=0.6, color=color)
        eval_sent = [r for r in evals if sent(r) > 0]
        if eval_sent:
            right.plot([sent(r) for r in eval_sent], [r["val_loss"] for r in eval_sent], marker="o", ms=4, ls="--",
                       color=color, label=name)
    left.set(xlabel="step", ylabel="loss", title="training (line) and validation (points) loss vs step")
    bytes_axis(right)
    right.set(xlabel="bytes sent per worker (cumulative)", ylabel="loss", title="loss vs communication")
    left.legend(fontsize=9)
    if right.get_lines():
        right.legend(fontsize=9)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)
