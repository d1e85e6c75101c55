"""What a :class:`~lordo.DistributedOptimizer` keeps about the replicas it drives: the per-parameter state mapping
torch's tools read, a fingerprint of a model's weights, the default parameter groups, FSDP2's resharding, and the
check at interpreter exit that no optimizer was left between synchronisations."""

from __future__ import annotations

import atexit
import sys
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .model.params import ParamGroup, group_by_module, group_parameters
from .optim.sharded import local

if TYPE_CHECKING:
    from .distributed_optimizer import DistributedOptimizer


class WorkerStates(Mapping):
    """``DistributedOptimizer.state``: each hosted parameter's state in its worker's inner optimizer (moments,
    bases, error feedback), read-only and live; the optimizer's own state dict is :meth:`state_dict`'s."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = list(optimizers)
        # the parameters are fixed at construction (add_param_group is refused): one lookup table, by identity
        self._owners = {id(q): (q, opt) for opt in self._optimizers for g in opt.param_groups for q in g["params"]}

    def _owner(self, p: torch.Tensor) -> torch.optim.Optimizer | None:
        found = self._owners.get(id(p))
        return found[1] if found is not None and found[0] is p else None

    def __getitem__(self, p: torch.Tensor) -> dict:
        owner = self._owner(p)
        if owner is None:
            raise KeyError("parameter is not one this optimizer trains")
        return owner.state[p]

    def __iter__(self):
        return (p for opt in self._optimizers for p in list(opt.state))

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)


LIVE: weakref.WeakSet[DistributedOptimizer] = weakref.WeakSet()  # optimizers to check at exit


@atexit.register
def _warn_unfinished() -> None:
    """At interpreter exit: say so if an optimizer stopped between synchronisations without finish()."""
    for opt in list(LIVE):
        try:
            if opt.in_sync:
                continue
            behind = opt.steps_done - getattr(opt.strategy, "synced_at", 0)
        except Exception:  # noqa: BLE001 - never fail at exit
            continue
        print(f"lordo: warning: a DistributedOptimizer ({opt.strategy.name}) ended {behind} step(s) after its last "
              "synchronisation without opt.finish(): each worker holds its own model, not the common one. Call "
              "opt.finish() at the end of training, or train inside `with lordo.distributed(...) as opt:`",
              file=sys.stderr)


@torch.no_grad()
def fingerprint(model: nn.Module) -> torch.Tensor:
    """Per parameter (this rank's shard of it), its float64 sum and sum of squares: tells whether a model's
    weights changed, without a copy of them."""
    values = [local(p).detach().double() for p in model.parameters()]
    if not values:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([torch.stack([v.sum(), v.pow(2).sum()]).cpu() for v in values])


def default_groups(model: nn.Module) -> list[ParamGroup]:
    """lordo's own GPT keeps its name-based groups; any other model is grouped by module type."""
    from .model import GPT

    return group_parameters(model) if isinstance(model, GPT) else group_by_module(model)


def reshard(model: nn.Module) -> None:
    """Put a model sharded by FSDP2 back into its shards: FSDP2 keeps the root module's parameters gathered
    after a forward without backward (an evaluation). Nothing for other models."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # no module is FSDP2's before it is imported
    if fsdp is not None and isinstance(model, fsdp.FSDPModule):
        model.reshard()
