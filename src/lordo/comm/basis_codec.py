"""The pseudo-gradient sent in the basis every worker already holds: coefficients plus a sparse residual.

In a LoRDO round every local step's low-rank part lies in span(P), the global basis of its matrix that every
worker holds, computed rather than sent; only the full-rank QH term and the weight decay leave it. So each
low-rank matrix's Δ_m (plus what earlier rounds did not deliver, E_m) splits exactly into

    A_m = Δ_m + E_m = back(C_m) + R_m,   C_m = proj(A_m)   (A·P, p×r, or Pᵀ·A, r×q, by the matrix's side),

with C_m r/q of the matrix's size and R_m = A_m − back(C_m) orthogonal to span(P). The coefficients travel
dense through ``settings.dense`` (fp32, bf16: all-reduce; int8, int4: the quantised reduce-scatter and
all-gather), the residuals through the sparse codec (``comm.sparse``: chunk-wise top-k, all-gather). Full-rank
tensors (embedding, norms) go dense with the coefficients, or sparse too (``settings.fullrank``). The mean is

    Δ̄ = back(C̄) + R̄,   C̄ = mean of the decoded C_m,   R̄ = mean of the decoded R_m,

and the next basis is computed from it, as with any codec. Each worker keeps what its encodings lost, in
full-size form so that it outlives the basis change: E_m ← back(C_m − Ĉ_m) + (R_m − R̂_m) (hats: decoded),
and the owner of a shard of the quantised coefficients' mean adds M·back(what re-encoding that mean lost), so
that the next round's mean carries it once. Over rounds nothing is lost (tests/test_basis_codec.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..optim.subspace import Side
from .base import Communicator, TensorLists
from .codec import COMPRESSIONS, BlockCodec, Codec, add_shard, average, dense_codecs, padded_numel, shard_numel
from .sparse import VALUE_BITS, SparseCodec, average_sparse

FULLRANK = ("dense", "sparse")


@dataclass(frozen=True)
class SparseSettings:
    """How ``compress = "sparse"`` and ``"basis"`` encode: ``dense``, the codec of what travels dense (the
    coefficients, the averaged moments, full-rank tensors with ``fullrank = "dense"``); ``density`` and ``bits``
    of the sparse codec; ``fullrank``: full-rank tensors sparse or dense (``"basis"`` only)."""

    dense: str = "int8"
    density: float = 1 / 64
    bits: int = 2
    fullrank: str = "dense"

    def check(self) -> None:
        from ..errors import ConfigError

        if self.dense not in COMPRESSIONS:
            raise ConfigError(f"strategy.compress_dense must be one of {', '.join(COMPRESSIONS)}, got {self.dense!r}")
        if not (isinstance(self.density, (int, float)) and not isinstance(self.density, bool) and 0 < self.density <= 1):
            raise ConfigError(f"strategy.compress_density must be in (0, 1], got {self.density!r}")
        if self.bits not in VALUE_BITS:
            raise ConfigError(f"strategy.compress_bits must be one of {', '.join(map(str, VALUE_BITS))}, got {self.bits!r}")
        if self.fullrank not in FULLRANK:
            raise ConfigError(f"strategy.compress_fullrank must be one of {', '.join(FULLRANK)}, got {self.fullrank!r}")


def check_sparse(compress: str, settings: SparseSettings, comm: Communicator, strategy: str, shared_bases: bool) -> None:
    """Refuse ``compress`` = sparse / basis where it cannot work, naming why."""
    from ..errors import ConfigError

    settings.check()
    if compress == "basis" and not shared_bases:
        raise ConfigError(f"compress = \"basis\" sends coefficients in a basis every worker holds; {strategy!r} has "
                          "none shared (LoRDO's global variants do): use compress = \"sparse\"")
    if comm.fault_tolerant:
        raise ConfigError(f"strategy.compress = {compress!r} all-gathers sparse payloads; a fault-tolerant backend "
                          "(torchft) only averages: use none or bf16")
    if getattr(comm, "ranks_per_worker", 1) > 1:
        raise ConfigError(f"strategy.compress = {compress!r} encodes whole tensors; a worker of several ranks "
                          "exchanges shards: use none, bf16, int8 or int4")


def project(a: torch.Tensor, basis: torch.Tensor, side: Side) -> torch.Tensor:
    return a @ basis if side == Side.RIGHT else basis.T @ a


def back(c: torch.Tensor, basis: torch.Tensor, side: Side) -> torch.Tensor:
    return c @ basis.T if side == Side.RIGHT else basis @ c


class BasisCodec:
    """Coefficients in the round's bases (``bases``: per tensor of the payload, (P, side) or None for a
    full-rank tensor; the strategy sets them before each round) plus a sparse residual."""

    name = "basis"

    def __init__(self, settings: SparseSettings) -> None:
        self.settings = settings
        self.dense: Codec | BlockCodec = dense_codecs(settings.dense)["pseudo_gradient"]
        self.sparse = SparseCodec(settings.density, settings.bits)
        self.bases: list[tuple[torch.Tensor, Side] | None] = []

    def split(self, a: torch.Tensor, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(what travels dense, what travels sparse) of tensor ``i``'s input ``a``, in float32 (bf16 weights
        give bf16 pseudo-gradients; the bases are float32)."""
        entry, a = self.bases[i], a.float()
        if entry is None:
            return (a, None) if self.settings.fullrank == "dense" else (None, a)
        c = project(a, *entry)
        return c, a - back(c, *entry)

    @torch.no_grad()
    def average(self, comm: Communicator, per_worker: TensorLists, tag: str,
                residuals: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
        if comm.world_size == 1:
            return
        if len(self.bases) != len(per_worker[0]):
            raise RuntimeError(f"the basis codec holds {len(self.bases)} bases for a payload of {len(per_worker[0])} "
                               "tensors: the strategy must set them before the round")
        dense_of, sparse_of = [], []
        for h, tensors in enumerate(per_worker):
            inputs = [t + e for t, e in zip(tensors, residuals[h])] if residuals else list(tensors)
            parts = [self.split(a, i) for i, a in enumerate(inputs)]
            dense_of.append([d for d, _ in parts if d is not None])
            sparse_of.append([s for _, s in parts if s is not None])
        dense_lost = [[torch.zeros_like(d) for d in ds] for ds in dense_of] if residuals else None
        sparse_lost = [[torch.zeros_like(s) for s in ss] for ss in sparse_of] if residuals else None
        shard_lost = self._shard_buffers(comm, dense_of) if residuals else None
        if dense_of[0]:
            average(comm, dense_of, f"{tag}_coefficients", self.dense, dense_lost, shard_lost)
        if sparse_of[0]:
            average_sparse(comm, sparse_of, f"{tag}_residual_{self.sparse.name}", self.sparse, sparse_lost)
        for h, tensors in enumerate(per_worker):
            self._assemble(tensors, dense_of[h], sparse_of[h])
            if residuals:
                assert dense_lost is not None and sparse_lost is not None
                if shard_lost is not None:  # this worker owns a shard of the dense mean: what re-encoding lost, ×M
                    self._add_shard_loss(dense_lost[h], shard_lost[h], comm, h)
                self._assemble(residuals[h], dense_lost[h], sparse_lost[h])

    def _assemble(self, out: Sequence[torch.Tensor], dense: list[torch.Tensor], sparse: list[torch.Tensor]) -> None:
        """out[i] = back(dense part) + sparse part, each tensor from its parts in payload order."""
        d, s = iter(dense), iter(sparse)
        for i, t in enumerate(out):
            entry = self.bases[i]
            if entry is None:
                t.copy_(next(d) if self.settings.fullrank == "dense" else next(s))
            else:
                t.copy_(back(next(d), *entry)).add_(next(s))

    def _shard_buffers(self, comm: Communicator, dense_of: list[list[torch.Tensor]]) -> list[torch.Tensor] | None:
        if not isinstance(self.dense, BlockCodec) or not dense_of[0]:
            return None
        padded = padded_numel([d.numel() for d in dense_of[0]], self.dense)
        shard = shard_numel(padded, comm.world_size, self.dense)
        return [torch.zeros(shard, device=ds[0].device) for ds in dense_of]

    def _add_shard_loss(self, lost: list[torch.Tensor], shard_loss: torch.Tensor, comm: Communicator, h: int) -> None:
        add_shard(lost, shard_loss * comm.world_size, comm.local_ranks[h], comm.world_size, self.dense.block)  # type: ignore[union-attr]
