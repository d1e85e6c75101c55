"""A table across settings (scales) from a spec file: ``lordo report --table FILE.toml``.

A pooled report compares runs of one setting only. The README's results table puts each strategy at two
scales side by side, and a verdict of the paper at two scales compares two strategies at each; their runs live in
several folders written by different sweeps (and versions of lordo), so which runs form which row is written
down, not guessed: a spec names, for every row and scale, the folders and the settings its runs must have::

    [table]
    title = "Strategies at two scales"
    scales = ["micro", "paper-16m"]            # the columns, in order
    reference = "ddp"                          # the row whose perplexity is 1 at each scale
    memory = "../benchmarks/results/memory.json"  # optional: `lordo bench memory`'s JSON
    memory_shape = "micro"                     # its shape the state column reads

    [[row]]
    key = "ddp"
    label = "`ddp`"
    choose = "..."                             # optional: when to choose it
    memory = ["adamw (torch)"]                 # optional: bench rows, plain (lean)
    micro = { runs = ["long-stagnation"], where = { "strategy.name" = "ddp" } }
    paper-16m = { runs = ["scale-16m"], where = { "strategy.name" = "ddp", "optim.inner" = "auto" } }

    [[verdict]]
    claim = "LoRDO comes close to low-rank DDP"
    a = "lordo"
    b = "lowrank-ddp"

Folders are relative to the spec's own folder. A run belongs to a row where every ``where`` setting equals its
value (the sweep's point, else its config.json; a setting a run does not record does not match). Of the rates a
row's runs tried, the best is the lowest mean perplexity over the seeds that every rate ran (the probes' seed);
the cell gives all of that rate's seeds. A verdict gives, at each scale, a's perplexity against b's seed by seed
(each at its best rate) and says which is ahead on every seed, or ``split``; across the scales it ``holds``
(ahead in the same direction at both), ``flips`` (opposite) or is ``open`` (split, or not run, at one of them, or
run on one seed only: what it says so far is given beside);
a claim whose rows are not both named at a scale is left out there (``–``).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from ..errors import ConfigError, LordoError
from ..files import atomic_write, read_json
from .runs import mean_std, read_runs, wire_totals

Runs = list[dict[str, Any]]
_MISSING = object()  # a setting a run does not record

MIN_SEEDS = 2  # a verdict on a claim needs this many seeds at each scale


def setting_of(run: dict[str, Any], key: str) -> Any:
    if key in run["values"]:
        return run["values"][key]
    section, _, name = key.partition(".")
    return (run["config"].get(section) or {}).get(name, _MISSING)


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9)
    return bool(a == b)


def seed_of(run: dict[str, Any]) -> int:
    seed = setting_of(run, "train.seed")
    return 0 if seed is _MISSING else int(seed)


def _rate(run: dict[str, Any]) -> float | None:
    rate = setting_of(run, "optim.lr")
    return None if rate is _MISSING else float(rate)


def best_rate(runs: Runs) -> Runs:
    """The runs of the best rate: the lowest mean perplexity over the seeds every rate ran (over all its seeds where
    the rates share none)."""
    by_rate: dict[float | None, Runs] = {}
    for run in runs:
        by_rate.setdefault(_rate(run), []).append(run)
    common = set.intersection(*({seed_of(r) for r in rs} for rs in by_rate.values()))

    def score(rs: list[dict[str, Any]]) -> float:
        chosen = [r for r in rs if seed_of(r) in common] or rs
        return statistics.mean(r["summary"]["val_ppl"] for r in chosen)

    best: Runs = min(list(by_rate.values()), key=score)
    return sorted(best, key=seed_of)


class Spec:
    """A table spec, checked: every error names the field and what it may be."""

    def __init__(self, path: str | Path):
        from ..config import tomllib

        self.path = Path(path)
        self._read: dict[str, Runs] = {}
        try:
            raw = tomllib.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read the table spec {self.path}: {err}") from err
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{self.path} is not valid TOML: {err}") from err
        table = raw.get("table")
        if not isinstance(table, dict):
            raise ConfigError(f"{self.path}: a [table] section is required (title, scales, reference)")
        self.title = str(table.get("title", self.path.stem))
        scales, rows = table.get("scales"), raw.get("row")
        if not (isinstance(scales, list) and scales and all(isinstance(s, str) for s in scales)):
            raise ConfigError(f"{self.path}: table.scales must be a list of scale names, got {scales!r}")
        if not (isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows)):
            raise ConfigError(f"{self.path}: at least one [[row]] table is required")
        self.scales: list[str] = scales
        self.rows: list[dict[str, Any]] = rows
        for i, row in enumerate(self.rows):
            self._check_row(i, row)
        keys: list[str] = [row["key"] for row in self.rows]
        if len(set(keys)) < len(keys):
            raise ConfigError(f"{self.path}: row keys must differ, got {keys}")
        reference = table.get("reference")
        if not isinstance(reference, str) or reference not in keys:
            raise ConfigError(f"{self.path}: table.reference must be one of the row keys ({', '.join(keys)}), "
                              f"got {reference!r}")
        self.reference: str = reference
        verdicts = raw.get("verdict", [])
        if not (isinstance(verdicts, list) and all(isinstance(v, dict) for v in verdicts)):
            raise ConfigError(f"{self.path}: verdicts are [[verdict]] tables (claim, a, b), got {verdicts!r}")
        self.verdicts: list[dict[str, Any]] = verdicts
        for i, v in enumerate(self.verdicts):
            for side in ("a", "b"):
                if v.get(side) not in keys:
                    raise ConfigError(f"{self.path}: verdict {i + 1}'s {side} must be a row key ({', '.join(keys)}), "
                                      f"got {v.get(side)!r}")
            if not isinstance(v.get("claim"), str):
                raise ConfigError(f"{self.path}: verdict {i + 1} needs a claim (a string)")
        memory = table.get("memory")
        self.memory = self._memory(memory, table.get("memory_shape")) if memory is not None else None

    def _check_row(self, i: int, row: dict[str, Any]) -> None:
        where = f"{self.path}: row {i + 1}"
        if not isinstance(row.get("key"), str):
            raise ConfigError(f"{where} needs a key (a string the verdicts and table.reference name)")
        for scale in self.scales:
            cell = row.get(scale)
            if cell is None:
                continue
            if not (isinstance(cell, dict) and isinstance(cell.get("runs"), list) and isinstance(cell.get("where", {}), dict)):
                raise ConfigError(f"{where} ({row['key']}), scale {scale!r}: must be {{ runs = [folders], where = "
                                  f"{{ setting = value }} }}, got {cell!r}")
        unknown = set(row) - {"key", "label", "choose", "memory", *self.scales}
        if unknown:
            raise ConfigError(f"{where} ({row['key']}): unknown fields {sorted(unknown)}; a row has key, label, choose, "
                              f"memory and one entry per scale ({', '.join(self.scales)})")

    def _memory(self, name: Any, shape: Any) -> dict[str, float]:
        path = self.path.parent / str(name)
        data = read_json(path)
        if not isinstance(data, dict) or "rows" not in data:
            raise ConfigError(f"{self.path}: table.memory {name!r} is not a `lordo bench memory` JSON ({path})")
        rows = {r["name"]: r["total_vs_adamw"] for r in data["rows"] if r.get("shape") == shape}
        if not rows:
            shapes = sorted({str(r.get("shape")) for r in data["rows"]})
            raise ConfigError(f"{self.path}: table.memory_shape must be one of {', '.join(shapes)}, got {shape!r}")
        return rows

    def runs(self, row: dict[str, Any], scale: str) -> Runs:
        """The finished runs of ``row`` at ``scale`` (none where the spec names none or its folders hold none yet)."""
        cell = row.get(scale)
        if cell is None:
            return []
        found = []
        for folder in cell["runs"]:
            found += [r for r in self._folder(folder) if all(same_value(setting_of(r, k), v) for k, v in cell.get("where", {}).items())]
        return found

    def _folder(self, name: str) -> Runs:
        """A results folder's finished runs, read once (rows share folders)."""
        if name not in self._read:
            root = self.path.parent / name
            self._read[name] = read_runs(root) if root.is_dir() else []
        return self._read[name]


def _ppl_cell(best: Runs, reference: float | None) -> str:
    ppl = [r["summary"]["val_ppl"] for r in best]
    spread = mean_std(ppl)
    seeds = "" if len(best) > 1 else ", 1 seed"
    ratio = f"{statistics.mean(ppl) / reference:.2f} " if reference else ""
    return f"{ratio}({spread}{seeds})"


def _two_digits(x: float) -> str:
    """Two significant digits, a trailing zero kept (0.040 beside 0.037, not 0.04); 1 stays "1"."""
    text = f"{x:#.2g}"
    return "1" if x == 1 else text.rstrip(".")


def _bytes(best: Runs) -> float | None:
    ratios = [w / d for w, d in (wire_totals(r["summary"]) for r in best) if d]
    return statistics.mean(ratios) if ratios else None


def _memory_cell(spec: Spec, row: dict[str, Any]) -> str:
    names = row.get("memory") or []
    if spec.memory is None or not names:
        return "–"
    missing = [n for n in names if n not in spec.memory]
    if missing:
        raise ConfigError(f"{spec.path}: row {row['key']}'s memory names {missing[0]!r}, not a row of the memory JSON "
                          "at its shape")
    first, *lean = (f"{spec.memory[n]:.2f}" for n in names)
    return first + (f" ({', '.join(lean)})" if lean else "")


def render(spec: Spec, command: str) -> list[str]:
    bests: dict[tuple[str, str], Runs] = {}
    for row in spec.rows:
        for scale in spec.scales:
            runs = spec.runs(row, scale)
            if runs:
                bests[row["key"], scale] = best_rate(runs)
    if not bests:
        raise LordoError(f"{spec.path}: none of its rows has a finished run in the folders it names")
    refs = {s: statistics.mean(r["summary"]["val_ppl"] for r in bests[spec.reference, s])
            for s in spec.scales if (spec.reference, s) in bests}
    lines = [f"# {spec.title}", "", f"Regenerate with `{command}`. Perplexity: × the `{spec.reference}` row's at each "
             "scale (in brackets the validation perplexity, mean ± std over seeds, at the row's best rate); bytes on "
             "the wire per worker over the whole run × `ddp`'s at each scale" + ("; optimizer state × AdamW's, measured "
             "(`lordo bench memory`; in brackets the lean setting)" if spec.memory is not None else "") + ".", ""]
    head = ["strategy", *(f"ppl × {spec.reference}, {s}" for s in spec.scales), f"bytes × ddp, {' / '.join(spec.scales)}"]
    head += ["state × AdamW"] if spec.memory is not None else []
    head += ["choose it when"] if any("choose" in r for r in spec.rows) else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in spec.rows:
        cells = [row.get("label", row["key"])]
        cells += [_ppl_cell(bests[row["key"], s], refs.get(s)) if (row["key"], s) in bests
                  else ("not run yet" if row.get(s) else "–") for s in spec.scales]
        sent = [_bytes(bests[row["key"], s]) if (row["key"], s) in bests else None for s in spec.scales]
        cells.append(" / ".join("–" if b is None else _two_digits(b) for b in sent))
        cells += [_memory_cell(spec, row)] if spec.memory is not None else []
        cells += [row.get("choose", "")] if "choose it when" in head else []
        lines.append("| " + " | ".join(cells) + " |")
    if spec.verdicts:
        lines += ["", *_verdicts(spec, bests)]
    return lines


def _paired(a: Runs, b: Runs) -> dict[int, float]:
    """Seed → a's perplexity against b's on that seed, in per cent."""
    theirs = {seed_of(r): r["summary"]["val_ppl"] for r in b}
    return {seed_of(r): 100 * (r["summary"]["val_ppl"] / theirs[seed_of(r)] - 1) for r in a if seed_of(r) in theirs}


def _direction(diffs: dict[int, float]) -> str | None:
    if not diffs:
        return None
    if all(d < 0 for d in diffs.values()):
        return "a"
    if all(d > 0 for d in diffs.values()):
        return "b"
    return "split"


def _verdicts(spec: Spec, bests: dict[tuple[str, str], Runs]) -> list[str]:
    head = ["claim", *(f"a against b, {s}" for s in spec.scales), "verdict"]
    lines = ["Each claim's a against b, seed by seed (each at its best rate; negative: a's perplexity lower).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = {row["key"]: row for row in spec.rows}
    for v in spec.verdicts:
        cells, directions, few = [f"{v['claim']} (a: {v['a']}, b: {v['b']})"], [], []
        for s in spec.scales:
            if rows[v["a"]].get(s) is None or rows[v["b"]].get(s) is None:  # not part of that scale's table
                cells.append("–")
                continue
            a, b = bests.get((v["a"], s)), bests.get((v["b"], s))
            diffs = _paired(a, b) if a and b else {}
            direction = _direction(diffs)
            directions.append(direction)
            if 0 < len(diffs) < MIN_SEEDS:
                few.append(s)
            if direction is None:
                cells.append("not run yet")
                continue
            ahead = {"a": f"{v['a']} ahead", "b": f"{v['b']} ahead", "split": "split"}[direction]
            cells.append(" / ".join(f"{d:+.1f} %" for _, d in sorted(diffs.items())) + f" ({ahead})")
        cells.append(_across(directions, few))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _across(directions: list[str | None], few: list[str]) -> str:
    """The verdict across the scales; ``few``: the scales where fewer than :data:`MIN_SEEDS` seeds ran (a verdict
    needs two: it is given as what the runs so far say, the claim left open)."""
    if len(directions) < 2:
        return "one scale only"
    if any(d is None for d in directions):
        return "open (not run at every scale)"
    if "split" in directions:
        return "open (split seeds)"
    verdict = "holds" if len(set(directions)) == 1 else "flips"
    if few:
        return f"open (1 seed at {', '.join(few)}; so far it {verdict})"
    return verdict


def write_table(spec_path: str | Path, out: str | Path | None = None) -> str:
    """The table of ``spec_path``; written to ``out`` (markdown) where given. Returns the text."""
    spec = Spec(spec_path)
    command = f"lordo report --table {spec_path}" + (f" --out {out}" if out is not None else "")
    text = "\n".join(render(spec, command)) + "\n"
    if out is not None:
        atomic_write(Path(out), text.encode())
    return text
