"""What every benchmark shares: the machine's description, timing interleaved round by round, medians and
ratios, the printed table and the JSON file."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def machine() -> dict[str, Any]:
    """What a timing depends on: versions, cores, the CPU's model and whether it has bfloat16 matrix instructions
    (bfloat16 GEMMs are an order of magnitude slower without them), the GPU."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "platform": platform.platform(), **_cpu()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu() -> dict[str, Any]:
    from ..train.runtime import BF16_MATRIX_FLAGS

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), None)
    flags = {f for line in lines if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return {"cpu": model, "cpu_bf16_matrix": sorted(flags & set(BF16_MATRIX_FLAGS))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(fns: dict[str, Callable[[], None]], rounds: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per call of each function, measured round-robin (a, b, c, a, b, c, ...) with a rotating
    start so that no function always runs first after a pause."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    _sync(device)
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for i in range(rounds):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fns[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1000)
            else:
                t0 = time.perf_counter()
                fns[name]()
                times[name].append(time.perf_counter() - t0)
    return times


def summarize(times: dict[str, list[float]], reference: str) -> list[dict[str, Any]]:
    ref = statistics.median(times[reference])
    rows = []
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4) if len(ts) >= 4 else [min(ts), statistics.median(ts), max(ts)]
        med = statistics.median(ts)
        rows.append({"name": name, "median_ms": 1000 * med, "p25_ms": 1000 * q[0], "p75_ms": 1000 * q[-1],
                     "ratio": med / ref, "samples": len(ts)})
    return rows


def print_table(title: str, rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> None:
    """``columns``: (key, header, format)."""
    print(f"\n{title}")
    cells = [[h for _, h, _ in columns]] + [[format(r[k], f) if r.get(k) is not None else "–" for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for c in cells[1:]:
        print("| " + " | ".join(x.ljust(w) for x, w in zip(c, widths)) + " |")


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine(), "command": " ".join(["lordo", *sys.argv[1:]]), **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
