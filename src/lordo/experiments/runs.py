"""A results folder's finished runs, read once, and what the report's table and its plots both compute from them:
the point a run belongs to (its varied settings without the seed), bytes on the wire, swept numbers."""

from __future__ import annotations

import json
import math
import statistics
import warnings
from pathlib import Path
from typing import Any

from ..comm.ledger import wire_bytes
from ..files import read_json, read_jsonl


def read_runs(root: Path) -> list[dict[str, Any]]:
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
                "folder": root.name,
                "config": read_json(folder / "config.json") or {},
                "values": values_by_dir.get(folder.name, {}),
                "summary": summary,
                "metrics": read_jsonl(metrics) if metrics.exists() else [],
                "eval": (read_json(folder / "eval.json") or {}).get("tasks", {}),  # lordo eval's scores
            }
        )
    return runs


def group_key(run: dict[str, Any]) -> str:
    """The run's point without its seed: runs that differ only in the seed are averaged."""
    parts = [f"{k.split('.')[-1]}={v}" for k, v in run["values"].items() if k != "train.seed"]
    return ", ".join(parts) or run["name"]


def mean_std(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


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


def wire_rows(run: dict[str, Any]) -> dict[int, tuple[float, float]]:
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
