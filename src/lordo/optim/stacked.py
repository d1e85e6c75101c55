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
per-matrix path avoids the two extra copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .subspace import RIGHT, grad_of, side_of

DEFERRED = "error_feedback_deferred"  # state flag (a bool): E is a running sum S, see LowRankQHAdam
INSIDE = "error_feedback_inside"  # with a deferred buffer S and qh_source grad+error: proj(S), low-rank
STACKED_STATE = ("step", "basis", "exp_avg", "exp_avg_sq", "error_feedback")


class MatrixStack:
    """n low-rank matrices of one shape, side, dtype and device of one parameter group (see module doc)."""

    def __init__(self, params: Sequence[torch.Tensor], states: Sequence[dict]) -> None:
        self.params, self.states = list(params), list(states)
        self.side = side_of(self.params[0].shape)
        self._grad: tuple[slice, torch.Tensor] | None = None  # this step's stacked gradients, see project
        self.tensors = {key: torch.stack([s[key] for s in self.states]) for key in STACKED_STATE if key in self.states[0]}
        low_shape = self.tensors["exp_avg"].shape
        self.inside = torch.zeros(low_shape, dtype=self.params[0].dtype, device=self.params[0].device)
        for i, s in enumerate(self.states):
            for key, stacked in self.tensors.items():
                s[key] = stacked[i]
            if INSIDE in s:
                self.inside[i].copy_(s[INSIDE])
                s[INSIDE] = self.inside[i]

    def intact(self) -> bool:
        """Whether every state tensor still points into this stack."""
        for i, s in enumerate(self.states):
            for key, stacked in self.tensors.items():
                if key not in s or s[key].data_ptr() != stacked[i].data_ptr():
                    return False
        return True

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
        lr, eps, omega = group["lr"], group["eps"], group["omega"]
        u, v = self.tensors["exp_avg"][rows], self.tensors["exp_avg_sq"][rows]
        steps = self.tensors["step"][rows]
        steps.add_(1)
        u.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        # D = sqrt(v/bc2) + ε = (sqrt(v) + ε·sqrt(bc2)) / sqrt(bc2): D' = sqrt(bc2)·D, and the factors
        # sqrt(bc2) and 1/bc1 go into the per-matrix scales below (no pass for the divisions)
        t = steps.to(torch.float64)  # the step counts live on the CPU: these scalars cost no device sync
        root = (1 - b2**t).sqrt()

        def per_matrix(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=u.device, dtype=u.dtype).view(-1, 1, 1)

        denom = v.sqrt().add_(per_matrix(eps * root))
        ratio = u / denom
        full, low = self._qh_inputs(group, rows, g)
        with_qh = omega < 1 and full is not None
        ratio.mul_(per_matrix(-lr * (omega if with_qh else 1.0) * group["scale"] * root / (1 - b1**t)))
        if with_qh:
            # − η(1−ω)·A/mean(D) = − κ·A/ΣD' with κ = η(1−ω)·numel·sqrt(bc2)
            factor = per_matrix(lr * (1 - omega) * denom[0].numel() * root) / denom.sum(dim=(1, 2), keepdim=True)
            if low is not None:
                ratio.addcmul_(low.to(ratio.dtype), factor)  # + back(κ/ΣD'·c) joins the low-rank update's GEMM
        params = self.params[rows]
        work = torch.stack([p.detach() for p in params]).to(ratio.dtype)  # bf16/fp16: update in fp32
        basis = self.tensors["basis"][rows].to(work.dtype)
        decay = 1 - lr * group["weight_decay"]
        if self.side == RIGHT:
            work.baddbmm_(ratio.to(work.dtype), basis.transpose(1, 2), beta=decay)
        else:
            work.baddbmm_(basis, ratio.to(work.dtype), beta=decay)
        if with_qh:
            assert full is not None
            work.addcmul_(full.to(work.dtype), (-factor).to(work.dtype))
        torch._foreach_copy_([p.detach() for p in params], list(work.unbind(0)))
        self._grad = None
        if with_qh and group["qh_source"] == "grad+error" and group["error_feedback_after_qh"] == "remove":
            # the full-rank term applied (1 − ω)·E of what lies outside the subspace: E keeps the rest
            if "error_feedback" in self.tensors:
                self.tensors["error_feedback"][rows].mul_(omega)
            if INSIDE in states[0]:
                self.inside[rows].mul_(omega)

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
        def mode(s: dict) -> tuple[bool, bool]:
            return bool(s.get(DEFERRED)), INSIDE in s

        runs, start = [], 0
        for i in range(1, len(self.states) + 1):
            if i == len(self.states) or mode(self.states[i]) != mode(self.states[start]):
                runs.append(slice(start, i))
                start = i
        return runs
