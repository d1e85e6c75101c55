"""The anchor: the model at the last synchronisation (θ_anchor), one copy per process, and the outer step that
moves it. A local-update strategy computes each worker's pseudo-gradient Δ_m = θ_anchor − θ_m against it and
hands it the averaged Δ; how it is stored is this module's business.

Storage (``dtype``):

- ``float32``: the anchor is the outer optimizer's parameter (SGD at lr 1: averaging; with momentum: DiLoCo), the
  averaged Δ its gradient, and every worker copies the stepped anchor.
- ``bfloat16``, ``int8`` (blocks of 256 with a scale each, optim/compact.py's ``lin8``) or ``int4`` (blocks of 64,
  15 even levels, compact.py's ``int4``: a rounding error 18 times int8's, at 0.56 bytes an element): with plain averaging
  (outer lr 1, no momentum) the new model is θ_new = a − mean_m(a − θ_m) = mean_m θ_m whatever a's rounding: the
  rounding error r = a − θ_anchor is in every worker's Δ_m alike and leaves again with the mean. So θ_new is
  computed in float32 from the rounded anchor and written to the workers, and only the kept copy is rounded:
  its error never reaches the model and does not accumulate over rounds. What r does change is what the round
  sends (Δ_m + r: compressed payloads carry it, and error feedback of the codec keeps what they drop) and the
  averaged Δ that the global bases are computed from (r is a few per cent of a late round's Δ, spread over all
  directions). An outer optimizer with momentum would fold r into its momentum and step it into the model, so a
  rounded anchor is refused there.

``offload``: the anchor lives in host memory (pinned when a GPU is present) and travels to the device one tensor
at a time. ``keep``: which tensors need an anchor at all: with one worker and plain averaging a synchronisation
leaves the model as it is, and only what the bases are computed from needs Δ (nothing is allocated for the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ConfigError
from ..optim import compact

ANCHOR_DTYPES = ("float32", "bfloat16", "int8", "int4")
FORMATS = {"int8": compact.LIN8, "int4": compact.INT4}  # a compact anchor's codes
OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
Lists = list[list[torch.Tensor]]


def is_averaging(outer: torch.optim.Optimizer) -> bool:
    """Whether ``outer`` steps θ ← θ − Δ exactly (torch's SGD at lr 1, no momentum, decay or dampening)."""
    if type(outer) is not torch.optim.SGD:
        return False
    return all(float(g["lr"]) == 1.0 and g["momentum"] == 0 and g["weight_decay"] == 0 and not g["maximize"]
               for g in outer.param_groups)


class Anchor:
    """θ_anchor for ``tensors`` (worker 0's, whose values every worker holds at the start) and its outer step."""

    def __init__(self, tensors: Sequence[torch.Tensor], outer_optimizer: OuterFactory, *, dtype: str = "float32",
                 offload: bool = False, keep: Sequence[bool] | None = None) -> None:
        if dtype not in ANCHOR_DTYPES:
            raise ConfigError(f"anchor_dtype must be one of {', '.join(ANCHOR_DTYPES)}, got {dtype!r}")
        self.dtype, self.offload = dtype, offload
        self.shapes = [t.shape for t in tensors]
        self.device = tensors[0].device
        probe = outer_optimizer([torch.zeros(1, requires_grad=True)])  # its settings, not its state
        if not isinstance(probe, torch.optim.Optimizer):
            raise ConfigError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(probe).__name__}")
        averaging = is_averaging(probe)
        if dtype != "float32" and not averaging:
            raise ConfigError(f"anchor_dtype = {dtype!r} keeps a rounded anchor, exact only with plain averaging (outer "
                              "lr 1, no momentum): an outer optimizer with momentum would carry the rounding into the "
                              "model. Use anchor_dtype = \"float32\" with outer momentum (DiLoCo), or outer_lr = 1 and "
                              "outer_momentum = 0")
        self.keep = list(keep) if keep is not None and averaging else [True] * len(tensors)
        # the outer optimizer steps a float32 anchor; a rounded one, or one of some tensors only, is averaged here
        self.manual = dtype != "float32" or not all(self.keep)
        if not self.manual:
            self.tensors: list[Any] = [self._place(t.detach().clone()) for t in tensors]
            self.outer = outer_optimizer(self.tensors)
            return
        self.outer = probe  # kept for its settings; it holds no state
        self.tensors = [self._encode(t) if k else None for t, k in zip(tensors, self.keep)]

    # --- storage -----------------------------------------------------------------------------------------

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        if not self.offload:
            return t
        host = t.to("cpu", copy=True)
        return host.pin_memory() if torch.cuda.is_available() else host

    def _encode(self, t: torch.Tensor) -> Any:
        if self.dtype == "float32":
            return self._place(t.detach().clone())
        if self.dtype == "bfloat16" or not compact.worth_compacting(t.numel()):  # small tensors: float32
            return self._place(t.detach().to(torch.bfloat16 if self.dtype == "bfloat16" else torch.float32, copy=True))
        codes, scale = compact.encode(t.detach(), FORMATS[self.dtype])
        return (self._place(codes), self._place(scale))

    def decoded(self, i: int, device: torch.device | None = None) -> torch.Tensor:
        """Tensor ``i`` of the anchor in float32 (float64 for a float64 parameter: its anchor is kept exact) on
        ``device`` (the training device); for ``float32`` the stored tensor itself when it is there."""
        device = device or self.device
        a = self.tensors[i]
        if a is None:
            raise ValueError(f"the anchor keeps no copy of tensor {i}")
        if isinstance(a, tuple):
            codes, scale = a
            return compact.decode(codes.to(device, non_blocking=True), scale.to(device, non_blocking=True),
                                  FORMATS[self.dtype], self.shapes[i])
        return a.to(device=device, dtype=torch.promote_types(a.dtype, torch.float32), non_blocking=True)

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> torch.Tensor:
        """Tensor ``i`` of the anchor in float32, or float64 for a float64 parameter (the stored tensor itself then)."""
        a = self.tensors[i]
        return a if isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.float64) else self.decoded(i)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def _store(self, i: int, value: torch.Tensor) -> None:
        self.tensors[i] = self._encode(value)

    # --- the round -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def pseudo_gradients(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each worker tensor t becomes its pseudo-gradient θ_anchor − t, in place; tensors without an anchor (see
        ``keep``) are left as they are and stand for a zero Δ (returned as zeros that take no memory)."""
        if not self.manual and not self.offload:
            torch._foreach_sub_(list(tensors), self.tensors)
            torch._foreach_neg_(list(tensors))
            return list(tensors)
        out = []
        for i, t in enumerate(tensors):
            if not self.keep[i]:
                out.append(torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape))
                continue
            t.sub_(self.decoded(i, t.device)).neg_()
            out.append(t)
        return out

    @torch.no_grad()
    def own(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """θ_anchor − t for each tensor, as new tensors (a round sent without blocking keeps what it sent)."""
        return [self.own_one(i, t) for i, t in enumerate(tensors)]

    def own_one(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """θ_anchor − t of tensor ``i`` (zeros where the anchor keeps no copy)."""
        return self.decoded(i, t.device) - t if self.keep[i] else torch.zeros_like(t)

    @torch.no_grad()
    def step(self, delta: Sequence[torch.Tensor], workers: Lists, own: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
        """The outer step with the averaged pseudo-gradient ``delta``; then each worker's tensors (``workers``) hold
        θ_new (``own`` None: they held their Δ_m), or, for a round that landed late, their own steps since on top:
        θ_m += Δ_m + (θ_new − θ_anchor), ``own[m]`` = Δ_m."""
        if not self.manual:
            self._step_outer(delta, workers, own)
            return
        for i, d in enumerate(delta):
            if not self.keep[i]:
                continue
            new = self.decoded(i, d.device) - d
            for w, tensors in enumerate(workers):
                if own is None:
                    tensors[i].copy_(new)
                else:
                    tensors[i].add_(own[w][i]).sub_(d)
            self._store(i, new)

    def _step_outer(self, delta: Sequence[torch.Tensor], workers: Lists, own: Sequence[Sequence[torch.Tensor]] | None) -> None:
        if own is not None:
            for tensors, mine in zip(workers, own, strict=True):
                for t, m in zip(tensors, mine, strict=True):  # one at a time: ``mine`` may be decoded as it is read
                    t.add_(m)
                self._add_to(tensors, -1.0)
        for a, d in zip(self.tensors, delta, strict=True):
            a.grad = d if d.device == a.device else d.to(a.device)
        self.outer.step()
        for a in self.tensors:
            a.grad = None
        if own is None:
            self.restore(workers)
        else:
            for tensors in workers:
                self._add_to(tensors, 1.0)

    def _add_to(self, tensors: Sequence[torch.Tensor], alpha: float) -> None:
        """tensors += alpha · θ_anchor."""
        if self.offload:
            for t, a in zip(tensors, self.tensors):
                t.add_(a.to(t.device, non_blocking=True), alpha=alpha)
        else:
            torch._foreach_add_(list(tensors), self.tensors, alpha=alpha)

    @torch.no_grad()
    def restore(self, workers: Lists) -> None:
        """Every worker's tensors ← θ_anchor (those without an anchor are left as they are)."""
        for tensors in workers:
            if not self.manual and not self.offload:
                torch._foreach_copy_(list(tensors), self.tensors)
                continue
            for i, t in enumerate(tensors):
                if self.keep[i]:
                    t.copy_(self.decoded(i, t.device), non_blocking=True)

    @property
    def complete(self) -> bool:
        """Whether every tensor has an anchor (a rollback restores the whole model)."""
        return all(self.keep)

    # --- state and bytes -------------------------------------------------------------------------------

    def held(self) -> list[Any]:
        return [a for a in self.tensors if a is not None]

    def accounted_bytes(self) -> int:
        """Bytes of the anchor as its shapes and format say (:meth:`held` measures them)."""
        total = 0
        for shape, keep in zip(self.shapes, self.keep):
            n = int(torch.Size(shape).numel())
            if not keep:
                continue
            if self.dtype == "float32" or (self.dtype in FORMATS and not compact.worth_compacting(n)):
                total += 4 * n
            elif self.dtype == "bfloat16":
                total += 2 * n
            else:
                total += compact.nbytes(FORMATS[self.dtype], n)
        return total

    def state_dict(self) -> dict[str, Any]:
        """``anchor`` as stored (a rounded anchor is saved rounded, not widened), and the outer optimizer's state."""
        if not self.manual:
            return {"anchor": [a.clone() for a in self.tensors], "outer_optimizer": self.outer.state_dict()}
        saved: list[Any] = []
        for a in self.tensors:
            saved.append(None if a is None else tuple(x.clone() for x in a) if isinstance(a, tuple) else a.clone())
        return {"anchor": saved, "anchor_dtype": self.dtype}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """What :meth:`state_dict` saved, or a float32 anchor of an earlier checkpoint (rounded here if this anchor
        is rounded; a rounded one loaded into a float32 anchor is refused: its lost bits cannot come back)."""
        saved = list(state["anchor"])
        if len(saved) != len(self.tensors):
            raise ValueError(f"state holds an anchor of {len(saved)} tensors, this model has {len(self.tensors)}")
        saved_dtype = state.get("anchor_dtype", "float32")
        if not self.manual:
            if saved_dtype != "float32" or any(a is None for a in saved):
                raise ValueError(f"the state holds an anchor rounded to {saved_dtype}; this run keeps a float32 anchor "
                                 f"(set strategy.anchor_dtype = {saved_dtype!r} to resume it)")
            torch._foreach_copy_(self.tensors, saved)
            if "outer_optimizer" in state:
                self.outer.load_state_dict(state["outer_optimizer"])
            return
        for i, value in enumerate(saved):
            if not self.keep[i]:
                continue
            if value is None:
                raise ValueError(f"the state holds no anchor of tensor {i}, which this run needs (it was saved by a run "
                                 "of one worker)")
            if saved_dtype == self.dtype:
                self.tensors[i] = (tuple(self._place(x.to(self.device).clone()) for x in value)
                                   if isinstance(value, (tuple, list)) else self._place(value.to(self.device).clone()))
            elif isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                self._store(i, value.to(self.device))
            else:
                raise ValueError(f"the state holds an anchor rounded to {saved_dtype}; this run keeps one in {self.dtype}")
