"""``lordo bench memory``: the optimizer state of every strategy and of the peer optimizers, measured from the live
tensors after real steps and a synchronisation, beside what lordo's accounting computes from the shapes.

Each row builds its optimizer on a real model of the shape (two simulated workers for the strategies, so that a
synchronisation really exchanges), takes a few steps of random tokens (a synchronisation among them, K = 2), and
counts the bytes of every tensor the optimizer and the strategy hold for one worker (strategies/footprint.py:
storages once, by category and placement). On a GPU the process's own view is read too: the growth of
``torch.cuda.memory_allocated`` over the run, with the gradients freed, against the measured device bytes of
every hosted worker together.

Rows: torch's AdamW, bitsandbytes' 8-bit AdamW and galore-torch's GaLoreAdamW (where installed: the ``bench``
extra), lordo's ``LowRankQHAdam`` with GaLore's parameter groups (as a GaLore user drops it in), and the strategies
(``ddp`` is AdamW's state, listed as such).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import build_config
from ..errors import ConfigError
from ..memtrack import PeakTracker
from ..optim import compact
from ..strategies.footprint import InFlightPeak, excluded_storages, live_storages
from .step import shape_overrides
from .timing import machine

# --lean as it was before its low-rank moments passed their gate; --lean with E in 4 bits
EARLY_LEAN = ('strategy.anchor_dtype="int8"', 'strategy.error_feedback_dtype="int8"', 'strategy.moments_dtype="int8"')
LEAN4 = ('strategy.memory="lean"', 'strategy.error_feedback_dtype="int4"')
MUON = ('optim.inner="muon"', 'optim.muon_ns_dtype="float32"')
LOWRANK_MUON = 'optim.muon_orthogonalise="lowrank"'  # LoRDO's r-dimensional Muon form, the default before the split
STRATEGY_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ddp + Muon", ('strategy.name="ddp"', *MUON)),
    ("local-adam", ('strategy.name="local-adam"',)),
    ("local-adam, lean (int8 anchor)", ('strategy.name="local-adam"', 'strategy.memory="lean"')),
    ("local-adam + Muon", ('strategy.name="local-adam"', *MUON)),
    ("local-adam + Muon, lean (int8 anchor)", ('strategy.name="local-adam"', *MUON, 'strategy.memory="lean"')),
    ("local-adam + Muon, lean, 8-bit Muon momentum and AdamW moments (opt-in)",
     ('strategy.name="local-adam"', *MUON, 'strategy.memory="lean"', 'strategy.moments_dtype="int8"')),
    ("diloco (anchor, outer momentum)", ('strategy.name="diloco"',)),
    ("diloco + Muon (MuLoCo)", ('strategy.name="diloco"', *MUON)),
    ("lowrank-ddp", ('strategy.name="lowrank-ddp"',)),
    ("lowrank-ddp, lean (int8 E, full-rank and low-rank moments)", ('strategy.name="lowrank-ddp"', 'strategy.memory="lean"')),
    ("lordo", ('strategy.name="lordo"',)),
    ("lordo, LoRDO's Muon form", ('strategy.name="lordo"', *MUON, LOWRANK_MUON)),
    ("lordo, LoRDO's Muon form, r = 64", ('strategy.name="lordo"', *MUON, LOWRANK_MUON, "strategy.rank=64")),
    ("lordo, Muon form split", ('strategy.name="lordo"', *MUON, 'optim.muon_orthogonalise="split"')),
    ("lordo --lean, Muon form split", ('strategy.name="lordo"', *MUON, 'optim.muon_orthogonalise="split"',
                                       'strategy.memory="lean"')),
    ("lordo, bf16 error feedback, anchor in host memory (before)",
     ('strategy.name="lordo"', 'strategy.error_feedback_dtype="bfloat16"', "strategy.offload_anchor=true")),
    ("lordo --lean (int8 anchor, E, full-rank and low-rank moments)", ('strategy.name="lordo"', 'strategy.memory="lean"')),
    ("lordo --lean, anchor in host memory", ('strategy.name="lordo"', 'strategy.memory="lean"', "strategy.offload_anchor=true")),
    ("lordo, int8 anchor, E, full-rank moments (float32 low-rank moments)", ('strategy.name="lordo"', *EARLY_LEAN)),
    ("lordo, lean with int4 E", ('strategy.name="lordo"', *LEAN4)),
    ("lordo --lean, int4 anchor", ('strategy.name="lordo"', 'strategy.memory="lean"', 'strategy.anchor_dtype="int4"')),
    ("lordo, lean with int4 E and int4 anchor", ('strategy.name="lordo"', *LEAN4, 'strategy.anchor_dtype="int4"')),
    ("lordo, lean with int4 E, anchor in host memory", ('strategy.name="lordo"', *LEAN4, "strategy.offload_anchor=true")),
    ("lordo, int4 rounds", ('strategy.name="lordo"', 'strategy.compress="int4"')),
    ("lordo, int4 rounds, sync_delay 1", ('strategy.name="lordo"', 'strategy.compress="int4"', "strategy.sync_delay=1")),
    ("lordo --lean, int4 rounds (residual folded)", ('strategy.name="lordo"', 'strategy.memory="lean"', 'strategy.compress="int4"')),
    ("lordo --lean, int4 rounds, sync_delay 1",
     ('strategy.name="lordo"', 'strategy.memory="lean"', 'strategy.compress="int4"', "strategy.sync_delay=1")),
    ("lordo, lean with int4 E, int4 rounds, residual folded",
     ('strategy.name="lordo"', *LEAN4, 'strategy.compress="int4"', 'strategy.compress_residual="model"')),
    ("lordo, lean with int4 E, int4 rounds, residual folded, sync_delay 1",
     ('strategy.name="lordo"', *LEAN4, 'strategy.compress="int4"', 'strategy.compress_residual="model"',
      "strategy.sync_delay=1")),
)


def _tokens(vocab: int, seq: int, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    t = torch.randint(0, vocab, (1, seq + 1), generator=g).to(device)
    return t[:, :-1], t[:, 1:]


def _device_bytes(measured: dict[str, int]) -> int:
    return sum(v for k, v in measured.items() if not k.endswith(" (host)"))


def strategy_row(overrides: list[str], vocab: int, device: torch.device, seq: int = 32, workers: int = 2) -> dict[str, Any]:
    """Build the strategy as worker 0 of ``workers`` in a process of its own (:class:`MirrorCommunicator`: its collectives
    allocate what torch.distributed's do), step until a synchronisation has happened (and, for a delayed one, while
    its round is in flight) and measure its state; follow every op of the synchronisation and of the step after it
    (where a delayed round lands) for the peak; on a GPU also the allocator's growth."""
    from ..comm.simulated import MirrorCommunicator
    from ..distributed_optimizer import DistributedOptimizer
    from ..model import build_model

    cfg = build_config(overrides=[*overrides, "strategy.sync_every=2", f"dist.workers={workers}"])
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    models = [build_model(cfg, vocab).to(device)]
    before = torch.cuda.memory_allocated(device) if cuda else 0
    baseline = live_storages()  # the models, the codec's tables (made before), whatever the process held
    opt = DistributedOptimizer(models, cfg, MirrorCommunicator(workers), check_finish=False)

    def step(i: int, tracker: PeakTracker | None = None) -> None:
        for rank, model in enumerate(models):
            model(*_tokens(vocab, seq, i, rank, device))[1].backward()
        with tracker.tracking() if tracker is not None else contextlib.nullcontext():
            opt.step(lr=1e-3)

    step(0)
    start = opt.memory_report()["total"]
    # every op of the optimizer's steps from here (and of a round's exchange thread) is followed: the peak over the
    # synchronisation and the step after it, where a delayed round (tau = 1) lands
    tracker = PeakTracker(excluded_storages(models)).begin()
    step(1, tracker)  # the synchronisation (K = 2)
    # what no walk reaches (a round's thread and closures), sampled while the round's exchange runs and after it
    handle = getattr(getattr(opt.strategy, "in_flight", None), "handle", None)
    hidden = InFlightPeak(opt.strategy, models, baseline).follow(lambda: handle is not None and not handle.done)
    if cfg.strategy.sync_delay:  # a delayed round is measured in flight
        measured, accounted = opt.memory_report(), opt.accounted_memory()
    step(2, tracker)
    if not cfg.strategy.sync_delay:  # a blocking one after the step that follows it
        measured, accounted = opt.memory_report(), opt.accounted_memory()
    row = {"measured_bytes": measured["total"], "accounted_bytes": accounted["total"],
           "device_bytes": measured["device_total"], "adamw_bytes": measured["adamw"],
           "unreached_bytes": hidden, "transient_bytes": tracker.transient,
           "peak_bytes": max(measured["total"] + hidden, start + tracker.transient),
           "by_category": {k: v for k, v in measured.items() if k not in ("total", "device_total", "adamw")}}
    if cuda:  # every hosted worker's device state together, against what the allocator holds beyond the models
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated(device) - before
        held: dict[str, int] = {}
        for w in range(len(opt.strategy.workers)):
            for k, v in opt.strategy.measured_state_bytes(w).items():
                held[k] = max(held.get(k, 0), v) if k.startswith("anchor") else held.get(k, 0) + v
        row["cuda_allocated_growth"] = grown
        row["cuda_measured_hosted"] = _device_bytes(held)
    return row


def _peer_optimizers(model: nn.Module, rank: int) -> list[tuple[str, Callable[[], torch.optim.Optimizer]]]:
    """(name, builder) of the single-process optimizers, each over ``model``; GaLore's groups as its README
    builds them (the block matrices at rank r, the rest plain)."""
    from ..model import group_parameters
    from ..optim import LowRankQHAdam

    groups = group_parameters(model)
    matrices = [p for g in groups if g.rule.matrix for p in g.params if p.ndim == 2]
    ids = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in ids]
    galore = {"params": matrices, "rank": rank, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
    rows: list[tuple[str, Callable[[], torch.optim.Optimizer]]] = [
        ("adamw (torch)", lambda: torch.optim.AdamW(model.parameters(), lr=1e-3)),
        ("LowRankQHAdam with GaLore's groups (defaults)",
         lambda: LowRankQHAdam([{"params": rest}, dict(galore)], lr=1e-3)),
        ("LowRankQHAdam with GaLore's groups, int8 error feedback and moments",
         lambda: LowRankQHAdam([{"params": rest}, dict(galore)], lr=1e-3, error_feedback_dtype="int8", moments_dtype="int8")),
        ("LowRankQHAdam with GaLore's groups, int8 error feedback, full-rank and low-rank moments",
         lambda: LowRankQHAdam([{"params": rest}, dict(galore)], lr=1e-3, error_feedback_dtype="int8", moments_dtype="int8",
                               lowrank_moments_dtype="int8")),
        ("LowRankQHAdam with GaLore's groups, no error feedback",
         lambda: LowRankQHAdam([{"params": rest}, dict(galore)], lr=1e-3, error_feedback=False)),
    ]
    try:
        import bitsandbytes as bnb

        rows.insert(1, ("adamw 8-bit (bitsandbytes)", lambda: bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)))
    except Exception:  # noqa: BLE001 - not installed, or no kernels for this machine
        pass
    try:
        from galore_torch import GaLoreAdamW, GaLoreAdamW8bit

        rows.append(("GaLoreAdamW (galore-torch)", lambda: GaLoreAdamW([{"params": rest}, dict(galore)], lr=1e-3)))
        rows.append(("GaLoreAdamW8bit (galore-torch)", lambda: GaLoreAdamW8bit([{"params": rest}, dict(galore)], lr=1e-3)))
    except Exception:  # noqa: BLE001
        pass
    return rows


def peer_row(build: Callable[[], torch.optim.Optimizer], model: nn.Module, vocab: int, device: torch.device,
             seq: int = 32) -> dict[str, Any]:
    from ..strategies.footprint import measure

    opt = build()
    tracker = None
    for step in range(2):
        model(*_tokens(vocab, seq, step, 0, device))[1].backward()
        with tracker.tracking() if tracker is not None else contextlib.nullcontext():
            opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 0:  # the second step's ops followed: its state is made, what it allocates beside it is the peak's
            start = sum(measure({}, opt, [model], device).values())
            tracker = PeakTracker(excluded_storages([model], opt)).begin()
    assert tracker is not None
    measured = measure({}, opt, [model], device)
    adamw = 8 * sum(p.numel() for p in model.parameters())
    return {"measured_bytes": sum(measured.values()), "accounted_bytes": None, "device_bytes": _device_bytes(measured),
            "adamw_bytes": adamw, "transient_bytes": tracker.transient, "peak_bytes": start + tracker.transient,
            "by_category": measured}


def _picks(text: str, name: str) -> bool:
    return name == text[1:] if text.startswith("=") else text in name


def memory_benchmark(shapes: list[tuple[str, int | None, int | None]], device: torch.device | None = None,
                     peers: bool = True, log: Callable[[str], None] = lambda _: None,
                     only: list[str] | None = None, workers: int = 2) -> dict[str, Any]:
    """Every row at every shape, rank r = d_model/8 (min(p, q)/8 of every block matrix); ``log`` hears of each.
    ``only``: just the strategy rows whose name contains one of these texts, or is one after a leading ``=`` (a
    ConfigError names the rows when none does). ``workers``: M, of which each strategy row measures worker 0."""
    chosen = [(name, extra) for name, extra in STRATEGY_ROWS if only is None or any(_picks(text, name) for text in only)]
    if not chosen:
        raise ConfigError(f"--rows {' '.join(map(repr, only or []))} matches no row; the rows: "
                          + "; ".join(name for name, _ in STRATEGY_ROWS))
    from ..model import build_model

    device = device or torch.device("cpu")
    before = live_storages()
    compact.make_tables(device)  # the codec's tables, made once per process: counted apart, not in a row's peak
    tables = sum(n for key, n in live_storages().items() if key not in before)
    rows = []
    for preset, d_model, layers in shapes:
        overrides = shape_overrides(preset, d_model, layers)
        vocab = 4096 if d_model is None else 32000
        base = build_config(overrides=overrides)
        rank = base.model.d_model // 8
        label = preset if d_model is None else f"d{d_model}x{layers}"
        found: list[tuple[str, dict[str, Any]]] = []
        if peers:
            torch.manual_seed(0)
            model = build_model(base, vocab).to(device)
            for name, build in _peer_optimizers(model, rank):
                log(f"{label}: {name}")
                try:
                    found.append((name, peer_row(build, model, vocab, device)))
                except Exception as exc:  # noqa: BLE001 - a peer that does not run here is reported, not fatal
                    log(f"    {name} did not run here: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                model.zero_grad(set_to_none=True)
            del model
        for name, extra in chosen:
            log(f"{label}: {name}")
            try:
                found.append((name, strategy_row([*overrides, f"strategy.rank={rank}", *extra], vocab, device,
                                                         workers=workers)))
            except ConfigError as exc:  # a fixed rank wider than this shape's matrices: not measured here
                log(f"    not at this shape: {str(exc).splitlines()[0][:160]}")
        params = sum(p.numel() for p in build_model(base, vocab).parameters())
        for name, row in found:
            adamw = row["adamw_bytes"]
            accounted = row["accounted_bytes"]
            rows.append({"shape": label, "params": params, "rank": rank, "name": name, **row,
                         "total_vs_adamw": row["measured_bytes"] / adamw, "device_vs_adamw": row["device_bytes"] / adamw,
                         "peak_vs_adamw": row.get("peak_bytes", row["measured_bytes"]) / adamw,
                         "accounted_vs_measured": None if accounted is None else accounted / row["measured_bytes"]})
    return {"machine": machine(), "device": str(device), "workers": workers, "codec_tables_bytes": tables, "rows": rows}


def within(rows: list[dict[str, Any]], tolerance: float = 0.02) -> list[str]:
    """Rows whose accounted bytes differ from the measured ones by more than ``tolerance``."""
    return [f"{r['shape']} {r['name']}" for r in rows
            if r["accounted_bytes"] is not None and not math.isclose(r["accounted_bytes"], r["measured_bytes"], rel_tol=tolerance)]
