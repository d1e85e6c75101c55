"""Codecs: how tensors travel in a synchronisation, and the one call strategies make to average through one.

- :class:`Codec` (fp32, as they are) and :class:`Bf16`: summable, so averaged by an all-reduce.
- :class:`BlockCodec` (int8, int4, log-int8): integer codes with a float32 scale per block of elements.
  Codes with different scales cannot be summed on the wire, so :func:`average` runs a quantised
  reduce-scatter and all-gather: every worker flattens its tensors into one vector, cuts it into M equal
  shards and sends shard j, encoded, to worker j (an all-to-all); worker j decodes the M copies of its shard,
  averages them (in rank order, float32), encodes the mean and all-gathers it. Each worker sends
  2·(M−1)/M of one encoded vector, as a ring all-reduce of it would: the wire bytes fall with the bit width
  and do not grow with M.

Error feedback (``residuals``, per worker, and ``shard_residuals``, per shard owner): what each of the two
encodings lost is added to the next round's input, so over rounds nothing is lost (tests/test_compress.py).
``dense_codecs(compress)`` names the codec of each payload for ``strategy.compress`` = none | bf16 | int8 | int4;
``comm.payloads.sync_codecs`` adds ``sparse`` (``comm.sparse``: chunk-wise top-k, all-gathered) and ``basis``
(``comm.basis_codec``: coefficients in LoRDO's shared basis plus a sparse residual).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .base import Communicator, TensorLists
from .compress import dequantize_int8_rows, dequantize_log_int8_rows, quantize_int8_rows, quantize_log_int8_rows
from .sparse import SparseCodec, average_sparse

COMPRESSIONS = ("none", "bf16", "int8", "int4")  # dense codecs
ALL_COMPRESSIONS = (*COMPRESSIONS, "sparse", "basis")

AnyCodec = Any  # Codec | BlockCodec | SparseCodec | basis_codec.BasisCodec (which runs an exchange of its own)


class Codec:
    """The identity: tensors travel as they are (fp32) and are summed on the wire."""

    name = "none"

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def decode(self, sent: torch.Tensor) -> torch.Tensor:
        return sent


class Bf16(Codec):
    """bfloat16 on the wire, summed in bfloat16."""

    name = "bf16"

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16)


def _as_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


class BlockCodec:
    """Integer codes for a flat float vector whose length is a multiple of ``block``, with a float32 scale
    per block, packed into one uint8 buffer (``encode``/``decode``; ``nbytes`` its size).

    ``bits = 8``: q = round(x/s) in [−127, 127], s = max|x|/127 per block (``compress.quantize_int8_rows``).
    ``bits = 4``: q in [−7, 7], s = max|x|/7, two codes per byte. ``log``: 8-bit codes of ln x for
    non-negative vectors of wide range (Adam's second moments; ``compress.quantize_log_int8_rows``)."""

    def __init__(self, bits: int = 8, block: int = 256, log: bool = False) -> None:
        if bits not in (4, 8) or (log and bits != 8):
            raise ValueError(f"bits must be 8 (or 4 without log), got {bits}")
        self.bits, self.block, self.log = bits, block, log
        self.name = "log-int8" if log else f"int{bits}"

    def code_bytes(self, numel: int) -> int:
        return numel * self.bits // 8

    def nbytes(self, numel: int) -> int:
        meta = 8 if self.log else 4  # per block: [lo, hi] of ln x, or one scale
        return self.code_bytes(numel) + meta * (numel // self.block)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.float().reshape(-1, self.block)
        if self.log:
            return _as_bytes(*quantize_log_int8_rows(rows))
        if self.bits == 8:
            return _as_bytes(*quantize_int8_rows(rows))
        scale = rows.abs().amax(dim=1) / 7
        q = (rows / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).round_().clamp_(-7, 7).to(torch.uint8) + 8
        flat = q.reshape(-1)
        return _as_bytes(flat[0::2] | (flat[1::2] << 4), scale)

    def decode(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        return self.decode_blocks(buf, numel, 0, numel // self.block)

    def decode_blocks(self, buf: torch.Tensor, numel: int, lo: int, hi: int) -> torch.Tensor:
        """Blocks ``lo`` to ``hi`` − 1 of a payload of ``numel`` elements, decoded alone: equal to
        ``decode(buf, numel)[lo * block:hi * block]``."""
        per, meta_bytes = self.code_bytes(self.block), 8 if self.log else 4
        codes = buf[lo * per:hi * per]
        meta = buf[self.code_bytes(numel) + lo * meta_bytes:self.code_bytes(numel) + hi * meta_bytes].view(torch.float32)
        nblocks = hi - lo
        if self.log:
            return dequantize_log_int8_rows(codes.view(torch.int8).reshape(nblocks, self.block), meta.reshape(nblocks, 2)).reshape(-1)
        if self.bits == 8:
            return dequantize_int8_rows(codes.view(torch.int8).reshape(nblocks, self.block), meta).reshape(-1)
        q = torch.stack([codes & 0xF, codes >> 4], dim=1).reshape(nblocks, self.block).to(torch.float32)
        return q.sub_(8).mul_(meta[:, None]).reshape(-1)  # in place: one float32 copy of the payload


def dense_codecs(compress: str) -> dict[str, AnyCodec]:
    """The codec of each payload of a synchronisation for a dense ``compress`` (none, bf16, int8, int4):
    ``pseudo_gradient``, ``exp_avg``, ``exp_avg_sq`` (moments stay at 8 bits under int4: they are small, and second
    moments need the log domain). comm/payloads.py adds the sparse and basis codecs."""
    if compress == "none":
        return dict.fromkeys(("pseudo_gradient", "exp_avg", "exp_avg_sq"), Codec())
    if compress == "bf16":
        return dict.fromkeys(("pseudo_gradient", "exp_avg", "exp_avg_sq"), Bf16())
    if compress in ("int8", "int4"):
        return {"pseudo_gradient": BlockCodec(bits=int(compress[3:]), block=256 if compress == "int8" else 128),
                "exp_avg": BlockCodec(bits=8), "exp_avg_sq": BlockCodec(log=True)}
    raise ValueError(f"a dense compress must be one of {', '.join(COMPRESSIONS)}, got {compress!r}")


def padded_numel(shapes_or_numels: Sequence, codec: BlockCodec) -> int:
    """Length of the flat vector of several tensors laid out so that no block spans two tensors (a block's
    scale then follows one tensor's magnitude): each tensor padded with zeros to whole blocks."""
    numels = [n if isinstance(n, int) else math.prod(n) for n in shapes_or_numels]
    return sum(math.ceil(n / codec.block) * codec.block for n in numels)


def shard_numel(padded: int, world: int, codec: BlockCodec) -> int:
    """Elements of each worker's shard when a vector of ``padded`` elements (:func:`padded_numel`) is cut into
    ``world`` equal shards of whole blocks (the vector is padded with zeros to world × shard)."""
    return math.ceil(padded / (world * codec.block)) * codec.block


@torch.no_grad()
def average(comm: Communicator, per_worker: TensorLists, tag: str, codec: AnyCodec,
            residuals: Sequence[Sequence[torch.Tensor]] | None = None,
            shard_residuals: Sequence[torch.Tensor] | None = None) -> None:
    """Replace every hosted worker's tensors, in place, by their mean over all workers, sent through ``codec``
    (ledger tag ``tag``, suffixed with the codec's name). ``residuals`` (per hosted worker, per tensor) and
    ``shard_residuals`` (per hosted worker, :func:`shard_numel` elements; block codecs only): error feedback
    of what encoding lost, added to the next round's input. With one worker nothing is sent or lost."""
    if comm.world_size == 1:
        return
    if isinstance(codec, SparseCodec):
        average_sparse(comm, per_worker, f"{tag}_{codec.name}", codec, residuals)
        return
    if hasattr(codec, "average"):  # a codec with an exchange of its own
        codec.average(comm, per_worker, tag, residuals)
        return
    if isinstance(codec, BlockCodec):
        _sharded_average(comm, per_worker, f"{tag}_{codec.name}", codec, residuals, shard_residuals)
        return
    if type(codec) is Codec:  # nothing to encode
        comm.all_reduce_mean(per_worker, tag=tag)
        return
    if residuals:
        for tensors, errors in zip(per_worker, residuals, strict=True):
            torch._foreach_add_(list(tensors), list(errors))  # x = value + what earlier rounds did not deliver
    payload = [[codec.encode(t) for t in tensors] for tensors in per_worker]
    if residuals:
        for sent, errors, tensors in zip(payload, residuals, per_worker):
            for p, e, t in zip(sent, errors, tensors):
                e.copy_(t).sub_(codec.decode(p))
    comm.all_reduce_mean(payload, tag=f"{tag}_{codec.name}")
    for tensors, sent in zip(per_worker, payload):
        for t, p in zip(tensors, sent):
            t.copy_(codec.decode(p))


def _sharded_average(comm: Communicator, per_worker: TensorLists, tag: str, codec: BlockCodec,
                     residuals: Sequence[Sequence[torch.Tensor]] | None,
                     shard_residuals: Sequence[torch.Tensor] | None) -> None:
    shard = shard_numel(padded_numel([t.numel() for t in per_worker[0]], codec), comm.world_size, codec)
    chunks = [shard_payloads(tensors, comm.world_size, shard, codec, residuals[h] if residuals else None)
              for h, tensors in enumerate(per_worker)]
    gathered = exchange_shards(comm, chunks, tag, codec, shard, shard_residuals)
    for tensors, sources in zip(per_worker, gathered):  # shard by shard: one shard's float32 values at a time
        for j, src in enumerate(sources):
            _write_span(tensors, codec.decode(src[0], shard), j * shard, codec.block)


def shard_payloads(tensors: Sequence[torch.Tensor], world: int, shard: int, codec: BlockCodec,
                   residuals: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """One worker's tensors (plus ``residuals``) laid out flat and cut into ``world`` shards of ``shard``
    elements, each encoded: shard j goes to worker j. ``residuals`` are set to what the encoding lost. Each shard
    is laid out and encoded alone (one shard's float32 copy at a time; each tensor read where it overlaps that
    shard, so ``tensors`` may compute each one as it is read)."""
    encoded = []
    for j in range(world):
        x = _padded_span(tensors, j * shard, (j + 1) * shard, codec.block)
        if residuals:  # added span by span into the shard's copy
            _write_span(residuals, x, j * shard, codec.block, read_into=True)
        encoded.append(codec.encode(x))
        if residuals:  # what the first encoding lost stays with this worker
            lost = codec.decode(encoded[-1], shard).neg_().add_(x)  # x − decoded, in the decoded copy
            _write_span(residuals, lost, j * shard, codec.block)
    return encoded


def exchange_shards(comm: Communicator, chunks: list[list[torch.Tensor]], tag: str, codec: BlockCodec, shard: int,
                    shard_residuals: Sequence[torch.Tensor] | None) -> list[list[list[torch.Tensor]]]:
    """The quantised reduce-scatter and all-gather of every hosted worker's :func:`shard_payloads`: per hosted
    worker, the encoded mean of each shard (``[[payload]]`` per shard, in rank order; :func:`decode_shards`)."""
    received = comm.all_to_all(chunks, tag=tag)
    mine = []
    for h, copies in enumerate(received):  # the mean of my shard over the workers, summed in rank order
        mean = torch.zeros(shard, dtype=torch.float32, device=copies[0].device)
        for buf in copies:
            mean += codec.decode(buf, shard)
        mean /= comm.world_size
        if shard_residuals is not None:
            mean += shard_residuals[h]
        sent = codec.encode(mean)
        if shard_residuals is not None:  # what the second encoding lost stays with the shard's owner
            shard_residuals[h].copy_(mean).sub_(codec.decode(sent, shard))  # no third copy of the shard
        mine.append([sent])
    return comm.all_gather(mine, tag=tag)


def add_shard(tensors: Sequence[torch.Tensor], values: torch.Tensor, owner: int, world: int, block: int) -> None:
    """Add ``values`` (shard ``owner`` of the flat layout of :func:`shard_payloads`, of ``world`` shards) to the
    elements of ``tensors`` that shard was cut from."""
    _write_span(tensors, values, owner * values.numel(), block, add=True)


def _write_span(tensors: Sequence[torch.Tensor], values: torch.Tensor, lo: int, block: int, add: bool = False,
                read_into: bool = False) -> None:
    """Copy (or add) ``values``, elements ``lo`` … of the flat layout (:func:`_padded_span`), into the tensors'
    spans they overlap, in place (no copy of the model); ``read_into``: the other way, the tensors' spans added to
    ``values``."""
    hi, offset = lo + values.numel(), 0
    for t in tensors:
        start, end = max(lo, offset), min(hi, offset + t.numel())
        if start < end:
            span, part = t.view(-1)[start - offset:end - offset], values[start - lo:end - lo]
            if read_into:
                part += span
            elif add:
                span += part
            else:
                span.copy_(part)
        offset += math.ceil(t.numel() / block) * block


def decode_shards(sources: Sequence[Sequence[torch.Tensor]], shard: int, codec: BlockCodec) -> torch.Tensor:
    """The flat vector whose shards ``sources`` holds encoded (one ``[payload]`` per shard, in order)."""
    return torch.cat([codec.decode(src[0], shard) for src in sources])


def decode_span(sources: Sequence[Sequence[torch.Tensor]], shard: int, codec: BlockCodec, start: int, stop: int) -> torch.Tensor:
    """Elements ``start`` to ``stop`` − 1 of that vector (``decode_shards(...)[start:stop]``), decoding only the
    blocks that hold them."""
    parts, pos, block = [], start, codec.block
    while pos < stop:
        j = pos // shard
        end = min(stop, (j + 1) * shard)
        lo, hi = (pos - j * shard) // block, math.ceil((end - j * shard) / block)
        skip = pos - j * shard - lo * block
        parts.append(codec.decode_blocks(sources[j][0], shard, lo, hi)[skip:skip + end - pos])
        pos = end
    if not parts:
        return torch.zeros(0, device=sources[0][0].device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _padded_span(tensors: Sequence[torch.Tensor], lo: int, hi: int, block: int) -> torch.Tensor:
    """Elements ``lo`` to ``hi`` − 1 of the flat layout of ``tensors`` (each padded with zeros to whole blocks, one
    after the other; read only where they overlap the span; their sizes from the sequence's ``numels`` where it has
    them, else from the tensors)."""
    numels = getattr(tensors, "numels", None) or [t.numel() for t in tensors]
    out, offset = None, 0
    for i, n in enumerate(numels):
        start, end = max(lo, offset), min(hi, offset + n)
        if start < end:
            t = tensors[i]
            if out is None:
                out = torch.zeros(hi - lo, dtype=torch.float32, device=t.device)
            out[start - lo:end - lo] = t.reshape(-1)[start - offset:end - offset]
        offset += math.ceil(n / block) * block
    return out if out is not None else torch.zeros(hi - lo, device=getattr(tensors, "device", None) or tensors[0].device)
