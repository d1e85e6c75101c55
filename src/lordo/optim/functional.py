"""Stateless update kernels: the low-rank quasi-hyperbolic Adam step and full-rank QHAdam.

Shapes: W, G, E are p×q; u, v are the low-rank moments (p×r on the right side, r×q on the left).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.optim.adamw import adamw as adamw_functional

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
    step: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    omega: float,
    qh_lowrank: torch.Tensor | None = None,
    lowrank_term: str = "adam",
) -> None:
    """One step from the low-rank gradient ``g`` (already projected); ``step`` (a 0-d tensor, the steps taken
    so far) is incremented first, as in torch's kernels, and t is its new value:

        u ← β1·u + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
        û = u/(1−β1^t) ;  D = sqrt(v/(1−β2^t)) + ε
        A = qh_grad − back(qh_lowrank)            (A = qh_grad when qh_lowrank is None)
        U = ω·back(û/D) + (1−ω)·A/mean(D)       (ω·back(û) + ... with lowrank_term "momentum")
        W ← W·(1 − η·λ) − η·U

    ``A`` is the full-rank gradient of the quasi-hyperbolic term (G, or G + E); unused when ω = 1 or
    ``qh_grad`` is None. ``qh_lowrank`` (shaped like ``g``) lets a caller pass G + E as a running sum S and
    its low-rank part, A = S − back(c), without forming A: the back-projection joins the GEMM of the
    low-rank update."""
    lowrank_qh_adam_update_many([param], [g], [qh_grad], [exp_avg], [exp_avg_sq], [basis], [side], [step], lr=lr,
                                beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, omega=omega,
                                qh_lowranks=None if qh_lowrank is None else [qh_lowrank], lowrank_term=lowrank_term)


@torch.no_grad()
def lowrank_qh_adam_update_many(
    params: list[torch.Tensor],
    gs: list[torch.Tensor],
    qh_grads: list[torch.Tensor | None],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    bases: list[torch.Tensor],
    sides: list[str],
    state_steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    omega: float,
    qh_lowranks: list[torch.Tensor | None] | None = None,
    qh_scales: list[float] | None = None,
    lowrank_scale: float = 1.0,
    moment_numels: list[int] | None = None,
    sum_totals: Callable[[list[torch.Tensor]], None] | None = None,
    lowrank_term: str = "adam",
) -> None:
    """:func:`lowrank_qh_adam_update` for several matrices (``lowrank_term = "momentum"``: the low-rank update is
    ω·back(û), the momentum not divided by D, as in the authors' research code; D still scales the QH term;
    ``lowrank_scale``: GaLore's ``scale``, a factor on
    the low-rank update ω·back(û/D) only; ``qh_scales``: a factor per matrix on its full-size QH input, which
    holds A/factor): the moment math on the small low-rank tensors runs
    as multi-tensor (foreach) ops, the two full-size updates of each matrix as one fused GEMM and one pass.

    For shards of matrices (optim/sharded.py) mean(D) is over the whole matrix: ``moment_numels`` gives each
    matrix's number of moment entries and ``sum_totals`` turns the shards' sums of D into the matrices' sums
    in place."""
    if not params:
        return
    torch._foreach_add_(state_steps, 1)
    steps = [int(t) for t in torch.stack(state_steps).tolist()]  # one host read for all the bias corrections
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, gs, alpha=1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, gs, gs, value=1 - beta2)
    # D = sqrt(v/bc2) + ε = (sqrt(v) + ε·sqrt(bc2)) / sqrt(bc2): the low-rank tensors hold D' = sqrt(bc2)·D
    # (no pass for the division by bc2) and the factors sqrt(bc2) and 1/bc1 go into the scalars below
    roots = [(1 - beta2**t) ** 0.5 for t in steps]
    denoms = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denoms, [eps * r for r in roots])
    momentum = lowrank_term == "momentum"
    # u/D' = (û/D)·bc1/sqrt(bc2); the momentum form uses u itself (read only below)
    ratios = exp_avgs if momentum else torch._foreach_div(exp_avgs, denoms)
    qh = omega < 1.0
    # sum(D') of every matrix in one call (D' > 0, so its L1 norm), kept as 0-d tensors: no host
    # synchronisation on GPUs
    totals = torch._foreach_norm(denoms, 1) if qh else [None] * len(params)
    if qh and sum_totals is not None:
        sum_totals(totals)  # type: ignore[arg-type]
    numels = moment_numels if moment_numels is not None else [d.numel() for d in denoms]
    decay = 1 - lr * weight_decay
    lows = qh_lowranks if qh_lowranks is not None else [None] * len(params)
    factors = qh_scales if qh_scales is not None else [1.0] * len(params)
    for weight, qh_grad, low, factor, basis, side, step, root, ratio, numel, total in zip(
            params, qh_grads, lows, factors, bases, sides, steps, roots, ratios, numels, totals, strict=True):
        # a bf16/fp16 matrix is updated in float32 (the moments' precision) and rounded once
        param = weight if weight.dtype == ratio.dtype else weight.to(ratio.dtype)
        with_qh = qh and qh_grad is not None
        # the QH term's scale: − η(1−ω)·A/mean(D) = − η(1−ω)·numel·sqrt(bc2)·A/sum(D')
        kappa = lr * (1 - omega) * numel * root
        alpha = -lr * (omega if with_qh else 1.0) * lowrank_scale * (1.0 if momentum else root) / (1 - beta1**step)
        if with_qh and low is not None:
            assert total is not None
            # + η(1−ω)·back(c)/mean(D) joins the low-rank update: one GEMM for both
            ratio = torch.addcdiv(ratio.mul(alpha), low.to(ratio.dtype), total, value=kappa)
            alpha = 1.0
        ratio = ratio if ratio.dtype == param.dtype else ratio.to(param.dtype)
        basis = basis if basis.dtype == param.dtype else basis.to(param.dtype)
        # W ← (1 − ηλ)·W − η·ω·back(û/D) in one fused GEMM: no full-size temporary
        if side == RIGHT:
            param.addmm_(ratio, basis.T, beta=decay, alpha=alpha)
        else:
            param.addmm_(basis, ratio, beta=decay, alpha=alpha)
        if with_qh:
            assert qh_grad is not None and total is not None
            param.addcdiv_(qh_grad if qh_grad.dtype == param.dtype else qh_grad.to(param.dtype),
                           total if total.dtype == param.dtype else total.to(param.dtype), value=-kappa * factor)
        if param is not weight:
            weight.copy_(param)


@torch.no_grad()
def qh_adam_update(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    omega: float,
) -> None:
    """Full-rank QHAdam with decoupled weight decay: U = ((1−ω)·G + ω·û)/D, D = sqrt(v̂) + ε; ``step`` (0-d)
    is incremented first. ω = 1 is AdamW exactly. With moments of a wider dtype than the parameter (fp32
    moments of a bf16 weight), the update is computed at the moments' precision and rounded once."""
    if param.dtype != exp_avg.dtype:
        wide = param.to(exp_avg.dtype)
        qh_adam_update(wide, grad.to(exp_avg.dtype), exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2,
                       eps=eps, weight_decay=weight_decay, omega=omega)
        param.copy_(wide)
        return
    step += 1
    t = int(step)
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bc1, bc2 = 1 - beta1**t, 1 - beta2**t
    denom = (exp_avg_sq / bc2).sqrt_().add_(eps)
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    if omega == 1.0:
        param.addcdiv_(exp_avg, denom, value=-lr / bc1)
        return
    numerator = exp_avg.mul(omega / bc1).add_(grad, alpha=1 - omega)
    param.addcdiv_(numerator, denom, value=-lr)


@torch.no_grad()
def qh_adam_update_many(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    omega: float,
) -> None:
    """:func:`qh_adam_update` on several tensors at once; increments ``state_steps`` (0-d tensors) itself.

    QHAdam is AdamW at learning rate η·ω (decay λ/ω, so that the decay factor stays 1 − ηλ) plus the term
    −η(1−ω)·G/D, D taken from the updated second moment. The AdamW part runs as torch's multi-tensor
    kernel (fused on CPU, where it is several times faster than per-tensor ops; foreach elsewhere); the
    correction adds a few foreach passes. ω = 0 (no AdamW part) falls back to the per-tensor kernel."""
    if not params:
        return
    supported = {p.device.type for p in params} <= {"cpu", "cuda"} and all(
        p.dtype in (torch.float32, torch.float64) and p.dtype == m.dtype and not g.is_sparse
        for p, g, m in zip(params, grads, exp_avgs)
    )
    if omega == 0.0 or not supported:
        for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps):
            qh_adam_update(p, g, m, v, t, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, omega=omega)
        return
    fused = all(p.device.type == "cpu" for p in params)  # CUDA's fused kernel wants its steps on the device
    adamw_functional(
        params, grads, exp_avgs, exp_avg_sqs, [], state_steps, foreach=not fused, fused=fused or None,
        amsgrad=False, beta1=beta1, beta2=beta2, lr=lr * omega, weight_decay=weight_decay / omega, eps=eps,
        maximize=False,
    )
    if omega == 1.0:
        return
    # G/D with D = sqrt(v/bc2) + ε equals sqrt(bc2)·G/(sqrt(v) + ε·sqrt(bc2)): no pass for the division by bc2
    roots = [(1 - beta2 ** int(t)) ** 0.5 for t in state_steps]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_add_(denom, [eps * r for r in roots])
    torch._foreach_addcdiv_(params, grads, denom, [-lr * (1 - omega) * r for r in roots])
