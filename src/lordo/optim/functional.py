"""Stateless update kernels: the low-rank quasi-hyperbolic Adam step and full-rank QHAdam.

Shapes: W, G, E are p×q; u, v are the low-rank moments (p×r on the right side, r×q on the left).
"""

from __future__ import annotations

import torch

from .subspace import RIGHT


@torch.no_grad()
def lowrank_qh_adam_update(
    param: torch.Tensor,
    g: torch.Tensor,
    qh_grad: torch.Tensor | None,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    basis: torch.Tensor,
    side: str,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    omega: float,
) -> None:
    """One step from the low-rank gradient ``g`` (already projected):

        u ← β1·u + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
        û = u/(1−β1^t) ;  D = sqrt(v/(1−β2^t)) + ε
        U = ω·back(û/D) + (1−ω)·qh_grad/mean(D)
        W ← W·(1 − η·λ) − η·U

    ``qh_grad`` is the full-rank gradient of the quasi-hyperbolic term (G, or G+E); unused when ω = 1."""
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    denom = (exp_avg_sq / bc2).sqrt_().add_(eps)  # low-rank: small
    ratio = (exp_avg / denom).to(param.dtype)  # û/D up to the 1/bc1 folded into alpha below
    qh = omega < 1.0 and qh_grad is not None
    basis = basis if basis.dtype == param.dtype else basis.to(param.dtype)
    # W ← (1 − ηλ)·W − η·ω·back(û/D) in one fused GEMM: no full-size temporary
    decay, alpha = 1 - lr * weight_decay, -lr * (omega if qh else 1.0) / bc1
    if side == RIGHT:
        param.addmm_(ratio, basis.T, beta=decay, alpha=alpha)
    else:
        param.addmm_(basis, ratio, beta=decay, alpha=alpha)
    if qh:
        assert qh_grad is not None
        # − η(1−ω)·G/mean(D): mean(D) stays a 0-d tensor (no host synchronisation on GPUs)
        param.addcdiv_(qh_grad.to(param.dtype), denom.mean().to(param.dtype), value=-lr * (1 - omega))


@torch.no_grad()
def qh_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    omega: float,
) -> None:
    """Full-rank QHAdam with decoupled weight decay: U = ((1−ω)·G + ω·û)/D, D = sqrt(v̂) + ε.

    ω = 1 is AdamW exactly."""
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    denom = (exp_avg_sq / bc2).sqrt_().add_(eps)
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    if omega == 1.0:
        param.addcdiv_(exp_avg, denom, value=-lr / bc1)
        return
    numerator = exp_avg.mul(omega / bc1).add_(grad, alpha=1 - omega)
    param.addcdiv_(numerator, denom, value=-lr)
