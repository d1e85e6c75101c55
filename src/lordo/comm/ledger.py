"""The communication ledger: every collective, counted by the communicator itself, and a wall-clock model.

Each entry holds the *payload* one worker contributes (the tensors it hands to the collective) and its *wire*
bytes: what that worker actually sends over its link under the collective's algorithm. The two differ: a
ring all-reduce of S bytes puts 2(M−1)/M·S on each link, an all-gather (M−1)·S, a tree broadcast sends
from the root and the inner nodes only. Ratios to DDP and the modelled wall-clock use wire bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def broadcast_children(rank: int, world: int, root: int = 0) -> int:
    """How many workers ``rank`` sends to in a binomial-tree broadcast from ``root`` (gloo's algorithm)."""
    relative = (rank - root) % world
    count, step = 0, 1
    while step < world:
        if step > relative and relative + step < world:
            count += 1
        step *= 2
    return count


def wire_bytes(kind: str, payload: int, world: int, rank: int = 0) -> int:
    """Bytes worker ``rank`` sends for one collective to which it contributes ``payload`` bytes, on gloo's
    algorithms (tests/test_wire.py checks them against the bytes written to the process's sockets):

    - ``all_reduce``: ring, 2(M−1)/M·S;
    - ``all_gather``: ring, (M−1)·S (S: one worker's part);
    - ``all_to_all`` (a reduce-scatter's first half): (M−1)/M·S (S: all it scatters, in M equal chunks);
    - ``broadcast``: binomial tree, S per child (the root has ⌈log2 M⌉ children, leaves none)."""
    if world <= 1:
        return 0
    if kind == "all_reduce":
        return 2 * (world - 1) * payload // world
    if kind == "all_gather":
        return (world - 1) * payload
    if kind == "all_to_all":
        return (world - 1) * payload // world
    if kind == "broadcast":
        return broadcast_children(rank, world) * payload
    raise ValueError(f"unknown collective {kind!r}")


@dataclass
class Entry:
    calls: int = 0
    bytes: int = 0  # payload bytes this worker contributed, summed over calls
    tensors: int = 0
    wire: int = 0  # bytes this worker sent, summed over calls


@dataclass
class Ledger:
    """Totals per (collective kind, tag) for one worker (worker ``rank``; on the simulator, worker 0)."""

    world_size: int
    rank: int = 0
    entries: dict[str, Entry] = field(default_factory=dict)
    comm_s: float = 0.0  # measured seconds inside collectives (loopback or in-process here)

    def record(self, kind: str, tag: str, nbytes: int, ntensors: int, seconds: float = 0.0, wire: int | None = None) -> None:
        e = self.entries.setdefault(f"{kind}:{tag}", Entry())
        e.calls += 1
        e.bytes += nbytes
        e.tensors += ntensors
        e.wire += wire_bytes(kind, nbytes, self.world_size, self.rank) if wire is None else wire
        self.comm_s += seconds

    @property
    def total_bytes(self) -> int:
        """Payload bytes, all collectives."""
        return sum(e.bytes for e in self.entries.values())

    @property
    def total_wire_bytes(self) -> int:
        """Bytes sent, all collectives."""
        return sum(e.wire for e in self.entries.values())

    @property
    def total_calls(self) -> int:
        return sum(e.calls for e in self.entries.values())

    def modeled_comm_s(self, bandwidth_bits_per_s: float, latency_s: float) -> float:
        """Seconds the recorded collectives take on a link of this bandwidth: a latency per call plus the wire
        bytes at the bandwidth (a worker sends and receives at once, so its sent bytes set the time)."""
        if self.world_size <= 1:
            return 0.0
        return sum(e.calls * latency_s + e.wire * 8 / bandwidth_bits_per_s for e in self.entries.values())

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "comm_s": self.comm_s,
            "entries": {k: [e.calls, e.bytes, e.tensors, e.wire] for k, e in self.entries.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.world_size = int(state["world_size"])
        self.rank = int(state.get("rank", self.rank))
        self.comm_s = float(state["comm_s"])
        self.entries = {}
        for key, values in state["entries"].items():
            calls, nbytes, tensors = map(int, values[:3])
            # ledgers saved before wire bytes were counted: the model gives them from the payload per call
            wire = int(values[3]) if len(values) > 3 else calls * wire_bytes(key.split(":")[0], nbytes // max(calls, 1),
                                                                             self.world_size, self.rank)
            self.entries[key] = Entry(calls, nbytes, tensors, wire)

    def table(self) -> dict[str, dict[str, int]]:
        return {k: {"calls": e.calls, "bytes": e.bytes, "tensors": e.tensors, "wire": e.wire}
                for k, e in sorted(self.entries.items())}
