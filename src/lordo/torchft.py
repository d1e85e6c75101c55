"""torchft's shape: ``lordo.torchft.LoRDO`` takes what ``torchft.local_sgd.DiLoCo`` takes and is used the same way,
around your own loop, so that switching is one line::

    from torchft.local_sgd import DiLoCo                 # before
    from lordo.torchft import LoRDO as DiLoCo            # after

    with DiLoCo(manager, [model], inner_optimizer, outer_optimizer, sync_every=32) as diloco:
        for step in range(diloco.start_step, steps):     # 0, or the others' step after a recovery
            inner_optimizer.zero_grad()
            loss(model, batch(step)).backward()
            inner_optimizer.step()                       # LoRDO's local step; every sync_every steps a round

Inside, every ``inner_optimizer.step()`` is LoRDO's: a low-rank QH-Adam step with the global basis, at the learning
rate, betas, eps and weight decay your inner optimizer's first group holds when it is called (so your LR scheduler
keeps working); the outer optimizer's settings (SGD: lr, momentum, Nesterov) are the outer step's. The rounds run
over your ``torchft.Manager`` (``use_async_quorum=False``, as DiLoCo needs): a worker that fails is left out, one that
(re)starts receives lordo's state from a peer and continues from their step (:attr:`start_step`). Leaving the block
normally synchronises once more (every worker then holds the same model); your optimizers are yours again.

What does not carry over: the inner optimizer's state (lordo keeps its own low-rank moments), streaming fragments
(one fragment: the whole model), ``should_quantize`` (torchft averages in float32 or bfloat16 here).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .errors import ConfigError

ENV_REPLICAS = "NUM_REPLICA_GROUPS"


def _inner_settings(inner: torch.optim.Optimizer) -> dict[str, Any]:
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(f"LoRDO's local step is Adam's, in a low-rank basis: give torch.optim.AdamW (or Adam) as the "
                          f"inner optimizer, got {type(inner).__name__}")
    group = inner.param_groups[0]
    b1, b2 = group["betas"]
    return {"lr": float(group["lr"]), "beta1": b1, "beta2": b2, "eps": group["eps"], "weight_decay": group["weight_decay"]}


def _outer_settings(outer: Any) -> dict[str, Any]:
    if outer is None:
        return {}
    if not isinstance(outer, torch.optim.SGD):
        raise ConfigError(f"the outer optimizer must be torch.optim.SGD (DiLoCo's: lr 0.7, momentum 0.9, nesterov=True), "
                          f"got {type(outer).__name__}")
    group = outer.param_groups[0]
    return {"outer_lr": float(group["lr"]), "outer_momentum": float(group["momentum"]),
            "outer_nesterov": bool(group["nesterov"])}


def _replica(manager: Any) -> int:
    """This worker's index: the trailing digits of the Manager's replica id (torchft's own rule)."""
    replica_id = str(getattr(manager, "_replica_id", "") or "")
    found = re.search(r"(\d+)$", replica_id.split(":")[0])
    if found is None:
        raise ConfigError(f"the Manager's replica_id {replica_id!r} does not end in this worker's index: build it with "
                          "replica_id=f\"...{REPLICA_GROUP_ID}\"")
    return int(found.group(1))


class LoRDO:
    """``LoRDO(manager, model_fragments, inner_optimizer, outer_optimizer, sync_every, ...)``: every argument of
    torchft 0.2's ``DiLoCo``, in its order and with its defaults (docs/integrations.md lists what each does here),
    then ``workers``: how many workers the run is planned for (default ``$NUM_REPLICA_GROUPS``: it shards the data
    and scales the accounting) and lordo's ``options`` (``rank``, ``omega``, ``memory="lean"``, ... as for
    :func:`lordo.distributed`). ``outer_optimizer``: an SGD or a one-element list of one (one fragment);
    ``backup_device`` None or the CPU keeps the anchor in host memory, as DiLoCo keeps its backup; ``pin_memory``,
    ``use_bucketization`` and ``bucket_cap_mb`` are accepted (lordo's rounds are always one bucket per dtype); the
    streaming options must stay off."""

    def __init__(self, manager: Any, model_fragments: Sequence[nn.Module], inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None, sync_every: int,
                 backup_device: torch.device | str | None = None, pin_memory: bool = True, use_bucketization: bool = False,
                 bucket_cap_mb: int | None = None, should_quantize: bool = False, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, *, workers: int | None = None, **options: Any) -> None:
        from .api import distributed
        from .comm.ft import TorchFTCommunicator

        fragments = list(model_fragments) if not isinstance(model_fragments, nn.Module) else [model_fragments]
        if len(fragments) != 1:
            raise ConfigError(f"LoRDO synchronises the whole model in each round (no streaming fragments): pass "
                              f"[model], got {len(fragments)} fragments")
        if isinstance(outer_optimizer, (list, tuple)):  # torchft's one outer optimizer per fragment
            if len(outer_optimizer) != 1:
                raise ConfigError(f"outer_optimizer: one per fragment, and LoRDO has one fragment (the whole model); got "
                                  f"a list of {len(outer_optimizer)}")
            outer_optimizer = outer_optimizer[0]
        if fragment_sync_delay or should_quantize or fragment_update_alpha:
            raise ConfigError("fragment_sync_delay, fragment_update_alpha and should_quantize are streaming DiLoCo's; "
                              "leave them at 0 / 0.0 / False (lordo's sync_delay and int8 rounds do not run over torchft)")
        del pin_memory, use_bucketization, bucket_cap_mb  # lordo's rounds are always bucketed (a buffer per dtype)
        if workers is None:
            raw = os.environ.get(ENV_REPLICAS)
            if raw is None or not raw.strip().isdigit():
                raise ConfigError(f"how many workers does the run have? pass workers=N or set ${ENV_REPLICAS}")
            workers = int(raw)
        self.model, self.inner, self.manager = fragments[0], inner_optimizer, manager
        settings = _inner_settings(inner_optimizer)
        lr = settings.pop("lr")
        comm = TorchFTCommunicator.over(manager, workers, _replica(manager))
        offload = backup_device is None or torch.device(backup_device).type == "cpu"
        self.optimizer = distributed(self.model, "lordo", lr=lr, backend=comm, sync_every=sync_every,
                                     offload_anchor=offload, **{**settings, **_outer_settings(outer_optimizer), **options})
        self.start_step = 0
        self._own: dict[str, Any] = {}

    def __enter__(self) -> LoRDO:
        """Start with the other workers (or recover from them: :attr:`start_step` is then their step), and make
        ``inner_optimizer.step()`` LoRDO's step until the block ends."""
        self.start_step = self.optimizer.join()
        self._own = {name: vars(self.inner).get(name) for name in ("step", "zero_grad")}
        inner = self.inner

        def step(closure=None) -> Any:
            inner._opt_called = True  # type: ignore[attr-defined]  # what a scheduler's own wrapper records
            return self.optimizer.step(closure, lr=float(inner.param_groups[0]["lr"]))

        # a scheduler built before the block (the documented order) checks for its wrapper on every step: this
        # replacement counts as one, so it does not warn that step() was "overridden after" it
        step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
        self.inner.step = step  # type: ignore[method-assign]
        self.inner.zero_grad = self._zero_grad  # type: ignore[method-assign]
        return self

    def _zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    def __exit__(self, exc_type, exc, tb) -> None:
        for name, value in self._own.items():  # the user's optimizer is theirs again
            if value is None:
                vars(self.inner).pop(name, None)
            else:
                vars(self.inner)[name] = value
        if exc_type is None:
            self.optimizer.finish()

    @property
    def steps_done(self) -> int:
        return self.optimizer.steps_done

    def comm_report(self) -> dict[str, Any]:
        return self.optimizer.comm_report()

    def memory_report(self) -> dict[str, int]:
        return self.optimizer.memory_report()
