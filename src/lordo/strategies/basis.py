"""Where the bases of the low-rank matrices come from (a basis policy), the one helper that changes them, and
the two diagnostics of a basis every low-rank strategy reports (``residual_energy``, ``error_feedback_ratio``).

- :class:`GlobalBasis` (``lordo``, ``lordo-global-noqh``): one basis per matrix, the same on every worker:
  the top-r basis of the averaged pseudo-gradient at each synchronisation; the first one from the first
  step's gradient, all-reduced once (counted in the ledger).
- :class:`LocalBasis` (``lordo-local``): each worker's own basis, from its own stochastic gradient at the
  step of each synchronisation; the first from its own first gradient.

Bases are computed from identical inputs with a deterministic algorithm on every worker, so a global basis
agrees everywhere without a broadcast (a test checks it across gloo processes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import Communicator
from ..optim import LowRankQHAdam, grad_of, overlap, project, side_of
from ..optim.sharded import local, sum_over_shards


@torch.no_grad()
def change_bases(optimizers: Sequence[LowRankQHAdam], lowrank: Sequence[Sequence[torch.Tensor]],
                 sources: Sequence[Sequence[torch.Tensor]], *, shared: bool) -> list[float]:
    """New bases for the low-rank matrices (``lowrank[w][k]``: worker w's matrix k), moments rotated.

    ``shared``: one basis per matrix, computed by worker 0's optimizer from ``sources[0][k]`` and set on every
    worker; otherwise each worker's from its own ``sources[w][k]``. A basis whose computation fails is kept
    (warned). Returns, per matrix that had a basis, the overlap of worker 0's old and new basis."""
    opt0, overlaps = optimizers[0], []
    for k, p0 in enumerate(lowrank[0]):
        old = opt0.state[p0]["basis"].clone() if "basis" in opt0.state[p0] else None
        if shared:
            new = opt0.compute_basis(p0, sources[0][k])
            if new is None:
                if old is None:
                    raise RuntimeError("could not compute an initial basis (SVD failed)")
                overlaps.append(1.0)
                continue
            for opt, low in zip(optimizers, lowrank, strict=True):
                opt.set_basis(low[k], new)
        else:
            for opt, low, src in zip(optimizers, lowrank, sources, strict=True):
                opt.refresh_basis(low[k], src[k])
            new = opt0.state[p0]["basis"]
        if old is not None:
            overlaps.append(overlap(new, old))
    return overlaps


@torch.no_grad()
def residual_energy(matrices: Sequence[torch.Tensor], optimizer: LowRankQHAdam, params: Sequence[torch.Tensor]) -> float | None:
    """Share of the matrices' energy outside the current bases of ``params`` (None before any basis). For
    sharded matrices, ``matrices`` are this rank's shards and the energies are summed over the worker's ranks."""
    totals, inside = [], []
    for m, p in zip(matrices, params, strict=True):
        basis = optimizer.state[p].get("basis")
        if basis is None:
            return None
        totals.append(m.float().pow(2).sum())
        inside.append(project(m.float(), basis, side_of(p.shape)).pow(2).sum())
    sum_over_shards(params, totals)
    sum_over_shards(params, inside)
    energy = sum(float(t) for t in totals)
    return sum(float(t) - float(i) for t, i in zip(totals, inside)) / energy if energy > 0 else 0.0


@torch.no_grad()
def error_feedback_ratio(opt: LowRankQHAdam, params: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> float | None:
    """Mean over low-rank matrices of ‖E‖/‖W‖ (None without error feedback): watches E's growth. For sharded
    matrices, ``weights`` are this rank's shards and the norms are summed over the worker's ranks."""
    held, errors, sizes = [], [], []
    for p, w in zip(params, weights, strict=True):
        e = opt.error_feedback(p)  # a copy where E is deferred or compact: one matrix's at a time
        if e is not None:
            held.append(p)
            errors.append(e.float().pow(2).sum())
            sizes.append(w.float().pow(2).sum())
    if not held:
        return None
    sum_over_shards(held, errors)
    sum_over_shards(held, sizes)
    ratios = [float(e) ** 0.5 / max(float(w) ** 0.5, 1e-12) for e, w in zip(errors, sizes)]
    return sum(ratios) / len(ratios)


def _own_gradients(lowrank: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
    return [[local(grad_of(p)).detach().clone() for p in low] for low in lowrank]


class BasisPolicy:
    """Hooks a local-update strategy calls: before each local step (gradients in ``.grad``) and at each
    synchronisation (with the averaged pseudo-gradients of the low-rank matrices)."""

    name = ""

    def before_step(self, step: int, sync_every: int, lowrank: Sequence[Sequence[torch.Tensor]],
                    optimizers: Sequence[LowRankQHAdam], comm: Communicator) -> None:
        """``step``: local steps taken so far."""

    def at_sync(self, delta: Sequence[torch.Tensor], lowrank: Sequence[Sequence[torch.Tensor]],
                optimizers: Sequence[LowRankQHAdam]) -> list[float]:
        """Change the bases after the average; returns the overlaps (:func:`change_bases`)."""
        raise NotImplementedError

    def take_round_input(self) -> list[list[torch.Tensor]] | None:
        """What ``at_sync`` will read, handed over to a synchronisation in flight (``sync_delay``)."""
        return None

    def give_round_input(self, value: list[list[torch.Tensor]] | None) -> None:
        """Put back, when a synchronisation in flight lands, what :meth:`take_round_input` handed over."""


class GlobalBasis(BasisPolicy):
    name = "global"

    def before_step(self, step, sync_every, lowrank, optimizers, comm) -> None:
        if step == 0:  # the initial basis: the top-r basis of the first gradient, all-reduced once
            grads = _own_gradients(lowrank)
            comm.all_reduce_mean(grads, tag="initial_basis_gradient")
            change_bases(optimizers, lowrank, grads, shared=True)

    def at_sync(self, delta, lowrank, optimizers) -> list[float]:
        return change_bases(optimizers, lowrank, [delta] * len(lowrank), shared=True)


class LocalBasis(BasisPolicy):
    name = "local"

    def __init__(self) -> None:
        self._captured: list[list[torch.Tensor]] | None = None

    def before_step(self, step, sync_every, lowrank, optimizers, comm) -> None:
        if (step + 1) % sync_every == 0:  # this step ends with a sync: keep each worker's own gradient
            self._captured = _own_gradients(lowrank)

    def take_round_input(self) -> list[list[torch.Tensor]] | None:
        captured, self._captured = self._captured, None
        return captured

    def give_round_input(self, value: list[list[torch.Tensor]] | None) -> None:
        self._captured = value

    def at_sync(self, delta, lowrank, optimizers) -> list[float]:
        captured, self._captured = self._captured, None
        if captured is None:  # a final sync off the K-grid: no next round, keep the bases
            return [1.0] * len(lowrank[0])
        return change_bases(optimizers, lowrank, captured, shared=False)


BASIS_POLICIES = {"global": GlobalBasis, "local": LocalBasis}
