"""Error feedback, and its deferred form, in one place: what both implementations of the step (per matrix and
batched) do with a matrix's buffer E.

After a step in basis P, E = A − back(proj(A)) has no component in P's subspace (E·P = 0 on the right side, up
to rounding). While P stays, proj(G + E) = proj(G), and the E of step t is (E_s + G_s+1 + ... + G_t) with its
component in the subspace removed: the buffer only needs to sum the gradients (one elementwise pass instead of
a pass and two GEMMs per step), and the projection is removed once, when the basis changes (:func:`settle`).

The representation, in the matrix's state (tensors, a bool and a float, so saved and restored with it: a
resumed run continues bit for bit):

- ``DEFERRED`` (bool): the buffer ``error_feedback`` holds the running sum S (divided by SCALE, below);
- ``INSIDE``: c = proj(S), low-rank, kept with qh_source "grad+error" (the full-rank term needs
  A = G + E_before = S − back(c − g) every step; A is never formed: back(c − g) joins the low-rank update's
  GEMM);
- ``SCALE`` (float, default 1): with error_feedback_after_qh "remove", E ← ω·E after every step would be one
  more full-size pass; the buffer holds S/SCALE and the factor is what shrinks (:func:`shrink`), gradients are
  added as G/SCALE, and the factor is multiplied in when the projection is removed (the same GEMM) or once it
  falls below ``FOLD_BELOW``.

Deferred only for buffers at the gradient's precision (a bf16 running sum would drown the small outside part
in the large inside one): :func:`deferrable`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import compact
from .lowrank import project, project_with_feedback, remove_projection
from .subspace import Side

DEFERRED = "error_feedback_deferred"
INSIDE = "error_feedback_inside"
SCALE = "error_feedback_scale"
FOLD_BELOW = 2.0**-10


def deferrable(error: torch.Tensor, grad_dtype: torch.dtype) -> bool:
    return error.dtype == grad_dtype and error.dtype in (torch.float32, torch.float64)


def keeps_inside(group: dict) -> bool:
    """Whether a deferred buffer of ``group`` keeps proj(S): the full-rank term reads G + E."""
    return group["qh_source"] == "grad+error" and group["omega"] < 1


def shrinks(group: dict) -> bool:
    """Whether E ← ω·E after each step of ``group`` (error_feedback_after_qh "remove")."""
    return keeps_inside(group) and group["error_feedback_after_qh"] == "remove"


def mode(state: dict) -> tuple[bool, bool]:
    """What a batch of matrices must share to be stepped as one: deferred or not, proj(S) kept or not."""
    return bool(state.get(DEFERRED)), INSIDE in state


def project_each(grads: Sequence[torch.Tensor], states: Sequence[dict], bases: Sequence[torch.Tensor],
                 sides: Sequence[Side], inside: Sequence[bool], defer: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """g = proj(G + E) of each matrix, E updated: a deferred buffer adds G, another one takes the projection out
    (E ← A − back(g)) and is deferred from then on where it can be. ``inside[i]``: whether matrix i keeps proj(S)
    once deferred (:func:`keeps_inside`); ``defer[i]`` False: never defer matrix i (a buffer held compact between
    steps, optim/compact.py, holds E itself)."""
    out = []
    defer = [True] * len(grads) if defer is None else defer
    for grad, state, basis, side, keep, may in zip(grads, states, bases, sides, inside, defer, strict=True):
        basis = basis if basis.dtype == grad.dtype else basis.to(grad.dtype)
        if state.get(DEFERRED):
            # S += G/factor right before G is projected, matrix by matrix: G is read twice while it is in cache
            state["error_feedback"].add_(grad, alpha=1 / state.get(SCALE, 1.0))
            g = project(grad, basis, side)
            if INSIDE in state:
                state[INSIDE].add_(g)  # proj(S) follows S
            out.append(g)
            continue
        error = state.get("error_feedback")
        out.append(project_with_feedback(grad, error, basis, side))
        if may and error is not None and deferrable(error, grad.dtype):
            begin(state, torch.zeros_like(out[-1]) if keep else None)
    return out


def begin(state: dict, inside: torch.Tensor | None) -> None:
    """Defer a buffer that just had the projection taken out (E lies outside the subspace: proj(E) = 0, so
    ``inside`` is zeros, or None where proj(S) is not kept)."""
    state[DEFERRED] = True
    if inside is not None:
        state[INSIDE] = inside


def qh_input(state: dict, g: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """The full-rank term's input A = G + E_before of one matrix as (full, low, factor): A = factor·full − back(low),
    from its projected gradient ``g`` and gradient ``grad`` (after :func:`project_each` or the batched projection)."""
    error = state.get("error_feedback")
    if error is None:  # error feedback off: A = G
        return grad, None, 1.0
    if INSIDE in state:  # deferred: A = S − back(c − g), S = SCALE·buffer the running sum after this step
        return error, state[INSIDE] - g, state.get(SCALE, 1.0)
    return error, -g, 1.0  # A = G + E_before = E_after + back(g)


def next_scales(states: Sequence[dict], omega: float) -> None:
    """E ← ω·E of the deferred buffers among ``states`` through their factors: each factor shrinks, and one that falls
    below FOLD_BELOW is multiplied into its buffer."""
    for s in states:
        if not s.get(DEFERRED) or "error_feedback" not in s:
            continue
        if (scale := s.get(SCALE, 1.0) * omega) < FOLD_BELOW:
            s["error_feedback"].mul_(scale)
            s.pop(SCALE, None)
        else:
            s[SCALE] = scale


def shrink(states: Sequence[dict], omega: float) -> None:
    """E ← ω·E for each matrix (the full-rank term applied (1 − ω)·E of what lies outside the subspace: E keeps the
    rest): a deferred buffer's factor and its proj(S), other buffers themselves (one multi-tensor call)."""
    next_scales(states, omega)
    buffers = [s[INSIDE] for s in states if INSIDE in s]
    buffers += [s["error_feedback"] for s in states if "error_feedback" in s and not s.get(DEFERRED)]
    if buffers:
        torch._foreach_mul_(buffers, omega)


def settle(state: dict, side: Side) -> None:
    """Make the buffer E itself again (its projection removed, its factor multiplied in): before a basis changes
    or E is read in place."""
    state.pop(INSIDE, None)
    scale = state.pop(SCALE, 1.0)
    if state.pop(DEFERRED, False):
        remove_projection(state["error_feedback"], state["basis"], side, scale)


def settled_copy(state: dict, side: Side) -> torch.Tensor | None:
    """E of a matrix, as a copy if deferred (reading it changes nothing); None without a buffer."""
    error = state.get("error_feedback")
    if error is None or not state.get(DEFERRED):
        return error
    error = error.clone()
    remove_projection(error, state["basis"], side, state.get(SCALE, 1.0))
    return error


def forget(state: dict) -> None:
    """E = 0 (a deferred buffer stays deferred: zero lies outside every subspace; a compact one: its scales zero)."""
    state.pop(SCALE, None)
    for key in ("error_feedback", INSIDE, "error_feedback" + compact.SCALE):
        if key in state:
            state[key].zero_()


def state_bytes(numel: int, lowrank_numel: int, ef_dtype: torch.dtype, dtype: torch.dtype, group: dict) -> int:
    """Bytes of a matrix's error feedback: the buffer, and proj(S) beside it where it is kept."""
    out = numel * torch.empty((), dtype=ef_dtype).element_size()
    if ef_dtype == dtype and dtype in (torch.float32, torch.float64) and keeps_inside(group):
        out += lowrank_numel * torch.empty((), dtype=dtype).element_size()
    return out
