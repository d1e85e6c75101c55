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


MEDIA = ("switched", "shared")


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
    comm_s: float = 0.0  # measured seconds inside collectives, wherever they ran
    # the part of the traffic that ran behind the training thread (a synchronisation in flight, sync_delay > 0):
    # its seconds, calls and wire bytes (included in the totals above), and what the training thread waited for it
    overlapped_s: float = 0.0
    overlapped_calls: int = 0
    overlapped_wire: int = 0
    wait_s: float = 0.0

    def record(self, kind: str, tag: str, nbytes: int, ntensors: int, seconds: float = 0.0, wire: int | None = None,
               background: bool = False) -> None:
        key = f"{kind}:{tag}"
        if key not in self.entries:  # a new dict, not an insertion: a round's thread may record while the
            self.entries = {**self.entries, key: Entry()}  # training thread iterates the old one (totals, table)
        e = self.entries[key]
        sent = wire_bytes(kind, nbytes, self.world_size, self.rank) if wire is None else wire
        e.calls += 1
        e.bytes += nbytes
        e.tensors += ntensors
        e.wire += sent
        self.comm_s += seconds
        if background:
            self.overlapped_s += seconds
            self.overlapped_calls += 1
            self.overlapped_wire += sent

    @property
    def blocked_s(self) -> float:
        """Seconds the training thread spent in collectives or waiting for a synchronisation in flight."""
        return self.comm_s - self.overlapped_s + self.wait_s

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

    def medium_bytes(self, key: str | None = None) -> int:
        """Bytes all workers together put on the network for the entry ``key`` (None: all of them): M times
        this worker's for the symmetric collectives, (M − 1) payloads for a broadcast (each receiver gets it once)."""
        entries = self.entries.items() if key is None else [(key, self.entries[key])]
        return sum((self.world_size - 1) * e.bytes if k.startswith("broadcast:") else self.world_size * e.wire
                   for k, e in entries)

    def modeled_comm_s(self, bandwidth_bits_per_s: float, latency_s: float, medium: str = "switched",
                       split: bool = False) -> Any:
        """Seconds the recorded collectives take on a network of this bandwidth: a latency per call plus the bytes
        at the bandwidth. ``medium``: ``switched`` (each worker has a link of its own, as in a cluster: a worker
        sends and receives at once, so its own sent bytes set the time) or ``shared`` (one medium for all, as a
        site uplink or the throttled namespace of ``lordo bench link``: every worker's bytes cross it).
        ``split``: (blocking, overlapped) seconds, the second for the traffic that ran behind the training."""
        if medium not in MEDIA:
            raise ValueError(f"medium must be one of {', '.join(MEDIA)}, got {medium!r}")
        if self.world_size <= 1:
            return (0.0, 0.0) if split else 0.0
        shared = medium == "shared"
        sent = self.medium_bytes() if shared else self.total_wire_bytes
        behind = self.overlapped_wire * (self.world_size if shared else 1)
        total = self.total_calls * latency_s + sent * 8 / bandwidth_bits_per_s
        overlapped = self.overlapped_calls * latency_s + behind * 8 / bandwidth_bits_per_s
        return (total - overlapped, overlapped) if split else total

    def state_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "comm_s": self.comm_s,
            "overlapped": [self.overlapped_s, self.overlapped_calls, self.overlapped_wire, self.wait_s],
            "entries": {k: [e.calls, e.bytes, e.tensors, e.wire] for k, e in self.entries.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.world_size = int(state["world_size"])
        self.rank = int(state.get("rank", self.rank))
        self.comm_s = float(state["comm_s"])
        seconds, calls, wire, wait = state.get("overlapped", (0.0, 0, 0, 0.0))  # older ledgers: nothing overlapped
        self.overlapped_s, self.overlapped_calls, self.overlapped_wire, self.wait_s = float(seconds), int(calls), int(wire), float(wait)
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
