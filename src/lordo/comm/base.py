"""One small communicator interface, implemented in-process (``sim``) and over torch.distributed.

A process hosts one or more workers (``local_ranks``): the simulator hosts all M, a torch.distributed
process hosts one. Collectives take one list of tensors *per hosted worker* and work in place, so the
strategy code is identical on both: it loops over its hosted workers and calls the same collectives.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..memtrack import carry
from .ledger import Ledger, broadcast_children

TensorLists = Sequence[Sequence[torch.Tensor]]


def payload_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class RoundHandle:
    """A synchronisation's exchange started without blocking (:meth:`Communicator.start_round`). ``wait``
    returns its result once it has finished, re-raising what it raised; the seconds the caller waited go to
    the ledger's ``wait_s``."""

    def __init__(self, ledger: Ledger, fn: Callable[[], Any] | None = None, result: Any = None) -> None:
        self.ledger, self.result = ledger, result
        self.error: BaseException | None = None
        self.thread = None
        if fn is not None:
            self.thread = threading.Thread(target=self._run, args=(carry(fn),), name="lordo-round", daemon=True)
            self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # handed to the training thread by wait()
            self.error = exc

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def wait(self) -> Any:
        if self.thread is not None:
            t0 = time.perf_counter()
            self.thread.join()
            self.ledger.wait_s += time.perf_counter() - t0
            self.thread = None
        if self.error is not None:
            raise self.error
        return self.result


class Communicator(ABC):
    world_size: int
    local_ranks: list[int]
    background = False  # True on the view whose collectives run behind the training thread (start_round)
    overlaps_rounds = True  # whether start_round may run behind the training thread here (False: refused)

    def __init__(self, world_size: int, local_ranks: list[int]) -> None:
        self.world_size = world_size
        self.local_ranks = local_ranks
        self.ledger = Ledger(world_size, rank=local_ranks[0])  # the simulator's ledger speaks for worker 0

    @property
    def is_main(self) -> bool:
        """True in the process that hosts worker 0 (evaluates, logs, writes files)."""
        return 0 in self.local_ranks

    @property
    def is_node_main(self) -> bool:
        """True in one process per machine: the one that prepares local files such as the corpus."""
        return True

    # A worker may be a group of ranks (WorkerGroupCommunicator): synchronous inside, LoRDO between groups.
    # For one process per worker (or the simulator) these are the trivial answers.

    intra_ledger: Ledger | None = None  # traffic inside a worker (its fast link), when a worker has several ranks

    def data_shards(self) -> list[tuple[int, int]]:
        """(shard, of how many) of the training data each hosted worker reads: every rank reads its own."""
        return [(r, self.world_size) for r in self.local_ranks]

    @property
    def writes_worker_files(self) -> bool:
        """Whether this process writes its hosted workers' checkpoint files (one rank per worker does)."""
        return True

    def average_within_worker(self, grads: TensorLists) -> None:  # noqa: B027 (a no-op unless a worker has ranks)
        """Average each hosted worker's gradients over its ranks (every step; nothing with one rank)."""

    def _check(self, per_worker: TensorLists) -> list[torch.Tensor]:
        if len(per_worker) != len(self.local_ranks):
            raise ValueError(f"expected tensors for {len(self.local_ranks)} hosted workers, got {len(per_worker)}")
        first = list(per_worker[0])
        for other in per_worker[1:]:
            if [t.shape for t in other] != [t.shape for t in first]:
                raise ValueError("every worker must pass tensors of the same shapes")
        return first

    def all_reduce_mean(self, per_worker: TensorLists, tag: str, accounted: bool = True) -> None:
        """Replace each worker's tensors, in place, by their mean over all workers.

        ``accounted=False`` keeps the call out of the ledger: traffic that is not part of the training
        algorithm (averaging the workers' models for an evaluation), which DDP would not need either."""
        first = self._check(per_worker)
        if self.world_size == 1:  # nothing to exchange, nothing to count
            return
        t0 = time.perf_counter()
        self._all_reduce_mean(per_worker)
        if accounted:
            self.ledger.record("all_reduce", tag, payload_bytes(first), len(first), time.perf_counter() - t0,
                               background=self.background)

    def broadcast(self, per_worker: TensorLists, tag: str, src: int = 0) -> None:
        """Replace each worker's tensors, in place, by worker ``src``'s."""
        first = self._check(per_worker)
        if self.world_size == 1:
            return
        t0 = time.perf_counter()
        self._broadcast(per_worker, src)
        size = payload_bytes(first)
        self.ledger.record("broadcast", tag, size, len(first), time.perf_counter() - t0,
                           wire=broadcast_children(self.ledger.rank, self.world_size, root=src) * size,
                           background=self.background)

    def all_gather(self, per_worker: TensorLists, tag: str) -> list[list[list[torch.Tensor]]]:
        """Every worker's tensors, delivered to every worker: ``result[h][m]`` is worker m's list, for each
        hosted worker h. Treat the result as read-only (the simulator shares it between hosted workers).
        The ledger counts what one worker contributes (its own tensors)."""
        first = self._check(per_worker)
        if self.world_size == 1:
            return [[list(tensors)] for tensors in per_worker]
        t0 = time.perf_counter()
        out = self._all_gather(per_worker)
        self.ledger.record("all_gather", tag, payload_bytes(first), len(first), time.perf_counter() - t0,
                           background=self.background)
        return out

    def all_to_all(self, per_worker: TensorLists, tag: str) -> list[list[torch.Tensor]]:
        """Worker w's chunk j goes to worker j: each hosted worker passes M chunks of one shape and dtype (one
        per destination) and gets, per hosted worker, the M chunks sent to it (from workers 0 … M−1). The
        ledger counts all M chunks as the payload and the M − 1 sent away as wire bytes."""
        first = self._check(per_worker)
        if len(first) != self.world_size or any(t.shape != first[0].shape or t.dtype != first[0].dtype for t in first):
            raise ValueError(f"all_to_all takes {self.world_size} chunks of one shape and dtype per worker")
        if self.world_size == 1:
            return [list(chunks) for chunks in per_worker]
        t0 = time.perf_counter()
        out = self._all_to_all(per_worker)
        size = payload_bytes(first[:1])
        self.ledger.record("all_to_all", tag, size * self.world_size, len(first), time.perf_counter() - t0,
                           wire=size * (self.world_size - 1), background=self.background)
        return out

    @abstractmethod
    def _all_to_all(self, per_worker: TensorLists) -> list[list[torch.Tensor]]: ...

    @abstractmethod
    def _all_gather(self, per_worker: TensorLists) -> list[list[list[torch.Tensor]]]: ...

    @abstractmethod
    def _all_reduce_mean(self, per_worker: TensorLists) -> None: ...

    @abstractmethod
    def _broadcast(self, per_worker: TensorLists, src: int) -> None: ...

    def agree(self, flags: list[bool]) -> list[bool]:
        """Control traffic, not in the ledger: each flag becomes true everywhere if it is true on any worker
        (stop requests, non-finite losses), so that every process takes the same branch."""
        return list(flags)

    def agree_min(self, value: int) -> int:
        """Control traffic, not in the ledger: the smallest ``value`` over all processes (the newest
        checkpoint step every process can load, ...)."""
        return value

    def share_text(self, text: str) -> str:
        """Control traffic, not in the ledger: the main process's ``text`` on every process (a folder name
        only the main process may choose)."""
        return text

    @abstractmethod
    def barrier(self) -> None: ...

    def start_round(self, exchange: Callable[[Communicator], Any]) -> RoundHandle:
        """Start a synchronisation's collectives without waiting for them: ``exchange(comm)`` makes them on
        ``comm``, over buffers that nothing else touches until the handle's ``wait`` returns. Here (one process
        hosts every worker) it runs at once; torch.distributed runs it in a thread on a process group of its
        own, so the training thread's collectives and the exchange's never interleave. Its traffic is counted
        as overlapped either way (the ledger's ``overlapped_*``), so the modelled wall-clock can hide it."""
        self.background = True
        try:
            return RoundHandle(self.ledger, result=exchange(self))
        finally:
            self.background = False

    fault_tolerant = False  # True: rounds can fail and be run again (torchft)
    # fault-tolerant backends: the settings that shape the trajectory and how to compare two of them (a list
    # of differences), set by DistributedOptimizer, so that a worker with other settings cannot join
    settings: dict[str, Any] | None = None
    compare_settings: Callable[[dict, dict], list[str]] | None = None

    def round(self, kind: str, fn, strategy, resume_at: int):
        """Run ``fn``, a synchronisation's collectives and updates, as one round (``kind``: sync, final,
        initial_basis). Here simply ``fn()``; the torchft communicator runs it again, without the workers that
        left, when one fails mid-round, and lets a recovering worker take part."""
        return fn()

    def join(self, strategy) -> int:
        """Enter the run (fault-tolerant backends: start with the others or recover from them); returns the step
        counter to continue from. Here nothing to do."""
        return strategy.steps_done

    def close(self, clean: bool = True) -> None:  # noqa: B027 (a no-op unless the backend holds a process group)
        """Release the process group, if any; ``clean=False`` when an error is on its way out (a peer may be
        dead, so nothing waits for the others)."""
