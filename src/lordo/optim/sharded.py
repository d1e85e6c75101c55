"""Parameters sharded by FSDP2 (``fully_shard``): the low-rank step on each rank's shard.

FSDP2 turns every parameter into a DTensor on a 1-D mesh, split along one dimension (``Shard(d)``); each rank
holds its rows (d = 0) or columns (d = 1) as a plain tensor (``to_local()``, the same storage), and after
backward its shard of the gradient, already averaged over the mesh. LoRDO's step acts on those shards:

- a low-rank matrix must be split along its *long* side, the one the basis does not compress (rows on the
  right side, p ≥ q; columns on the left side, p < q). Then the basis (q×r or p×r) is whole on every rank,
  the projection, the moments, the error feedback, the back-projection and the rotation of the moments are
  the shard's own rows or columns, and a step needs no collective except one: the sum of the moment
  denominator D over the whole matrix, for the quasi-hyperbolic term's mean(D) (one small all-reduce for all
  the matrices of a group);
- a new basis comes from the whole matrix: its shards are gathered on every rank of the mesh, so the basis
  is the one an unsharded run computes, identical on every rank;
- full-rank parameters (embeddings, norms, biases) take QHAdam elementwise on their shards, split any way.

:func:`fsdp_placement` is the ``shard_placement_fn`` that splits each matrix along its long side;
``fully_shard``'s default (``Shard(0)`` everywhere) suits right-side matrices only, and a left-side matrix
split by rows is refused with an error saying so. This module imports ``torch.distributed`` only when it
meets a DTensor (``lordo.optim`` stays free of it otherwise).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from .subspace import Side, side_of

_DTENSOR: list[type] = []  # DTensor's class, once its module is imported (called every step: kept cheap)


def is_sharded(t: torch.Tensor) -> bool:
    if not _DTENSOR:
        module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
        if module is None:
            return False
        _DTENSOR.append(module.DTensor)
    return isinstance(t, _DTENSOR[0])


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (sharing its storage: writing it writes the parameter); others as given."""
    return t._local_tensor if is_sharded(t) else t  # type: ignore[attr-defined]


def long_side(shape: Sequence[int]) -> int:
    """The dimension a low-rank matrix may be split along: rows on the right side, columns on the left."""
    return 1 if side_of(tuple(shape)) == Side.LEFT else 0


def fsdp_placement(param: torch.nn.Parameter):
    """``fully_shard(..., shard_placement_fn=lordo.optim.fsdp_placement)``: every matrix split along its long
    side, which the low-rank step needs; other parameters along their first dimension."""
    from torch.distributed.tensor import Shard

    return Shard(long_side(param.shape) if param.ndim == 2 else 0)


def check_sharding(p: torch.Tensor, lowrank: bool) -> None:
    """Raise ValueError for a sharding the step cannot take: a mesh of more than one dimension, a placement
    other than Shard, or a low-rank matrix split along its compressed side."""
    if not is_sharded(p):
        return
    shape = tuple(p.shape)
    placements = tuple(p.placements)  # type: ignore[attr-defined]
    if p.device_mesh.ndim != 1 or len(placements) != 1 or not hasattr(placements[0], "dim"):  # type: ignore[attr-defined]
        raise ValueError(f"a parameter of shape {shape} is a DTensor with placements {placements} on a "
                         f"{p.device_mesh.ndim}-D mesh; LowRankQHAdam takes FSDP2's sharding: one mesh dimension, "  # type: ignore[attr-defined]
                         "Shard(d)")
    dim = placements[0].dim
    if lowrank and dim != long_side(shape):
        raise ValueError(f"a low-rank {shape[0]}×{shape[1]} matrix is split along dimension {dim}, the side its basis "
                         f"compresses; split it along dimension {long_side(shape)}: fully_shard(..., "
                         "shard_placement_fn=lordo.optim.fsdp_placement)")


def gather(p: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """The whole matrix of which ``shard`` (shaped like ``p``'s local shard) is this rank's part, on every rank
    of ``p``'s mesh (an all-gather); ``shard`` itself when ``p`` is not sharded."""
    if not is_sharded(p):
        return shard
    from torch.distributed.tensor import DTensor

    whole = DTensor.from_local(shard.contiguous(), p.device_mesh, p.placements, run_check=False,  # type: ignore[attr-defined]
                               shape=p.shape, stride=p.stride())
    return whole.full_tensor()


def whole(p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` shaped like ``p``: as given, or gathered from every rank's shard when ``p`` is sharded and
    ``matrix`` is this rank's shard (a collective over ``p``'s mesh: call it on every rank)."""
    if is_sharded(matrix):
        return matrix.full_tensor()  # type: ignore[attr-defined]
    if is_sharded(p) and tuple(matrix.shape) != tuple(p.shape):
        return gather(p, matrix)
    return matrix


def sum_over_shards(params: Sequence[torch.Tensor], values: list[torch.Tensor]) -> None:
    """``values[i]`` (0-d, one per parameter) ← its sum over the ranks of ``params[i]``'s mesh, in place, for the
    sharded parameters: one all-reduce per mesh."""
    import torch.distributed as dist

    by_group: dict[int, tuple[object, list[int]]] = {}
    for i, p in enumerate(params):
        if is_sharded(p):
            group = p.device_mesh.get_group()  # type: ignore[attr-defined]
            by_group.setdefault(id(group), (group, []))[1].append(i)
    for group, index in by_group.values():
        stacked = torch.stack([values[i].float() for i in index])
        dist.all_reduce(stacked, group=group)
        for i, total in zip(index, stacked.unbind(0)):
            values[i].copy_(total)
