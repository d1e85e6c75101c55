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
    strategy = run["summary"].get("strategy")
    return ", ".join(parts) or (f"name={strategy}" if strategy else "(every run)")


def _edge(best: Any, tried: list[Any]) -> str:
    """A note where the best rate is the lowest or highest tried: the best may lie beyond the grid."""
    if len(tried) < 2 or best not in (tried[0], tried[-1]):
        return ""
    return "; lowest tried" if best == tried[0] else "; highest tried"


def _mean_ppl(members: list[dict[str, Any]]) -> float:
    return statistics.mean(m["summary"]["val_ppl"] for m in members)


def _rate(run: dict[str, Any]) -> Any:
    """The run's learning rate: its point's, or its config.json's where the sweep did not vary it."""
    return run["values"].get("optim.lr", run["config"].get("optim", {}).get("lr"))


def _unvaried(runs: list[dict[str, Any]]) -> frozenset[str]:
    """The swept keys whose value is the same in every one of ``runs``."""
    return frozenset(k for k in runs[0]["values"] if len({json.dumps(r["values"].get(k)) for r in runs}) == 1)


def _best_rates(groups: dict[str, list[dict[str, Any]]], reference: float | None, pooled: bool = False) -> list[str]:
    """A table of each configuration at its best learning rate (lowest mean perplexity over its seeds), with
    what it costs against ``ddp`` and AdamW; empty unless the runs vary ``optim.lr``. ``pooled``: runs of several
    folders, each configuration named with its folder."""
    runs = [m for members in groups.values() for m in members]
    if len({_rate(m) for m in runs}) < 2:
        return []
    # a configuration is named by what its folder's sweep varied (config.json files of different versions of lordo
    # record different settings, and defaults have changed: they cannot tell configurations of two folders apart)
    folders = {r["folder"] for r in runs}
    same = {f: _unvaried([r for r in runs if r["folder"] == f]) for f in folders}
    by_config: dict[str, list[list[dict[str, Any]]]] = {}
    for members in groups.values():
        label = configuration(members[0], same[members[0]["folder"]])
        by_config.setdefault(f"{members[0]['folder']}: {label}" if pooled else label, []).append(members)
    rows = []
    for config, points in by_config.items():
        best = min(points, key=_mean_ppl)
        s = [m["summary"] for m in best]
        ratios = [w / d for w, d in map(wire_totals, s) if d]
        state = sum(s[0]["optimizer_state_bytes"].values())
        tried = sorted(r for r in {_rate(p[0]) for p in points} if r is not None)
        rate = _rate(best[0])
        cells = [config, f"{rate} ({', '.join(map(str, tried))}{_edge(rate, tried)})", str(len(best)),
                 mean_std([x["val_ppl"] for x in s])]
        cells += [f"{_mean_ppl(best) / reference:.3f}"] if reference else []
        cells += [f"{statistics.mean(ratios):.4f}" if ratios else "–", _adamw_ratio(s[0], state)]
        rows.append((_mean_ppl(best), "| " + " | ".join(cells) + " |"))
    return [*_best_table(rows, reference), *_rate_grid(by_config)]


def _rate_grid(by_config: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    """Every configuration's mean perplexity at every rate it tried: one row per configuration, one column per rate."""
    rates = sorted({_rate(p[0]) for points in by_config.values() for p in points if _rate(p[0]) is not None})
    lines = ["", "Mean validation perplexity at each rate tried (`–`: a rate not tried for that configuration):", "",
             "| configuration | " + " | ".join(f"lr {r}" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for config, points in sorted(by_config.items(), key=lambda item: min(map(_mean_ppl, item[1]))):  # best first
        at = {_rate(p[0]): p for p in points}
        lines.append(f"| {config} | " + " | ".join(f"{_mean_ppl(at[r]):.2f}" if r in at else "–" for r in rates) + " |")
    return lines


def _best_table(rows: list[tuple[float, str]], reference: float | None) -> list[str]:
    return ["", "## Each configuration at its best learning rate", "",
            "The rate with the lowest mean perplexity over its seeds, of the rates tried (in brackets; where it is the "
            "lowest or highest tried, the best may lie beyond them)"
            + ("; ppl × ddp against the best `ddp` point." if reference else "."), "",
            "| configuration | best lr (tried) | seeds | val ppl |" + (" ppl × ddp |" if reference else "")
            + " bytes × ddp | state × AdamW |",
            "|---|---|---|---|" + ("---|" if reference else "") + "---|---|"] + [row for _, row in sorted(rows)]


def _groups(runs: list[dict[str, Any]], pooled: bool) -> dict[str, list[dict[str, Any]]]:
    """Runs by point (seeds together); pooled from several folders, each point named with its folder."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(f"{run['folder']}: {group_key(run)}" if pooled else group_key(run), []).append(run)
    return groups


def _points_table(groups: dict[str, list[dict[str, Any]]], reference: float | None, tasks: list[str]) -> list[str]:
    lines = [
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
    return lines


def _seed(run: dict[str, Any]) -> Any:
    return run["values"].get("train.seed", run["config"].get("train", {}).get("seed"))


def _paired(groups: dict[str, list[dict[str, Any]]], reference: str) -> list[str]:
    """Each point's perplexity against point ``reference``'s on the same seed (the same initial model and data
    order: the difference is the setting's alone, where the seeds' own spread is much larger), in per cent."""
    if reference not in groups:
        raise LordoError(f"--paired {reference!r} is not a point of this report; its points are: " + "; ".join(groups))
    base = {_seed(m): m["summary"]["val_ppl"] for m in groups[reference]}
    seeds = sorted(base, key=str)
    lines = ["", f"## Paired against {reference}", "",
             "Each point's validation perplexity on a seed, and how far it is from the reference's on that seed.", "",
             "| point | " + " | ".join(f"seed {s}" for s in seeds) + " | largest difference |",
             "|---|" + "---|" * len(seeds) + "---|",
             f"| {reference} (reference) | " + " | ".join(f"{base[s]:.2f}" for s in seeds) + " | – |"]
    for key, members in groups.items():
        if key == reference:
            continue
        mine = {_seed(m): m["summary"]["val_ppl"] for m in members}
        diffs = {s: 100 * (mine[s] / base[s] - 1) for s in seeds if s in mine}
        cells = [f"{mine[s]:.2f} ({diffs[s]:+.2f} %)" if s in diffs else "–" for s in seeds]
        largest = f"{max(diffs.values(), key=abs):+.2f} %" if diffs else "–"
        lines.append(f"| {key} | " + " | ".join(cells) + f" | {largest} |")
    return lines


def _tables(runs: list[dict[str, Any]], pooled: bool, command: str, paired: str | None = None) -> list[str]:
    groups = _groups(runs, pooled)
    tasks = sorted({t for run in runs for t in run["eval"]})  # downstream scores, where lordo eval wrote them
    reference = _ddp_ppl(groups)  # the best ddp point's perplexity, where there is one
    intro = (f"{len(runs)} runs; mean ± std over seeds where there are several. Regenerate with `{command}`."
             + (f" ppl × ddp: against the best `ddp` point's mean ({reference:.2f})." if reference else ""))
    return ["", intro, "", *_points_table(groups, reference, tasks), *_best_rates(groups, reference, pooled),
            *(_paired(groups, paired) if paired else [])]


def _command(roots: list[Path], out: str | Path | None, paired: str | None) -> str:
    return ("lordo report " + " ".join(str(r) for r in roots) + (f" --out {out}" if out is not None else "")
            + (f" --paired '{paired}'" if paired else ""))


def _finished_runs(root: Path) -> list[dict[str, Any]]:
    runs = read_runs(root)
    if not runs:
        raise LordoError(f"no finished runs (*/summary.json) under {root}")
    return runs


def write_report(root: str | Path, paired: str | None = None) -> Path:
    """``root``/report.md and its plots; ``paired``: a point the others are compared with, seed by seed."""
    root = Path(root)
    runs = _finished_runs(root)
    lines = [f"# Report: {root.name}", *_tables(runs, False, _command([root], None, paired), paired)]
    from .plots import write_plots

    plots = write_plots(root, runs)
    lines += ["", "## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    out = root / "report.md"
    atomic_write(out, "\n".join(lines).encode())
    return out


# what runs pooled into one table must share: a perplexity or a byte count means nothing beside another setting's
LIKE_FOR_LIKE = ("model.d_model", "model.n_layers", "model.seq_len", "data.vocab_size", "train.steps",
                 "train.batch_size", "dist.workers")


def _setting(run: dict[str, Any], key: str) -> Any:
    section, name = key.split(".")
    return run["config"].get(section, {}).get(name)


def write_pooled(roots: list[Path] | list[str], out: str | Path, paired: str | None = None) -> Path:
    """One report (tables, no plots) of the runs of several folders, at ``out``: each point named with its folder
    and what that folder's sweep varied (seeds are averaged within a folder, not across folders), the best rate of
    each configuration, all against the best ``ddp`` point among them. The folders' runs must
    share the model, vocabulary, steps, batch and workers (LIKE_FOR_LIKE): an error names the setting that differs."""
    folders = [Path(r) for r in roots]
    names = [r.name for r in folders]
    if len(set(names)) < len(names):
        raise LordoError(f"two of the folders have the same name ({', '.join(names)}): their points could not be told apart")
    runs = [run for root in folders for run in _finished_runs(root)]
    unknown = [f"{run['folder']}/{run['name']}" for run in runs if not run["config"]]
    if unknown:
        raise LordoError(f"{unknown[0]} has no readable config.json"
                         + (f" (nor {len(unknown) - 1} more)" if len(unknown) > 1 else "")
                         + ": its settings cannot be compared with the other runs'")
    for key in LIKE_FOR_LIKE:
        seen: dict[str, list[str]] = {}
        for run in runs:
            seen.setdefault(json.dumps(_setting(run, key)), []).append(f"{run['folder']}/{run['name']}")
        if len(seen) > 1:
            listed = "; ".join(f"{value}: {where[0]}" + (f" and {len(where) - 1} more" if len(where) > 1 else "")
                               for value, where in seen.items())
            raise LordoError(f"the runs differ in {key} ({listed}): pool only runs of one setting, whose perplexities "
                             "and bytes compare")
    lines = ["# Report: " + ", ".join(names), *_tables(runs, True, _command(folders, out, paired), paired), ""]
    out = Path(out)
    atomic_write(out, "\n".join(lines).encode())
    return out
