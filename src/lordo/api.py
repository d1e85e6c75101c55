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

import torch
from torch import nn

from .comm import Communicator, Ledger, make_communicator
from .config import Config, OptimConfig, StrategyConfig, build_config
from .errors import ConfigError
from .model.params import ParamGroup, group_by_module, group_parameters
from .strategies import STRATEGIES, Strategy, build_strategy

_OPTIM_KEYS = {f.name for f in dataclasses.fields(OptimConfig)}
_STRATEGY_KEYS = {f.name for f in dataclasses.fields(StrategyConfig)} - {"name"}


class DistributedOptimizer:
    """The optimizer state and all communication of the workers this process hosts.

    Call :meth:`step` once per training step, after ``loss.backward()`` on every hosted replica; it
    takes the local (or synchronous) optimizer step, communicates when due, and clears the gradients.
    Build it with :func:`distributed`; ``lordo train`` builds it from a :class:`~lordo.config.Config`.
    """

    def __init__(
        self,
        models: Sequence[nn.Module],
        cfg: Config,
        comm: Communicator,
        groups: Sequence[Sequence[ParamGroup]] | None = None,
        owns_comm: bool = False,
    ) -> None:
        self.models = list(models)
        if len(self.models) != len(comm.local_ranks):
            raise ConfigError(
                f"{len(self.models)} model replica(s) given, but this process hosts {len(comm.local_ranks)} worker(s)"
            )
        self.cfg, self.comm, self._owns_comm = cfg, comm, owns_comm
        # replicas start equal: worker 0's parameters everywhere (counted in the ledger as the initial broadcast)
        comm.broadcast([[p.data for p in m.parameters()] for m in self.models], tag="init")
        if groups is None:
            groups = [default_groups(m) for m in self.models]
        self.groups = [list(g) for g in groups]
        self.strategy: Strategy = build_strategy(cfg, self.models, self.groups, comm)

    # --- the training step -------------------------------------------------------------------------
    def step(self, lr: float | None = None) -> dict[str, float]:
        """One optimizer step of every hosted worker from its ``.grad`` (clipped to ``grad_clip``), with the
        communication due at this step; clears the gradients. ``lr`` overrides the configured learning
        rate for this step (pass your schedule's value). Returns diagnostics (gradient norm; at a
        synchronisation ``synced``, ``pseudo_grad_norm``, ``basis_overlap``, ``residual_energy``)."""
        return self.strategy.step(self.cfg.optim.lr if lr is None else float(lr))

    def finish(self) -> dict[str, float]:
        """Synchronise once more if local steps are pending, so every worker holds the same model. Call it
        at the end of training (and before evaluating or saving a model mid-training if you need the
        global model; between synchronisations each worker holds its own)."""
        return self.strategy.finish()

    @property
    def in_sync(self) -> bool:
        """True when every worker holds the same model: always for ``ddp`` and ``lowrank-ddp``; for the
        local-update strategies right after a synchronisation (and at the start)."""
        return self.strategy.in_sync

    @torch.no_grad()
    def average_into(self, model: nn.Module) -> None:
        """Load into ``model`` (a spare replica of the same architecture) the mean of every worker's current
        parameters: the model all workers would hold if they synchronised now, without changing the run.
        A collective (every process must call it) that is not counted in the ledger; between
        synchronisations it is the fair model to evaluate, where worker 0's own model has drifted."""
        mine = [[p.detach().clone() for p in m.parameters()] for m in self.models]
        self.comm.all_reduce_mean(mine, tag="evaluation", accounted=False)
        for target, mean in zip(model.parameters(), mine[0], strict=True):
            target.copy_(mean)

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (the local-step counter that decides when to synchronise)."""
        return self.strategy.steps_done

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (tensors, numbers, strings; ``torch.save`` it per process):
        ``shared`` (the same on every worker), ``workers`` (one entry per hosted worker) and the ledger."""
        state = self.strategy.state_dict()
        state["ledger"] = self.comm.ledger.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, in a process hosting the same workers, after the model's
        own ``load_state_dict``."""
        missing = {"shared", "workers"} - set(state)
        if missing:
            raise ValueError(f"not a lordo optimizer state: keys {sorted(missing)} are missing")
        self.strategy.load_state_dict({"shared": state["shared"], "workers": state["workers"]})
        if "ledger" in state:
            self.comm.ledger.load_state_dict(state["ledger"])

    # --- accounting ----------------------------------------------------------------------------------
    @property
    def ledger(self) -> Ledger:
        """Every collective so far: kind, tag, calls, bytes per worker (``ledger.table()``)."""
        return self.comm.ledger

    def memory_report(self) -> dict[str, int]:
        """Bytes of optimizer state one worker holds, by category, with ``total`` and ``adamw`` (two fp32
        moments of every trained parameter: what ``torch.optim.AdamW`` would hold) for comparison."""
        report = dict(self.strategy.state_bytes())
        report["total"] = sum(report.values())
        report["adamw"] = 2 * 4 * sum(p.numel() for p in self.strategy.workers[0].params)
        return report

    def comm_report(self) -> dict[str, Any]:
        """Bytes sent per worker so far, and against DDP (the full gradient every step, same initial broadcast)."""
        steps = self.strategy.steps_done
        init = self.ledger.entries.get("broadcast:init")
        ddp = steps * self.strategy.step_payload_bytes() + (init.bytes if init else 0) if self.comm.world_size > 1 else 0
        total = self.ledger.total_bytes
        return {
            "steps": steps,
            "bytes_total": total,
            "bytes_per_step": total / steps if steps else 0.0,
            "calls": self.ledger.total_calls,
            "ddp_bytes": ddp,
            "ratio_to_ddp": total / ddp if ddp else None,
            "by_collective": self.ledger.table(),
        }

    @property
    def world_size(self) -> int:
        """M: the number of workers (processes under torch.distributed, or simulated replicas)."""
        return self.comm.world_size

    @property
    def is_main(self) -> bool:
        """True in the process hosting worker 0 (the one that should log and save)."""
        return self.comm.is_main

    def close(self) -> None:
        """Release the process group if this object created it (not one the caller initialised)."""
        if self._owns_comm:
            self.comm.close()

    def __repr__(self) -> str:
        s = self.cfg.strategy
        return (
            f"DistributedOptimizer(strategy={s.name!r}, workers={self.comm.world_size}, "
            f"hosted={len(self.models)}, rank={s.rank}, sync_every={s.sync_every}, omega={s.omega})"
        )


def default_groups(model: nn.Module) -> list[ParamGroup]:
    """lordo's own GPT keeps its name-based groups; any other model is grouped by module type."""
    from .model import GPT

    return group_parameters(model) if isinstance(model, GPT) else group_by_module(model)


def distributed(
    model: nn.Module | Sequence[nn.Module],
    strategy: str = "lordo",
    *,
    lr: float | None = None,
    backend: str = "auto",
    timeout_s: float = 300.0,
    **options: Any,
) -> DistributedOptimizer:
    """Wrap ``model`` (this process's replica) in a distributed optimizer.

    ``strategy``: one of ``ddp``, ``local-adam``, ``lordo``, ``lordo-global-noqh``, ``lordo-local``,
    ``lowrank-ddp``. ``lr``: the learning rate used when :meth:`DistributedOptimizer.step` is called without
    one; default: the strategy's (3e-3 for ddp and local-adam, 6e-3 for the low-rank strategies: tuned on
    a 1.4M-parameter model; tune it for yours). ``options``: any ``strategy.*`` key (``rank``, ``sync_every``, ``omega``,
    ``error_feedback``, ``basis_method``, ``average_moments``, ``outer_lr``, ``lowrank_pattern``, ...) or
    ``optim.*`` key (``weight_decay``, ``beta1``, ``beta2``, ``eps``, ``grad_clip``), with the defaults and
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
    """
    models: list[nn.Module] = [model] if isinstance(model, nn.Module) else list(model)
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise ConfigError("model must be an nn.Module, or a non-empty list of replicas for the simulator")
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    tree: dict[str, dict[str, Any]] = {"optim": {"lr": lr or 0.0}, "strategy": {"name": strategy}, "dist": {"timeout_s": timeout_s}}
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
    if backend not in ("auto", "sim", "gloo", "nccl"):
        raise ConfigError(f"backend must be one of auto, sim, gloo, nccl, got {backend!r}")
    first = next(models[0].parameters(), None)
    if first is None:
        raise ConfigError("the model has no parameters")
    device = first.device.type
    comm = make_communicator(backend, len(models), timeout_s, device)
    if len(models) > 1 and len(comm.local_ranks) != len(models):
        comm.close()
        raise ConfigError(
            f"{len(models)} replicas given, but the {type(comm).__name__} hosts one worker per process; "
            "pass one model under torch.distributed, or backend='sim' to simulate workers"
        )
    tree["dist"].update({"workers": comm.world_size, "backend": getattr(comm, "backend", "sim")})
    try:
        cfg = build_config(tree=tree)
        return DistributedOptimizer(models, cfg, comm, owns_comm=True)
    except BaseException:
        comm.close()
        raise


__all__ = ["DistributedOptimizer", "distributed", "default_groups"]
