"""Sparse payloads: chunk-wise top-k with a few bits per kept value (SparseLoCo's encoding), averaged by an
all-gather.

A flat float vector is cut into chunks of ``CHUNK`` = 4096 elements (the last one padded with zeros). Of each
chunk the k = max(1, round(density·4096)) elements of largest magnitude are kept: each travels as its index in
the chunk (12 bits) and a ``bits``-bit code of its value, packed together; each chunk adds one float32 scale
(a buffer holds the scales, then the packed codes).
A code c in [0, L) with L = 2^bits stands for (c − (L−1)/2)·s, s = 2·max|kept| / (L − 1): a symmetric uniform
grid whose outermost levels are ±max|kept| (2 bits: ±max and ±max/3). Every buffer of a vector of n elements
has the same size (``nbytes``), so the workers all-gather them; each decodes the M copies and averages them in
rank order, float32, so all hold the same mean. What a worker's encoding dropped (the elements left out, the
rounding of those kept) is its error feedback, added to the next round's input (``average_sparse``).

Unlike a block codec's reduce-scatter, an all-gather's bytes grow with the number of workers: each receives
M − 1 buffers. At density d and b bits a buffer is about n·d·(12 + b)/8 bytes against 4n for fp32, so it sends
fewer bytes than a ring all-reduce of fp32 (2·(M−1)/M·4n) while (M − 1)·d·(12 + b)/8 < 2·(M−1)/M·4, i.e. at
d = 1/64 and b = 2 for every M below 147.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import Communicator, TensorLists

CHUNK = 4096
INDEX_BITS = 12  # log2(CHUNK)
VALUE_BITS = (2, 4, 8)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below 2^width as a uint8 buffer of ceil(len·width/8) bytes, little-endian bits."""
    bits = (codes.to(torch.int64)[:, None] >> torch.arange(width, device=codes.device)) & 1
    flat = bits.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % 8)])
    weights = 1 << torch.arange(8, device=codes.device)
    return (flat.reshape(-1, 8) * weights).sum(dim=1).to(torch.uint8)


def unpack_bits(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: ``count`` int64 codes of ``width`` bits."""
    bits = (buf.to(torch.int64)[:, None] >> torch.arange(8, device=buf.device)) & 1
    bits = bits.reshape(-1)[: count * width].reshape(count, width)
    return (bits << torch.arange(width, device=buf.device)).sum(dim=1)


class SparseCodec:
    """Chunk-wise top-k of a flat float32 vector with ``bits``-bit values and packed 12-bit indices."""

    name = "sparse"

    def __init__(self, density: float = 1 / 64, bits: int = 2) -> None:
        if not (isinstance(density, (int, float)) and 0 < density <= 1):
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if bits not in VALUE_BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, VALUE_BITS))}, got {bits!r}")
        self.density, self.bits = float(density), bits
        self.k = max(1, round(density * CHUNK))
        self.name = f"sparse{bits}"

    def chunks(self, numel: int) -> int:
        return max(1, math.ceil(numel / CHUNK))

    def code_bytes(self, numel: int) -> int:
        return math.ceil(self.chunks(numel) * self.k * (INDEX_BITS + self.bits) / 8)

    def nbytes(self, numel: int) -> int:
        return self.code_bytes(numel) + 4 * self.chunks(numel)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        n, chunks = x.numel(), self.chunks(x.numel())
        rows = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=x.device)
        rows[:n] = x.reshape(-1)
        rows = rows.reshape(chunks, CHUNK)
        index = rows.abs().topk(self.k, dim=1, sorted=False).indices.sort(dim=1).values
        kept = rows.gather(1, index)
        half = (2 ** self.bits - 1) / 2
        scale = kept.abs().amax(dim=1) / half
        q = (kept / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None] + half).round_().clamp_(0, 2 * half)
        codes = index.reshape(-1) | (q.to(torch.int64).reshape(-1) << INDEX_BITS)
        packed = pack_bits(codes, INDEX_BITS + self.bits)
        return torch.cat([scale.contiguous().view(torch.uint8), packed])

    def decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        chunks = self.chunks(numel)
        scale = buf[:4 * chunks].clone().view(torch.float32)  # a copy: a view of a received buffer may be unaligned
        codes = unpack_bits(buf[4 * chunks:], INDEX_BITS + self.bits, chunks * self.k).reshape(chunks, self.k)
        half = (2 ** self.bits - 1) / 2
        values = ((codes >> INDEX_BITS).to(torch.float32) - half) * scale[:, None]
        rows = torch.zeros(chunks, CHUNK, dtype=torch.float32, device=buf.device)
        rows.scatter_(1, codes & (CHUNK - 1), values)
        return rows.reshape(-1)[:numel]


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1).float() for t in tensors]) if tensors else torch.zeros(0)


def unflat_into(tensors: Sequence[torch.Tensor], vector: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        t.copy_(vector[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def average_sparse(comm: Communicator, per_worker: TensorLists, tag: str, codec: SparseCodec,
                   residuals: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
    """Replace every hosted worker's tensors, in place, by the mean over the workers of their sparse encodings
    (one all-gather, ledger tag ``tag``). ``residuals`` (per hosted worker, per tensor): error feedback, added to
    the input first and left holding what this round's encoding dropped."""
    if comm.world_size == 1 or not per_worker[0]:
        return
    numel = sum(t.numel() for t in per_worker[0])
    mine = []
    for h, tensors in enumerate(per_worker):
        x = flat(tensors)
        if residuals:
            x += flat(residuals[h])
        sent = codec.encode(x)
        if residuals:
            unflat_into(residuals[h], x - codec.decode(sent, numel))
        mine.append([sent])
    gathered = comm.all_gather(mine, tag=tag)
    means: dict[int, torch.Tensor] = {}  # the simulator hands every hosted worker the same list
    for tensors, sources in zip(per_worker, gathered):
        if id(sources) not in means:
            mean = torch.zeros(numel, dtype=torch.float32, device=tensors[0].device)
            for src in sources:  # in rank order: the same sum on every worker
                mean += codec.decode(src[0], numel)
            means[id(sources)] = mean / comm.world_size
        unflat_into(tensors, means[id(sources)])
