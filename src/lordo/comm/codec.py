"""Codecs: how a tensor travels in a synchronisation, and the one call strategies make to average through one.

A codec encodes a tensor into a payload (a few tensors) and decodes a payload back. Payloads of a
*summable* codec (fp32, bf16) are summed on the wire by an all-reduce; integer payloads with per-row
scales cannot be, so they are all-gathered and every worker decodes and sums them itself, in rank order
(the same sum on every worker). :func:`average` also keeps error feedback when asked: what encoding lost
on a worker is added to that worker's next payload, so nothing is lost over rounds.

``sync_codecs(compress)`` names the codec of each payload of a synchronisation (pseudo-gradients, first
and second moments) for ``strategy.compress`` = none | bf16 | int8.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Communicator, TensorLists
from .compress import dequantize_int8_rows, dequantize_log_int8_rows, quantize_int8_rows, quantize_log_int8_rows

COMPRESSIONS = ("none", "bf16", "int8")


class Codec:
    """The identity: tensors travel as they are (fp32) and are summed on the wire."""

    name = "none"
    summable = True

    def encode(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t]

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """``like``'s values back from ``payload`` (in the payload's dtype; the caller copies them into place)."""
        return payload[0]


class Bf16(Codec):
    """bfloat16 on the wire, summed in bfloat16."""

    name = "bf16"

    def encode(self, t: torch.Tensor) -> list[torch.Tensor]:
        return [t.to(torch.bfloat16)]


class Int8Rows(Codec):
    """int8 with one float32 scale per row (``compress.quantize_int8_rows``), all-gathered.

    ``long_rows``: quantise a tall matrix along its longer axis (a low-rank moment is p×r: one scale per r
    elements would cost as much as the codes)."""

    name = "int8"
    summable = False

    def __init__(self, long_rows: bool = False) -> None:
        self.long_rows = long_rows

    def _turned(self, t: torch.Tensor) -> bool:
        return self.long_rows and t.ndim == 2 and t.shape[0] > t.shape[1]

    def _quantize(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_rows(t)

    def _dequantize(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return dequantize_int8_rows(codes, meta)

    def encode(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(self._quantize(t.T if self._turned(t) else t))

    def decode(self, payload: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        x = self._dequantize(payload[0], payload[1])
        return x.T if self._turned(like) else x


class LogInt8Rows(Int8Rows):
    """int8 codes of ln x per row, for non-negative tensors of wide range (Adam's second moments: a small
    entry rounded to zero would make its step explode); ``compress.quantize_log_int8_rows``."""

    def _quantize(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_log_int8_rows(t)

    def _dequantize(self, codes: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return dequantize_log_int8_rows(codes, meta)


def sync_codecs(compress: str) -> dict[str, Codec]:
    """The codec of each payload of a synchronisation: ``pseudo_gradient``, ``exp_avg``, ``exp_avg_sq``."""
    if compress == "none":
        return dict.fromkeys(("pseudo_gradient", "exp_avg", "exp_avg_sq"), Codec())
    if compress == "bf16":
        return dict.fromkeys(("pseudo_gradient", "exp_avg", "exp_avg_sq"), Bf16())
    if compress == "int8":
        return {"pseudo_gradient": Int8Rows(), "exp_avg": Int8Rows(long_rows=True), "exp_avg_sq": LogInt8Rows(long_rows=True)}
    raise ValueError(f"compress must be one of {', '.join(COMPRESSIONS)}, got {compress!r}")


@torch.no_grad()
def average(comm: Communicator, per_worker: TensorLists, tag: str, codec: Codec,
            residuals: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
    """Replace every hosted worker's tensors, in place, by their mean over all workers, sent through ``codec``
    (ledger tag ``tag``, suffixed with the codec's name). ``residuals`` (per hosted worker, per tensor; only
    with a lossy codec): error feedback, added to the tensor before encoding and set to what encoding lost."""
    if type(codec) is Codec:  # nothing to encode
        comm.all_reduce_mean(per_worker, tag=tag)
        return
    tag = f"{tag}_{codec.name}"
    if residuals:
        for tensors, errors in zip(per_worker, residuals, strict=True):
            torch._foreach_add_(list(tensors), list(errors))  # x = value + what earlier rounds did not deliver
    payload = [[codec.encode(t) for t in tensors] for tensors in per_worker]
    if residuals:
        for tensors, sent, errors in zip(per_worker, payload, residuals):
            for t, p, e in zip(tensors, sent, errors):
                e.copy_(t).sub_(codec.decode(p, t))
    if codec.summable:
        comm.all_reduce_mean([[x for p in sent for x in p] for sent in payload], tag=tag)
        for tensors, sent in zip(per_worker, payload):
            for t, p in zip(tensors, sent):
                t.copy_(codec.decode(p, t))
        return
    gathered = comm.all_gather([[x for p in sent for x in p] for sent in payload], tag=tag)
    means: dict[int, list[torch.Tensor]] = {}  # the simulator hands every hosted worker the same list
    for tensors, sources in zip(per_worker, gathered):
        if id(sources) not in means:
            means[id(sources)] = _decoded_mean(codec, tensors, sources, comm.world_size)
        for t, m in zip(tensors, means[id(sources)]):
            t.copy_(m)


def _decoded_mean(codec: Codec, like: Sequence[torch.Tensor], sources: list[list[torch.Tensor]], world: int) -> list[torch.Tensor]:
    """Mean over workers of their decoded payloads (each worker's list: code, metadata, code, ...), summed
    in rank order in float32 so that every worker gets the same bits."""
    width = len(sources[0]) // len(like)
    out = []
    for i, t in enumerate(like):
        acc = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        for src in sources:
            acc += codec.decode(src[width * i: width * (i + 1)], t)
        out.append(acc.div_(world))
    return out
