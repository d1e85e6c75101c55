"""From a run's ``Config`` to a strategy: the one place that reads ``Config`` for the strategies.

Builds the inner optimizers (AdamW, or ``LowRankQHAdam`` over the low-rank split of the parameter groups),
the outer optimizer, the basis policy and the codec choice, and hands them to the strategy's constructor.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..comm.basis_codec import SparseSettings
from ..config import DEFAULT_LR, Config, OptimConfig, StrategyConfig
from ..config.sections import outer_settings
from ..errors import ConfigError
from ..model.params import ParamGroup
from ..optim import LowRankQHAdam, compact, float8
from ..optim.functional import takes_fused_adamw
from ..optim.hybrid import MuonAdamW
from ..optim.muon import LowRankMuon
from .base import Strategy
from .basis import GlobalBasis, LocalBasis
from .ddp import DDPStrategy
from .local_adam import LocalUpdateStrategy
from .lordo import LoRDOStrategy
from .lowrank_ddp import LowRankDDPStrategy


def make_adamw(groups: Sequence[ParamGroup], o: OptimConfig, moments_dtype: str = "float32") -> torch.optim.Optimizer:
    """AdamW over parameter groups; weight decay only where the group's rule asks for it.

    torch's AdamW keeps its moments in the parameters' dtype, where g² underflows for fp16 weights; for a
    bf16/fp16 model, and with ``moments_dtype = "int8"`` (its moments held in 8 bits between steps), this is
    ``LowRankQHAdam`` with ``rank=None, omega=1``: AdamW's update with float32 arithmetic (tests/test_optim.py checks
    the equality)."""
    param_groups = [
        {"params": g.params, "weight_decay": o.weight_decay if g.rule.weight_decay else 0.0, "name": g.rule.group}
        for g in groups
    ]
    params = [p for g in groups for p in g.params]
    if moments_dtype != "float32" or any(p.dtype in (torch.float16, torch.bfloat16) for p in params):
        return LowRankQHAdam(param_groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, omega=1.0, rank=None,
                             moments_dtype=None if moments_dtype == "float32" else moments_dtype)
    fused = takes_fused_adamw(params)
    return torch.optim.AdamW(param_groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             fused=fused or None, foreach=None if fused else True)


def make_inner(groups: Sequence[ParamGroup], o: OptimConfig, moments_dtype: str = "float32") -> torch.optim.Optimizer:
    """The inner optimizer of ddp, local-adam and diloco: AdamW (:func:`make_adamw`), or with ``optim.inner = muon``
    torch's Muon on the 2-D parameters of the groups whose rule marks them as block matrices and AdamW on the rest
    (:class:`~lordo.optim.hybrid.MuonAdamW`); ``moments_dtype`` (``strategy.moments_dtype``) holds their state in 8
    bits between steps."""
    if o.compile_codec:
        float8.use_compiled()
    if o.inner != "muon":
        return make_adamw(groups, o, moments_dtype)
    if any(p.dtype in (torch.float16, torch.bfloat16) for g in groups for p in g.params):
        raise ConfigError("optim.inner = \"muon\" with bfloat16/float16 weights: Muon keeps its momentum in the "
                          "weights' dtype; use train.precision = \"fp32\" or \"bf16-mixed\"")
    param_groups = []
    for g in groups:
        decay = o.weight_decay if g.rule.weight_decay else 0.0
        matrices = [p for p in g.params if g.rule.matrix and p.ndim == 2]
        rest = [p for p in g.params if not (g.rule.matrix and p.ndim == 2)]
        for muon, params in ((True, matrices), (False, rest)):
            if params:
                param_groups.append({"params": params, "weight_decay": decay, "name": g.rule.group, "muon": muon})
    if not any(g["muon"] for g in param_groups):
        raise ConfigError("optim.inner = \"muon\": no parameter group holds block matrices for Muon to take")
    return MuonAdamW(param_groups, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps,
                     momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                     adjust_lr_fn=o.muon_adjust_lr, ns_dtype=getattr(torch, o.muon_ns_dtype), moments_dtype=moments_dtype)


def split_lowrank(groups: Sequence[ParamGroup], pattern: str, rank: int) -> tuple[list[dict], list[str]]:
    """Optimizer parameter groups: the 2-D parameters selected by ``pattern`` become low-rank at ``rank``.

    ``pattern`` is ``"auto"`` (the parameters of groups whose rule marks them as block matrices) or a regular
    expression searched in parameter names."""
    regex = None if pattern == "auto" else re.compile(pattern)

    def is_lowrank(group: ParamGroup, name: str, p: torch.Tensor) -> bool:
        return p.ndim == 2 and (group.rule.matrix if regex is None else regex.search(name) is not None)

    out, lowrank_names = [], []
    for g in groups:
        low = [(n, p) for n, p in zip(g.names, g.params) if is_lowrank(g, n, p)]
        full = [(n, p) for n, p in zip(g.names, g.params) if not is_lowrank(g, n, p)]
        for n, p in low:
            if rank > min(p.shape):
                raise ConfigError(
                    f"strategy.rank must be in [1, {min(p.shape)}] for {n} {tuple(p.shape)} (the smallest low-rank "
                    f"dimension), got {rank}; lower the rank or narrow strategy.lowrank_pattern"
                )
        if low:
            out.append({"params": [p for _, p in low], "rank": rank, "name": g.rule.group, "decay": g.rule.weight_decay})
            lowrank_names += [n for n, _ in low]
        if full:
            out.append({"params": [p for _, p in full], "rank": None, "name": g.rule.group, "decay": g.rule.weight_decay})
    if not lowrank_names:
        what = "no parameter group holds block matrices" if regex is None else f"{pattern!r} matches no 2-D parameter"
        raise ConfigError(f"strategy.lowrank_pattern: {what}; nothing would be trained low-rank")
    return out, lowrank_names


def basis_method(s: StrategyConfig) -> str:
    """``strategy.basis_method`` resolved: ``auto`` is the exact SVD for ``lordo-local`` (the paper's LoRDO-Local:
    each worker's basis afresh from its own gradient) and warm-started subspace iteration otherwise."""
    if s.basis_method != "auto":
        return s.basis_method
    return "svd" if s.name == "lordo-local" else "subspace"


def make_lowrank_optimizer(groups: Sequence[ParamGroup], s: StrategyConfig, o: OptimConfig, *, omega: float,
                           error_feedback: bool | None = None) -> LowRankQHAdam:
    """``LowRankQHAdam`` over the low-rank split of ``groups`` with the config's hyperparameters (``LowRankMuon``, its
    Muon form, with ``optim.inner = muon``)."""
    if o.compile_codec:
        float8.use_compiled()
    specs, _ = split_lowrank(groups, s.lowrank_pattern, s.rank)
    param_groups = [
        {"params": spec["params"], "rank": spec["rank"], "name": spec["name"],
         "weight_decay": o.weight_decay if spec["decay"] else 0.0}
        for spec in specs
    ]
    common: dict[str, Any] = dict(
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, omega=omega,
        error_feedback=s.error_feedback if error_feedback is None else error_feedback,
        qh_source=s.qh_source, error_feedback_after_qh=s.error_feedback_after_qh, basis_method=basis_method(s),
        basis_iterations=s.basis_iterations, error_feedback_dtype=ef_dtype(s.error_feedback_dtype),
        moments_dtype=None if s.moments_dtype == "float32" else s.moments_dtype,
    )
    if s.lowrank_moments_dtype != "float32":  # (config checks refuse it with the Muon form)
        common["lowrank_moments_dtype"] = s.lowrank_moments_dtype
    if o.inner == "muon":  # LoRDO's Muon form (config checks leave compile_step and lowrank_term at their defaults)
        return LowRankMuon(param_groups, momentum=o.muon_momentum, nesterov=o.muon_nesterov, ns_steps=o.muon_ns_steps,
                           adjust_lr_fn=o.muon_adjust_lr, ns_dtype=getattr(torch, o.muon_ns_dtype),
                           qh_scale=o.muon_qh_scale, orthogonalise=o.muon_orthogonalise, **common)
    return LowRankQHAdam(param_groups, compile=o.compile_step, lowrank_term=s.lowrank_term, **common)


def ef_dtype(name: str) -> torch.dtype | str:
    """``strategy.error_feedback_dtype`` as LowRankQHAdam takes it: a torch dtype, or a compact format's name."""
    return name if name in compact.BY_NAME else getattr(torch, name)


def outer_optimizer(s: StrategyConfig) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """SGD over the anchor: lr ``outer_lr``, optional (Nesterov) momentum; lr 1 without momentum is averaging."""
    lr, momentum = outer_settings(s)

    def build(anchor: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(anchor, lr=lr, momentum=momentum, nesterov=s.outer_nesterov and momentum > 0)
    return build


def _local_options(cfg: Config, default_average: str) -> dict:
    s = cfg.strategy
    return dict(
        sync_every=s.sync_every, outer_optimizer=outer_optimizer(s), compress=s.compress,
        compress_settings=SparseSettings(s.compress_dense, s.compress_density, s.compress_bits, s.compress_fullrank),
        compression_feedback=s.compress_feedback, grad_clip=cfg.optim.grad_clip, sync_buffers=s.sync_buffers,
        offload_anchor=s.offload_anchor, sync_delay=s.sync_delay, anchor_dtype=s.anchor_dtype,
        compression_residual=s.compress_residual,
        average_moments=default_average if s.average_moments == "auto" else s.average_moments,
        moment_periods={"exp_avg": s.sync_exp_avg_every, "exp_avg_sq": s.sync_exp_avg_sq_every},
    )


Groups = Sequence[Sequence[ParamGroup]]


def _ddp(cfg: Config, models: list[nn.Module], groups: Groups, comm: Communicator) -> Strategy:
    optimizers = [make_inner(g, cfg.optim, cfg.strategy.moments_dtype) for g in groups]
    return DDPStrategy(models, comm, optimizers=optimizers, grad_clip=cfg.optim.grad_clip,
                       sync_buffers=cfg.strategy.sync_buffers)


def _local_adam(cfg: Config, models: list[nn.Module], groups: Groups, comm: Communicator) -> Strategy:
    optimizers = [make_inner(g, cfg.optim, cfg.strategy.moments_dtype) for g in groups]
    return LocalUpdateStrategy(models, comm, optimizers=optimizers, **_local_options(cfg, "none"))


def _lordo(cfg: Config, models: list[nn.Module], groups: Groups, comm: Communicator, *, omega: float | None = None,
           local: bool = False) -> Strategy:
    s = cfg.strategy
    if cfg.optim.grad_clip == 0 and (s.omega if omega is None else omega) < 1:
        warnings.warn("optim.grad_clip = 0 with LoRDO's full-rank term (omega < 1): that term is divided by the "
                      "low-rank moments' mean denominator, and unclipped it can outgrow the rest of the step when the "
                      "gradient inside the bases shrinks faster than outside them (docs/concepts.md, 'Keep the "
                      "gradient clipped'); the default clip 0.5 keeps it bounded", RuntimeWarning, stacklevel=3)
    opts = [make_lowrank_optimizer(g, s, cfg.optim, omega=s.omega if omega is None else omega) for g in groups]
    basis = LocalBasis() if local else GlobalBasis()
    return LoRDOStrategy(models, comm, optimizers=opts, basis=basis, average_error_feedback=s.average_error_feedback,
                         **_local_options(cfg, "none" if local else "lowrank"))


def _lowrank_ddp(cfg: Config, models: list[nn.Module], groups: Groups, comm: Communicator) -> Strategy:
    opts = [make_lowrank_optimizer(g, cfg.strategy, cfg.optim, omega=1.0) for g in groups]
    return LowRankDDPStrategy(models, comm, optimizers=opts, refresh_every=cfg.strategy.sync_every,
                              grad_clip=cfg.optim.grad_clip, sync_buffers=cfg.strategy.sync_buffers)


# strategy.name -> builder; the names and their default learning rates are config.DEFAULT_LR's
BUILDERS: dict[str, Callable[[Config, list[nn.Module], Groups, Communicator], Strategy]] = {
    "ddp": _ddp,
    "local-adam": _local_adam,
    "diloco": _local_adam,  # local-adam with DiLoCo's outer Nesterov momentum (outer_settings)
    "lordo": _lordo,
    "lordo-global-noqh": lambda cfg, m, g, c: _lordo(cfg, m, g, c, omega=1.0),
    "lordo-local": lambda cfg, m, g, c: _lordo(cfg, m, g, c, local=True),
    "lowrank-ddp": _lowrank_ddp,
}
assert set(BUILDERS) == set(DEFAULT_LR), "every strategy name needs a builder and a default learning rate"


def build_strategy(cfg: Config, models: Sequence[nn.Module], groups: Groups, comm: Communicator) -> Strategy:
    """The strategy ``cfg.strategy.name`` over ``models`` (one per hosted worker) and their parameter groups."""
    name = cfg.strategy.name
    if name not in BUILDERS:
        raise ConfigError(f"strategy.name must be one of {', '.join(BUILDERS)}, got {name!r}")
    strategy = BUILDERS[name](cfg, list(models), groups, comm)
    strategy.name = name
    return strategy
