"""torch.distributed backend: one worker per process (gloo on CPU, NCCL on CUDA), started by torchrun
or by ``lordo train --backend gloo --workers M``.

Collectives are bucketed (one flat buffer per dtype) and have a timeout; a failure inside torch.distributed
(a peer that died, a timeout) surfaces as a :class:`CommError` naming the collective.
"""

from __future__ import annotations

import datetime as _dt
import os

import torch
import torch.distributed as dist

from ..errors import LordoError
from .base import Communicator, TensorLists


class CommError(LordoError):
    """A collective failed: a worker died, the network broke, or the timeout expired."""


ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ENV_KEYS)


class TorchDistCommunicator(Communicator):
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
            try:
                dist.init_process_group(backend, store=self._store(rank, world), rank=rank, world_size=world, timeout=self.timeout)
            except Exception as exc:  # rendezvous failures come in several exception types
                raise CommError(
                    f"could not join the process group as rank {rank} of {world} at "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} ({backend}): {exc}"
                ) from exc
        super().__init__(world, [rank])
        self.backend = backend
        self.rank = rank

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

    @staticmethod
    def _buckets(tensors) -> dict:
        buckets: dict = {}
        for t in tensors:
            buckets.setdefault((t.dtype, t.device), []).append(t)
        return buckets

    @torch.no_grad()
    def _all_reduce_mean(self, per_worker: TensorLists) -> None:
        (tensors,) = per_worker
        for group in self._buckets(tensors).values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self._run("all_reduce", dist.all_reduce, flat, op=dist.ReduceOp.SUM)
            flat /= self.world_size
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    @torch.no_grad()
    def _all_gather(self, per_worker: TensorLists) -> list[list[list[torch.Tensor]]]:
        (tensors,) = per_worker
        result: list[list[torch.Tensor | None]] = [[None] * len(tensors) for _ in range(self.world_size)]
        index = {id(t): i for i, t in enumerate(tensors)}
        for group in self._buckets(tensors).values():
            flat = torch.cat([t.reshape(-1) for t in group])
            outs = [torch.empty_like(flat) for _ in range(self.world_size)]
            self._run("all_gather", dist.all_gather, outs, flat)
            for rank, out in enumerate(outs):
                offset = 0
                for t in group:
                    result[rank][index[id(t)]] = out[offset : offset + t.numel()].view_as(t)
                    offset += t.numel()
        return [[[t for t in row if t is not None] for row in result]]

    @torch.no_grad()
    def _all_to_all(self, per_worker: TensorLists) -> list[list[torch.Tensor]]:
        (chunks,) = per_worker
        received = torch.empty((self.world_size, *chunks[0].shape), dtype=chunks[0].dtype, device=chunks[0].device)
        self._run("all_to_all", dist.all_to_all_single, received, torch.stack(list(chunks)))
        return [list(received.unbind(0))]

    @torch.no_grad()
    def _broadcast(self, per_worker: TensorLists, src: int) -> None:
        (tensors,) = per_worker
        for group in self._buckets(tensors).values():
            flat = torch.cat([t.reshape(-1) for t in group])
            self._run("broadcast", dist.broadcast, flat, src=src)
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

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

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
