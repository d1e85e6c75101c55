"""summary.json: what a finished run reports (perplexity, bytes against DDP, optimizer state, modelled time)."""

from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

import torch

from ..comm.ledger import Ledger
from ..config import Config
from ..errors import WriteError
from ..files import atomic_write, write_json
from .checkpoint import full_state

if TYPE_CHECKING:
    from .loop import Trainer


def modeled_wall_s(cfg: Config, ledger: Ledger, compute_s: float, bandwidth: float) -> float:
    """Modelled wall-clock at ``bandwidth`` bit/s: the compute, the blocking collectives, and what the
    synchronisations in flight (``sync_delay`` = τ) take beyond the τ steps of compute each one hides behind:
    the rounds started at steps s ≤ steps − τ ran behind τ steps each (a later one lands early, at the end)."""
    s, steps = cfg.strategy, cfg.train.steps
    blocking, behind = ledger.modeled_comm_s(bandwidth, cfg.comm.latency_s, medium=cfg.comm.medium, split=True)
    hidden = max(0, (steps - s.sync_delay) // s.sync_every) * s.sync_delay * compute_s / steps if s.sync_delay else 0.0
    return compute_s + blocking + max(0.0, behind - hidden)


def summarize(trainer: Trainer, wall_s: float, resumed_from: int) -> dict[str, Any]:
    """The run's summary; the main process also writes summary.json and the final model.pt."""
    cfg, comm, state = trainer.cfg, trainer.comm, trainer.state
    steps = cfg.train.steps
    ledger = comm.ledger
    report = trainer.optimizer.comm_report()
    intra = comm.intra_ledger  # a worker of several ranks: their traffic on the worker's own (fast) link
    intra_s = intra.modeled_comm_s(cfg.comm.intra_bandwidth_gbit * 1e9, cfg.comm.latency_s) if intra else 0.0
    measured_s = ledger.comm_s + (intra.comm_s if intra else 0.0)
    blocked_s = ledger.blocked_s + (intra.comm_s if intra else 0.0)  # what the training thread waited for
    compute_s = max(0.0, state.train_s - blocked_s) / len(comm.local_ranks)  # per worker
    summary = {
        "strategy": cfg.strategy.name,
        "model": cfg.model.preset,
        "params": trainer.models[0].num_params(),
        "workers": comm.world_size,
        "communicator": type(comm).__name__,
        "sync_every": cfg.strategy.sync_every if cfg.strategy.name != "ddp" else 1,
        "steps": steps,
        "tokens": steps * trainer.tokens_per_step,
        "val_loss": state.val_loss,
        "val_ppl": math.exp(state.val_loss),
        "unigram_val_ppl": trainer.data.manifest["unigram_baseline"]["val_ppl"],
        "wall_s": wall_s,
        "train_s": state.train_s,
        "tokens_per_s": steps * trainer.tokens_per_step / state.train_s if state.train_s else float("nan"),
        "optimizer_state_bytes": trainer.optimizer.strategy.state_bytes(),
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
        "compute_utilisation": compute_s * len(comm.local_ranks) / state.train_s if state.train_s else float("nan"),
        "modeled_wall_s": {
            f"{bw:g}gbit": modeled_wall_s(cfg, ledger, compute_s, bw * 1e9) + intra_s for bw in cfg.comm.bandwidths_gbit
        },
        "medium": cfg.comm.medium,
        "latency_s": cfg.comm.latency_s,
        "ranks_per_worker": cfg.dist.ranks_per_worker,
        "intra_worker_wire_bytes_total": intra.total_wire_bytes if intra else 0,
        "intra_worker_by_collective": intra.table() if intra else {},
        "skipped_steps": state.skipped,
        "resumed_from_step": resumed_from,
        "out_dir": str(trainer.out),
    }
    if getattr(comm, "fault_tolerant", False):  # torchft: each committed round's step, kind and workers
        summary["rounds"] = comm.rounds
    for key, values in state.diagnostics.items():
        summary[f"{key}_mean"] = sum(values) / len(values)
        summary[f"{key}_last"] = values[-1]
    weights = full_state(trainer.models[0])  # a sharded model's shards gathered on every rank of its worker
    if trainer.main:
        buffer = io.BytesIO()
        torch.save(weights, buffer)
        try:
            atomic_write(trainer.out / "model.pt", buffer.getvalue())
            write_json(trainer.out / "summary.json", summary)
        except WriteError as exc:
            latest = trainer.checkpoints.latest_intact_name()
            kept = f"; the checkpoint {latest} is intact: free space and rerun with --resume {trainer.out}" if latest else ""
            raise WriteError(f"{exc}{kept}") from None
    return summary
