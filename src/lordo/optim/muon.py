"""``LowRankMuon``: LoRDO's local step in Muon's form — a momentum of the projected gradient in the shared basis,
orthogonalised with what the basis drops (``orthogonalise = "split"``, the default since its perplexity was 23 % below
the r-dimensional form's at 2,000 ``micro`` steps, docs/results.md section 13) or alone in the r-dimensional
space with the full-rank quasi-hyperbolic term beside it (``"lowrank"``, the first form, kept for reproduction).
The r-dimensional form (docs/concepts.md):

For a matrix W (p×q) with basis P (its smaller side, as :class:`~lordo.optim.LowRankQHAdam`), gradient G and
error feedback E::

    A = G + E ;  g = proj(A) ;  E ← A − back(g)            # error feedback, deferred as LowRankQHAdam's
    M ← μ·M + (1−μ)·g                                     # torch's Muon: buf.lerp_(g, 1 − μ)
    N = (1−μ)·g + μ·M (Nesterov) or M
    O = NS(N)                                             # Newton–Schulz on the p×r (or r×q) matrix
    s = adjust(p, q)·sqrt(min(p, q)/r)                    # Muon's per-matrix rate, and the rank's share
    ρ = s·‖O‖/sqrt(p·q)                                   # the RMS of s·back(O) (back keeps norms)
    Q = G or A (qh_source) ;  W ← W·(1 − ηλ) − η·(ω·s·back(O) + (1 − ω)·ρ·Q/σ)
    σ = rms(back(N)) (qh_scale "momentum": the size of what was orthogonalised) or rms(Q) ("own")

``orthogonalise = "whole"`` (a setting) orthogonalises the whole p×q step instead, a quasi-hyperbolic Muon whose
momentum lives in the shared basis and whose remainder is the full-rank term::

    X = ω·back(N)/‖N‖ + (1 − ω)·Q/‖Q‖ ;  W ← W·(1 − ηλ) − η·adjust(p, q)·NS(X)

Newton–Schulz lifts every singular value of X towards 1, so the directions outside the basis move as far as those
inside it, however small ω leaves their share; the state stays r-dimensional (M) plus E; the cost per step is
full-rank Muon's iteration on p×q. At ω = 1 it is NS(back(N)): at r = min(p, q) and P = I, torch's Muon again.

``orthogonalise = "split"`` reads E as what it is under ``error_feedback_after_qh = "remove"``: while the basis
stays, E_t = ω·(E_{t−1} + c_t) with c = G − back(g) the part of G the projection drops, so R = (1 − ω)/ω·E is an
ω-average of c, the momentum of the directions outside the basis. The step is full-rank Muon's on the Nesterov
momentum split in two, back(N) inside the basis (μ, shared by the workers at a synchronisation) and
(1 − ω)·c + ω·R = (1 − ω)·(c + E_t) outside it (ω, each worker's own)::

    X = back(N) + (1 − ω)·(c + E_t) ;  W ← W·(1 − ηλ) − η·adjust(p, q)·NS(X)

With ω = μ and the basis fixed it is torch's Muon at any rank r (one momentum, split); a basis change carries E
into the new basis as error feedback (its part inside the new basis enters the momentum through g).

``adjust`` is torch's: ``match_rms_adamw`` 0.2·sqrt(max(p, q)), ``original`` sqrt(max(1, p/q)); the factor
sqrt(min(p, q)/r) gives the rank-r update the RMS of a full-rank orthogonal one (an orthogonal p×q matrix of
rank r has RMS sqrt(r/(p·q))). At r = min(p, q), ω = 1 and P = I this is torch's ``torch.optim.Muon`` step. At
a basis change M is carried into the new basis as Adam's first moment is (M ← M·Cᵀ, C = P_newᵀ·P_old).

The momentum lives in the state as ``exp_avg`` with μ as the group's ``betas[0]`` (it is Adam's first moment
with β1 = μ), so that LoRDO's strategies average and replay it as they do Adam's; there is no second moment.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import feedback
from .optimizer import LowRankQHAdam
from .sharded import is_sharded
from .state import Lists
from .subspace import Side

ADJUST_LR = ("match_rms_adamw", "original")
QH_SCALES = ("momentum", "own")
ORTHOGONALISE = ("lowrank", "whole", "split")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch's (Keller Jordan's quintic)


def newton_schulz(x: torch.Tensor, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, steps: int = 5,
                  eps: float = 1e-7, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An approximately orthogonal matrix with ``x``'s singular vectors (U·S'·Vᵀ, S' near 1), by ``steps`` quintic
    Newton–Schulz iterations in ``dtype`` on the wide orientation (Gram matrix of the smaller side), after scaling
    to Frobenius norm 1; torch's Muon runs the same iteration in bfloat16."""
    a, b, c = coefficients
    y = x.to(dtype)
    tall = y.shape[0] > y.shape[1]
    if tall:
        y = y.T
    y = y / y.norm().clamp(min=eps)
    for _ in range(steps):
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if tall else y


def muon_scale(shape: tuple[int, ...], adjust: str | None) -> float:
    """Muon's per-matrix rate factor of a p×q matrix, as torch's ``adjust_lr_fn``: ``match_rms_adamw``
    0.2·sqrt(max(p, q)), ``original`` (or None) sqrt(max(1, p/q))."""
    p, q = shape[0], shape[1]
    return 0.2 * math.sqrt(max(p, q)) if adjust == "match_rms_adamw" else math.sqrt(max(1.0, p / q))


def rank_scale(shape: tuple[int, int], rank: int, adjust: str) -> float:
    """s: Muon's per-matrix rate factor of a p×q matrix, times sqrt(min(p, q)/r)."""
    return muon_scale(shape, adjust) * math.sqrt(min(shape) / rank)


@dataclass(frozen=True)
class MuonOptions:
    momentum: float
    nesterov: bool
    coefficients: tuple[float, float, float]
    steps: int
    eps: float
    adjust: str
    dtype: torch.dtype
    qh_scale: str
    orthogonalise: str = "split"


class LowRankMuon(LowRankQHAdam):
    """LoRDO's local optimizer in Muon's form (see the module doc); groups with ``rank=None`` take full-rank
    QHAdam with ``betas`` and ``eps`` as in :class:`LowRankQHAdam`.

    ``momentum``, ``nesterov``, ``ns_coefficients``, ``ns_steps``, ``ns_eps``, ``adjust_lr_fn`` are torch's Muon
    options (``adjust_lr_fn`` defaults to ``match_rms_adamw``: AdamW's rate and weight decay carry over);
    ``ns_dtype`` the Newton–Schulz precision (bfloat16, as torch; float32/float64 for references). ``qh_scale``
    what the full-rank term Q is divided by before it gets the orthogonalised part's RMS ρ: ``"momentum"`` the
    RMS of the back-projected momentum N that Newton–Schulz normalised (Q then weighs against the low-rank part as
    in Adam's form, where both are divided by the same √v̂: see docs/concepts.md) or ``"own"`` Q's own RMS (the
    term's size is always (1 − ω)·ρ; on micro the basis then stagnates, docs/results.md section 13); it applies to
    ``orthogonalise = "lowrank"`` only. ``orthogonalise``: ``"split"`` (the default: full-rank Muon on the momentum
    split into the basis and E; needs the default error feedback), ``"lowrank"`` (the r-dimensional form) or
    ``"whole"`` (module doc). Every other
    option is :class:`LowRankQHAdam`'s. Runs per matrix (``batched``/``compile`` refused by name) and on whole
    matrices (FSDP2 shards refused: the iteration needs every row)."""

    _SECOND_MOMENT = False

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, ns_steps: int = 5, ns_eps: float = 1e-7,
                 adjust_lr_fn: str = "match_rms_adamw", ns_dtype: torch.dtype = torch.bfloat16,
                 qh_scale: str = "momentum", orthogonalise: str = "split", betas: tuple[float, float] = (0.9, 0.999),
                 **options) -> None:
        for key in ("batched", "compile"):
            if options.get(key):
                raise ValueError(f"{key}={options[key]!r}: LowRankMuon runs per matrix; leave {key} out")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR}, got {adjust_lr_fn!r}")
        if qh_scale not in QH_SCALES:
            raise ValueError(f"qh_scale must be one of {QH_SCALES}, got {qh_scale!r}")
        if orthogonalise not in ORTHOGONALISE:
            raise ValueError(f"orthogonalise must be one of {ORTHOGONALISE}, got {orthogonalise!r}")
        if not (isinstance(ns_steps, int) and 1 <= ns_steps < 100):
            raise ValueError(f"ns_steps must be an integer in [1, 100), got {ns_steps!r}")
        a, b, c = ns_coefficients
        self.muon = MuonOptions(momentum=momentum, nesterov=nesterov, coefficients=(a, b, c), steps=ns_steps,
                                eps=ns_eps, adjust=adjust_lr_fn, dtype=ns_dtype,
                                qh_scale=qh_scale, orthogonalise=orthogonalise)
        super().__init__(params, lr=lr, betas=betas, batched=False, **options)

    def __getstate__(self) -> dict:  # torch's keeps defaults, state and groups only: a copy needs the options too
        return {**super().__getstate__(), "muon": self.muon}

    def add_param_group(self, param_group: dict) -> None:
        """:class:`LowRankQHAdam`'s, with μ as the low-rank groups' ``betas[0]`` and FSDP2 shards refused."""
        count = len(self.param_groups)
        super().add_param_group(param_group)  # may add two groups (matrices, and the rest full-rank), each through here
        for group in self.param_groups[count:]:
            if any(is_sharded(p) for p in group["params"]):
                del self.param_groups[count:]
                raise ValueError("LowRankMuon does not take parameters sharded by FSDP2: Newton–Schulz needs every "
                                 "row of a matrix; use LowRankQHAdam (lordo's default inner optimizer)")
            if group["rank"] is not None and group.get("lowrank_moments_dtype"):
                del self.param_groups[count:]
                raise ValueError(f"lowrank_moments_dtype={group['lowrank_moments_dtype']!r} holds Adam's low-rank "
                                 "moments compact; LowRankMuon keeps its momentum in float32: leave it out")
            if group["rank"] is not None and self.muon.orthogonalise == "split" and not (
                    group["error_feedback"] and group["qh_source"] == "grad+error"
                    and group["error_feedback_after_qh"] == "remove"):
                del self.param_groups[count:]
                raise ValueError("orthogonalise='split' keeps the momentum's part outside the basis in the error feedback "
                                 "E (an omega-average of what the projection drops): it needs error_feedback=True, "
                                 "qh_source='grad+error' and error_feedback_after_qh='remove' (the defaults)")
            if group["rank"] is not None:
                group["betas"] = (self.muon.momentum, group["betas"][1])

    def _rotate(self, state: dict, group: dict, new: torch.Tensor, side: Side) -> None:
        """M into the new basis, C = P_newᵀ·P_old on the reduced axis (M·Cᵀ, or C·M on the left side): the first
        moment's rotation; there is no second moment. In float32 whatever M's dtype, rounded once."""
        m = state["exp_avg"]
        work = torch.promote_types(m.dtype, torch.float32)
        c = new.to(work).T @ state["basis"].to(work)
        m.copy_(m.to(work) @ c.T if side == Side.RIGHT else c @ m.to(work))

    def _apply_each(self, group: dict, lists: Lists, gs: list[torch.Tensor]) -> None:
        mu, lr, omega = group["betas"][0], float(group["lr"]), group["omega"]
        m = self.muon
        for weight, g, grad, state, side in zip(lists.weights, gs, lists.grads, lists.states, lists.sides, strict=True):
            state["step"] += 1
            buffer, basis = state["exp_avg"], state["basis"].to(weight.dtype)
            buffer.lerp_(g, 1 - mu)
            n = g.lerp(buffer, mu) if m.nesterov else buffer
            if m.orthogonalise != "lowrank":
                self._whole_step(group, weight, n, g, grad, state, basis, side)
                continue
            o = newton_schulz(n, m.coefficients, m.steps, m.eps, m.dtype).to(weight.dtype)
            s = rank_scale((weight.shape[0], weight.shape[1]), group["rank"], m.adjust)
            left, right = (o, basis.T) if side == Side.RIGHT else (basis, o)
            weight.addmm_(left, right, beta=1 - lr * group["weight_decay"], alpha=-lr * omega * s * group["scale"])
            if omega < 1:
                q = self._qh_input(group, state, g, grad, basis, side)
                sigma = n if m.qh_scale == "momentum" else q  # ‖back(N)‖ = ‖N‖: the basis is orthonormal
                ratio = s * o.float().norm() / sigma.float().norm().clamp(min=1e-30)  # ρ/σ: 0-d, on the device
                weight.addcmul_(q, ratio.to(weight.dtype), value=-lr * (1 - omega))
        if feedback.shrinks(group):
            feedback.shrink(lists.states, omega)

    def _whole_step(self, group: dict, weight: torch.Tensor, n: torch.Tensor, g: torch.Tensor, grad: torch.Tensor,
                    state: dict, basis: torch.Tensor, side: Side) -> None:
        """Newton–Schulz on a p×q step, at Muon's own rate (module doc). ``"whole"``: X = ω·back(N)/‖N‖ +
        (1 − ω)·Q/‖Q‖, the two terms at unit norm (``qh_scale`` does not apply: the iteration normalises the sum).
        ``"split"``: the full-rank Nesterov momentum whose part outside the basis is E, an ω-average:
        X = back(N) + (1 − ω)·(c + E_after), c = G − back(g), E_after = ω·(A − back(g)), A = G + E_before."""
        m, lr, omega = self.muon, float(group["lr"]), group["omega"]
        if m.orthogonalise == "split":
            # X = (1 − ω)·(G + ω·A) + back(N − (1 − ω)(1 + ω)·g), with A = factor·F − back(L) as the error feedback
            # holds it (optim/feedback.py): (1 − ω)·(G + ω·factor·F) + back(N − (1 − ω)((1 + ω)·g + ω·L)), one
            # full-size pass and one GEMM (A is never formed)
            full, held, factor = feedback.qh_input(state, g, grad)
            low = n - g * ((1 - omega) * (1 + omega))
            if held is not None:
                low.sub_(held.to(low.dtype), alpha=(1 - omega) * omega)
            rest = torch.add(grad, full, alpha=omega * factor)  # in the wider of the two dtypes
            low, basis = low.to(rest.dtype), basis.to(rest.dtype)
            x = (torch.addmm(rest, low, basis.T, beta=1 - omega) if side == Side.RIGHT
                 else torch.addmm(rest, basis, low, beta=1 - omega))
        else:
            x = n @ basis.T if side == Side.RIGHT else basis @ n
            if omega < 1:  # ‖back(N)‖ = ‖N‖: the basis is orthonormal
                q = self._qh_input(group, state, g, grad, basis, side)
                x = x * (omega / n.float().norm().clamp(min=1e-30)).to(x.dtype)
                x.add_(q * ((1 - omega) / q.float().norm().clamp(min=1e-30)).to(q.dtype))
        o = newton_schulz(x, m.coefficients, m.steps, m.eps, m.dtype).to(weight.dtype)
        s = muon_scale((weight.shape[0], weight.shape[1]), m.adjust)
        weight.mul_(1 - lr * group["weight_decay"]).add_(o, alpha=-lr * s * group["scale"])

    @staticmethod
    def _qh_input(group: dict, state: dict, g: torch.Tensor, grad: torch.Tensor, basis: torch.Tensor,
                  side: Side) -> torch.Tensor:
        """Q: G, or A = G + E formed from its representation (optim/feedback.py): factor·full − back(low)."""
        if group["qh_source"] == "grad":
            return grad
        full, low, factor = feedback.qh_input(state, g, grad)
        if low is None:
            return full if factor == 1.0 else full * factor
        if side == Side.RIGHT:
            return torch.addmm(full, low.to(full.dtype), basis.T, beta=factor, alpha=-1)
        return torch.addmm(full, basis, low.to(full.dtype), beta=factor, alpha=-1)
