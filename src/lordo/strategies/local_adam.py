"""Local-update strategies: K local optimizer steps per worker, then the workers average.

At a synchronisation every worker sends its pseudo-gradient Δ_m = θ_anchor − θ_m. The mean Δ becomes the
``.grad`` of the anchor (the model at the last synchronisation, one copy per process) and an outer
``torch.optim`` optimizer steps it: SGD at lr 1 is plain model averaging (θ_new = θ_anchor − Δ), SGD with
Nesterov momentum is DiLoCo. Every worker then restarts from θ_new. Optimizer moments can be averaged too,
at every sync or with periods of their own (DES-LOC). Payloads travel through a codec (``comm.codec``:
fp32, bf16, int8), with error feedback of what a lossy codec dropped.

``local-adam`` is this class with AdamW as the inner optimizer; LoRDO's strategies (``lordo.py``) extend it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..comm.codec import COMPRESSIONS, BlockCodec, average, padded_numel, shard_numel, sync_codecs
from ..errors import ConfigError, NonFiniteError
from ..optim.sharded import local
from .base import Strategy, check_number, tensor_bytes

MOMENTS = ("exp_avg", "exp_avg_sq")
AVERAGED = ("none", "lowrank", "all")
OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def model_averaging(anchor: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The default outer optimizer: SGD at lr 1 on the averaged pseudo-gradient, i.e. θ_new = mean of θ_m."""
    return torch.optim.SGD(anchor, lr=1.0)


class LocalUpdateStrategy(Strategy):
    """``LocalUpdateStrategy(models, comm, optimizers=[...], sync_every=32)``: K local steps, then average.

    ``outer_optimizer``: builds the outer optimizer over the anchor tensors (default :func:`model_averaging`;
    e.g. ``lambda a: torch.optim.SGD(a, lr=0.7, momentum=0.9, nesterov=True)`` for DiLoCo).
    ``average_moments``: none | all (every parameter's ``exp_avg``/``exp_avg_sq``); ``moment_periods``: steps
    between averages of each (0 = at every sync). ``compress``: none | bf16 | int8 | int4 payloads, with
    ``compression_feedback`` keeping what compressing the pseudo-gradient lost for the next round.
    ``offload_anchor``: keep the anchor in host memory (pinned when a GPU is present), copied to the device one
    tensor at a time at each synchronisation: the device holds no full-size copy of the model for it."""

    name = "local-adam"
    recoverable = True
    shardable = True  # everything it exchanges is per-parameter: a rank exchanges its shards (Worker.tensors)

    def __init__(self, models: Sequence[nn.Module], comm: Communicator, *, optimizers: Sequence[torch.optim.Optimizer],
                 sync_every: int, outer_optimizer: OuterFactory = model_averaging, average_moments: str = "none",
                 moment_periods: dict[str, int] | None = None, compress: str = "none",
                 compression_feedback: bool = True, grad_clip: float = 0.5, sync_buffers: bool = True,
                 offload_anchor: bool = False) -> None:
        super().__init__(models, comm, optimizers=optimizers, grad_clip=grad_clip, sync_buffers=sync_buffers)
        check_number("sync_every", sync_every, minimum=1, integer=True)
        if average_moments not in AVERAGED:
            raise ConfigError(f"average_moments must be one of {', '.join(AVERAGED)}, got {average_moments!r}")
        if compress not in COMPRESSIONS:
            raise ConfigError(f"compress must be one of {', '.join(COMPRESSIONS)}, got {compress!r}")
        self.moment_periods = dict.fromkeys(MOMENTS, 0) | dict(moment_periods or {})
        for key, period in self.moment_periods.items():
            if key not in MOMENTS:
                raise ConfigError(f"moment_periods keys are {', '.join(MOMENTS)}, got {key!r}")
            check_number(f"moment_periods[{key!r}]", period, integer=True)
        if comm.fault_tolerant and any(self.moment_periods.values()):
            raise ConfigError("strategy.sync_exp_avg_every / sync_exp_avg_sq_every (moment_periods) average moments "
                              "between synchronisations; a fault-tolerant backend (torchft) communicates only at "
                              "synchronisations: leave them at 0")
        if comm.fault_tolerant and compress in ("int8", "int4"):
            raise ConfigError(f"strategy.compress = {compress!r} gathers quantised shards; a fault-tolerant backend "
                              "(torchft) only averages: use none or bf16")
        self.sync_every, self.average = sync_every, average_moments
        self.codecs = sync_codecs(compress)
        # the anchor (last synchronised model) is the same on every worker: one copy per process, stepped by
        # the outer optimizer with the averaged pseudo-gradient as its gradient
        self.anchor = [t.detach().clone() for t in self.workers[0].tensors]
        self.offload_anchor = offload_anchor
        if offload_anchor:  # in host memory (pinned, for asynchronous copies, when a GPU is there), as torchft keeps it
            pin = torch.cuda.is_available()
            self.anchor = [a.to("cpu", copy=True).pin_memory() if pin else a.to("cpu", copy=True) for a in self.anchor]
        self.outer = outer_optimizer(self.anchor)
        if not isinstance(self.outer, torch.optim.Optimizer):
            raise ConfigError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(self.outer).__name__}")
        self.syncs = 0
        self.synced_at = 0  # the step of the last synchronisation (0: the replicas start equal)
        if compress != "none" and compression_feedback:
            codec = self.codecs["pseudo_gradient"]
            for w in self.workers:
                w.residuals = [torch.zeros_like(t) for t in w.tensors]
                if isinstance(codec, BlockCodec):
                    padded = padded_numel([t.numel() for t in w.tensors], codec)
                    w.shard_residual = torch.zeros(shard_numel(padded, comm.world_size, codec), device=w.tensors[0].device)

    def averaged_params(self, worker: int) -> list[torch.Tensor]:
        """Parameters whose optimizer moments are averaged."""
        return self.workers[worker].params if self.average == "all" else []

    def before_local_step(self) -> dict[str, float]:
        """Hook: runs after backward, before any local optimizer step (gradients are in ``.grad``)."""
        return {}

    def after_average(self, delta: list[torch.Tensor]) -> dict[str, float]:
        """Hook: runs at a sync with the averaged pseudo-gradient ``delta`` (ordered like the anchor), before
        the outer step."""
        return {}

    def step(self, lr: float | None = None) -> dict[str, float]:
        self.set_lr(lr)
        self.grads()  # raises if backward was not called
        stats = self.before_local_step()
        stats["grad_norm"] = self.clip_and_step()[0]
        if self.steps_done % self.sync_every == 0:
            stats.update(self.comm.round("sync", self.sync_round, self, self.steps_done))
        else:
            self.average_moments(False)
        return stats

    def sync_round(self) -> dict[str, float]:
        """What a synchronisation exchanges: the moments due, then the pseudo-gradients."""
        self.average_moments(True)
        return self.synchronise()

    def average_moments(self, sync_due: bool) -> None:
        if self.average == "none":
            return
        for key, period in self.moment_periods.items():
            if (self.steps_done % period == 0) if period else sync_due:
                moments = [[local(w.optimizer.state[p][key]) for p in self.averaged_params(i)]  # shards, if sharded
                           for i, w in enumerate(self.workers)]
                if moments[0]:
                    # compressed moments need no error feedback: they are running averages, not sums to deliver
                    average(self.comm, moments, key, self.codecs[key])

    def finish(self) -> dict[str, float]:
        return self.comm.round("final", self.synchronise, self, self.steps_done) if self.steps_done % self.sync_every else {}

    def mirror_round(self, kind: str, resume_at: int) -> None:
        # the received model is the anchor: a pseudo-gradient of zero, left out of every mean anyway
        self.steps_done = resume_at
        rounds = {"sync": self.sync_round, "final": self.synchronise}
        if kind not in rounds:
            raise ValueError(f"cannot take part in a {kind!r} round")
        rounds[kind]()

    @torch.no_grad()
    def forget_own_errors(self) -> None:
        for w in self.workers:
            for e in w.residuals:
                e.zero_()
            if w.shard_residual is not None:
                w.shard_residual.zero_()

    @property
    def in_sync(self) -> bool:
        return self.synced_at == self.steps_done

    @torch.no_grad()
    def synchronise(self) -> dict[str, float]:
        # each worker's parameters become its pseudo-gradient in place (they are overwritten below anyway)
        for w in self.workers:
            if self.offload_anchor:  # one tensor at a time on the device: the anchor is never there whole
                for t, a in zip(w.tensors, self.anchor):
                    t.sub_(a.to(t.device, non_blocking=True)).neg_()
            else:
                torch._foreach_sub_(w.tensors, self.anchor)
                torch._foreach_neg_(w.tensors)
        pseudo = [[t.data for t in w.tensors] for w in self.workers]
        shard_residuals = [w.shard_residual for w in self.workers if w.shard_residual is not None] or None
        average(self.comm, pseudo, "pseudo_gradient", self.codecs["pseudo_gradient"], [w.residuals for w in self.workers],
                shard_residuals)
        delta = pseudo[0]
        finite = all(bool(torch.isfinite(d).all()) for d in delta)
        if getattr(self.comm, "sharded", False):  # each rank checked its own shards: all must take one branch
            finite = not self.comm.agree([not finite])[0]
        if not finite:
            self._restore_from_anchor()  # roll back: every replica holds the last good model again
            raise NonFiniteError(
                f"the averaged pseudo-gradient is not finite at synchronisation {self.syncs + 1} (after optimizer "
                f"step {self.steps_done}); every worker was reset to the model of the previous synchronisation"
            )
        stats = {"synced": 1.0, "pseudo_grad_norm": self.total_norm(delta)}
        stats.update(self.after_average(delta))
        for a, d in zip(self.anchor, delta, strict=True):
            a.grad = d if d.device == a.device else d.to(a.device)
        self.outer.step()
        for a in self.anchor:
            a.grad = None
        self._restore_from_anchor()
        self.average_buffers()
        self.syncs += 1
        self.synced_at = self.steps_done
        return stats

    @torch.no_grad()
    def _restore_from_anchor(self) -> None:
        for w in self.workers:
            if self.offload_anchor:
                for t, a in zip(w.tensors, self.anchor):
                    t.copy_(a, non_blocking=True)
            else:
                torch._foreach_copy_(w.tensors, self.anchor)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        for saved, w in zip(state["workers"], self.workers):
            if w.residuals:
                saved["compression_error"] = [e.clone() for e in w.residuals]
            if w.shard_residual is not None:
                saved["shard_compression_error"] = w.shard_residual.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for saved, w in zip(state["workers"], self.workers):
            if w.residuals:
                torch._foreach_copy_(w.residuals, list(saved["compression_error"]))
            if w.shard_residual is not None:
                w.shard_residual.copy_(saved["shard_compression_error"])

    def shared_state(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "syncs": self.syncs,
            "synced_at": self.synced_at,
            "anchor": [a.clone() for a in self.anchor],
            "outer_optimizer": self.outer.state_dict(),
        }

    def load_shared_state(self, state: dict[str, Any]) -> None:
        self.steps_done, self.syncs = int(state["steps_done"]), int(state["syncs"])
        # older checkpoints lack it: they were taken after the step's synchronisation, if one was due
        self.synced_at = int(state.get("synced_at", self.steps_done - self.steps_done % self.sync_every))
        anchor = list(state["anchor"])
        if len(anchor) != len(self.anchor):
            raise ValueError(f"state holds an anchor of {len(anchor)} tensors, this model has {len(self.anchor)}")
        torch._foreach_copy_(self.anchor, anchor)
        if "outer_optimizer" in state:
            self.outer.load_state_dict(state["outer_optimizer"])
        else:  # checkpoint format 1: the hand-written outer momentum, one buffer per anchor tensor (or none)
            buffers = list(state.get("outer_momentum", []))
            outer = self.outer.state_dict()
            outer["state"] = {i: {"momentum_buffer": b.clone()} for i, b in enumerate(buffers)}
            self.outer.load_state_dict(outer)

    def optimizer_bytes(self) -> dict[str, int]:
        return {"full_rank_moments": 2 * tensor_bytes(self.workers[0].tensors)}

    def state_bytes(self) -> dict[str, int]:
        out = self.optimizer_bytes()
        out["anchor (host)" if self.offload_anchor else "anchor"] = tensor_bytes(self.anchor)
        outer = tensor_bytes(t for s in self.outer.state.values() for t in s.values())
        if outer:
            out["outer_optimizer"] = outer
        if self.workers[0].residuals:
            out["compression_feedback"] = tensor_bytes([*self.workers[0].residuals, self.workers[0].shard_residual])
        return out


LocalAdamStrategy = LocalUpdateStrategy
