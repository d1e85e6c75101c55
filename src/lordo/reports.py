"""What :class:`~lordo.DistributedOptimizer` reports of itself: its collectives (the ledger), the bytes sent against
DDP's, and its optimizer state measured from the live tensors or computed from the shapes (a mixin over the
optimizer's ``strategy`` and ``comm``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .comm.ledger import Ledger, wire_bytes

if TYPE_CHECKING:
    from .comm import Communicator
    from .strategies import Strategy


class Reports:
    strategy: Strategy
    comm: Communicator

    @property
    def ledger(self) -> Ledger:
        """Every collective so far: kind, tag, calls, bytes per worker (``ledger.table()``)."""
        return self.comm.ledger

    def memory_report(self) -> dict[str, int]:
        """Bytes of optimizer state one worker holds (a rank, for a model sharded over the worker's ranks), measured
        from the live tensors of its inner optimizer and of the strategy (each storage once), by category
        (``... (host)``: kept in host memory), with ``total``, ``device_total`` (on the training device) and
        ``adamw`` (two fp32 moments of every trained parameter: what ``torch.optim.AdamW`` would hold) for
        comparison. Optimizers allocate state at their first step: before it, their moments are not there yet.
        :meth:`accounted_memory` gives the figures computed from shapes and settings."""
        from .strategies.footprint import report

        return report(self.strategy.measured_state_bytes(), self._adamw_bytes())

    def accounted_memory(self) -> dict[str, int]:
        """:meth:`memory_report`'s categories as computed from the shapes and storage settings (what the state holds
        after the first step), without reading the tensors."""
        from .strategies.footprint import report

        return report(self.strategy.state_bytes(), self._adamw_bytes())

    def _adamw_bytes(self) -> int:
        # per rank of a sharded model: its shards
        return 2 * 4 * sum(t.numel() for t in self.strategy.workers[0].tensors)

    def comm_report(self) -> dict[str, Any]:
        """Bytes per worker so far, against what DDP would have needed for the same steps (the full gradient
        all-reduced every step, plus the same initial broadcast). ``wire_*`` are the bytes a worker sends
        under each collective's algorithm (a ring all-reduce of S bytes sends 2(M−1)/M·S); ``bytes_*`` the
        payload it hands to the collectives. ``ratio_to_ddp`` compares wire bytes."""
        steps, ledger, world = self.strategy.steps_done, self.ledger, self.comm.world_size
        init = ledger.entries.get("broadcast:init")
        grad = self.strategy.step_payload_bytes()
        ddp = steps * grad + (init.bytes if init else 0) if world > 1 else 0
        ddp_wire = steps * wire_bytes("all_reduce", grad, world) + (init.wire if init else 0) if world > 1 else 0
        total, wire = ledger.total_bytes, ledger.total_wire_bytes
        return {
            "steps": steps,
            "bytes_total": total,
            "bytes_per_step": total / steps if steps else 0.0,
            "wire_bytes_total": wire,
            "wire_bytes_per_step": wire / steps if steps else 0.0,
            "calls": ledger.total_calls,
            "ddp_bytes": ddp,
            "ddp_wire_bytes": ddp_wire,
            "ratio_to_ddp": wire / ddp_wire if ddp_wire else None,
            "payload_ratio_to_ddp": total / ddp if ddp else None,
            "by_collective": ledger.table(),
        }
