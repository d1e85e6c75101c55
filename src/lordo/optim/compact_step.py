"""The step of parameters whose state is held compact (optim/compact.py), one parameter at a time.

A low-rank matrix with compact error feedback is stepped alone, its E expanded to float32 around the step
(:func:`expanded`): the float32 copy of one matrix is the only transient. A full-rank tensor with compact moments
(the embedding) is stepped in chunks of :data:`CHUNK` elements, each chunk's moments expanded, updated by the
same QHAdam kernel, and stored back: the float32 moments of a whole embedding never exist.

Stochastic rounding (second moments) is seeded by the parameter's position, its step count and the chunk, so
a resumed run rounds exactly as the uninterrupted one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from . import compact
from .sharded import local
from .state import compact_formats, entry_shapes
from .subspace import grad_of

CHUNK = 1 << 20  # elements of a full-rank tensor stepped at once (a multiple of every format's block)
# salts of the roundings outside a step (a step's chunks are 0, 1, ...): moments averaged at a synchronisation,
# and rotated into a new basis
AVERAGED, ROTATED = 4001, 4002

Update = Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]], None]


def split(group: dict, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(params stepped as usual, params whose state ``group`` holds compact)."""
    plain: list[torch.Tensor] = []
    held: list[torch.Tensor] = []
    for p in params:
        (held if compact_formats(group, p) else plain).append(p)
    return plain, held


def seed(position: int, step: int, chunk: int = 0) -> int:
    return (position * 1_000_003 + step) * 4099 + chunk


@contextlib.contextmanager
def expanded(state: dict, group: dict, p: torch.Tensor, position: int, keys: tuple[str, ...] | None = None,
             salt: int = 0) -> Iterator[None]:
    """``p``'s compact state entries (those of ``keys``, default all) as float32 tensors inside the block (stored
    compact again after it). ``salt`` tells apart the roundings of one step (a synchronisation's from the step's)."""
    formats = {k: f for k, f in compact_formats(group, p).items()
               if compact.is_compact(state, k) and (keys is None or k in keys)}
    if not formats:
        yield
        return
    with compact.expanded(state, formats, entry_shapes(group, p), seed(position, int(state["step"]), salt)):
        yield


@torch.no_grad()
def full_rank_step(p: torch.Tensor, state: dict, group: dict, position: int, update: Update) -> None:
    """``update(weights, grads, exp_avgs, exp_avg_sqs, steps)`` (a QHAdam kernel over tensor lists) on ``p`` chunk by
    chunk, its moments expanded from and stored back to their compact form; the step counter advances once."""
    formats = compact_formats(group, p)
    weight, grad = local(p), local(grad_of(p))
    if not (weight.is_contiguous() and grad.is_contiguous()):
        weight_flat, grad_flat = weight.reshape(-1).clone(), grad.reshape(-1)
    else:
        weight_flat, grad_flat = weight.view(-1), grad.view(-1)
    step = int(state["step"])
    counter = state["step"]
    for k, start in enumerate(range(0, weight_flat.numel(), CHUNK)):
        stop = min(weight_flat.numel(), start + CHUNK)
        moments = [compact.load_range(state, key, formats[key], start, stop) for key in ("exp_avg", "exp_avg_sq")]
        counter = state["step"].clone()  # each chunk is the same step
        update([weight_flat[start:stop]], [grad_flat[start:stop]], [moments[0]], [moments[1]], [counter])
        for key, value in zip(("exp_avg", "exp_avg_sq"), moments):
            compact.store_range(state, key, value, formats[key], start, seed(position, step, k))
    state["step"].copy_(counter)
    if weight_flat.data_ptr() != weight.data_ptr():
        weight.copy_(weight_flat.view_as(weight))
