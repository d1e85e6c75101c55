"""torch.distributed backend: one worker per process (gloo on CPU, NCCL on CUDA), started by torchrun
or by ``lordo train --backend gloo --workers M``.

Collectives are bucketed (one flat buffer per dtype) and have a timeout; a failure inside torch.distributed
(a peer that died, a timeout) surfaces as a :class:`CommError` naming the collective.
"""

from __future__ import annotations

import atexit
import copy
import datetime as _dt
import gc
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..errors import LordoError
from ..optim.sharded import is_sharded
from .base import Communicator, RoundHandle, TensorLists, payload_bytes
from .ledger import Ledger, broadcast_children


class CommError(LordoError):
    """A collective failed: a worker died, the network broke, or the timeout expired."""


ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ENV_KEYS)


_EXIT_HANDLER_REGISTERED = False
_COMMUNICATORS: weakref.WeakSet = weakref.WeakSet()  # every live one: a round in flight settles before the group goes


def destroy_group_at_exit() -> None:
    """Have the process group destroyed at interpreter exit if nothing destroyed it before (a script that never
    calls ``opt.close()`` or ``dist.destroy_process_group()``, as Hugging Face's Trainer scripts never do): torch's
    own teardown of a live gloo group during the interpreter's finalisation can abort the process after a run that
    went well (``terminate called without an active exception``, SIGABRT). A synchronisation still in flight
    (``sync_delay``) is let end first, however the script ends (``sys.exit``, an exception): a group destroyed
    under its exchange aborts the process too. No barrier there: a peer may be dead."""
    global _EXIT_HANDLER_REGISTERED
    if not _EXIT_HANDLER_REGISTERED:
        atexit.register(_destroy_group_left_open)
        _EXIT_HANDLER_REGISTERED = True


def _destroy_group_left_open() -> None:
    for comm in list(_COMMUNICATORS):
        comm.settle_round()
        comm.release_groups()
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - never fail at exit
            pass
    gc.collect()  # the groups' C++ objects (and their gloo threads) go now, not during the interpreter's finalisation


BUCKET_BYTES = 1 << 24  # the most one flat buffer of a collective holds (a larger tensor goes alone)


def _buckets(tensors) -> list[list[torch.Tensor]]:
    """Tensors grouped by dtype and device, each group cut where it would pass BUCKET_BYTES: one flat buffer per
    bucket goes through each collective, so a synchronisation's copies stay that size, not the model's."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    out: list[list[torch.Tensor]] = []
    for group in groups.values():
        size = BUCKET_BYTES
        for t in group:
            nbytes = t.numel() * t.element_size()
            if size + nbytes > BUCKET_BYTES:
                out.append([])
                size = 0
            out[-1].append(t)
            size += nbytes
    return out


class GroupOps:
    """Bucketed collectives over one process group (``None``: all processes), whose members' global ranks are
    ``ranks``, in group order; ``run`` wraps each call into a CommError on failure."""

    def __init__(self, group, ranks: list[int], run) -> None:
        self.group, self.ranks, self.run = group, ranks, run

    @property
    def size(self) -> int:
        return len(self.ranks)

    @torch.no_grad()
    def all_reduce_mean(self, tensors) -> None:
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.run("all_reduce", dist.all_reduce, flat, op=dist.ReduceOp.SUM, group=self.group)
            flat /= self.size
            _unflatten(flat, bucket)
            del flat  # before the next bucket's: one flat buffer at a time

    @torch.no_grad()
    def all_gather(self, tensors) -> list[list[torch.Tensor]]:
        result: list[list[torch.Tensor | None]] = [[None] * len(tensors) for _ in range(self.size)]
        index = {id(t): i for i, t in enumerate(tensors)}
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            outs = [torch.empty_like(flat) for _ in range(self.size)]
            self.run("all_gather", dist.all_gather, outs, flat, group=self.group)
            for member, out in enumerate(outs):
                offset = 0
                for t in bucket:
                    result[member][index[id(t)]] = out[offset : offset + t.numel()].view_as(t)
                    offset += t.numel()
            del flat, outs
        return [[t for t in row if t is not None] for row in result]

    @torch.no_grad()
    def all_to_all(self, chunks) -> list[torch.Tensor]:
        received = torch.empty((self.size, *chunks[0].shape), dtype=chunks[0].dtype, device=chunks[0].device)
        self.run("all_to_all", dist.all_to_all_single, received, torch.stack(list(chunks)), group=self.group)
        return list(received.unbind(0))

    @torch.no_grad()
    def broadcast(self, tensors, src: int) -> None:
        """From the group's member ``src`` (its index in the group)."""
        for bucket in _buckets(tensors):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.run("broadcast", dist.broadcast, flat, src=self.ranks[src], group=self.group)
            _unflatten(flat, bucket)
            del flat


def _unflatten(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    offset = 0
    for t in bucket:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


class OneWorkerCollectives:
    """The collectives of a process that hosts one worker, through its :class:`GroupOps` (``self.ops``)."""

    ops: GroupOps

    @torch.no_grad()
    def _all_reduce_mean(self, per_worker: TensorLists) -> None:
        self.ops.all_reduce_mean(per_worker[0])

    @torch.no_grad()
    def _all_gather(self, per_worker: TensorLists) -> list[list[list[torch.Tensor]]]:
        return [self.ops.all_gather(per_worker[0])]

    @torch.no_grad()
    def _all_to_all(self, per_worker: TensorLists) -> list[list[torch.Tensor]]:
        return [self.ops.all_to_all(per_worker[0])]

    @torch.no_grad()
    def _broadcast(self, per_worker: TensorLists, src: int) -> None:
        self.ops.broadcast(per_worker[0], src)


class TorchDistCommunicator(OneWorkerCollectives, Communicator):
    """One worker per process. Joins the process group from torchrun's environment, or uses the one the
    caller already initialised (``dist.init_process_group``), which it then leaves open on ``close``."""

    def __init__(self, backend: str, timeout_s: float) -> None:
        self.timeout = _dt.timedelta(seconds=timeout_s)
        self.owns_group = not dist.is_initialized()
        if not self.owns_group:
            rank, world = dist.get_rank(), dist.get_world_size()
            backend = str(dist.get_backend())
        else:
            missing = [k for k in ENV_KEYS if k not in os.environ]
            if missing:
                raise CommError(
                    f"backend {backend!r} needs a launcher: environment variables {', '.join(missing)} are not set. "
                    "Start with `torchrun --nproc-per-node M -m lordo.cli train ...` or `lordo train --workers M --backend "
                    f"{backend}` (which starts the processes itself)"
                )
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            if backend == "nccl":
                if not torch.cuda.is_available():
                    raise CommError("backend 'nccl' needs CUDA devices; use 'gloo' on CPU")
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self._rendezvous = self._store(rank, world)
            try:
                dist.init_process_group(backend, store=self._rendezvous, rank=rank, world_size=world, timeout=self.timeout)
            except Exception as exc:  # rendezvous failures come in several exception types
                raise CommError(
                    f"could not join the process group as rank {rank} of {world} at "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} ({backend}): {exc}"
                ) from exc
        # the group goes at exit if nothing else destroyed it: ours when a script never calls close(), a caller's
        # (Accelerate's under Hugging Face's Trainer, whose scripts never destroy it) alike
        destroy_group_at_exit()
        super().__init__(world, [rank])
        self.backend = backend
        self.rank = rank
        self.ops = GroupOps(None, list(range(world)), self._run)
        self._side: TorchDistCommunicator | None = None  # the view start_round's exchanges run on
        self._round: RoundHandle | None = None
        _COMMUNICATORS.add(self)

    def start_round(self, exchange: Callable[[Communicator], Any]) -> RoundHandle:
        """The exchange in a thread, on a process group of its own (made at the first call: every process
        reaches it at the same step), over this communicator's ledger, counted as overlapped."""
        if self._round is not None and not self._round.done:
            raise RuntimeError("a synchronisation is already in flight; wait for it before starting another")
        if self._side is None:
            group = dist.new_group(list(range(self.world_size)), timeout=self.timeout)
            side = copy.copy(self)
            side.ops, side.background = GroupOps(group, self.ops.ranks, self._run), True
            self._side = side
        side = self._side
        self._round = RoundHandle(self.ledger, lambda: exchange(side))
        return self._round

    def settle_round(self) -> bool:
        """Let a round still in flight end before the group goes: it arrives (its peers started it at the same
        step, so it does unless one died) or its collective fails at the timeout. Returns whether it arrived;
        its error, if any, is dropped (something else is already ending the run)."""
        handle, self._round = self._round, None
        if handle is None or handle.thread is None:
            return handle is None or handle.error is None
        handle.thread.join(self.timeout.total_seconds() + 5.0)
        return handle.done and handle.error is None

    def release_groups(self) -> None:
        """Drop this object's references to the process groups it made (the side group of start_round): a group
        still referenced after ``destroy_process_group`` is destroyed during the interpreter's finalisation, where
        its gloo threads' teardown can abort the process (``terminate called without an active exception``)."""
        if self._round is None or self._round.done:
            self._side = None

    @property
    def is_node_main(self) -> bool:
        return int(os.environ.get("LOCAL_RANK", self.rank)) == 0

    def _store(self, rank: int, world: int):
        """The rendezvous key-value store, with keys private to this attempt.

        Under torchrun the agent hosts the store and keeps it across restarts (--max-restarts); without a prefix
        per attempt, a restarted group would read the dead attempt's addresses and hang connecting to them."""
        agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world_size=world,
            is_master=not agent_hosts_store and rank == 0,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"lordo/attempt-{attempt}", store)

    def _run(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise CommError(
                f"worker {self.rank}: {what} failed; another worker probably died or the network broke "
                f"(timeout {self.timeout.total_seconds():.0f}s). Cause: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            ) from exc

    def agree(self, flags: list[bool]) -> list[bool]:
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
        self._run("agree", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def agree_min(self, value: int) -> int:
        device = torch.device("cuda") if self.backend == "nccl" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=device)
        self._run("agree_min", dist.all_reduce, t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def share_text(self, text: str) -> str:
        box = [text if self.rank == 0 else None]
        self._run("share_text", dist.broadcast_object_list, box, src=0)
        return str(box[0])

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def close(self, clean: bool = True) -> None:
        """Destroy the process group this object created. After a clean run the ranks leave in order: a barrier
        (no rank tears its group down while a peer is still in a collective), then each rank destroys its group,
        and rank 0, which hosts the rendezvous store, waits until every other rank has done so before it
        returns (a peer that loses the store or its gloo connections mid-teardown can abort). ``clean=False``
        (an error is on its way out) skips both waits: a peer may be dead. A round still in flight ends first either
        way (it arrives, or its collective fails at the timeout): a group destroyed under it aborts the process."""
        if not (self.owns_group and dist.is_initialized()):
            return
        if not self.settle_round():  # a round in flight ends first (its peers are in it too), whatever the exit
            clean = False
        if clean:
            try:
                dist.barrier()
            except Exception:  # a peer died after all: tear down without waiting for it
                clean = False
        self.release_groups()
        dist.destroy_process_group()
        gc.collect()
        if clean:
            self._leave_in_order()

    def _leave_in_order(self, poll_s: float = 0.01) -> None:
        store, others = getattr(self, "_rendezvous", None), self.world_size - 1
        if store is None or others == 0:
            return
        try:
            if self.rank != 0:
                store.add("closed", 1)
                return
            deadline = time.monotonic() + min(self.timeout.total_seconds(), 60.0)
            while store.add("closed", 0) < others and time.monotonic() < deadline:
                time.sleep(poll_s)
        except Exception:  # the store is only a courtesy here; the run itself has finished
            pass


class WorkerGroupCommunicator(Communicator):
    """A LoRDO worker made of ``ranks_per_worker`` processes (a node, a cluster): synchronous inside, like DDP
    (gradients averaged over the worker's ranks every step, on its fast link), and one LoRDO worker to the
    others. Ranks ``w·R … w·R + R − 1`` form worker w. Collectives between workers run among the workers'
    first ranks (the leaders, the only traffic on the slow link) and their results are broadcast inside each
    worker, so every rank of a worker holds the same model and state. ``ledger`` counts the slow link (a
    leader's bytes), ``intra_ledger`` the fast one.

    ``sharded``: the worker's model is sharded over its ranks (FSDP2, ``lordo.worker_mesh``): each rank holds
    a shard of every tensor the strategy exchanges, so collectives between workers run among the ranks at the
    same position in each worker (rank m of every worker), each on its own shards, and nothing is broadcast
    inside; gradients arrive averaged over the worker by FSDP2 itself. ``ledger`` counts this rank's share of
    the slow link (a worker sends the sum over its ranks)."""

    overlaps_rounds = False  # a round's exchange would need side groups inside and between workers: not built

    def __init__(self, base: TorchDistCommunicator, ranks_per_worker: int, sharded: bool = False) -> None:
        world, rank, r = base.world_size, base.rank, ranks_per_worker
        if r < 1 or world % r:
            raise CommError(f"dist.ranks_per_worker ({r}) must divide the number of processes ({world})")
        self.base, self.ranks_per_worker = base, r
        self.worker, self.member = rank // r, rank % r
        workers = world // r
        self.intra_ranks = [list(range(w * r, (w + 1) * r)) for w in range(workers)]
        # the ranks at each position of every worker (position 0: the leaders)
        positions = [list(range(m, world, r)) for m in (range(r) if sharded else range(1))]
        # every process creates every group, in the same order (torch.distributed's rule)
        handles = [dist.new_group(g, timeout=base.timeout) for g in self.intra_ranks]
        across = [dist.new_group(g, timeout=base.timeout) for g in positions]
        self.intra = GroupOps(handles[self.worker], self.intra_ranks[self.worker], base._run)
        self.sharded = sharded
        mine = self.member if sharded else 0
        self.inter = GroupOps(across[mine], positions[mine], base._run) if sharded or self.member == 0 else None
        super().__init__(workers, [self.worker])
        self.ledger.rank = self.worker
        self.intra_ledger = Ledger(r, rank=self.member)
        self.backend, self.rank = base.backend, rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_node_main(self) -> bool:
        return self.base.is_node_main

    @property
    def writes_worker_files(self) -> bool:
        return self.sharded or self.member == 0  # sharded: each rank holds (and saves) its own shards

    def data_shards(self) -> list[tuple[int, int]]:
        return [(self.rank, self.base.world_size)]

    def _share(self, tensors, tag: str) -> None:
        """The leader's tensors to every rank of its worker (fast link); nothing when sharded (each rank
        exchanged its own shards)."""
        if self.sharded:
            return
        t0 = time.perf_counter()
        self.intra.broadcast(tensors, 0)
        size = payload_bytes(tensors)
        self.intra_ledger.record("broadcast", tag, size, len(tensors), time.perf_counter() - t0,  # type: ignore[union-attr]
                                 wire=broadcast_children(self.member, self.ranks_per_worker) * size)

    def average_within_worker(self, grads: TensorLists) -> None:
        # sharded gradients (FSDP2) arrive averaged over the worker's ranks already
        tensors = [g for g in grads[0] if not is_sharded(g)]
        if self.ranks_per_worker == 1 or not tensors:
            return
        t0 = time.perf_counter()
        self.intra.all_reduce_mean(tensors)
        self.intra_ledger.record("all_reduce", "gradient", payload_bytes(tensors), len(tensors),  # type: ignore[union-attr]
                                 time.perf_counter() - t0)

    def all_reduce_mean(self, per_worker: TensorLists, tag: str, accounted: bool = True) -> None:
        if not accounted:  # outside the algorithm (evaluation, logging): the mean over every process
            (self.inter if self.sharded else self.base.ops).all_reduce_mean(per_worker[0])  # type: ignore[union-attr]
            return
        super().all_reduce_mean(per_worker, tag, accounted)

    @torch.no_grad()
    def _all_reduce_mean(self, per_worker: TensorLists) -> None:
        (tensors,) = per_worker
        if self.inter is not None:
            self.inter.all_reduce_mean(tensors)
        self._share(tensors, "between_workers")

    @torch.no_grad()
    def _broadcast(self, per_worker: TensorLists, src: int) -> None:
        (tensors,) = per_worker
        if self.inter is not None:
            self.inter.broadcast(tensors, src)
        self._share(tensors, "between_workers")

    @torch.no_grad()
    def _all_gather(self, per_worker: TensorLists) -> list[list[list[torch.Tensor]]]:
        (tensors,) = per_worker
        if self.inter is not None:
            gathered = self.inter.all_gather(tensors)
        else:
            gathered = [[torch.empty_like(t) for t in tensors] for _ in range(self.world_size)]
        self._share([t for row in gathered for t in row], "between_workers")
        return [gathered]

    @torch.no_grad()
    def _all_to_all(self, per_worker: TensorLists) -> list[list[torch.Tensor]]:
        (chunks,) = per_worker
        received = self.inter.all_to_all(chunks) if self.inter is not None else [torch.empty_like(c) for c in chunks]
        self._share(received, "between_workers")
        return [received]

    def agree(self, flags: list[bool]) -> list[bool]:
        return self.base.agree(flags)

    def agree_min(self, value: int) -> int:
        return self.base.agree_min(value)

    def share_text(self, text: str) -> str:
        return self.base.share_text(text)

    def barrier(self) -> None:
        self.base.barrier()

    def close(self, clean: bool = True) -> None:
        self.base.close(clean)
