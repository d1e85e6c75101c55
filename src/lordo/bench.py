"""Benchmarks: ``lordo bench step|basis|wire|memory|runs|link``. Not part of the test suite.

Every benchmark measures the things it compares side by side in one process, interleaved round by round
(this matters on a shared, noisy machine), prints a table of medians, spreads and ratios, and writes the
numbers to a JSON file. Peers (``galore-torch``, ``pytorch-optimizer``) are optional: install
``lordo[bench]``; a missing peer is reported and skipped.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .config import build_config
from .errors import ConfigError
from .optim.functional import takes_fused_adamw


def machine() -> dict[str, Any]:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


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


# ------------------------------------------------------------------------------------------------------
# the local optimizer step


def _shape_overrides(preset: str, d_model: int | None, n_layers: int | None) -> list[str]:
    """Config overrides for a preset, optionally widened (heads of 64) and deepened."""
    overrides = [f'model.preset="{preset}"']
    if d_model:
        overrides += [f"model.d_model={d_model}", f"model.n_heads={max(1, d_model // 64)}"]
    if n_layers:
        overrides.append(f"model.n_layers={n_layers}")
    return overrides


def _model_params(preset: str, device: torch.device, d_model: int | None = None, n_layers: int | None = None):
    from .model import build_model, group_parameters

    cfg = build_config(overrides=_shape_overrides(preset, d_model, n_layers))
    model = build_model(cfg, 4096 if d_model is None else 32000).to(device)
    return model, group_parameters(model)


FLOOR = "2 rank-r GEMMs per matrix alone (floor)"


Replica = Callable[[], tuple[list, list[torch.Tensor], list[torch.Tensor]]]


def step_benchmark(preset: str, rank: int | None, rounds: int, device: torch.device, d_model: int | None = None,
                   n_layers: int | None = None, peers: bool = True, compiled: bool = False) -> dict[str, Any]:
    """Median time of one optimizer step on ``preset``'s parameters with fixed random gradients; ``compiled``
    adds the default step batched and compiled (``LowRankQHAdam(compile=True)``, compiled in the warm-up)."""
    model, groups = _model_params(preset, device, d_model, n_layers)
    matrices = [p for g in groups if g.rule.matrix for p in g.params]
    r = rank or min(min(p.shape) for p in matrices) // 8
    gen = torch.Generator(device="cpu").manual_seed(0)
    grads = {n: (torch.randn(p.shape, generator=gen) * 1e-3).to(device) for n, p in model.named_parameters()}

    def replica():
        """A copy of the model with the fixed gradients; returns (its groups, its matrices, the rest)."""
        from .model import group_parameters

        m = copy.deepcopy(model)
        for n, p in m.named_parameters():
            p.grad = grads[n]
        gs = group_parameters(m)
        return gs, [p for g in gs if g.rule.matrix for p in g.params], [p for g in gs if not g.rule.matrix for p in g.params]

    skipped: dict[str, str] = {}
    optimizers = _adamw_optimizers(replica, device, skipped)
    optimizers.update(_lordo_optimizers(replica, preset, r, device, compiled))
    if peers:
        optimizers.update(_peer_optimizers(replica, r, skipped))
    fns: dict[str, Callable[[], None]] = {name: opt.step for name, opt in optimizers.items()}
    fns[FLOOR] = _gemm_floor(replica, r, gen, device)
    times = time_interleaved(fns, rounds=rounds, warmup=3, device=device)
    reference = "AdamW fused" if "AdamW fused" in times else "AdamW foreach"
    rows = summarize(times, reference)
    n_params = sum(p.numel() for p in model.parameters())
    for row in rows:
        row["state_bytes"] = _state_bytes(optimizers[row["name"]]) if row["name"] in optimizers else None
    shape = f"{preset}" if d_model is None else f"d_model={d_model}, layers={n_layers}"
    print_table(f"optimizer step, {shape} ({n_params:,} parameters, {len(matrices)} low-rank matrices at r = {r}), "
                f"{device}, {rounds} rounds; ratio = median / {reference} median",
                rows, [("name", "optimizer", "s"), ("median_ms", "median ms", ".2f"), ("p25_ms", "p25", ".2f"),
                       ("p75_ms", "p75", ".2f"), ("ratio", f"× {reference}", ".2f"), ("state_bytes", "state bytes", ",")])
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    return {"preset": preset, "d_model": d_model, "n_layers": n_layers, "params": n_params, "rank": r,
            "device": str(device), "rows": rows, "skipped": skipped}


def _adamw_optimizers(replica: Replica, device: torch.device, skipped: dict[str, str]) -> dict[str, torch.optim.Optimizer]:
    """AdamW fused (the reference, where this torch has it for ``device``) and foreach, over every parameter."""
    out: dict[str, torch.optim.Optimizer] = {}
    for label, fused in (("AdamW fused", True), ("AdamW foreach", False)):
        _, ms, os_ = replica()
        if fused and not takes_fused_adamw(ms + os_):
            skipped[label] = f"torch's fused AdamW does not take these tensors ({device.type})"
            continue
        out[label] = torch.optim.AdamW(ms + os_, lr=1e-3, weight_decay=0.1, fused=fused or None,
                                       foreach=None if fused else True)
    return out


def _lordo_optimizers(replica: Replica, preset: str, r: int, device: torch.device,
                      compiled: bool) -> dict[str, torch.optim.Optimizer]:
    """lordo's optimizer as the defaults build it, its other forms of the full-rank term, its other execution
    path on ``device`` (batched over shapes, or per matrix), compiled (if asked) and without error feedback."""
    from .strategies import make_lowrank_optimizer

    cfg = build_config(overrides=[f'model.preset="{preset}"', f"strategy.rank={r}", 'strategy.name="lordo"'])

    def build(strategy=cfg.strategy, **options) -> torch.optim.Optimizer:
        gs, _, _ = replica()
        return make_lowrank_optimizer(gs, strategy, cfg.optim, omega=strategy.omega, **options)

    out: dict[str, torch.optim.Optimizer] = {}
    forms: dict[str, dict[str, Any]] = {  # the default full-rank term (G + E, what it applied removed from E), others
        "lordo (LowRankQHAdam)": {},
        "lordo, G + E kept": {"error_feedback_after_qh": "keep"},
        "lordo, qh_source=grad": {"qh_source": "grad"},
    }
    for label, changes in forms.items():
        out[label] = build(dataclasses.replace(cfg.strategy, **changes))
    other_path = device.type == "cpu"
    paths = {f"lordo, batched={other_path}": {"batched": other_path}}
    if compiled:
        paths["lordo, compiled"] = {"batched": True, "compile": True}
    for label, options in paths.items():
        out[label] = opt = build()
        for group in opt.param_groups:
            group.update(options)
    out["lordo, error_feedback=false"] = build(error_feedback=False)  # like for like with GaLore, which keeps none
    return out


def _peer_optimizers(replica: Replica, r: int, skipped: dict[str, str]) -> dict[str, torch.optim.Optimizer]:
    """The GaLore packages (the ``bench`` extra) at rank ``r``, their projector computed once in the warm-up."""
    out: dict[str, torch.optim.Optimizer] = {}
    huge_gap = 10**9  # the projector is computed at the first step (warm-up) and never again while timing

    def groups(projection_key: str) -> list[dict[str, Any]]:
        _, ms, os_ = replica()
        return [{"params": ms, "rank": r, "update_proj_gap": huge_gap, "scale": 1.0, projection_key: "std"},
                {"params": os_}]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from galore_torch import GaLoreAdamW
        out["galore-torch GaLoreAdamW"] = GaLoreAdamW(groups("proj_type"), lr=1e-3, weight_decay=0.1,
                                                      no_deprecation_warning=True)
    except Exception as exc:  # ImportError, or its transformers / bitsandbytes imports failing
        skipped["galore-torch GaLoreAdamW"] = f"not importable ({type(exc).__name__}: {exc}); pip install 'lordo[bench]'"
    try:
        from pytorch_optimizer import GaLore

        out["pytorch-optimizer GaLore"] = GaLore(groups("projection_type"), lr=1e-3, weight_decay=0.1)
    except Exception as exc:
        skipped["pytorch-optimizer GaLore"] = f"not importable ({type(exc).__name__}: {exc}); pip install 'lordo[bench]'"
    return out


def _gemm_floor(replica: Replica, r: int, gen: torch.Generator, device: torch.device) -> Callable[[], None]:
    """The arithmetic floor of any rank-r step: the two GEMMs per matrix that lordo's steady-state step does
    (project G, back-project the update into W), nothing else."""
    _, floor_ms, _ = replica()
    floor_bases = [torch.linalg.qr(torch.randn(min(p.shape), r, generator=gen).to(device))[0] for p in floor_ms]

    def gemms_only() -> None:
        with torch.no_grad():
            for p, b in zip(floor_ms, floor_bases):
                if p.shape[0] >= p.shape[1]:
                    p.addmm_(p.grad @ b, b.T, alpha=-1e-9)
                else:
                    p.addmm_(b, b.T @ p.grad, alpha=-1e-9)

    return gemms_only


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (after its first step)."""
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.ndim > 0:
                total += v.numel() * v.element_size()
            elif hasattr(v, "ortho_matrix"):  # GaLore projectors hold their basis
                m = v.ortho_matrix
                tensors = m if isinstance(m, (list, tuple)) else [m]
                total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


# ------------------------------------------------------------------------------------------------------
# basis refresh on real pseudo-gradients


def capture_pseudo_gradients(preset: str, steps: int, rank: int, data_dir: str, workers: int = 4,
                             batch_size: int = 4) -> list[dict[str, torch.Tensor]]:
    """Train ``lordo`` on the simulator for ``steps`` steps (K = steps // 2, so two synchronisations) and
    return, for each synchronisation, every low-rank matrix's averaged pseudo-gradient and its basis before."""
    from .api import DistributedOptimizer
    from .comm import SimCommunicator
    from .data import prepare
    from .data.sampler import BatchSampler
    from .model import build_model
    from .strategies import LoRDOStrategy

    cfg = build_config(overrides=[f'model.preset="{preset}"', 'strategy.name="lordo"', f"strategy.rank={rank}",
                                  f"strategy.sync_every={max(1, steps // 2)}", f"dist.workers={workers}",
                                  f"train.batch_size={batch_size}"])
    data = prepare.ensure(data_dir, cfg.data.vocab_size, cfg.data.val_fraction, log=lambda _: None)
    models = [build_model(cfg, data.vocab_size) for _ in range(workers)]
    opt = DistributedOptimizer(models, cfg, SimCommunicator(workers))
    strategy = opt.strategy
    assert isinstance(strategy, LoRDOStrategy)
    captured: list[dict[str, torch.Tensor]] = []

    def capture(delta):
        bases = [strategy.optimizer(0).state[p]["basis"].clone() for p in strategy.lowrank(0)]  # before the change
        captured.append({"deltas": [delta[i].detach().clone() for i in strategy.lowrank_index], "bases": bases})

    strategy.round_observers.append(capture)
    samplers = [BatchSampler(data.train, cfg.model.seq_len, batch_size, 0, r, workers) for r in range(workers)]
    for _ in range(steps):
        for model, sampler in zip(models, samplers):
            x, y = sampler.next()
            model(x, y)[1].backward()
        opt.step(lr=3e-3)
    return captured


def _must(basis: torch.Tensor | None) -> torch.Tensor:
    if basis is None:
        raise RuntimeError("a basis computation failed")
    return basis


def basis_benchmark(preset: str, rank: int, steps: int, rounds: int, data_dir: str, iters: int = 1,
                    device: torch.device | None = None) -> dict[str, Any]:
    """Exact SVD vs warm-started subspace iteration on the pseudo-gradients of a short run (captured on the
    CPU), timed on ``device``."""
    from .optim import captured_energy, subspace_iteration_basis, svd_basis

    device = device or torch.device("cpu")
    print(f"training {preset} with lordo for {steps} steps on 4 simulated workers to capture pseudo-gradients ...")
    syncs = capture_pseudo_gradients(preset, steps, rank, data_dir)
    sync = syncs[-1]  # the second synchronisation: the previous basis is a real warm start
    deltas, previous = [d.to(device) for d in sync["deltas"]], [b.to(device) for b in sync["bases"]]
    def exact() -> None:
        for d in deltas:
            svd_basis(d, rank)

    def warm() -> None:
        for d, b in zip(deltas, previous):
            subspace_iteration_basis(d, rank, b, iters=iters)

    fns = {"exact SVD": exact, f"subspace iteration ({iters} it, warm)": warm}
    times = time_interleaved(fns, rounds=rounds, warmup=1, device=device)
    rows = summarize(times, "exact SVD")
    exact_bases = [_must(svd_basis(d, rank)) for d in deltas]
    approx = [_must(subspace_iteration_basis(d, rank, b, iters=iters)) for d, b in zip(deltas, previous)]
    e_exact = [captured_energy(d, b) for d, b in zip(deltas, exact_bases)]
    e_approx = [captured_energy(d, b) for d, b in zip(deltas, approx)]
    e_old = [captured_energy(d, b) for d, b in zip(deltas, previous)]
    ratio = [a / e if e > 0 else 1.0 for a, e in zip(e_approx, e_exact)]
    rows[0]["energy_vs_exact"] = 1.0
    rows[1]["energy_vs_exact"] = statistics.mean(ratio)
    rows[1]["energy_vs_exact_min"] = min(ratio)
    rows[0]["speedup"] = 1.0
    rows[1]["speedup"] = rows[0]["median_ms"] / rows[1]["median_ms"]
    shapes = sorted({tuple(d.shape) for d in deltas})
    print_table(f"basis refresh of {len(deltas)} matrices {shapes} at r = {rank} ({preset}, the pseudo-gradients of "
                f"the second synchronisation), {device}, {rounds} rounds",
                rows, [("name", "method", "s"), ("median_ms", "median ms (all matrices)", ".2f"), ("p25_ms", "p25", ".2f"),
                       ("p75_ms", "p75", ".2f"), ("speedup", "speed-up", ".1f"),
                       ("energy_vs_exact", "captured energy / exact (mean)", ".4f"),
                       ("energy_vs_exact_min", "min", ".4f")])
    print(f"captured energy of the exact top-{rank}: mean {statistics.mean(e_exact):.4f}; of the previous basis "
          f"(no refresh): mean {statistics.mean(e_old):.4f}")
    return {"preset": preset, "rank": rank, "device": str(device), "shapes": shapes, "rows": rows, "energy_exact": e_exact,
            "energy_subspace": e_approx, "energy_previous": e_old}


# ------------------------------------------------------------------------------------------------------
# memory, end to end, bytes: short training runs in child processes


def _run_child(args: list[str], out: Path) -> dict[str, Any]:
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
            summaries[name].append(_run_child(args, out_dir / f"{name}-{rep}"))
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


MEMORY_CASES: tuple[tuple[str, list[str]], ...] = (
                ("lordo", []), ("lordo, bf16 error feedback", ['strategy.error_feedback_dtype="bfloat16"']),
                ("lordo, bf16 error feedback, anchor in host memory",
                 ['strategy.error_feedback_dtype="bfloat16"', "strategy.offload_anchor=true"]))


def memory_benchmark(shapes: list[tuple[str, int | None, int | None]]) -> dict[str, Any]:
    """Optimizer-related bytes one worker keeps on the training device (moments, bases, error feedback,
    anchor, ...), against AdamW's two fp32 moments, at r = min(p, q)/8 of each shape's block matrices.
    Counted from the state's shapes (``memory_report``): the same on any device."""
    from .api import DistributedOptimizer
    from .comm import SimCommunicator
    from .model import build_model

    rows = []
    for preset, d_model, layers in shapes:
        overrides = _shape_overrides(preset, d_model, layers)
        base = build_config(overrides=overrides)
        vocab = 4096 if d_model is None else 32000
        rank = base.model.d_model // 8  # min(p, q) of every block matrix is d_model
        model = build_model(base, vocab)
        label = preset if d_model is None else f"d{d_model} x {layers} layers"
        for name, extra in MEMORY_CASES:
            cfg = build_config(overrides=[*overrides, f"strategy.rank={rank}", *extra])
            report = DistributedOptimizer([model], cfg, SimCommunicator(1)).memory_report()
            rows.append({"shape": label, "params": model.num_params(), "rank": rank, "name": name,
                         "device_bytes": report["device_total"], "adamw_bytes": report["adamw"],
                         "device_vs_adamw": report["device_total"] / report["adamw"], "by_category": report})
    return {"machine": machine(), "rows": rows}


WIRE_CASES = (("ddp", "none"), ("lowrank-ddp", "none"), ("local-adam", "none"), ("lordo", "none"), ("lordo", "bf16"),
              ("lordo", "int8"), ("lordo", "int4"))
PER_STEP_TAGS = ("gradient", "projected_gradient")  # sent every step; everything else once per sync period


def wire_benchmark(preset: str, rank: int, worlds: tuple[int, ...], sync_every: int = 32) -> dict[str, Any]:
    """Steady-state bytes per step and worker of every strategy (and LoRDO's compressions) on the simulator:
    one whole synchronisation period is run at K = 2 on ``preset``'s shapes with random tokens, its
    per-collective wire and payload bytes are taken from the ledger, and what is sent once a period is spread
    over ``sync_every`` steps. DDP's all-reduce of every gradient is the reference."""
    from .api import DistributedOptimizer
    from .comm import SimCommunicator
    from .model import build_model

    rows = []
    for world in worlds:
        ddp_wire = None
        for name, compress in WIRE_CASES:
            cfg = build_config(overrides=[f'model.preset="{preset}"', f'strategy.name="{name}"', f"strategy.rank={rank}",
                                          "strategy.sync_every=2", f'strategy.compress="{compress}"', f"dist.workers={world}"])
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
            rows.append({"workers": world, "name": name if compress == "none" else f"{name}, {compress}",
                         "wire_per_step": per_step["wire"], "payload_per_step": per_step["bytes"],
                         "less_than_ddp": ddp_wire / per_step["wire"]})
    return {"machine": machine(), "preset": preset, "rank": rank, "sync_every": sync_every, "rows": rows}


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lordo bench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True, metavar="BENCH")
    s = sub.add_parser("step", help="optimizer step: lordo vs AdamW (fused, foreach) and the GaLore peers")
    s.add_argument("--preset", default="small", help="model shape preset whose matrices are stepped (default small)")
    s.add_argument("--d-model", type=int, help="a custom width instead of the preset's (e.g. 768 for a 125M shape)")
    s.add_argument("--layers", type=int, help="a custom depth (with --d-model)")
    s.add_argument("--rank", type=int, help="default: min(p, q)/8 of the smallest low-rank matrix")
    s.add_argument("--rounds", type=int, default=30, help="timed steps per optimizer, interleaved (default 30)")
    s.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    s.add_argument("--no-peers", action="store_true", help="leave out the GaLore packages (the bench extra)")
    s.add_argument("--compiled", action="store_true",
                   help="also time the step compiled with torch.compile (row 'lordo, compiled'; compiles first)")
    b = sub.add_parser("basis", help="basis refresh: exact SVD vs warm-started subspace iteration on real pseudo-gradients")
    b.add_argument("--preset", default="micro", help="model shape preset of the short run (default micro)")
    b.add_argument("--rank", type=int, default=16, help="r (default 16)")
    b.add_argument("--steps", type=int, default=32, help="training steps (two synchronisations)")
    b.add_argument("--iters", type=int, default=1, help="subspace iterations (the optimizer uses 1)")
    b.add_argument("--rounds", type=int, default=20, help="timed refreshes per method (default 20)")
    b.add_argument("--device", default="cpu", help="where the bases are computed (the run that supplies them trains on the CPU)")
    w = sub.add_parser("wire", help="steady-state bytes sent per step of every strategy and compression, against ddp")
    w.add_argument("--preset", default="micro", help="model shape preset (default micro)")
    w.add_argument("--rank", type=int, default=16, help="r (default 16)")
    w.add_argument("--workers", default="2,4,8", help="comma-separated worker counts")
    m = sub.add_parser("memory", help="optimizer-related device memory against AdamW's, at r = min(p, q)/8")
    m.add_argument("--shapes", default="micro,paper-16m,d768x12",
                   help="comma-separated presets or dMODELxLAYERS shapes (vocabulary 32000 for the latter)")
    r = sub.add_parser("runs", help="memory, peak RSS, tokens/s and bytes per step of every strategy (short runs)")
    r.add_argument("--preset", default="micro", help="model shape preset (default micro)")
    r.add_argument("--steps", type=int, default=64, help="training steps per run (default 64)")
    r.add_argument("--rank", type=int, default=16, help="r (default 16)")
    r.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    r.add_argument("--batch-size", type=int, default=8, help="sequences per worker and step (default 8)")
    r.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies (default: all but diloco)")
    r.add_argument("--repeats", type=int, default=2, help="runs per strategy, round-robin (median tokens/s)")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run (repeatable)")
    from .bench_link import add_parser as add_link

    k = add_link(sub)
    for q in (s, b, w, m, r, k):
        q.add_argument("--json", metavar="FILE", help="where to write the numbers (default benchmarks/results/<bench>.json)")
        q.add_argument("--data-dir", default="data", help="data folder (default ./data)")
    return ap


def main(argv: list[str]) -> int:
    args = make_parser().parse_args(argv)
    out = Path(args.json) if args.json else None
    try:
        device = torch.device(getattr(args, "device", "cpu"))
    except RuntimeError:
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device")
    if args.what == "link":
        from .bench_link import main as link_main

        link_main(args, out, write_json, print_table)
        return 0
    if args.what == "step":
        res = step_benchmark(args.preset, args.rank, args.rounds, device, args.d_model, args.layers, not args.no_peers,
                             compiled=args.compiled)
        shape = args.preset if not args.d_model else f"d{args.d_model}"
        write_json(out or Path(f"benchmarks/results/step-{shape}-{device.type}.json"), res)
    elif args.what == "basis":
        res = basis_benchmark(args.preset, args.rank, args.steps, args.rounds, args.data_dir, args.iters, device)
        suffix = "" if device.type == "cpu" else f"-{device.type}"
        write_json(out or Path(f"benchmarks/results/basis-{args.preset}{suffix}.json"), res)
    elif args.what == "memory":
        shapes: list[tuple[str, int | None, int | None]] = []
        for item in (x for x in args.shapes.split(",") if x):
            if item.startswith("d") and "x" in item:
                d, layers = item[1:].split("x")
                shapes.append(("micro", int(d), int(layers)))
            else:
                shapes.append((item, None, None))
        res = memory_benchmark(shapes)
        print_table("optimizer-related bytes on the training device, one worker, r = min(p, q)/8", res["rows"],
                    [("shape", "shape", "s"), ("params", "params", ","), ("name", "state", "s"),
                     ("device_bytes", "device bytes", ","), ("device_vs_adamw", "× AdamW", ".2f")])
        # the committed table is the default shapes'; another selection gets a file of its own
        default = args.shapes == make_parser().parse_args(["memory"]).shapes
        name = "memory" if default else "memory-" + "-".join(x for x in args.shapes.split(",") if x)
        write_json(out or Path(f"benchmarks/results/{name}.json"), res)
    elif args.what == "wire":
        worlds = tuple(int(x) for x in args.workers.split(",") if x)
        if not worlds or min(worlds) < 2:
            raise ConfigError(f"--workers must list worker counts >= 2, got {args.workers!r}")
        res = wire_benchmark(args.preset, args.rank, worlds)
        print_table(f"steady-state bytes sent per step and worker ({args.preset}, r = {args.rank}, K = 32; simulator, "
                    "wire model of gloo's collectives)", res["rows"],
                    [("workers", "M", "d"), ("name", "strategy", "s"), ("wire_per_step", "sent B/step", ",.0f"),
                     ("payload_per_step", "payload B/step", ",.0f"), ("less_than_ddp", "× less than ddp", ".1f")])
        write_json(out or Path(f"benchmarks/results/wire-{args.preset}.json"), res)
    else:
        import tempfile

        strategies = tuple(x for x in args.strategies.split(",") if x)
        extra = tuple(x for kv in args.set for x in ("--set", kv)) + ("--data-dir", args.data_dir)
        with tempfile.TemporaryDirectory() as tmp:
            res = runs_benchmark(args.preset, args.steps, args.rank, args.workers, args.batch_size, Path(tmp), strategies,
                                 extra, args.repeats)
        print_table(f"short runs ({args.preset}, {args.workers} simulated workers, {args.steps} steps, batch {args.batch_size}, "
                    f"r = {args.rank}), {args.repeats} per strategy round-robin in child processes; tokens/s: median",
                    res["rows"], [("name", "strategy", "s"), ("state_bytes", "optimizer state B", ","),
                                  ("state_ratio", "× AdamW", ".2f"), ("peak_rss_bytes", "peak RSS B", ","),
                                  ("rss_ratio", "× ddp", ".2f"), ("tokens_per_s", "tokens/s", ",.0f"),
                                  ("tokens_per_s_ratio", "× ddp", ".2f"), ("comm_bytes_per_step", "bytes/step", ",.0f"),
                                  ("bytes_less", "× less than ddp", ".1f")])
        write_json(out or Path(f"benchmarks/results/runs-{args.preset}.json"), res)
    return 0
