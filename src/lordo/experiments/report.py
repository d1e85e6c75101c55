"""Reports of a sweep: a markdown table (mean ± std over seeds) and PNG plots.

``lordo report DIR`` reads every ``DIR/<point>/summary.json`` and ``metrics.jsonl`` and writes
``DIR/report.md`` (a row per point; where the folder varies ``optim.lr``, each configuration at its best rate,
against ``ddp`` and AdamW) and ``DIR/plots/*.png``: validation loss against steps and against bytes sent per worker
(wire bytes, log axis), basis overlap and the error feedback's size (‖E‖/‖W‖) at each synchronisation,
optimizer-state memory by category, and for each numeric key the sweep varies over three or more values
(rank, omega, batch size, ...) the final validation perplexity against it, one line per setting of the other
keys (``val_ppl_vs_<key>.png``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from ..errors import LordoError
from ..files import atomic_write
from .runs import group_key, mean_std, read_runs, swept_numbers, tag_wire, wire_totals

__all__ = ["swept_numbers", "tag_wire", "wire_totals", "write_report"]


def _wall(summaries: list[dict[str, Any]]) -> str:
    """Modelled seconds of communication (wall-clock minus the measured compute): deterministic, unlike the
    compute time, which depends on what else the machine was doing."""
    walls = [x.get("modeled_wall_s") or {} for x in summaries]
    if not all("1gbit" in w and "10gbit" in w for w in walls):
        return "–"
    comm = {k: statistics.mean(w[k] - x["compute_s_per_worker"] for w, x in zip(walls, summaries)) for k in ("1gbit", "10gbit")}
    return f"{comm['1gbit']:.2f} / {comm['10gbit']:.2f}"


def _adamw_ratio(summary: dict[str, Any], state: int) -> str:
    """Optimizer state against AdamW's two fp32 moments of every trained parameter (8 bytes per parameter)."""
    params = summary.get("params")
    return f"{state / (8 * params):.2f}" if params else "–"


def _task_score(members: list[dict[str, Any]], task: str) -> str:
    """A downstream task's headline metric over the runs that were scored on it (mean ± std)."""
    from ..model.downstream import headline

    values = [headline(m["eval"][task]) for m in members if task in m["eval"]]
    return mean_std([v for v in values if v is not None], 4) if values else "–"


def _ddp_ppl(groups: dict[str, list[dict[str, Any]]]) -> float | None:
    """The mean perplexity of the best point whose runs are ``ddp`` (AdamW, Muon or any inner optimizer)."""
    means = [statistics.mean(m["summary"]["val_ppl"] for m in members) for members in groups.values()
             if all(m["summary"].get("strategy") == "ddp" for m in members)]
    return min(means) if means else None


def configuration(run: dict[str, Any], same: frozenset[str] = frozenset()) -> str:
    """The run's point without its seed and learning rate (and the keys ``same`` for every run): what the rate
    probes of one configuration share."""
    parts = [f"{k.split('.')[-1]}={v}" for k, v in run["values"].items()
             if k not in ("train.seed", "optim.lr") and k not in same]
    return ", ".join(parts) or "(every run)"


def _edge(best: Any, tried: list[Any]) -> str:
    """A note where the best rate is the lowest or highest tried: the best may lie beyond the grid."""
    if len(tried) < 2 or best not in (tried[0], tried[-1]):
        return ""
    return "; lowest tried" if best == tried[0] else "; highest tried"


def _mean_ppl(members: list[dict[str, Any]]) -> float:
    return statistics.mean(m["summary"]["val_ppl"] for m in members)


def _best_rates(groups: dict[str, list[dict[str, Any]]], reference: float | None) -> list[str]:
    """A table of each configuration at its best learning rate (lowest mean perplexity over its seeds), with
    what it costs against ``ddp`` and AdamW; empty unless the folder varies ``optim.lr``."""
    if len({m["values"].get("optim.lr") for members in groups.values() for m in members}) < 2:
        return []
    runs = [m for members in groups.values() for m in members]
    same = frozenset(k for k in runs[0]["values"] if len({json.dumps(r["values"].get(k)) for r in runs}) == 1)
    by_config: dict[str, list[list[dict[str, Any]]]] = {}
    for members in groups.values():
        by_config.setdefault(configuration(members[0], same), []).append(members)
    rows = []
    for config, points in by_config.items():
        best = min(points, key=_mean_ppl)
        s = [m["summary"] for m in best]
        ratios = [w / d for w, d in map(wire_totals, s) if d]
        state = sum(s[0]["optimizer_state_bytes"].values())
        tried = sorted(p[0]["values"]["optim.lr"] for p in points if "optim.lr" in p[0]["values"])
        rate = best[0]["values"].get("optim.lr", "–")
        cells = [config, f"{rate} ({', '.join(map(str, tried))}{_edge(rate, tried)})", str(len(best)),
                 mean_std([x["val_ppl"] for x in s])]
        cells += [f"{_mean_ppl(best) / reference:.3f}"] if reference else []
        cells += [f"{statistics.mean(ratios):.4f}" if ratios else "–", _adamw_ratio(s[0], state)]
        rows.append((_mean_ppl(best), "| " + " | ".join(cells) + " |"))
    return ["", "## Each configuration at its best learning rate", "",
            "The rate with the lowest mean perplexity over its seeds, of the rates tried (in brackets; where it is the "
            "lowest or highest tried, the best may lie beyond them)"
            + ("; ppl × ddp against the best `ddp` point." if reference else "."), "",
            "| configuration | best lr (tried) | seeds | val ppl |" + (" ppl × ddp |" if reference else "")
            + " bytes × ddp | state × AdamW |",
            "|---|---|---|---|" + ("---|" if reference else "") + "---|---|"] + [row for _, row in sorted(rows)]


def write_report(root: str | Path) -> Path:
    root = Path(root)
    runs = read_runs(root)
    if not runs:
        raise LordoError(f"no finished runs (*/summary.json) under {root}")
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(group_key(run), []).append(run)

    tasks = sorted({t for run in runs for t in run["eval"]})  # downstream scores, where lordo eval wrote them
    reference = _ddp_ppl(groups)  # the best ddp point's perplexity, where the folder has one
    lines = [
        f"# Report: {root.name}",
        "",
        f"{len(runs)} runs; mean ± std over seeds where there are several. Regenerate with `lordo report {root}`."
        + (f" ppl × ddp: against the best `ddp` point's mean ({reference:.2f})." if reference else ""),
        "",
        "| point | seeds | val ppl |" + (" ppl × ddp |" if reference else "") + " val loss | bytes sent / step (payload) "
        "| × ddp | modelled comm s @ 1 / 10 Gbit/s | optimizer state (bytes) | × AdamW | basis overlap |"
        + "".join(f" {t} |" for t in tasks),
        "|---|---|---|" + ("---|" if reference else "") + "---|---|---|---|---|---|---|" + "---|" * len(tasks),
    ]
    for key, members in groups.items():
        s = [m["summary"] for m in members]
        totals = [wire_totals(x) for x in s]
        ratios = [w / d for w, d in totals if d]
        ratio = f"{statistics.mean(ratios):.4f}" if ratios else "–"
        state = sum(s[0]["optimizer_state_bytes"].values())
        sent = statistics.mean(w / x["steps"] for (w, _), x in zip(totals, s))
        relative = f" {statistics.mean(x['val_ppl'] for x in s) / reference:.3f} |" if reference else ""
        lines.append(
            f"| {key} | {len(members)} | {mean_std([x['val_ppl'] for x in s])} |{relative} {mean_std([x['val_loss'] for x in s])} "
            f"| {sent:,.0f} ({statistics.mean(x['comm_bytes_per_step'] for x in s):,.0f}) | {ratio} | {_wall(s)} "
            f"| {state:,} | {_adamw_ratio(s[0], state)} | {mean_std([x.get('basis_overlap_mean') for x in s], 4)} |"
            + "".join(f" {_task_score(members, t)} |" for t in tasks)
        )
    lines += _best_rates(groups, reference)
    from .plots import write_plots

    plots = write_plots(root, runs)
    lines += ["", "## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    out = root / "report.md"
    atomic_write(out, "\n".join(lines).encode())
    return out


