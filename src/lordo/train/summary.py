"""summary.json: what a finished run reports (perplexity, bytes against DDP, optimizer state, modelled time)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..comm import Communicator
from ..comm.ledger import Ledger
from ..config import Config
from ..distributed_optimizer import DistributedOptimizer


def modeled_wall_s(cfg: Config, ledger: Ledger, compute_s: float, bandwidth: float) -> float:
    """Modelled wall-clock at ``bandwidth`` bit/s: the compute, the blocking collectives, and what the
    synchronisations in flight (``sync_delay`` = τ) take beyond the τ steps of compute each one hides behind:
    the rounds started at steps s ≤ steps − τ ran behind τ steps each (a later one lands early, at the end)."""
    s, steps = cfg.strategy, cfg.train.steps
    blocking, behind = ledger.modeled_comm_s(bandwidth, cfg.comm.latency_s, medium=cfg.comm.medium, split=True)
    hidden = max(0, (steps - s.sync_delay) // s.sync_every) * s.sync_delay * compute_s / steps if s.sync_delay else 0.0
    return compute_s + blocking + max(0.0, behind - hidden)


@dataclass
class RunFacts:
    """What a summary says of a finished run besides its config, communicator and optimizer."""

    params: int  # the model's parameters
    tokens_per_step: int
    unigram_val_ppl: float  # the corpus's unigram baseline
    val_loss: float
    train_s: float  # seconds of training steps (all hosted workers)
    skipped: int  # steps skipped for non-finite gradients
    diagnostics: dict[str, list[float]]  # per-sync values, averaged into the summary
    out_dir: str


def summarize(cfg: Config, comm: Communicator, optimizer: DistributedOptimizer, run: RunFacts, wall_s: float,
              resumed_from: int) -> dict[str, Any]:
    """The run's summary (what summary.json holds)."""
    steps = cfg.train.steps
    ledger = comm.ledger
    report = optimizer.comm_report()
    intra = comm.intra_ledger  # a worker of several ranks: their traffic on the worker's own (fast) link
    intra_s = intra.modeled_comm_s(cfg.comm.intra_bandwidth_gbit * 1e9, cfg.comm.latency_s) if intra else 0.0
    measured_s = ledger.comm_s + (intra.comm_s if intra else 0.0)
    blocked_s = ledger.blocked_s + (intra.comm_s if intra else 0.0)  # what the training thread waited for
    compute_s = max(0.0, run.train_s - blocked_s) / len(comm.local_ranks)  # per worker
    summary = {
        "strategy": cfg.strategy.name,
        "model": cfg.model.preset,
        "params": run.params,
        "workers": comm.world_size,
        "communicator": type(comm).__name__,
        "sync_every": cfg.strategy.sync_every if cfg.strategy.name != "ddp" else 1,
        "steps": steps,
        "tokens": steps * run.tokens_per_step,
        "val_loss": run.val_loss,
        "val_ppl": math.exp(run.val_loss),
        "unigram_val_ppl": run.unigram_val_ppl,
        "wall_s": wall_s,
        "train_s": run.train_s,
        "tokens_per_s": steps * run.tokens_per_step / run.train_s if run.train_s else float("nan"),
        # measured from the live tensors at the end of the run (lordo.strategies.footprint), and as the shapes and
        # storage settings account for it during training
        "optimizer_state_bytes": optimizer.strategy.measured_state_bytes(),
        "optimizer_state_bytes_accounted": optimizer.strategy.state_bytes(),
        "comm_wire_bytes_total": ledger.total_wire_bytes,  # what one worker sent (worker 0)
        "comm_wire_bytes_per_step": ledger.total_wire_bytes / steps,
        "comm_bytes_total": ledger.total_bytes,  # the payload it handed to the collectives
        "comm_bytes_per_step": ledger.total_bytes / steps,
        "comm_calls": ledger.total_calls,
        "comm_by_collective": ledger.table(),
        "ddp_comm_wire_bytes": report["ddp_wire_bytes"],
        "ddp_comm_bytes": report["ddp_bytes"],
        "comm_ratio_to_ddp": report["ratio_to_ddp"],  # wire bytes against ddp's
        "comm_payload_ratio_to_ddp": report["payload_ratio_to_ddp"],
        "compute_s_per_worker": compute_s,
        "measured_comm_s": measured_s,
        "blocked_comm_s": blocked_s,
        "overlapped_comm_s": ledger.overlapped_s,
        "round_wait_s": ledger.wait_s,
        "compute_utilisation": compute_s * len(comm.local_ranks) / run.train_s if run.train_s else float("nan"),
        "modeled_wall_s": {
            f"{bw:g}gbit": modeled_wall_s(cfg, ledger, compute_s, bw * 1e9) + intra_s for bw in cfg.comm.bandwidths_gbit
        },
        "medium": cfg.comm.medium,
        "latency_s": cfg.comm.latency_s,
        "ranks_per_worker": cfg.dist.ranks_per_worker,
        "intra_worker_wire_bytes_total": intra.total_wire_bytes if intra else 0,
        "intra_worker_by_collective": intra.table() if intra else {},
        "skipped_steps": run.skipped,
        "resumed_from_step": resumed_from,
        "out_dir": run.out_dir,
    }
    if getattr(comm, "fault_tolerant", False):  # torchft: each committed round's step, kind and workers
        summary["rounds"] = comm.rounds  # type: ignore[attr-defined]
    for key, values in run.diagnostics.items():
        summary[f"{key}_mean"] = sum(values) / len(values)
        summary[f"{key}_last"] = values[-1]
    return summary
