"""Reports of a sweep: a markdown table (mean ± std over seeds) and PNG plots.

``lordo report DIR`` reads every ``DIR/<point>/summary.json`` and ``metrics.jsonl`` and writes
``DIR/report.md`` and ``DIR/plots/*.png``: validation loss against steps and against bytes sent per worker
(wire bytes, log axis), basis overlap and the error feedback's size (‖E‖/‖W‖) at each synchronisation,
optimizer-state memory by category, and for each numeric key the sweep varies over three or more values
(rank, omega, batch size, ...) the final validation perplexity against it, one line per setting of the other
keys (``val_ppl_vs_<key>.png``).
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from pathlib import Path
from typing import Any

from ..comm.ledger import wire_bytes
from ..errors import LordoError
from ..files import atomic_write, read_json, read_jsonl


def _read_runs(root: Path) -> list[dict[str, Any]]:
    """Every finished point under ``root``; a point whose summary.json is empty or cut short is left out with a
    warning (``lordo sweep`` runs it again), metrics lines cut short are left out of its curves."""
    runs = []
    index = read_json(root / "sweep.json") or {}
    values_by_dir = {Path(p["dir"]).name: p["values"] for p in index.get("points", []) if "dir" in p}
    for path in sorted(root.glob("*/summary.json")):
        folder = path.parent
        summary = read_json(path)
        if summary is None:
            warnings.warn(f"{path} is empty or damaged: {folder.name} left out of the report (lordo sweep runs it "
                          "again)", RuntimeWarning, stacklevel=2)
            continue
        metrics = folder / "metrics.jsonl"
        runs.append(
            {
                "name": folder.name,
                "values": values_by_dir.get(folder.name, {}),
                "summary": summary,
                "metrics": read_jsonl(metrics) if metrics.exists() else [],
                "eval": (read_json(folder / "eval.json") or {}).get("tasks", {}),  # lordo eval's scores
            }
        )
    return runs


def _group_key(run: dict[str, Any]) -> str:
    """The run's point without its seed: runs that differ only in the seed are averaged."""
    parts = [f"{k.split('.')[-1]}={v}" for k, v in run["values"].items() if k != "train.seed"]
    return ", ".join(parts) or run["name"]


def _mean_std(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _wall(summaries: list[dict[str, Any]]) -> str:
    """Modelled seconds of communication (wall-clock minus the measured compute): deterministic, unlike the
    compute time, which depends on what else the machine was doing."""
    walls = [x.get("modeled_wall_s") or {} for x in summaries]
    if not all("1gbit" in w and "10gbit" in w for w in walls):
        return "–"
    comm = {k: statistics.mean(w[k] - x["compute_s_per_worker"] for w, x in zip(walls, summaries)) for k in ("1gbit", "10gbit")}
    return f"{comm['1gbit']:.2f} / {comm['10gbit']:.2f}"


def tag_wire(summary: dict[str, Any], tag: str) -> int:
    """The wire bytes of one ledger tag of a run (0 if it has none); summaries written before wire bytes were
    counted get them from the tag's payload through comm.ledger.wire_bytes."""
    entry = summary["comm_by_collective"].get(tag)
    if not entry:
        return 0
    if "wire" in entry:
        return entry["wire"]
    return entry["calls"] * wire_bytes(tag.split(":")[0], entry["bytes"] // max(entry["calls"], 1), summary["workers"])


def wire_totals(summary: dict[str, Any]) -> tuple[int, int]:
    """(bytes sent per worker, what ddp would have sent) of a run. Summaries written before wire bytes were
    counted get them from their per-collective payloads through the same model (comm.ledger.wire_bytes)."""
    if "comm_wire_bytes_total" in summary:
        return summary["comm_wire_bytes_total"], summary["ddp_comm_wire_bytes"]
    world, steps = summary["workers"], summary["steps"]
    table = summary["comm_by_collective"]
    wire = sum(tag_wire(summary, tag) for tag in table)
    init = table.get("broadcast:init", {"bytes": 0})
    grad = (summary["ddp_comm_bytes"] - init["bytes"]) // steps if steps else 0
    return wire, steps * wire_bytes("all_reduce", grad, world) + wire_bytes("broadcast", init["bytes"], world)


def _wire_rows(run: dict[str, Any]) -> dict[int, tuple[float, float]]:
    """Step → (bytes sent so far, validation loss) of a run's evaluations after the first byte: the rows' wire
    counts, or (older runs) their payload counts scaled by the run's final wire / payload."""
    wire, _ = wire_totals(run["summary"])
    payload = run["summary"]["comm_bytes_total"]
    scale = wire / payload if payload else 1.0
    out = {}
    for r in run["metrics"]:
        sent = r.get("comm_wire_bytes", r.get("comm_bytes", 0) * scale)
        if "val_loss" in r and sent > 0:
            out[r["step"]] = (sent, r["val_loss"])
    return out


def _adamw_ratio(summary: dict[str, Any], state: int) -> str:
    """Optimizer state against AdamW's two fp32 moments of every trained parameter (8 bytes per parameter)."""
    params = summary.get("params")
    return f"{state / (8 * params):.2f}" if params else "–"


def _task_score(members: list[dict[str, Any]], task: str) -> str:
    """A downstream task's headline metric over the runs that were scored on it (mean ± std)."""
    from ..model.downstream import headline

    values = [headline(m["eval"][task]) for m in members if task in m["eval"]]
    return _mean_std([v for v in values if v is not None], 4) if values else "–"


def write_report(root: str | Path) -> Path:
    root = Path(root)
    runs = _read_runs(root)
    if not runs:
        raise LordoError(f"no finished runs (*/summary.json) under {root}")
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(_group_key(run), []).append(run)

    tasks = sorted({t for run in runs for t in run["eval"]})  # downstream scores, where lordo eval wrote them
    lines = [
        f"# Report: {root.name}",
        "",
        f"{len(runs)} runs; mean ± std over seeds where there are several. Regenerate with `lordo report {root}`.",
        "",
        "| point | seeds | val ppl | val loss | bytes sent / step (payload) | × ddp | modelled comm s @ 1 / 10 Gbit/s "
        "| optimizer state (bytes) | × AdamW | basis overlap |" + "".join(f" {t} |" for t in tasks),
        "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(tasks),
    ]
    for key, members in groups.items():
        s = [m["summary"] for m in members]
        totals = [wire_totals(x) for x in s]
        ratios = [w / d for w, d in totals if d]
        ratio = f"{statistics.mean(ratios):.4f}" if ratios else "–"
        state = sum(s[0]["optimizer_state_bytes"].values())
        sent = statistics.mean(w / x["steps"] for (w, _), x in zip(totals, s))
        lines.append(
            f"| {key} | {len(members)} | {_mean_std([x['val_ppl'] for x in s])} | {_mean_std([x['val_loss'] for x in s])} "
            f"| {sent:,.0f} ({statistics.mean(x['comm_bytes_per_step'] for x in s):,.0f}) | {ratio} | {_wall(s)} "
            f"| {state:,} | {_adamw_ratio(s[0], state)} | {_mean_std([x.get('basis_overlap_mean') for x in s], 4)} |"
            + "".join(f" {_task_score(members, t)} |" for t in tasks)
        )
    plots = _plots(root, runs)
    lines += ["", "## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    out = root / "report.md"
    atomic_write(out, "\n".join(lines).encode())
    return out


def _plots(root: Path, runs: list[dict[str, Any]]) -> list[Path]:
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
        groups.setdefault(_group_key(run), []).append(run)
    return list(groups.items())


def _mean_band(ax: Any, series: list[dict[float, float]], label: str, marker: str = "o") -> None:
    """The mean over seeds at the x values every seed has, as a line; their range as a band around it."""
    xs = sorted(set.intersection(*(set(s) for s in series)))
    if not xs:
        return
    means = [statistics.mean(s[x] for s in series) for x in xs]
    line = ax.plot(xs, means, marker=marker, ms=3, label=label if len(series) == 1 else f"{label} (mean of {len(series)})")
    if len(series) > 1:
        ax.fill_between(xs, [min(s[x] for s in series) for x in xs], [max(s[x] for s in series) for x in xs],
                        color=line[0].get_color(), alpha=0.2, lw=0)


def _plot_loss_vs_step(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, group in _by_point(runs):
        _mean_band(ax, [{r["step"]: r["val_loss"] for r in run["metrics"] if "val_loss" in r} for run in group], label)
    ax.set(xlabel="step", ylabel="validation loss", title="validation loss vs step (band: the seeds' range)")
    ax.legend(fontsize=6)
    return [("val_loss_vs_step.png", fig)]


def _plot_loss_vs_bytes(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, group in _by_point(runs):
        # the seeds of a point send the same bytes at the same steps: pair them by step, plot against the mean bytes
        by_step = [_wire_rows(run) for run in group]
        steps = sorted(set.intersection(*(set(s) for s in by_step))) if by_step else []
        if not steps:
            continue
        x_of = {st: statistics.mean(s[st][0] for s in by_step) for st in steps}
        _mean_band(ax, [{x_of[st]: s[st][1] for st in steps} for s in by_step], label)
    ax.set(xscale="log", xlabel="bytes sent per worker (cumulative)", ylabel="validation loss",
           title="validation loss vs communication")
    if ax.get_lines():
        ax.legend(fontsize=6)
    return [("val_loss_vs_bytes.png", fig)]


def _plot_overlap(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    with_overlap = [run for run in runs if any("basis_overlap" in r for r in run["metrics"])]
    if not with_overlap:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in with_overlap:
        ov = [r["basis_overlap"] for r in run["metrics"] if "basis_overlap" in r]
        ax.plot(range(1, len(ov) + 1), ov, marker="o", ms=3, label=run["name"])
    ax.set(xlabel="synchronisation round", ylabel="basis overlap (1 = unchanged)", title="basis overlap")
    ax.legend(fontsize=6)
    return [("basis_overlap.png", fig)]


def _plot_feedback(plt: Any, runs: list[dict[str, Any]]) -> Figures:
    with_feedback = [run for run in runs if any("error_feedback_norm" in r for r in run["metrics"])]
    if not with_feedback:
        return []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in with_feedback:
        rows = [r for r in run["metrics"] if "error_feedback_norm" in r]
        ax.plot([r["step"] for r in rows], [r["error_feedback_norm"] for r in rows], marker="o", ms=2, label=run["name"])
    ax.set(xlabel="step", ylabel="mean ‖E‖ / ‖W‖ of the low-rank matrices (worker 0)", yscale="log",
           title="error feedback at each synchronisation")
    ax.legend(fontsize=6)
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
        ax.legend(fontsize=7)
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
    ax.set_xticks(range(len(runs)), [run["name"] for run in runs], rotation=60, ha="right", fontsize=6)
    ax.set(ylabel="MiB per worker", title="optimizer state by category")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return [("optimizer_memory.png", fig)]


def swept_numbers(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[tuple[float, float, float]]]]:
    """For each numeric key the runs vary over at least 3 values (the seed aside): one series per setting of
    the other varied keys (its label), of (value, mean final validation perplexity, std over seeds) sorted by
    value; the std is 0 for a single seed."""
    varied = {k for run in runs for k in run["values"] if k != "train.seed"
              and len({json.dumps(r["values"].get(k)) for r in runs}) > 1}
    out: dict[str, dict[str, list[tuple[float, float, float]]]] = {}
    for key in sorted(varied):
        values = {r["values"].get(key) for r in runs}
        if len(values) < 3 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            continue
        cells: dict[str, dict[float, list[float]]] = {}
        for r in runs:
            label = ", ".join(f"{k.split('.')[-1]}={r['values'].get(k)}" for k in sorted(varied - {key}))
            cells.setdefault(label, {}).setdefault(r["values"][key], []).append(r["summary"]["val_ppl"])
        out[key] = {label: [(x, statistics.mean(ys), statistics.stdev(ys) if len(ys) > 1 else 0.0)
                            for x, ys in sorted(by_x.items())] for label, by_x in sorted(cells.items())}
    return out


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
        runs.append((d.name or str(d), [r for r in rows if "train_loss" in r], evals))
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise LordoError("plots need matplotlib: pip install 'lordo[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def sent(r: dict) -> float:
        return r.get("comm_wire_bytes", r.get("comm_bytes", 0))

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, trains, evals in runs:
        line = left.plot([r["step"] for r in trains], [r["train_loss"] for r in trains], lw=1, alpha=0.6,
                         label=f"{name}, train")[0] if trains else None
        color = line.get_color() if line is not None else None
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
    right.set(xscale="log", xlabel="bytes sent per worker (cumulative)", ylabel="loss",
              title="loss vs communication")
    left.legend(fontsize=7)
    if right.get_lines():
        right.legend(fontsize=7)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)
