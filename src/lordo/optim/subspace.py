"""Bases of matrices on the compressed side (SPEC "side rule"), exact or by warm-started subspace iteration.

For W ∈ R^{p×q} the smaller side is compressed:
- p ≥ q ("right"): basis P ∈ R^{q×r}; project A·P (p×r); back-project g·Pᵀ.
- p < q ("left"):  basis P ∈ R^{p×r}; project Pᵀ·A (r×q); back-project P·g.

All bases are fp32 with orthonormal columns, ordered by singular value, and sign-canonical (the entry of
largest magnitude in each column is positive), so the same matrix gives the same basis everywhere.
"""

from __future__ import annotations

import enum
import warnings

import torch


class Side(str, enum.Enum):
    """The side of a p×q matrix that its basis compresses: the smaller one."""

    RIGHT = "right"  # p ≥ q: P is q×r, proj(A) = A·P (p×r), back(g) = g·Pᵀ
    LEFT = "left"  # p < q: P is p×r, proj(A) = Pᵀ·A (r×q), back(g) = P·g


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, or an error that says what to do when backward has not run."""
    if p.grad is None:
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has no gradient: call loss.backward() before step()")
    return p.grad


def side_of(shape: torch.Size | tuple[int, ...]) -> Side:
    p, q = shape
    return Side.RIGHT if p >= q else Side.LEFT


def check_rank(rank: int, shape: tuple[int, ...], name: str = "rank") -> None:
    limit = min(shape)
    if not (isinstance(rank, int) and 1 <= rank <= limit):
        raise ValueError(f"{name} must be an integer in [1, {limit}] for a {shape[0]}×{shape[1]} matrix, got {rank!r}")


def _oriented(a: torch.Tensor, side: Side) -> torch.Tensor:
    """The matrix whose *right* singular vectors we want: A for the right side, Aᵀ for the left."""
    return a if side == Side.RIGHT else a.T


def canonical_signs(basis: torch.Tensor) -> torch.Tensor:
    """Flip each column so that its entry of largest magnitude is positive."""
    idx = basis.abs().argmax(dim=0)
    signs = torch.sign(basis[idx, torch.arange(basis.shape[1], device=basis.device)])
    signs[signs == 0] = 1
    return basis * signs


def svd_basis(a: torch.Tensor, rank: int, side: Side | None = None) -> torch.Tensor | None:
    """Top-``rank`` singular basis of ``a`` (p×q) on its compressed side, exact (fp32 SVD).

    Returns None if the SVD does not converge (the caller keeps its previous basis)."""
    side = side or side_of(a.shape)
    m = _oriented(a.detach().float(), side)
    try:
        _, _, vh = torch.linalg.svd(m, full_matrices=False)
    except torch.linalg.LinAlgError as exc:  # pragma: no cover - depends on LAPACK
        warnings.warn(f"SVD did not converge ({exc}); keeping the previous basis", RuntimeWarning, stacklevel=2)
        return None
    if not torch.isfinite(vh).all():
        warnings.warn("SVD returned non-finite values; keeping the previous basis", RuntimeWarning, stacklevel=2)
        return None
    return canonical_signs(vh[:rank].T.contiguous())


def subspace_iteration_basis(
    a: torch.Tensor, rank: int, previous: torch.Tensor | None, iters: int = 1, side: Side | None = None
) -> torch.Tensor | None:
    """A top-``rank`` basis by block power iteration warm-started from ``previous`` (e.g. the last basis).

    Each iteration is P ← qr(MᵀM·P) with M the oriented matrix: two rank-r GEMMs and a QR of a q×r matrix,
    against the full SVD's O(p·q²). The result spans the iterated subspace; its columns come in the previous
    basis's (Gram–Schmidt) order, not sorted by singular value: a Rayleigh–Ritz step would cost a third GEMM
    and an SVD, and the order does not matter, since the moments are rotated into whatever basis comes.
    Without a previous basis of ``rank`` columns it falls back to the exact SVD."""
    side = side or side_of(a.shape)
    if previous is None or previous.shape[1] != rank:
        return svd_basis(a, rank, side)
    m = _oriented(a.detach().float(), side)
    p = previous.float()
    for _ in range(iters):
        p, _ = torch.linalg.qr(m.T @ (m @ p))
    if not torch.isfinite(p).all():
        return svd_basis(a, rank, side)
    return canonical_signs(p.contiguous())


def captured_energy(a: torch.Tensor, basis: torch.Tensor, side: Side | None = None) -> float:
    """‖A projected onto the basis‖² / ‖A‖² (1 = A lies in the span)."""
    side = side or side_of(a.shape)
    m = _oriented(a.float(), side)
    total = float(m.pow(2).sum())
    return float((m @ basis).pow(2).sum()) / total if total > 0 else 1.0


def overlap(new: torch.Tensor, old: torch.Tensor) -> float:
    """Mean squared singular value of P_newᵀ·P_old (1 = same subspace, 0 = orthogonal)."""
    return float((new.T @ old).pow(2).sum()) / new.shape[1]
