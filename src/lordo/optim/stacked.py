"""The low-rank step for many matrices at once: matrices of one shape as one (n, p, q) batch.

A transformer has a handful of matrix shapes (attention, MLP up, MLP down) repeated over its layers. A
:class:`MatrixStack` holds the optimizer state of the n matrices of one shape, side, dtype and device of a
parameter group: error feedback, moments, bases and step counts are views of (n, ...) tensors it owns (the
per-matrix state points into them), so each operation of the step is one batched call (``bmm``, ``baddbmm``,
one elementwise kernel) for all n matrices instead of one per matrix: far fewer kernel launches and Python
calls, which is what a GPU step of many small matrices is bound by. The parameters themselves stay the
user's tensors (no shared storage, which ``safetensors`` and ``save_pretrained`` refuse): their gradients
are stacked once per step and the updated weights copied back with one multi-tensor copy.

The error feedback is optim/feedback.py's (the deferred running sum S, its proj(S) c and its factor), written
for a batch: with E the buffer,

    deferred (the basis has not changed since the last step):  S += G/factor ;  g = proj(G) ;  c += g
    otherwise:                                                  E += G ;  g = proj(E) ;  E −= back(g)

and the update is :func:`lordo.optim.functional.lowrank_qh_adam`'s batched implementation (the float64 reference
in tests/test_optim.py checks both implementations). The rows stepped as one batch share their error feedback's
mode (:func:`lordo.optim.feedback.mode`).

Per-matrix state is kept as views, so ``state_dict``, :meth:`LowRankQHAdam.set_basis` and resume work as
before; a stack whose views were replaced (a ``load_state_dict``, a basis set anew) is rebuilt from the
per-matrix tensors. :class:`LowRankQHAdam` takes this path on accelerators (``batched=None``) or when asked
(``batched=True``); on the CPU, where the step is bound by memory traffic rather than launches, the
per-matrix path avoids the two extra copies. With ``compile=True`` the update (:func:`update`) runs through
``torch.compile``: the moment math, the scales and the full-size epilogue of the GEMM (weight decay, QH term)
become two fused kernels around one ``bmm``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import feedback
from .feedback import DEFERRED, INSIDE, SCALE
from .functional import lowrank_qh_adam
from .subspace import Side, grad_of, side_of

STACKED_STATE = ("step", "basis", "exp_avg", "exp_avg_sq", "error_feedback")


class MatrixStack:
    """n low-rank matrices of one shape, side, dtype and device of one parameter group (see module doc)."""

    def __init__(self, params: Sequence[torch.Tensor], states: Sequence[dict]) -> None:
        self.params, self.states = list(params), list(states)
        self.side = side_of(self.params[0].shape)
        self._grad: tuple[slice, torch.Tensor] | None = None  # this step's stacked gradients, see project
        self.tensors = {key: torch.stack([s[key] for s in self.states]) for key in STACKED_STATE if key in self.states[0]}
        low_shape = self.tensors["exp_avg"].shape
        self._low_shape = low_shape
        # proj(S) of the deferred buffers (optim/feedback.py), allocated once a row keeps one: a stack whose
        # matrices never do (omega = 1, lowrank-ddp) holds none
        self._inside: torch.Tensor | None = None
        self._views: list[tuple[dict, str, torch.Tensor]] = []  # (state, key, the view it must hold)
        for i, s in enumerate(self.states):
            for key, stacked in self.tensors.items():
                s[key] = stacked[i]
                self._views.append((s, key, s[key]))
            if INSIDE in s:
                self.inside[i].copy_(s[INSIDE])
                s[INSIDE] = self.inside[i]

    @property
    def inside(self) -> torch.Tensor:
        if self._inside is None:
            self._inside = torch.zeros(self._low_shape, dtype=self.params[0].dtype, device=self.params[0].device)
        return self._inside

    def intact(self) -> bool:
        """Whether every state tensor is still the view this stack put there (checked at every step: by
        identity, which is cheap; a state loaded or set anew holds other tensors)."""
        return all(s.get(key) is view for s, key, view in self._views)

    def uniform_runs(self) -> list[slice]:
        """Consecutive rows whose error feedback is in the same mode, each one batch."""
        modes = [(bool(s.get(DEFERRED)), INSIDE in s) for s in self.states]  # feedback.mode, inlined: host time
        runs, start = [], 0
        for i in range(1, len(modes) + 1):
            if i == len(modes) or modes[i] != modes[start]:
                runs.append(slice(start, i))
                start = i
        return runs

    # ---------------------------------------------------------------------------------------------------

    def _proj(self, a: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, basis) if self.side == Side.RIGHT else torch.bmm(basis.transpose(1, 2), a)

    def _remove_back(self, a: torch.Tensor, g: torch.Tensor, basis: torch.Tensor) -> None:
        """a ← a − back(g), in place."""
        if self.side == Side.RIGHT:
            a.baddbmm_(g, basis.transpose(1, 2), alpha=-1)
        else:
            a.baddbmm_(basis, g, alpha=-1)

    @torch.no_grad()
    def project(self, group: dict, rows: slice) -> torch.Tensor:
        """g = proj(G + E) of the matrices ``rows``, updating their error feedback (see module doc)."""
        states = self.states[rows]
        grad = torch.stack([grad_of(p) for p in self.params[rows]])
        self._grad = (rows, grad)  # kept for apply's full-rank term
        basis = self.tensors["basis"][rows]
        basis = basis if basis.dtype == grad.dtype else basis.to(grad.dtype)
        error = self.tensors["error_feedback"][rows] if "error_feedback" in self.tensors else None
        if error is None:
            return self._proj(grad, basis)
        if states[0].get(DEFERRED):
            _add_scaled(error, grad, [s.get(SCALE, 1.0) for s in states])  # E lies outside the subspace: proj(G + E) = proj(G)
            g = self._proj(grad, basis)
            if INSIDE in states[0]:
                self.inside[rows].add_(g)  # proj(S) follows S
            return g
        low_precision = error.dtype != grad.dtype
        a = grad + error.to(grad.dtype) if low_precision else error.add_(grad)
        g = self._proj(a, basis)
        self._remove_back(a, g, basis)  # E ← A − back(g): what the projection drops, fed back next step
        if low_precision:
            error.copy_(a)
        elif feedback.deferrable(error, grad.dtype):  # from now on E is a running sum
            keep = feedback.keeps_inside(group)
            if keep:
                self.inside[rows].zero_()
            for i, s in zip(range(rows.start, rows.stop), states):
                feedback.begin(s, self.inside[i] if keep else None)
        return g

    @torch.no_grad()
    def apply(self, group: dict, rows: slice, g: torch.Tensor) -> None:
        """Moments and weights of the matrices ``rows`` from their projected gradients ``g`` (n, ., r)."""
        states, params = self.states[rows], self.params[rows]
        full, low, factor = self._qh_input(group, rows, g)
        b1, b2 = group["betas"]
        work = torch.stack([p.detach() for p in params]).to(self.tensors["exp_avg"].dtype)  # bf16/fp16: in fp32
        lowrank_qh_adam(
            [work], [g], [self.tensors["exp_avg"][rows]], [self.tensors["exp_avg_sq"][rows]],
            [self.tensors["basis"][rows]], [self.side], [self.tensors["step"][rows]], [full], [low], [factor],
            lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
            omega=group["omega"], scale=group["scale"], lowrank_term=group.get("lowrank_term", "adam"), batched=True,
            compiled=bool(group.get("compile")))
        torch._foreach_copy_([p.detach() for p in params], list(work.unbind(0)))
        self._grad = None
        if feedback.shrinks(group) and "error_feedback" in self.tensors:
            self._shrink(states, rows, group["omega"])

    def _shrink(self, states: list[dict], rows: slice, omega: float) -> None:
        """E ← ω·E (optim/feedback.py): a deferred run through its factor and proj(S), another one in full."""
        if not states[0].get(DEFERRED):
            self.tensors["error_feedback"][rows].mul_(omega)
            return
        feedback.next_scales(states, omega)
        if INSIDE in states[0]:
            self.inside[rows].mul_(omega)

    def _qh_input(self, group: dict, rows: slice, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, list[float]]:
        """The full-rank term's input as (full, low, factor): A = factor·full − back(low) (optim/feedback.py)."""
        ones = [1.0] * (rows.stop - rows.start)
        if group["omega"] == 1:
            return None, None, ones
        if group["qh_source"] == "grad" or "error_feedback" not in self.tensors:  # A = G: project's stack if it is this one
            cached = self._grad is not None and self._grad[0] == rows
            grad = self._grad[1] if cached else torch.stack([grad_of(p) for p in self.params[rows]])  # type: ignore[index]
            return grad, None, ones
        error, states = self.tensors["error_feedback"][rows], self.states[rows]
        if INSIDE in states[0]:  # deferred: A = factor·buffer − back(c − g), the running sum after this step
            return error, self.inside[rows] - g, [s.get(SCALE, 1.0) for s in states]
        return error, -g, ones  # A = G + E_before = E_after + back(g)


def _add_scaled(buffers: torch.Tensor, grads: torch.Tensor, scales: list[float]) -> None:
    """buffers[i] += grads[i]/scales[i] (a deferred buffer holds S/factor): one pass."""
    if all(s == scales[0] for s in scales):
        buffers.add_(grads, alpha=1 / scales[0])
    else:
        inverse = torch.tensor([1 / s for s in scales], dtype=buffers.dtype).to(buffers.device).view(-1, 1, 1)
        buffers.addcmul_(grads, inverse)
