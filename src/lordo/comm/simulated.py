"""M virtual workers in one process: exact, deterministic collectives (sums in rank order)."""

from __future__ import annotations

import torch

from .base import Communicator, TensorLists
from .torch_dist import GroupOps, OneWorkerCollectives


class SimCommunicator(Communicator):
    def __init__(self, world_size: int) -> None:
        super().__init__(world_size, list(range(world_size)))

    @torch.no_grad()
    def _all_reduce_mean(self, per_worker: TensorLists) -> None:
        for tensors in zip(*per_worker):
            acc = tensors[0].clone()
            for t in tensors[1:]:
                acc += t
            acc /= self.world_size
            for t in tensors:
                t.copy_(acc)

    def _all_to_all(self, per_worker: TensorLists) -> list[list[torch.Tensor]]:
        return [[per_worker[src][dst] for src in range(self.world_size)] for dst in range(self.world_size)]

    def _all_gather(self, per_worker: TensorLists) -> list[list[list[torch.Tensor]]]:
        gathered = [list(tensors) for tensors in per_worker]
        return [gathered for _ in per_worker]

    @torch.no_grad()
    def _broadcast(self, per_worker: TensorLists, src: int) -> None:
        for tensors in zip(*per_worker):
            for i, t in enumerate(tensors):
                if i != src:
                    t.copy_(tensors[src])

    def barrier(self) -> None:
        pass


class MirrorCommunicator(OneWorkerCollectives, Communicator):
    """Worker 0 of ``world_size`` alone in this process, the others mirroring it (each sends what it sends): every
    collective allocates and fills the buffers a torch.distributed process hosting worker 0 would (the same
    bucketed operations, :class:`~lordo.comm.torch_dist.GroupOps`), with the peers' tensors equal to its own. For
    measuring what one worker's process holds (``lordo bench memory``), not for training: the averages it gives are
    worker 0's own values."""

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size, [0])
        self.ops = GroupOps(None, list(range(world_size)), self._mirror)

    def _mirror(self, what: str, fn, *args, **kwargs) -> None:
        """A torch.distributed collective whose every peer passed this process's tensors."""
        import torch.distributed as dist

        if fn is dist.all_reduce:  # a sum of world_size equal tensors
            args[0].mul_(self.world_size)
        elif fn is dist.all_gather:
            outs, mine = args[0], args[1]
            for out in outs:
                out.copy_(mine)
        elif fn is dist.all_to_all_single:  # every peer sends this process the chunk for worker 0
            received, sent = args[0], args[1]
            received.copy_(sent[0].expand_as(received))
        elif fn is not dist.broadcast:  # a broadcast leaves every peer's equal tensors as they are
            raise NotImplementedError(f"MirrorCommunicator has no {what}")

    def barrier(self) -> None:
        pass
