"""Projection, back-projection, error feedback and momentum rotation for one low-rank matrix."""

from __future__ import annotations

import torch

from .subspace import Side


def project(a: torch.Tensor, basis: torch.Tensor, side: Side) -> torch.Tensor:
    """p×q → p×r (right side: A·P) or r×q (left side: Pᵀ·A)."""
    return a @ basis if side == Side.RIGHT else basis.T @ a


def back_project(g: torch.Tensor, basis: torch.Tensor, side: Side) -> torch.Tensor:
    """Low-rank → p×q: g·Pᵀ (right) or P·g (left)."""
    return g @ basis.T if side == Side.RIGHT else basis @ g


def project_with_feedback(grad: torch.Tensor, error: torch.Tensor | None, basis: torch.Tensor, side: Side) -> torch.Tensor:
    """g = proj(G + E), and E ← (G + E) − back(g) in place: what the projection drops is fed back next step.

    With ``error`` None (error feedback off) this is g = proj(G)."""
    if error is None:
        return project(grad, basis if basis.dtype == grad.dtype else basis.to(grad.dtype), side)
    # A = G + E, in the buffer itself, or at the gradient's precision when the buffer is low-precision
    low_precision = error.dtype != grad.dtype
    a = grad + error.to(grad.dtype) if low_precision else error.add_(grad)
    g = remove_projection(a, basis, side)  # E ← A − back(g)
    if low_precision:
        error.copy_(a)
    return g


def remove_projection(a: torch.Tensor, basis: torch.Tensor, side: Side, scale: float = 1.0) -> torch.Tensor:
    """A ← scale·(A − back(proj(A))) in place, keeping what lies outside the basis's subspace; returns proj(A).

    Two GEMMs; the back-projection and the scale are fused into the update (no full-size temporary)."""
    basis = basis if basis.dtype == a.dtype else basis.to(a.dtype)
    g = project(a, basis, side)
    if side == Side.RIGHT:
        a.addmm_(g, basis.T, beta=scale, alpha=-scale)
    else:
        a.addmm_(basis, g, beta=scale, alpha=-scale)
    return g


def rotate_moments(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
    side: Side,
    step: int,
    beta1: float,
    beta2: float,
) -> None:
    """Carry low-rank Adam moments from basis ``old`` to ``new`` in place (LDAdam's rotation).

    With C = P_newᵀ·P_old (r×r) applied on the reduced axis:
        u ← C·u
        v ← |(C∘C)·(v̂ − û²) + (C·û)²| · (1 − β2^t)      (v̂, û bias-corrected; v̂ − û² clamped at 0)
    A basis spanning the same subspace leaves back(u) unchanged. Computed in float32 (float64 for float64
    moments) whatever the moments' dtype: bf16/fp16 moments are rotated at full precision and rounded once."""
    if step <= 0:  # nothing accumulated yet
        exp_avg.zero_(), exp_avg_sq.zero_()
        return
    work = torch.promote_types(exp_avg.dtype, torch.float32)
    c = new.to(work).T @ old.to(work)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    u_hat = exp_avg.to(work) / bc1
    variance = (exp_avg_sq.to(work) / bc2 - u_hat.square()).clamp_(min=0)
    if side == Side.RIGHT:  # moments are p×r: the reduced axis is the last one
        rotated_u = u_hat @ c.T
        rotated_var = variance @ c.square().T
    else:  # r×q
        rotated_u = c @ u_hat
        rotated_var = c.square() @ variance
    exp_avg.copy_(rotated_u * bc1)
    exp_avg_sq.copy_((rotated_var + rotated_u.square()).abs_() * bc2)
