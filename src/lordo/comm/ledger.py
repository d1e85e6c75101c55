"""The communication ledger: every collective, counted by the communicator itself, and a wall-clock model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Entry:
    calls: int = 0
    bytes: int = 0  # payload bytes each worker contributes, summed over calls
    tensors: int = 0


@dataclass
class Ledger:
    """Totals per (collective kind, tag). Bytes are per worker: what one worker puts on the wire."""

    world_size: int
    entries: dict[str, Entry] = field(default_factory=dict)
    comm_s: float = 0.0  # measured seconds inside collectives (loopback or in-process here)

    def record(self, kind: str, tag: str, nbytes: int, ntensors: int, seconds: float = 0.0) -> None:
        e = self.entries.setdefault(f"{kind}:{tag}", Entry())
        e.calls += 1
        e.bytes += nbytes
        e.tensors += ntensors
        self.comm_s += seconds

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    @property
    def total_calls(self) -> int:
        return sum(e.calls for e in self.entries.values())

    def modeled_comm_s(self, bandwidth_bits_per_s: float, latency_s: float) -> float:
        """Seconds the recorded collectives take on a link of this bandwidth.

        All-reduce of S bytes over M workers as a ring: latency + 2·(M−1)/M·S/bandwidth per call.
        All-gather of S bytes from each worker as a ring: latency + (M−1)·S/bandwidth per call.
        Broadcast of S bytes as a pipelined chain: latency + S/bandwidth per call.
        """
        m = self.world_size
        bytes_per_s = bandwidth_bits_per_s / 8
        total = 0.0
        for key, e in self.entries.items():
            kind = key.split(":", 1)[0]
            factor = {"all_reduce": 2 * (m - 1) / m, "all_gather": float(m - 1)}.get(kind, 1.0)
            total += e.calls * latency_s + factor * e.bytes / bytes_per_s
        return total if m > 1 else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "comm_s": self.comm_s,
            "entries": {k: [e.calls, e.bytes, e.tensors] for k, e in self.entries.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.world_size = int(state["world_size"])
        self.comm_s = float(state["comm_s"])
        self.entries = {k: Entry(*map(int, v)) for k, v in state["entries"].items()}

    def table(self) -> dict[str, dict[str, int]]:
        return {k: {"calls": e.calls, "bytes": e.bytes, "tensors": e.tensors} for k, e in sorted(self.entries.items())}
