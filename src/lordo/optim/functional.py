"""Stateless update kernels: the low-rank quasi-hyperbolic Adam step and full-rank QHAdam.

:func:`lowrank_qh_adam` is the one functional entry of the low-rank step, as torch's ``adam()`` is Adam's: it
takes tensor lists and the hyper-parameters (keyword-only) and runs one of two implementations with the same
signature, chosen by the caller: per matrix (each list entry one matrix: multi-tensor moment math over all of
them, one fused GEMM and one pass per matrix) or batched (each list entry a stack of n matrices of one shape,
(n, ...) tensors: one ``baddbmm`` and a few batched passes per stack, optionally through ``torch.compile``).

Shapes of one matrix: W, G, E are p×q; u, v are the low-rank moments (p×r on the right side, r×q on the left).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim.adamw import adamw as adamw_functional

from .subspace import Side

Sums = Callable[[list[torch.Tensor]], None]


@torch.no_grad()
def lowrank_qh_adam(
    weights: list[torch.Tensor],
    gs: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    bases: list[torch.Tensor],
    sides: list[Side],
    state_steps: list[torch.Tensor],
    qh_fulls: list[torch.Tensor | None],
    qh_lows: list[torch.Tensor | None],
    qh_factors: list,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    omega: float,
    scale: float = 1.0,
    lowrank_term: str = "adam",
    moment_numels: list[int] | None = None,
    sum_totals: Sums | None = None,
    batched: bool = False,
    compiled: bool = False,
) -> None:
    """One step of each matrix from its projected gradient g; ``state_steps`` (the steps taken so far: 0-d
    tensors, or (n,) for a stack) are incremented first, as in torch's kernels, and t is the new value:

        u ← β1·u + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
        û = u/(1−β1^t) ;  D = sqrt(v/(1−β2^t)) + ε
        L = û/D (lowrank_term "adam") or û ("momentum": the authors' research code)
        A = factor·full − back(low)                 (the full-rank term's input: G, or G + E)
        W ← W·(1 − η·λ) − η·(ω·scale·back(L) + (1−ω)·A/mean(D))

    ``qh_fulls[i]`` None: no full-rank term for matrix i (also when ω = 1); ``qh_lows[i]`` None: A = factor·full.
    Passing G + E as a running sum S and its low-rank part c (A = S − back(c)) avoids forming A: the
    back-projection joins the GEMM of the low-rank update (optim/feedback.py). ``scale``: GaLore's factor on the
    low-rank update. For shards of matrices (optim/sharded.py) mean(D) is over the whole matrix: ``moment_numels``
    gives each matrix's number of moment entries and ``sum_totals`` turns the shards' sums of D into the whole
    matrices' sums in place (per-matrix implementation only). ``batched``: the entries are stacks (n, ...) of one
    side each, and each ``qh_factors`` entry n numbers, one per matrix; ``compiled``: the batched update runs
    through ``torch.compile``."""
    if not weights:
        return
    implementation = _batched if batched else _per_matrix
    implementation(weights, gs, exp_avgs, exp_avg_sqs, bases, sides, state_steps, qh_fulls, qh_lows, qh_factors,
                   lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, omega=omega, scale=scale,
                   lowrank_term=lowrank_term, moment_numels=moment_numels, sum_totals=sum_totals, compiled=compiled)


@torch.no_grad()
def lowrank_qh_adam_update(param: torch.Tensor, g: torch.Tensor, qh_grad: torch.Tensor | None, exp_avg: torch.Tensor,
                           exp_avg_sq: torch.Tensor, basis: torch.Tensor, side: Side, step: torch.Tensor, *,
                           qh_lowrank: torch.Tensor | None = None, **hyper) -> None:
    """:func:`lowrank_qh_adam` for one matrix: A = qh_grad − back(qh_lowrank)."""
    lowrank_qh_adam([param], [g], [exp_avg], [exp_avg_sq], [basis], [side], [step], [qh_grad], [qh_lowrank], [1.0],
                    **hyper)


Tensors = list[torch.Tensor]
Optionals = list[torch.Tensor | None]


def _per_matrix(weights: Tensors, gs: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, bases: Tensors,
                sides: list[Side], state_steps: Tensors, qh_fulls: Optionals, qh_lows: Optionals, qh_factors: list, *,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, omega: float, scale: float,
                lowrank_term: str, moment_numels: list[int] | None, sum_totals: Sums | None, compiled: bool) -> None:
    """Multi-tensor (foreach) moment math over every matrix, then one GEMM and one pass per matrix."""
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
    totals = torch._foreach_norm(denoms, 1) if qh else [None] * len(weights)
    if qh and sum_totals is not None:
        sum_totals(totals)  # type: ignore[arg-type]
    numels = moment_numels if moment_numels is not None else [d.numel() for d in denoms]
    for weight, full, low, factor, basis, side, step, root, ratio, numel, total in zip(
            weights, qh_fulls, qh_lows, qh_factors, bases, sides, steps, roots, ratios, numels, totals, strict=True):
        with_qh = qh and full is not None
        # the QH term's scale: − η(1−ω)·A/mean(D) = − η(1−ω)·numel·sqrt(bc2)·A/sum(D')
        kappa = lr * (1 - omega) * numel * root
        alpha = -lr * (omega if with_qh else 1.0) * scale * (1.0 if momentum else root) / (1 - beta1**step)
        _apply_one(weight, ratio, basis, side, full if with_qh else None, low, total, alpha=alpha, kappa=kappa,
                   factor=factor, decay=1 - lr * weight_decay)


def _apply_one(weight: torch.Tensor, ratio: torch.Tensor, basis: torch.Tensor, side: Side, full: torch.Tensor | None,
               low: torch.Tensor | None, total: torch.Tensor | None, *, alpha: float, kappa: float, factor: float,
               decay: float) -> None:
    """W ← decay·W + α·back(ratio) + κ·(back(low) − factor·full)/total: one fused GEMM, one pass."""
    # a bf16/fp16 matrix is updated in float32 (the moments' precision) and rounded once
    param = weight if weight.dtype == ratio.dtype else weight.to(ratio.dtype)
    if full is not None and low is not None:
        assert total is not None
        # + η(1−ω)·back(c)/mean(D) joins the low-rank update: one GEMM for both
        ratio = torch.addcdiv(ratio.mul(alpha), low.to(ratio.dtype), total, value=kappa)
        alpha = 1.0
    ratio = ratio if ratio.dtype == param.dtype else ratio.to(param.dtype)
    basis = basis if basis.dtype == param.dtype else basis.to(param.dtype)
    # W ← (1 − ηλ)·W − η·ω·back(û/D) in one fused GEMM: no full-size temporary
    if side == Side.RIGHT:
        param.addmm_(ratio, basis.T, beta=decay, alpha=alpha)
    else:
        param.addmm_(basis, ratio, beta=decay, alpha=alpha)
    if full is not None:
        assert total is not None
        param.addcdiv_(full if full.dtype == param.dtype else full.to(param.dtype),
                       total if total.dtype == param.dtype else total.to(param.dtype), value=-kappa * factor)
    if param is not weight:
        weight.copy_(param)


def _batched(weights: Tensors, gs: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors, bases: Tensors,
             sides: list[Side], state_steps: Tensors, qh_fulls: Optionals, qh_lows: Optionals, qh_factors: list, *,
             lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, omega: float, scale: float,
             lowrank_term: str, moment_numels: list[int] | None, sum_totals: Sums | None, compiled: bool) -> None:
    """Each entry a stack of n matrices (float32 or wider ``weights``): per-matrix scalars as (n, 1, 1) tensors, the
    update as one graph of batched calls (:func:`stack_update`)."""
    if sum_totals is not None:
        raise ValueError("the batched step does not take shards of matrices (sum_totals)")
    momentum = lowrank_term == "momentum"  # L = û, not û/D: no sqrt(bc2) to undo
    for work, g, u, v, basis, side, steps, full, low, factor in zip(
            weights, gs, exp_avgs, exp_avg_sqs, bases, sides, state_steps, qh_fulls, qh_lows, qh_factors, strict=True):
        steps.add_(1)
        with_qh = omega < 1 and full is not None
        # the step counts live on the CPU: the scales are computed there and sent in one small copy, no device
        # synchronisation (D' = sqrt(bc2)·D as in _per_matrix)
        ts = steps.tolist()
        roots = [(1 - beta2**t) ** 0.5 for t in ts]
        alpha = -lr * (omega if with_qh else 1.0) * scale
        kappa = lr * (1 - omega) * u[0].numel()  # κ: − η(1−ω)·A/mean(D) = − κ·A/ΣD'
        scales = torch.tensor([
            [eps * root for root in roots],
            [alpha * (1.0 if momentum else root) / (1 - beta1**t) for root, t in zip(roots, ts)],
            [kappa * root for root in roots],
            [-f for f in factor],
            [1 - lr * weight_decay] * len(roots),
        ], dtype=u.dtype).view(5, -1, 1, 1).to(u.device)
        args = (work, u, v, g, basis, full if with_qh else None, low if with_qh else None, scales)
        if compiled:
            compiled_stack_update(*args, None, b1=beta1, b2=beta2, side=side, momentum=momentum)
        else:
            stack_update(*args, 1 - lr * weight_decay, b1=beta1, b2=beta2, side=side, momentum=momentum)


def stack_update(work: torch.Tensor, u: torch.Tensor, v: torch.Tensor, g: torch.Tensor, basis: torch.Tensor,
                 full: torch.Tensor | None, low: torch.Tensor | None, scales: torch.Tensor, decay: float | None, *,
                 b1: float, b2: float, side: Side, momentum: bool = False) -> None:
    """The step of a stack from its projected gradients ``g``, in place: the moments u, v and the stacked weights
    ``work``. ``scales`` (5, n, 1, 1): ε·sqrt(bc2), the low-rank update's factor α, the QH term's κ, minus the factor
    on its full-size part, and the weight decay's factor 1 − ηλ per matrix; ``full``/``low``: the QH term's
    A = factor·full − back(low) (None: no QH term); ``momentum``: the low-rank update is the momentum, not û/D.

    Plain tensor code without host reads, so ``torch.compile`` captures it whole (:func:`compiled_stack_update`).
    ``decay``: 1 − ηλ as a number (eager: the GEMM's β, no extra pass), or None to take it from ``scales``
    (compiled: a number would be a constant of the graph, recompiled at every learning rate)."""
    eps_root, alpha, kappa, minus_factor, decays = scales.unbind(0)
    u.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = v.sqrt().add_(eps_root)
    ratio = u * alpha if momentum else (u / denom).mul_(alpha)
    qh = None
    if full is not None:
        qh = kappa / denom.sum(dim=(1, 2), keepdim=True)  # κ/ΣD' per matrix
        if low is not None:
            ratio.addcmul_(low.to(ratio.dtype), qh)  # + back(κ/ΣD'·c) joins the low-rank update's GEMM
    ratio, basis = ratio.to(work.dtype), basis.to(work.dtype)
    left, right = (ratio, basis.transpose(1, 2)) if side == Side.RIGHT else (basis, ratio)
    if decay is None:  # the GEMM alone, its epilogue (decay, QH term) fused into one pass by inductor
        work.mul_(decays).add_(torch.bmm(left, right))
    else:
        work.baddbmm_(left, right, beta=decay)
    if full is not None:
        assert qh is not None
        work.addcmul_(full.to(work.dtype), (qh * minus_factor).to(work.dtype))


_compiled: Callable | None = None


def compiled_stack_update(*args, **kwargs) -> None:
    """:func:`stack_update` through ``torch.compile`` (compiled on first use; one graph per shape and mode, shapes
    dynamic after the second): the elementwise work of a step fused into few kernels."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(stack_update, fullgraph=True)
    try:
        _compiled(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as err:
        raise RuntimeError("LowRankQHAdam(compile=True): torch.compile could not build the step on this machine "
                           "(on the CPU it needs a C++ compiler, on a GPU Triton); use compile=False") from err


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def takes_fused_adamw(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel (one pass over all tensors; on the CPU ~5× faster than foreach) takes
    every tensor: on the CPU or a CUDA device, of a floating dtype it handles."""
    return all(t.device.type in ("cpu", "cuda") and t.dtype in FUSED_DTYPES for t in tensors)


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
    supported = takes_fused_adamw(params) and all(
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
