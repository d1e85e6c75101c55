"""M virtual workers in one process: exact, deterministic collectives (sums in rank order)."""

from __future__ import annotations

import torch

from .base import Communicator, TensorLists


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
