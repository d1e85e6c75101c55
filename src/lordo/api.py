"""The library API: LoRDO (or a baseline) after ``loss.backward()`` in anyone's training loop.

::

    import lordo

    opt = lordo.distributed(model, strategy="lordo", lr=3e-3, rank=32, sync_every=32)
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()              # local step; every sync_every steps the workers synchronise
    opt.finish()                # final synchronisation: every worker holds the same model

Under torchrun (or after ``torch.distributed.init_process_group``) each process is one worker and the
collectives go over gloo or NCCL; otherwise the process is a single worker, or, given a list of model
replicas, simulates that many workers in-process. ``lordo train`` drives the same object.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torch import nn

from .comm import Communicator, make_communicator
from .comm.mesh import worker_mesh
from .config import OptimConfig, StrategyConfig, build_config
from .distributed_optimizer import DistributedOptimizer, StrategyFactory, default_groups, reshard
from .errors import ConfigError
from .strategies import STRATEGIES
from .strategies.base import sharded_names

BACKENDS = ("auto", "sim", "gloo", "nccl", "torchft")
_OPTIM_KEYS = {f.name for f in dataclasses.fields(OptimConfig)}
_STRATEGY_KEYS = {f.name for f in dataclasses.fields(StrategyConfig)} - {"name"}


def distributed(
    model: nn.Module | Sequence[nn.Module],
    strategy: str | StrategyFactory = "lordo",
    *,
    lr: float | None = None,
    backend: str | Communicator = "auto",
    timeout_s: float = 300.0,
    ranks_per_worker: int = 1,
    **options: Any,
) -> DistributedOptimizer:
    """Wrap ``model`` (this process's replica) in a distributed optimizer.

    ``strategy``: one of ``ddp``, ``local-adam``, ``diloco``, ``lordo``, ``lordo-global-noqh``, ``lordo-local``,
    ``lowrank-ddp``. ``lr``: every parameter group's initial learning rate (a torch LR scheduler or
    ``step(lr=...)`` changes it); None (the default): the strategy's (3e-3; 6e-3 for lordo-global-noqh: tuned on a
    1.4M-parameter model over 2,000 steps; tune it for yours). ``options``: any ``strategy.*`` key (``rank``, ``sync_every``, ``omega``,
    ``error_feedback``, ``basis_method``, ``average_moments``, ``outer_lr``, ``lowrank_pattern``, ...) or
    ``optim.*`` key (``weight_decay``, ``beta1``, ``beta2`` or torch's ``betas=(b1, b2)``, ``eps``, ``grad_clip``),
    with the defaults and
    allowed values that ``lordo train --help`` lists (docs/cli.md). Values are validated like the config
    file's: a bad one raises :class:`ConfigError` naming it. Gradients are clipped to ``grad_clip`` (0.5
    by default; 0 disables), so do not clip them yourself.

    Parameters are grouped by module (:func:`lordo.model.params.group_by_module`): ``nn.Linear`` weights
    (and ``nn.MultiheadAttention``'s input projection) train low-rank, except output heads over the
    vocabulary; embeddings, heads and other matrices train full-rank with QHAdam; vectors (norms, biases)
    full-rank without weight decay. ``lowrank_pattern="REGEX"`` picks the low-rank matrices by name instead.

    ``backend``: ``auto`` uses torch.distributed when a process group is initialised or torchrun started the
    process (gloo for CPU parameters, nccl for CUDA ones), else one worker; ``sim`` with a list of replicas
    simulates ``len(model)`` workers in this process; ``gloo``/``nccl`` force torch.distributed.
    ``torchft`` makes workers fail without stopping the others (one process per worker; environment
    ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``; call :meth:`DistributedOptimizer.join`
    before the first step; docs/multi-node.md), or pass a :class:`~lordo.comm.ft.TorchFTCommunicator` (or any
    communicator) as ``backend`` to set it up yourself.
    ``ranks_per_worker``: under torch.distributed, how many consecutive ranks form one LoRDO worker (a node:
    synchronous inside, gradients averaged every step; LoRDO between workers). With 2 nodes × 8 GPUs,
    ``ranks_per_worker=8`` makes 2 workers.

    ``strategy`` may instead be a factory ``(replicas, communicator) -> Strategy`` that builds one of
    :mod:`lordo.strategies`' classes with your own inner optimizers (one per hosted replica, over its
    parameters, with your parameter groups) and outer optimizer; ``lr`` and ``options`` then do not apply
    (your optimizers hold their settings) and torchft is refused. docs/integrations.md has an example:
    ``torch.optim.AdamW`` inside, SGD with Nesterov momentum outside.
    """
    models = _replicas(model)
    if callable(strategy):
        _check_own_factory(lr, options, backend)
    else:
        tree = _option_tree(strategy, lr, timeout_s, ranks_per_worker, options)
    comm, given = _communicator(models, backend, timeout_s, ranks_per_worker)
    try:
        if len(models) > 1 and len(comm.local_ranks) != len(models):
            raise ConfigError(f"{len(models)} replicas given, but the {type(comm).__name__} hosts one worker per "
                              "process; pass one model under torch.distributed, or backend='sim' to simulate workers")
        if callable(strategy):
            return DistributedOptimizer(models, None, comm, owns_comm=not given, strategy=strategy)
        tree["dist"].update({"workers": comm.world_size, "backend": getattr(comm, "backend", "sim")})
        return DistributedOptimizer(models, build_config(tree=tree), comm, owns_comm=not given)
    except BaseException:
        if not given:  # a process group this call started is released again
            comm.close(clean=False)
        raise


def _check_own_factory(lr: float | None, options: dict[str, Any], backend: str | Communicator) -> None:
    """:func:`distributed` with a strategy factory: options and torchft are for named strategies."""
    if lr is not None or options:
        given = (["lr"] if lr is not None else []) + sorted(options)
        raise ConfigError(f"{', '.join(given)}: options configure a named strategy; a strategy from your own factory "
                          "takes its settings from the optimizers you build in it")
    if backend == "torchft":
        raise ConfigError("backend 'torchft' runs named strategies only (a worker that joins compares its settings "
                          "with the run's); pass a strategy name")


def _communicator(models: list[nn.Module], backend: str | Communicator, timeout_s: float,
                  ranks_per_worker: int) -> tuple[Communicator, bool]:
    """The communicator ``backend`` names (started here), or the one given; and whether it was given."""
    if isinstance(backend, Communicator):
        return backend, True
    if backend not in BACKENDS:
        raise ConfigError(f"backend must be one of {', '.join(BACKENDS)} or a Communicator, got {backend!r}")
    sharded = bool(sharded_names(models))
    if sharded and backend in ("sim", "torchft"):
        raise ConfigError(f"a model sharded over ranks (FSDP2) runs under torch.distributed with worker groups; backend "
                          f"{backend!r} cannot: use gloo, nccl or auto with ranks_per_worker")
    device = next(models[0].parameters()).device.type
    return make_communicator(backend, len(models), timeout_s, device, ranks_per_worker, sharded), False


def _replicas(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    models: list[nn.Module] = [model] if isinstance(model, nn.Module) else list(model)
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise ConfigError("model must be an nn.Module, or a non-empty list of replicas for the simulator")
    if next(models[0].parameters(), None) is None:
        raise ConfigError("the model has no parameters")
    from torch.nn.parallel import DistributedDataParallel

    if any(isinstance(m, (DistributedDataParallel, nn.DataParallel)) for m in models):
        raise ConfigError("the model is wrapped in DistributedDataParallel (or DataParallel), which averages gradients "
                          "every step behind lordo's back: pass the module itself (model.module); lordo does the "
                          "communication")
    return models


def _option_tree(strategy: str, lr: float | None, timeout_s: float, ranks_per_worker: int,
                 options: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``distributed``'s arguments as a config tree (``build_config`` validates the values), each option put
    under ``strategy`` or ``optim``; unknown names and strategies refused here."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not (isinstance(ranks_per_worker, int) and ranks_per_worker >= 1):
        raise ConfigError(f"ranks_per_worker must be an integer >= 1, got {ranks_per_worker!r}")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0):
        raise ConfigError(f"lr must be a number > 0, or None for the strategy's default, got {lr!r}")
    if "betas" in options:  # torch.optim's spelling of beta1 and beta2
        betas = options.pop("betas")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ConfigError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        if "beta1" in options or "beta2" in options:
            raise ConfigError("give betas=(beta1, beta2) or beta1=/beta2=, not both")
        options = {**options, "beta1": betas[0], "beta2": betas[1]}
    tree: dict[str, dict[str, Any]] = {"optim": {"lr": 0.0 if lr is None else lr}, "strategy": {"name": strategy},
                                       "dist": {"timeout_s": timeout_s, "ranks_per_worker": ranks_per_worker}}
    for key, value in options.items():
        if key in _STRATEGY_KEYS:
            tree["strategy"][key] = value
        elif key in _OPTIM_KEYS:
            tree["optim"][key] = value
        else:
            raise ConfigError(
                f"unknown option {key!r}; options are strategy keys ({', '.join(sorted(_STRATEGY_KEYS))}) "
                f"or optim keys ({', '.join(sorted(_OPTIM_KEYS - {'lr'}))})"
            )
    return tree



__all__ = ["DistributedOptimizer", "distributed", "default_groups", "reshard", "worker_mesh"]
