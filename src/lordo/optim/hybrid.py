"""``MuonAdamW``: torch's Muon on a model's hidden matrices and torch's AdamW on the rest, as one optimizer.

The usual split for Muon (Keller Jordan's, Moonshot's): the 2-D matrices of the blocks (attention, MLP) take
Muon — momentum, orthogonalised by Newton–Schulz, then the step — and everything else (embeddings, the output
head, norms, biases) takes AdamW. Both are torch's own optimizers, held inside; this class only joins them,
so that a strategy, a scheduler and a checkpoint see one ``torch.optim.Optimizer``: ``param_groups`` are the
inner optimizers' group dicts themselves (Muon's first, then AdamW's; a scheduler's change reaches the inner
optimizer), ``state`` reads either optimizer's state, ``state_dict()`` is torch's format over all groups and
``load_state_dict`` hands each inner optimizer its part.

Muon's Newton–Schulz iteration runs in bfloat16, as torch's does, unless ``ns_dtype`` says otherwise
(:class:`PrecisionMuon`): on a CPU without bfloat16 matrix units (AVX2 only) a bfloat16 GEMM is an order of
magnitude slower than a float32 one, and float32 makes Muon usable there.

``moments_dtype = "int8"`` holds the state in 8 bits between steps (optim/compact.py), as LoRDO's lean state
holds its full-rank moments: Muon's momentum in the signed dynamic map, and the other parameters' AdamW moments
through ``LowRankQHAdam(rank=None, omega=1)`` (AdamW's update, its moments held compact). The step's arithmetic
stays float32; only the storage between steps is rounded. Tensors below ``compact.MIN_COMPACT_NUMEL`` stay float32.
``moments_dtype = "fp8"`` holds them in e4m3 per block instead (the momentum and first moments rounded to the
nearest, √v stochastically; optim/float8.py).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import torch

from . import compact
from .functional import takes_fused_adamw
from .muon import muon_scale, newton_schulz
from .optimizer import LowRankQHAdam
from .sharded import is_sharded
from .state import restore_saved_dtypes

ADJUST_LR = ("original", "match_rms_adamw")
NS_DTYPES = (torch.bfloat16, torch.float32, torch.float64)
MOMENTS_DTYPES = ("float32", "int8", "fp8")
BUFFER_FORMATS = {"int8": compact.INT8, "fp8": compact.FP8}  # Muon's momentum under moments_dtype
BUFFER = "momentum_buffer"


def holds_compact(p: torch.Tensor, moments_dtype: str) -> bool:
    """Whether Muon's momentum of ``p`` is held in 8 bits under ``moments_dtype``."""
    return moments_dtype in BUFFER_FORMATS and compact.worth_compacting(p.numel())


def muon_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], state: MutableMapping, group: dict,
              ns_dtype: torch.dtype, moments_dtype: str = "float32") -> None:
    """torch's Muon step (``torch.optim._muon._single_tensor_muon``) with the Newton–Schulz iteration in
    ``ns_dtype``: momentum buffer ← lerp to G by 1 − μ, the Nesterov mix, the quintic iteration, decoupled decay,
    then W −= lr·adjust(p, q)·O. The state is torch's (``momentum_buffer``, created as zeros at the first step);
    with ``moments_dtype = "int8"`` the buffer is held as 8-bit codes between steps (``momentum_buffer.codes`` and
    ``.scale``), expanded to float32 for the step."""
    lr, mu = float(group["lr"]), group["momentum"]
    for p, grad in zip(params, grads, strict=True):
        if grad.ndim != 2:
            raise ValueError(f"Muon takes 2-D matrices only, got a gradient of shape {tuple(grad.shape)}")
        held = holds_compact(p, moments_dtype)
        buf = _momentum(state[p], grad, held)
        buf.lerp_(grad, 1 - mu)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        if held:
            compact.store(state[p], BUFFER, buf, BUFFER_FORMATS[moments_dtype])
        o = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], ns_dtype)
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(o, alpha=-lr * muon_scale(p.shape, group["adjust_lr_fn"]))


def _momentum(state: dict, grad: torch.Tensor, held: bool) -> torch.Tensor:
    """The momentum buffer to update: the state's own tensor when it is kept so (created as zeros at the first step),
    else a float32 copy (expanded from its codes, or of a buffer saved in the other storage) to store back."""
    if compact.is_compact(state, BUFFER):  # held compact, or saved so and loaded where it is not: expand it
        saved = compact.FP8 if state[BUFFER + compact.CODES].dtype == torch.float8_e4m3fn else compact.INT8
        buf = compact.load(state, BUFFER, saved, grad.shape)
        if not held:
            del state[BUFFER + compact.CODES], state[BUFFER + compact.SCALE]
            state[BUFFER] = buf
        return buf
    if BUFFER not in state:
        buf = torch.zeros_like(grad, memory_format=torch.preserve_format)
        if not held:
            state[BUFFER] = buf
        return buf
    return state[BUFFER].float() if held else state[BUFFER]


class PrecisionMuon(torch.optim.Muon):
    """``torch.optim.Muon`` with the Newton–Schulz precision and the momentum's storage chosen.
    ``ns_dtype=torch.bfloat16`` with ``moments_dtype="float32"`` (the defaults) is torch's own step; otherwise the
    same step runs as :func:`muon_step`: the iteration in ``ns_dtype`` (float32 or float64 for CPUs whose bfloat16
    GEMM is slow), the momentum held in 8 bits between steps with ``moments_dtype="int8"``. The state and its
    checkpoint format are torch's but for the compact momentum's two entries."""

    def __init__(self, params: Any, *, ns_dtype: torch.dtype = torch.bfloat16, moments_dtype: str = "float32",
                 **options: Any) -> None:
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype!r}")
        if moments_dtype not in MOMENTS_DTYPES:
            raise ValueError(f"moments_dtype must be one of {MOMENTS_DTYPES}, got {moments_dtype!r}")
        super().__init__(params, **options)
        self.ns_dtype = ns_dtype
        self.moments_dtype = moments_dtype

    def __getstate__(self) -> dict:  # torch's keeps defaults, state and groups only: a copy needs the settings too
        return {**super().__getstate__(), "ns_dtype": self.ns_dtype, "moments_dtype": self.moments_dtype}

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, with each state tensor back at its saved dtype (torch casts them to their parameter's, the
        momentum's 8-bit codes too)."""
        super().load_state_dict(state_dict)
        restore_saved_dtypes(self.state, [p for g in self.param_groups for p in g["params"]], state_dict["state"])

    @torch.no_grad()
    def step(self, closure=None):
        compact_saved = any(compact.is_compact(s, BUFFER) for s in self.state.values())
        if self.ns_dtype == torch.bfloat16 and self.moments_dtype == "float32" and not compact_saved:
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            muon_step(params, [p.grad for p in params], self.state, group, self.ns_dtype, self.moments_dtype)
        return loss


def _adamw(groups: list[dict], *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
           moments_dtype: str) -> torch.optim.Optimizer:
    """torch's AdamW over ``groups``, or with ``moments_dtype = "int8"`` AdamW's update with its moments held in 8 bits
    (``LowRankQHAdam`` at ``rank=None, omega=1``)."""
    if moments_dtype != "float32":
        return LowRankQHAdam(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, omega=1.0, rank=None,
                             moments_dtype=moments_dtype)
    fused = takes_fused_adamw([p for g in groups for p in g["params"]])
    return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                             fused=fused or None, foreach=None if fused else True)


class _States(MutableMapping):
    """Both inner optimizers' ``state``, read and written through one mapping (their parameters are disjoint)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self._parts = (muon, adamw)
        self._owner = {id(p): opt for opt in self._parts for g in opt.param_groups for p in g["params"]}

    def _state_of(self, p: Any) -> MutableMapping:
        opt = self._owner.get(id(p))
        if opt is None:
            raise KeyError("parameter is not managed by this optimizer")
        return opt.state

    def __getitem__(self, p: Any) -> Any:
        return self._state_of(p)[p]

    def __setitem__(self, p: Any, value: Any) -> None:
        self._state_of(p)[p] = value

    def __delitem__(self, p: Any) -> None:
        del self._state_of(p)[p]

    def __iter__(self) -> Iterator:
        for opt in self._parts:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._parts)


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the groups with ``"muon": True``, AdamW on the others (see the module doc).

    ``groups``: torch-style parameter groups, each with ``"muon"`` (a bool; Muon takes 2-D matrices only) and
    any per-group setting (``weight_decay``, ``lr``, ``name``). ``momentum``, ``nesterov``, ``ns_steps`` and
    ``adjust_lr_fn`` are Muon's (torch's defaults but ``adjust_lr_fn``: ``"match_rms_adamw"`` scales each
    matrix's rate by 0.2·sqrt(max(p, q)), so that the learning rate and weight decay tuned for AdamW carry
    over, Moonshot's rule); ``ns_dtype`` the Newton–Schulz precision (:class:`PrecisionMuon`: bfloat16 is torch's
    own step); ``betas`` and ``eps`` AdamW's; ``moments_dtype`` the storage of both optimizers' state between
    steps (``"int8"`` or ``"fp8"``: Muon's momentum and AdamW's moments in 8 bits, see the module doc)."""

    def __init__(self, groups: Sequence[dict], *, lr: float = 1e-3, weight_decay: float = 0.1,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = "match_rms_adamw",
                 ns_dtype: torch.dtype = torch.bfloat16, moments_dtype: str = "float32") -> None:
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR:
            raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR}, got {adjust_lr_fn!r}")
        for g in groups:
            if not isinstance(g.get("muon"), bool):
                raise ValueError(f"every group needs \"muon\": True or False, got {g.get('muon')!r}")
        matrices = [{k: v for k, v in g.items() if k != "muon"} for g in groups if g["muon"]]
        if any(is_sharded(p) for g in matrices for p in g["params"]):
            raise ValueError("MuonAdamW does not take Muon matrices sharded by FSDP2: Newton–Schulz orthogonalises a "
                             "whole matrix and a rank holds only a shard; use AdamW (optim.inner = \"auto\") with "
                             "sharded workers")
        others = [{k: v for k, v in g.items() if k != "muon"} for g in groups if not g["muon"]]
        if not matrices or not others:
            raise ValueError("MuonAdamW needs groups of both kinds (\"muon\": True and False); for one kind use "
                             "torch.optim.Muon or torch.optim.AdamW")
        self.muon = PrecisionMuon(matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                                  ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype,
                                  moments_dtype=moments_dtype)
        self.adamw = _adamw(others, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, moments_dtype=moments_dtype)
        defaults = {**self.adamw.defaults, "momentum": momentum}  # what schedulers look for (betas, momentum)
        super().__init__([p for opt in (self.muon, self.adamw) for g in opt.param_groups for p in g["params"]], defaults)
        self._link()
        self._joined = True

    def _link(self) -> None:
        """This optimizer's groups and state: the inner optimizers' own."""
        self.param_groups = self.muon.param_groups + self.adamw.param_groups
        self.state = _States(self.muon, self.adamw)  # type: ignore[assignment]

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_joined", False):
            raise ValueError("MuonAdamW takes its groups at construction; build a new one to add parameters")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def state_bytes(self) -> dict[str, int]:
        """Bytes of state by category, as the optimizers hold it after their first step: Muon's momentum (one
        buffer per matrix, in the matrix's dtype or 8-bit codes) and AdamW's two moments of the other parameters."""
        def momentum(p: torch.Tensor) -> int:
            if holds_compact(p, self.muon.moments_dtype):
                return compact.nbytes(compact.INT8, p.numel())
            return p.numel() * p.element_size()

        if isinstance(self.adamw, LowRankQHAdam):
            moments = self.adamw.state_bytes()["full_rank_moments"]
        else:
            moments = sum(2 * p.numel() * p.element_size() for g in self.adamw.param_groups for p in g["params"])
        return {"muon_momentum": sum(momentum(p) for g in self.muon.param_groups for p in g["params"]),
                "full_rank_moments": moments}

    def state_category(self, p: torch.Tensor, path: list[str]) -> str:
        """The category of ``p``'s state entry at ``path``, as :meth:`state_bytes` names them."""
        return "muon_momentum" if path and path[0].startswith(BUFFER) else "full_rank_moments"

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format over all groups (Muon's first), split between the inner optimizers. Muon's momentum loads
        into either storage; AdamW's moments only into the storage they were saved in (torch's AdamW and the 8-bit
        form are different optimizers)."""
        groups = state_dict["param_groups"]
        n = len(self.muon.param_groups)
        if len(groups) != n + len(self.adamw.param_groups):
            raise ValueError(f"the state holds {len(groups)} parameter groups, this optimizer has "
                             f"{n + len(self.adamw.param_groups)}")
        saved_compact = all("moments_dtype" in g for g in groups[n:])
        if saved_compact != isinstance(self.adamw, LowRankQHAdam):
            saved, own = ("'int8' or 'fp8'", "'float32'") if saved_compact else ("'float32'", "'int8' or 'fp8'")
            raise ValueError(f"this state was saved with moments_dtype={saved} and this MuonAdamW has "
                             f"moments_dtype={own}: build it with the saved storage to load it")
        for opt, part in ((self.muon, groups[:n]), (self.adamw, groups[n:])):
            indices = {i for g in part for i in g["params"]}
            offset = min(indices, default=0)
            opt.load_state_dict({
                "state": {int(i) - offset: s for i, s in state_dict["state"].items() if int(i) in indices},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in part],
            })
        self._link()
