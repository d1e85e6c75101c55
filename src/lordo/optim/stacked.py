"""The low-rank step for many matrices at once: matrices of one shape as one (n, p, q) batch.

A transformer has a handful of matrix shapes (attention, MLP up, MLP down) repeated over its layers. A
:class:`MatrixStack` holds the optimizer state of the n matrices of one shape, side, dtype and device of a
parameter group: error feedback, moments, bases and step counts are views of (n, ...) tensors it owns (the
per-matrix state points into them), so each operation of the step is one batched call (``bmm``, ``baddbmm``,
one elementwise kernel) for all n matrices instead of one per matrix: far fewer kernel launches and Python
calls, which is what a GPU step of many small matrices is bound by. The parameters themselves stay the
user's tensors (no shared storage, which ``safetensors`` and ``save_pretrained`` refuse): their gradients
are stacked once per step and the updated weights copied back with one multi-tensor copy.

The math is :func:`lordo.optim.functional.lowrank_qh_adam_update`'s, written for a batch (the float64
reference in tests/test_optim.py checks both): with S the error-feedback buffer,

    deferred (the basis has not changed since the last step):  S += G ;  g = proj(G) ;  c += g
    otherwise:                                                  S += G ;  g = proj(S) ;  S −= back(g)
    u, v ← Adam moments of g ;  ratio = û/D ;  A = full − back(low)   (G; or G + E = S − back(c − g))
    W ← (1 − ηλ)·W + back(α·ratio + κ/ΣD·low) − κ/ΣD·full           (one baddbmm, one addcmul)

Per-matrix state is kept as views, so ``state_dict``, :meth:`LowRankQHAdam.set_basis` and resume work as
before; a stack whose views were replaced (a ``load_state_dict``, a basis set anew) is rebuilt from the
per-matrix tensors. :class:`LowRankQHAdam` takes this path on accelerators (``batched=None``) or when asked
(``batched=True``); on the CPU, where the step is bound by memory traffic rather than launches, the
per-matrix path avoids the two extra copies. With ``compile=True`` the update (:func:`update`) runs through
``torch.compile``: the moment math, the scales and the full-size epilogue of the GEMM (weight decay, QH term,
E ← ω·E) become two fused kernels around one ``bmm``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .subspace import RIGHT, grad_of, side_of

DEFERRED = "error_feedback_deferred"  # state flag (a bool): E is a running sum S, see LowRankQHAdam
INSIDE = "error_feedback_inside"  # with a deferred buffer S and qh_source grad+error: proj(S), low-rank
SCALE = "error_feedback_scale"  # a float, per-matrix path only: a deferred buffer holds S/SCALE (see LowRankQHAdam)
STACKED_STATE = ("step", "basis", "exp_avg", "exp_avg_sq", "error_feedback")


class MatrixStack:
    """n low-rank matrices of one shape, side, dtype and device of one parameter group (see module doc)."""

    def __init__(self, params: Sequence[torch.Tensor], states: Sequence[dict]) -> None:
        self.params, self.states = list(params), list(states)
        self.side = side_of(self.params[0].shape)
        self._grad: tuple[slice, torch.Tensor] | None = None  # this step's stacked gradients, see project
        for s in self.states:  # the per-matrix path's factor: folded in, the stack scales E itself
            if SCALE in s:
                s["error_feedback"].mul_(s.pop(SCALE))
        self.tensors = {key: torch.stack([s[key] for s in self.states]) for key in STACKED_STATE if key in self.states[0]}
        low_shape = self.tensors["exp_avg"].shape
        self.inside = torch.zeros(low_shape, dtype=self.params[0].dtype, device=self.params[0].device)
        self._views: list[tuple[dict, str, torch.Tensor]] = []  # (state, key, the view it must hold)
        for i, s in enumerate(self.states):
            for key, stacked in self.tensors.items():
                s[key] = stacked[i]
                self._views.append((s, key, s[key]))
            if INSIDE in s:
                self.inside[i].copy_(s[INSIDE])
                s[INSIDE] = self.inside[i]

    def intact(self) -> bool:
        """Whether every state tensor is still the view this stack put there (checked at every step: by
        identity, which is cheap; a state loaded or set anew holds other tensors)."""
        return all(s.get(key) is view for s, key, view in self._views)

    # ---------------------------------------------------------------------------------------------------

    def _proj(self, a: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, basis) if self.side == RIGHT else torch.bmm(basis.transpose(1, 2), a)

    def _remove_back(self, a: torch.Tensor, g: torch.Tensor, basis: torch.Tensor) -> None:
        """a ← a − back(g), in place."""
        if self.side == RIGHT:
            a.baddbmm_(g, basis.transpose(1, 2), alpha=-1)
        else:
            a.baddbmm_(basis, g, alpha=-1)

    @torch.no_grad()
    def project(self, group: dict, rows: slice) -> torch.Tensor:
        """g = proj(G + E) of the matrices ``rows``, updating their error feedback (see module doc)."""
        states = self.states[rows]
        grad = self._gradients(rows)
        self._grad = (rows, grad)  # kept for apply's full-rank term
        basis = self.tensors["basis"][rows]
        basis = basis if basis.dtype == grad.dtype else basis.to(grad.dtype)
        error = self.tensors["error_feedback"][rows] if "error_feedback" in self.tensors else None
        if states[0].get(DEFERRED):
            error.add_(grad)  # type: ignore[union-attr]  # E has no part in the subspace: proj(G + E) = proj(G)
            g = self._proj(grad, basis)
            if INSIDE in states[0]:
                self.inside[rows].add_(g)  # proj(S) follows S
            return g
        if error is None:
            return self._proj(grad, basis)
        low_precision = error.dtype != grad.dtype
        a = grad + error.to(grad.dtype) if low_precision else error.add_(grad)
        g = self._proj(a, basis)
        self._remove_back(a, g, basis)  # E ← A − back(g): what the projection drops, fed back next step
        if low_precision:
            error.copy_(a)
        elif error.dtype in (torch.float32, torch.float64):  # from now on E is a running sum (module doc)
            inside = group["qh_source"] == "grad+error" and group["omega"] < 1
            self.inside[rows].zero_()
            for i, s in zip(range(rows.start, rows.stop), states):
                s[DEFERRED] = True
                if inside:
                    s[INSIDE] = self.inside[i]  # E lies outside the subspace: proj(E) = 0
        return g

    @torch.no_grad()
    def apply(self, group: dict, rows: slice, g: torch.Tensor) -> None:
        """Moments and weights of the matrices ``rows`` from their projected gradients ``g`` (n, ., r)."""
        states = self.states[rows]
        b1, b2 = group["betas"]
        lr, omega = float(group["lr"]), group["omega"]
        u, v = self.tensors["exp_avg"][rows], self.tensors["exp_avg_sq"][rows]
        steps = self.tensors["step"][rows]
        steps.add_(1)
        full, low = self._qh_inputs(group, rows, g)
        with_qh = omega < 1 and full is not None
        # D = sqrt(v/bc2) + ε = (sqrt(v) + ε·sqrt(bc2)) / sqrt(bc2): D' = sqrt(bc2)·D, and the factors
        # sqrt(bc2) and 1/bc1 go into the per-matrix scales (no pass for the divisions). The step counts live
        # on the CPU: the scales are computed there and sent in one small copy, no device synchronisation.
        ts = steps.tolist()
        roots = [(1 - b2**t) ** 0.5 for t in ts]
        alpha = -lr * (omega if with_qh else 1.0) * group["scale"]
        momentum = group.get("lowrank_term", "adam") == "momentum"  # L = û, not û/D: no sqrt(bc2) to undo
        kappa = lr * (1 - omega) * u[0].numel()  # κ: − η(1−ω)·A/mean(D) = − κ·A/ΣD'
        scales = torch.tensor([
            [group["eps"] * root for root in roots],
            [alpha * (1.0 if momentum else root) / (1 - b1**t) for root, t in zip(roots, ts)],
            [kappa * root for root in roots],
            [1 - lr * group["weight_decay"]] * len(roots),
        ], dtype=u.dtype).view(4, -1, 1, 1).to(u.device)
        params = self.params[rows]
        work = torch.stack([p.detach() for p in params]).to(u.dtype)  # bf16/fp16: update in fp32
        buffers = []  # what E ← ω·E shrinks (``remove``): E, and proj(S) beside a running sum S
        if with_qh and group["qh_source"] == "grad+error" and group["error_feedback_after_qh"] == "remove":
            if "error_feedback" in self.tensors:
                buffers.append(self.tensors["error_feedback"][rows])
            if INSIDE in states[0]:
                buffers.append(self.inside[rows])
        args = (work, u, v, g, self.tensors["basis"][rows], full if with_qh else None, low if with_qh else None,
                buffers, scales)
        if group.get("compile"):
            compiled_update(*args, None, b1=b1, b2=b2, side=self.side, omega=omega, momentum=momentum)
        else:
            update(*args, 1 - lr * group["weight_decay"], b1=b1, b2=b2, side=self.side, omega=omega, momentum=momentum)
        torch._foreach_copy_([p.detach() for p in params], list(work.unbind(0)))
        self._grad = None

    def _qh_inputs(self, group: dict, rows: slice, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The full-rank term's input as (full-size part, low-rank part): A = full − back(low)."""
        if group["omega"] == 1:
            return None, None
        if group["qh_source"] == "grad" or "error_feedback" not in self.tensors:  # A = G: project's stack if it is this one
            cached = self._grad is not None and self._grad[0] == rows
            return (self._grad[1] if cached else self._gradients(rows)), None  # type: ignore[index]
        error = self.tensors["error_feedback"][rows]
        if INSIDE in self.states[rows][0]:  # deferred: A = S − back(c − g), S the running sum after this step
            return error, self.inside[rows] - g
        return error, -g  # A = G + E_before = E_after + back(g)

    def _gradients(self, rows: slice) -> torch.Tensor:
        return torch.stack([grad_of(p) for p in self.params[rows]])

    def uniform_runs(self) -> list[slice]:
        """Consecutive rows in the same mode (deferred or not, with or without proj(S)), each one batch."""
        modes = [(bool(s.get(DEFERRED)), INSIDE in s) for s in self.states]
        runs, start = [], 0
        for i in range(1, len(modes) + 1):
            if i == len(modes) or modes[i] != modes[start]:
                runs.append(slice(start, i))
                start = i
        return runs


def update(work: torch.Tensor, u: torch.Tensor, v: torch.Tensor, g: torch.Tensor, basis: torch.Tensor,
           full: torch.Tensor | None, low: torch.Tensor | None, buffers: list[torch.Tensor], scales: torch.Tensor,
           decay: float | None, *, b1: float, b2: float, side: str, omega: float, momentum: bool = False) -> None:
    """The step of a stack from its projected gradients ``g``, in place: the moments u, v, the stacked weights
    ``work`` (float32 or wider), and the error-feedback ``buffers`` to shrink by ω (``remove``; empty else).
    ``scales`` (4, n, 1, 1): ε·sqrt(bc2), the low-rank update's factor α, the QH term's κ and the weight decay's
    factor 1 − ηλ per matrix (see :meth:`MatrixStack.apply`); ``full``/``low``: the QH term's
    A = full − back(low) (None: no QH term); ``momentum``: the low-rank update is the momentum, not û/D.

    Plain tensor code without host reads, so ``torch.compile`` captures it whole (:func:`compiled_update`).
    ``decay``: 1 − ηλ as a number (eager: the GEMM's β, no extra pass), or None to take it from ``scales``
    (compiled: a number would be a constant of the graph, recompiled at every learning rate)."""
    eps_root, alpha, kappa, decays = scales.unbind(0)
    u.mul_(b1).add_(g, alpha=1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    denom = v.sqrt().add_(eps_root)
    ratio = u * alpha if momentum else (u / denom).mul_(alpha)
    factor = None
    if full is not None:
        factor = kappa / denom.sum(dim=(1, 2), keepdim=True)
        if low is not None:
            ratio.addcmul_(low.to(ratio.dtype), factor)  # + back(κ/ΣD'·c) joins the low-rank update's GEMM
    ratio, basis = ratio.to(work.dtype), basis.to(work.dtype)
    left, right = (ratio, basis.transpose(1, 2)) if side == RIGHT else (basis, ratio)
    if decay is None:  # the GEMM alone, its epilogue (decay, QH term, E ← ω·E) fused into one pass by inductor
        work.mul_(decays).add_(torch.bmm(left, right))
    else:
        work.baddbmm_(left, right, beta=decay)
    if full is not None:
        assert factor is not None
        work.addcmul_(full.to(work.dtype), (-factor).to(work.dtype))
    for buffer in buffers:  # the full-rank term applied (1 − ω)·E of what lies outside the subspace
        buffer.mul_(omega)


_compiled: Callable | None = None


def compiled_update(*args, **kwargs) -> None:
    """:func:`update` through ``torch.compile`` (compiled on first use; one graph per shape and mode, shapes
    dynamic after the second): the elementwise work of a step fused into few kernels."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(update, fullgraph=True)
    try:
        _compiled(*args, **kwargs)
    except torch._dynamo.exc.BackendCompilerFailed as err:
        raise RuntimeError("LowRankQHAdam(compile=True): torch.compile could not build the step on this machine "
                           "(on the CPU it needs a C++ compiler, on a GPU Triton); use compile=False") from err
