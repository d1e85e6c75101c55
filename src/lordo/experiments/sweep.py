"""Sweeps: a grid of config overrides over a base config, each point one ``lordo train`` run.

A sweep file (TOML)::

    [sweep]
    name = "stagnation"              # results go to results/<name> unless --out is given
    base_config = "configs/demo.toml"  # optional; [base] tables are applied on top of it

    [base.train]
    steps = 200

    [grid]
    "strategy.name" = ["ddp", "lordo"]
    "strategy.rank" = [8, 32]
    "train.seed" = [0, 1]

Settings that must change together (a strategy and its tuned learning rate; a batch size and the step
count that keeps the tokens equal) go in ``[[case]]`` tables; the points are then every case combined
with every grid combination::

    [[case]]
    "strategy.name" = "lordo"
    "optim.lr" = 3e-3

    [[case]]
    "strategy.name" = "ddp"
    "optim.lr" = 6e-3

Points are the cartesian product of the cases and the grid, in file order. Each runs in its own process (a crash
cannot take the sweep down) into ``<out>/<point>/``; a point whose ``summary.json`` exists is skipped, so
an interrupted sweep resumes (and a point interrupted mid-run resumes from its own checkpoint). A failed
point leaves ``failed.json`` with its exit code and the end of its error output, and the sweep goes on.
``<out>/sweep.json`` indexes every point and its status.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import build_config, load_toml, tomllib
from ..errors import ConfigError, Stopped
from ..files import read_json, read_jsonl, write_json
from ..launch import die_with_parent
from ..train.lock import OutputLock, holder

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
STOP_CODES = tuple(128 + s for s in STOP_SIGNALS)  # a training run that saved a checkpoint and stopped


@dataclass(frozen=True)
class Point:
    name: str  # folder name, e.g. "name-lordo__rank-8__seed-0"
    overrides: tuple[str, ...]  # --set arguments, e.g. ('strategy.name="lordo"', 'strategy.rank=8')
    values: dict[str, Any]


@dataclass
class Sweep:
    name: str
    out: Path
    base: dict[str, dict[str, Any]]
    grid: dict[str, list[Any]]
    cases: list[dict[str, Any]] = field(default_factory=list)

    def points(self) -> list[Point]:
        keys = list(self.grid)
        out = []
        for case, combo in itertools.product(self.cases or [{}], itertools.product(*(self.grid[k] for k in keys))):
            values = {**case, **dict(zip(keys, combo))}
            name = "__".join(f"{k.split('.')[-1]}-{_slug(v)}" for k, v in values.items()) or "base"
            overrides = tuple(f"{k}={json.dumps(v)}" for k, v in values.items())
            out.append(Point(name, overrides, values))
        return out


def _slug(value: Any) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", str(value)).strip("_") or "x"


def load_sweep(path: str | Path, out: str | Path | None = None) -> Sweep:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"sweep file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"sweep file {path} cannot be read as TOML: {exc}") from None
    unknown = set(raw) - {"sweep", "base", "grid", "case"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown tables {sorted(unknown)}; a sweep file has [sweep], [base.*], [grid] and [[case]]"
        )
    meta = raw.get("sweep", {})
    name = meta.get("name", path.stem)
    base: dict[str, dict[str, Any]] = {}
    if "base_config" in meta:
        base_path = (path.parent / meta["base_config"]) if not Path(meta["base_config"]).is_absolute() else Path(meta["base_config"])
        if not base_path.exists():
            base_path = Path(meta["base_config"])  # relative to the working directory
        base = load_toml(base_path)
    for section, body in raw.get("base", {}).items():
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: [base.{section}] must be a table of config keys")
        base.setdefault(section, {}).update(body)
    grid = raw.get("grid", {})
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path}: grid key {key!r} must list at least one value, got {values!r}")
    cases = raw.get("case", [])
    if not isinstance(cases, list) or not all(isinstance(c, dict) and c for c in cases):
        raise ConfigError(f"{path}: [[case]] must be an array of tables, each setting at least one config key")
    for i, case in enumerate(cases, 1):
        clash = sorted(set(case) & set(grid))
        if clash:
            raise ConfigError(f"{path}: case {i} sets {clash}, which the grid also varies; set each key in one place")
        if sorted(case) != sorted(cases[0]):
            raise ConfigError(f"{path}: case {i} sets {sorted(case)} but case 1 sets {sorted(cases[0])}; every case sets the same keys")
    sweep = Sweep(name, Path(out) if out else Path("results") / name, base, grid, cases)
    for point in sweep.points():  # every point must be a valid configuration before anything runs
        try:
            build_config(tree=base, overrides=point.overrides)
        except ConfigError as exc:
            raise ConfigError(f"{path}: point {point.name}: {exc}") from None
    return sweep


def run_sweep(sweep: Sweep, log: Callable[[str], None] = print, extra_args: list[str] | None = None,
              jobs: int = 1) -> dict:
    """Run every point not done yet, ``jobs`` at a time (each its own process); returns (and writes to
    sweep.json, after each point) the index of points and statuses, in file order."""
    if not (isinstance(jobs, int) and jobs >= 1):
        raise ConfigError(f"jobs must be an integer >= 1, got {jobs!r}")
    sweep.out.mkdir(parents=True, exist_ok=True)
    with _sweep_lock(sweep):  # a second sweep of the same folder would run its points twice and mark them failed
        return _run_points(sweep, log, extra_args, jobs)


@contextlib.contextmanager
def _sweep_lock(sweep: Sweep) -> Iterator[None]:
    lock = OutputLock(sweep.out)
    try:
        lock.acquire()
    except ConfigError:
        raise ConfigError(f"sweep {sweep.name}: {sweep.out} is in use by {holder(sweep.out) or 'another process'}; "
                          "wait for that sweep to end (`lordo sweep --status` shows its points)") from None
    try:
        yield
    finally:
        lock.release()


def _run_points(sweep: Sweep, log: Callable[[str], None], extra_args: list[str] | None, jobs: int) -> dict:
    base_file = sweep.out / "base.json"
    write_json(base_file, sweep.base)
    points = sweep.points()
    index: dict[str, Any] = {"name": sweep.name, "grid": sweep.grid, "cases": sweep.cases, "base": sweep.base, "points": []}
    entries = [{"name": p.name, "values": p.values, "dir": str(sweep.out / p.name), "status": "pending"} for p in points]
    index["points"] = entries
    lock = threading.Lock()
    running: set[subprocess.Popen] = set()
    stopped: list[int] = []  # the signal that stops the sweep: no point starts after it

    def write_index() -> None:
        with lock:
            write_json(sweep.out / "sweep.json", index)

    def run_point(i: int) -> None:
        point, entry = points[i], entries[i]
        folder = sweep.out / point.name
        summary = folder / "summary.json"
        if read_json(summary) is not None:
            entry["status"] = "done"
            log(f"[{i + 1}/{len(points)}] {point.name}: already done")
            return
        if summary.exists():  # empty or cut short: the run resumes from its checkpoint and writes it again
            log(f"[{i + 1}/{len(points)}] {point.name}: summary.json is damaged; running the point again")
            summary.unlink()
        cmd = [sys.executable, "-m", "lordo.cli", "train", "--config", str(base_file), "--out", str(folder)]
        for o in point.overrides:
            cmd += ["--set", o]
        cmd += list(extra_args or [])
        with lock:
            if stopped:
                return
            log(f"[{i + 1}/{len(points)}] {point.name}: running")
            (folder / "failed.json").unlink(missing_ok=True)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    preexec_fn=die_with_parent())
            running.add(proc)
        _, stderr = proc.communicate()
        with lock:
            running.discard(proc)
        if proc.returncode == 0 and read_json(summary) is not None:
            entry["status"] = "done"
        elif proc.returncode in STOP_CODES or -proc.returncode in STOP_SIGNALS:
            # stopped by a signal, after its checkpoint (128 + signal) or before it could save one (killed by it
            # during start-up): resumable from its last checkpoint, not failed
            entry["status"] = "stopped"
            with lock:
                stopped.append(proc.returncode - 128 if proc.returncode > 0 else -proc.returncode)
        else:
            folder.mkdir(parents=True, exist_ok=True)
            failure = {"returncode": proc.returncode, "stderr": stderr[-4000:], "command": cmd}
            write_json(folder / "failed.json", failure)
            entry["status"] = "failed"
            last = (stderr.strip().splitlines() or ["(no output)"])[-1]
            log(f"    {point.name} failed (exit {proc.returncode}): {last}")
        write_index()

    def stop(signum, frame) -> None:  # Ctrl-C or SIGTERM: the running points save and stop, no new one starts
        with lock:
            stopped.append(signum)
            for proc in running:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            for future in [pool.submit(run_point, i) for i in range(len(points))]:
                future.result()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    write_index()
    if stopped:
        name = signal.Signals(stopped[0]).name
        raise Stopped(f"sweep {sweep.name} stopped by {name}: the running points saved a checkpoint, the others did not "
                      f"start; continue with the same command (finished points are skipped, stopped ones resume)",
                      128 + stopped[0])
    return index


def point_status(folder: Path) -> tuple[str, str]:
    """(status, detail) of one point's folder, read without touching it: ``done`` (its validation perplexity),
    ``running`` (a live process holds its lock: the step it has logged), ``failed`` (failed.json: the exit code),
    ``stopped`` (begun, not finished, nobody running it: where it resumes) or ``queued`` (not begun)."""
    from ..train.checkpoint import saved_step_dirs

    summary = read_json(folder / "summary.json")
    if summary is not None:
        return "done", f"val ppl {summary['val_ppl']:.2f}" if "val_ppl" in summary else ""
    steps = ((read_json(folder / "config.json") or {}).get("train") or {}).get("steps")
    rows = [r for r in read_jsonl(folder / "metrics.jsonl") if "step" in r] if (folder / "metrics.jsonl").exists() else []
    logged = [r["step"] for r in rows]
    at = f"step {logged[-1] if logged else 0}" + (f" of {steps}" if steps else "")
    who = holder(folder)
    if who is not None:
        return "running", f"{at}{_time_left(rows, steps)} ({who})"
    failure = read_json(folder / "failed.json")
    if failure is not None:
        return "failed", f"exit {failure.get('returncode')} (failed.json)"
    saved = [int(d.name[5:]) for d in saved_step_dirs(folder / "checkpoints")[0]]
    if logged or saved:
        return "stopped", f"{at}; resumes " + (f"from its checkpoint at step {saved[-1]}" if saved else "from the start")
    return "queued", ""


def _time_left(rows: list[dict[str, Any]], steps: int | None) -> str:
    """", about N min left" at the pace of the last ten logged training rows (their ``train_s``), or nothing."""
    timed = [r for r in rows if "train_s" in r][-11:]
    if not steps or len(timed) < 2:
        return ""
    spent, done = timed[-1]["train_s"] - timed[0]["train_s"], timed[-1]["step"] - timed[0]["step"]
    if spent <= 0 or done <= 0:  # a resume restarted the clock between them
        return ""
    return f", about {max(1, round((steps - timed[-1]['step']) * spent / done / 60))} min left"


def minutes_left(sweep: Sweep) -> float | None:
    """Minutes of training the sweep's unfinished points still need, one at a time: each at the mean training time
    of its finished points (their ``train_s``), less what a begun point has logged; None before any has finished."""
    spent = [x["train_s"] for p in sweep.points() if (x := read_json(sweep.out / p.name / "summary.json"))
             and "train_s" in x]
    if not spent:
        return None
    each, left = statistics.mean(spent), 0.0
    for p in sweep.points():
        folder = sweep.out / p.name
        if (folder / "summary.json").exists() or (folder / "failed.json").exists():
            continue
        rows = [r for r in read_jsonl(folder / "metrics.jsonl") if "step" in r] if (folder / "metrics.jsonl").exists() else []
        steps = ((read_json(folder / "config.json") or {}).get("train") or {}).get("steps")
        done = rows[-1]["step"] / steps if rows and steps else 0.0
        left += each * max(0.0, 1.0 - done)
    return left / 60


def sweep_status(sweep: Sweep) -> list[tuple[str, str, str]]:
    """(point name, status, detail) of every point of ``sweep``, in file order (:func:`point_status`)."""
    return [(p.name, *point_status(sweep.out / p.name)) for p in sweep.points()]
