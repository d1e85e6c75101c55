"""``lordo bench runs|wire``: memory, throughput and bytes of short training runs (child processes), steady-state
bytes on the wire."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import build_config
from .timing import machine


def run_child(args: list[str], out: Path) -> dict[str, Any]:
    """``lordo train`` in a child process; returns its summary plus the child's peak RSS."""
    cmd = [sys.executable, "-c", "import resource, sys, runpy; sys.argv = ['lordo'] + sys.argv[1:]; "
           "from lordo.cli import main; code = main(); "
           "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); sys.exit(code)",
           "train", "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    for line in done.stderr.splitlines():
        if line.startswith("PEAK_RSS_KB"):
            summary["peak_rss_bytes"] = int(line.split()[1]) * 1024
    return summary


STRATEGIES = ("ddp", "local-adam", "lowrank-ddp", "lordo", "lordo-local", "lordo-global-noqh")


def runs_benchmark(preset: str, steps: int, rank: int, workers: int, batch_size: int, out_dir: Path,
                   strategies: tuple[str, ...] = STRATEGIES, extra: tuple[str, ...] = (), repeats: int = 2) -> dict[str, Any]:
    """Short runs of every strategy in child processes, ``repeats`` times round-robin (ddp, lordo, ..., ddp,
    lordo, ...) so that drift in the machine's speed hits all alike: memory (optimizer state, peak RSS),
    median tokens/s, bytes per step."""
    summaries: dict[str, list[dict[str, Any]]] = {name: [] for name in strategies}
    for rep in range(repeats):
        for name in strategies:
            args = ["--model", preset, "--steps", str(steps), "--strategy", name, "--rank", str(rank),
                    "--workers", str(workers), "--backend", "sim", "--set", f"train.batch_size={batch_size}",
                    "--set", "train.eval_every=100000", "--set", "train.eval_batches=1", "--set", "train.checkpoint_every=0",
                    "--set", f"schedule.warmup_steps={max(1, steps // 10)}", *extra]
            summaries[name].append(run_child(args, out_dir / f"{name}-{rep}"))
    rows = []
    for name, runs in summaries.items():
        s = runs[0]
        state = sum(s["optimizer_state_bytes"].values())
        rss = [r["peak_rss_bytes"] for r in runs if r.get("peak_rss_bytes")]
        rows.append({"name": name, "state_bytes": state, "state_ratio": state / (8 * s["params"]),
                     "by_category": s["optimizer_state_bytes"], "peak_rss_bytes": max(rss) if rss else None,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                     "tokens_per_s_all": [r["tokens_per_s"] for r in runs],
                     "comm_bytes_per_step": s["comm_bytes_per_step"],
                     "comm_ratio": s["comm_ratio_to_ddp"], "modeled_wall_s": s["modeled_wall_s"], "val_ppl": s["val_ppl"]})
    ref = next(r for r in rows if r["name"] == "ddp") if "ddp" in strategies else rows[0]
    for r in rows:
        r["tokens_per_s_ratio"] = r["tokens_per_s"] / ref["tokens_per_s"]
        r["rss_ratio"] = (r["peak_rss_bytes"] / ref["peak_rss_bytes"]) if r.get("peak_rss_bytes") and ref.get("peak_rss_bytes") else None
        r["bytes_less"] = 1 / r["comm_ratio"] if r["comm_ratio"] else None
    return {"preset": preset, "steps": steps, "rank": rank, "workers": workers, "batch_size": batch_size, "rows": rows}


WIRE_CASES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("ddp", "none", ()), ("lowrank-ddp", "none", ()), ("local-adam", "none", ()), ("lordo", "none", ()),
    ("lordo", "bf16", ()), ("lordo", "int8", ()), ("lordo", "int4", ()),
    ("local-adam", "sparse", ()), ("lordo", "sparse", ()), ("lordo", "basis", ()),
    ("lordo", "basis", ('strategy.compress_dense="int4"',)),
    ("lordo", "basis", ("strategy.compress_density=0.125",)),
    ("lordo", "basis", ('strategy.compress_fullrank="sparse"',)),
    ("lordo", "basis", ('strategy.compress_fullrank="sparse"', 'strategy.compress_dense="int4"')),
)
PER_STEP_TAGS = ("gradient", "projected_gradient")  # sent every step; everything else once per sync period


def wire_benchmark(preset: str, rank: int, worlds: tuple[int, ...], sync_every: int = 32) -> dict[str, Any]:
    """Steady-state bytes per step and worker of every strategy (and LoRDO's compressions) on the simulator:
    one whole synchronisation period is run at K = 2 on ``preset``'s shapes with random tokens, its
    per-collective wire and payload bytes are taken from the ledger, and what is sent once a period is spread
    over ``sync_every`` steps. DDP's all-reduce of every gradient is the reference."""
    from ..comm import SimCommunicator
    from ..distributed_optimizer import DistributedOptimizer
    from ..model import build_model

    rows = []
    for world in worlds:
        ddp_wire = None
        for name, compress, extra in WIRE_CASES:
            cfg = build_config(overrides=[f'model.preset="{preset}"', f'strategy.name="{name}"', f"strategy.rank={rank}",
                                          "strategy.sync_every=2", f'strategy.compress="{compress}"', f"dist.workers={world}",
                                          *extra])
            models = [build_model(cfg, 4096) for _ in range(world)]
            opt = DistributedOptimizer(models, cfg, SimCommunicator(world))
            gen = torch.Generator().manual_seed(0)
            before: dict[str, dict[str, int]] = {}
            for step in range(4):
                if step == 2:
                    before = opt.ledger.table()
                for m in models:
                    tokens = torch.randint(0, 4096, (2, cfg.model.seq_len + 1), generator=gen)
                    m(tokens[:, :-1], tokens[:, 1:])[1].backward()
                opt.step()
            per_step = {"wire": 0.0, "bytes": 0.0}
            for key, e in opt.ledger.table().items():
                tag = key.split(":")[1]
                period = 2 if tag in PER_STEP_TAGS else sync_every  # steps these bytes are spread over
                for field in per_step:
                    per_step[field] += (e[field] - before.get(key, {}).get(field, 0)) / period
            if name == "ddp":
                ddp_wire = per_step["wire"]
            assert ddp_wire is not None
            label = name if compress == "none" else f"{name}, {compress}"
            settings = ", ".join(o.split(".", 1)[1].replace('"', "") for o in extra)
            rows.append({"workers": world, "name": f"{label} ({settings})" if settings else label,
                         "wire_per_step": per_step["wire"], "payload_per_step": per_step["bytes"],
                         "less_than_ddp": ddp_wire / per_step["wire"]})
    return {"machine": machine(), "preset": preset, "rank": rank, "sync_every": sync_every, "rows": rows}
