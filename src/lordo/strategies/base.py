"""The strategy interface: everything that happens after ``loss.backward()``.

A strategy drives the workers this process hosts (all M on the simulator, one under torch.distributed):
their inner optimizers, which it is given, and all communication, which goes through the communicator, so
the same code runs on both. The training loop computes gradients and calls ``step``; it never touches an
optimizer directly. Strategies take their settings as keyword arguments and check them; only
``strategies.build`` reads a run's ``Config``.
"""

from __future__ import annotations

import copy
import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..errors import ConfigError
from ..optim.sharded import is_sharded, local, sum_over_shards


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def clip_gradients(params: list[torch.Tensor], max_norm: float) -> float:
    """Clip the global gradient norm of ``params`` in place (0 = no clipping); returns the norm before."""
    with_grad = [p for p in params if p.grad is not None]
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(with_grad, max_norm, foreach=True))
    return float(torch.nn.utils.get_total_norm([p.grad for p in with_grad if p.grad is not None], foreach=True))


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters in group order: the order of a worker's anchor, pseudo-gradients, payloads."""
    return [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class Worker:
    """One model replica this process hosts, and what belongs to it alone."""

    rank: int
    model: nn.Module
    optimizer: torch.optim.Optimizer  # the inner (local) optimizer
    params: list[torch.Tensor]  # the trained parameters, in the optimizer's order
    # what this rank holds of them, for the strategy's arithmetic and collectives: the parameters themselves,
    # or their shards (views of the same storage) when FSDP2 shards the model over the worker's ranks
    tensors: list[torch.Tensor] = field(default_factory=list)
    residuals: list[torch.Tensor] = field(default_factory=list)  # what compressing its pseudo-gradients lost
    shard_residual: torch.Tensor | None = None  # what re-encoding the mean of its shard lost (block codecs)


def sharded_names(models: Sequence[nn.Module]) -> list[str]:
    """Names of the parameters sharded across ranks (DTensor, from FSDP2's ``fully_shard``)."""
    return [n for m in models for n, p in m.named_parameters() if is_sharded(p)]


def check_sharded_models(models: Sequence[nn.Module], comm: Communicator) -> None:
    """Sharded parameters need a communicator of sharded worker groups, whose ranks are the DTensors' mesh;
    a model sharded in part (some parameters whole on every rank) is refused too."""
    names = sharded_names(models)
    if not names:
        return
    listed = f"{', '.join(names[:3])}{', ...' if len(names) > 3 else ''}"
    if not getattr(comm, "sharded", False):
        raise ConfigError(f"parameters sharded across ranks (DTensor, from FSDP2's fully_shard): {listed}. Shard the "
                          "model over the ranks of one worker (mesh=lordo.worker_mesh(ranks_per_worker)) and pass "
                          "ranks_per_worker to lordo.distributed under torch.distributed (docs/multi-node.md)")
    whole = [n for m in models for n, p in m.named_parameters() if p.requires_grad and not is_sharded(p)]
    if whole:
        raise ConfigError(f"the model is sharded in part: {', '.join(whole[:3])}{', ...' if len(whole) > 3 else ''} "
                          "are not; apply fully_shard to the root module too, so that every parameter is sharded")
    ranks = comm.intra_ranks[comm.worker]  # type: ignore[attr-defined]
    for m in models:
        for n, p in m.named_parameters():
            mesh = p.device_mesh  # type: ignore[attr-defined]
            if mesh.ndim != 1 or mesh.mesh.flatten().tolist() != ranks:
                raise ConfigError(f"parameter {n} is sharded over ranks {mesh.mesh.tolist()}, but this process's worker "
                                  f"is ranks {ranks}: shard with fully_shard(..., mesh=lordo.worker_mesh(ranks_per_worker))")


def check_workers(models: Sequence[nn.Module], comm: Communicator,
                  optimizers: Sequence[torch.optim.Optimizer]) -> list[Worker]:
    """One :class:`Worker` per hosted replica; every trainable parameter must be in its optimizer (a
    parameter left out would drift apart on each worker and never be synchronised)."""
    if len(models) != len(comm.local_ranks):
        raise ConfigError(f"{len(models)} model replica(s) given, but this process hosts {len(comm.local_ranks)} worker(s)")
    if len(optimizers) != len(models):
        raise ConfigError(f"optimizers: one per model replica, got {len(optimizers)} for {len(models)}")
    check_sharded_models(models, comm)
    workers = []
    for rank, model, opt in zip(comm.local_ranks, models, optimizers):
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(f"optimizers must be torch.optim.Optimizer instances, got {type(opt).__name__}")
        params = optimizer_params(opt)
        held = {id(p) for p in params}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
        if missing:
            raise ConfigError(f"the optimizer of worker {rank} does not hold the trainable parameter(s) {', '.join(missing)}")
        mine = {id(p) for p in model.parameters()}
        if not held <= mine:
            raise ConfigError(f"the optimizer of worker {rank} holds parameters of another model")
        workers.append(Worker(rank, model, opt, params, [local(p) for p in params]))
    return workers


def model_buffers(model: nn.Module) -> list[torch.Tensor]:
    """The model's persistent floating-point buffers (BatchNorm's running statistics, ...): state that is not
    trained but differs between workers. Non-persistent ones (RoPE tables) are constants."""
    out = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_floating_point() and name not in module._non_persistent_buffers_set:
                out.append(buf)
    return out


def check_number(name: str, value: Any, *, minimum: float = 0.0, below: float | None = None, integer: bool = False) -> None:
    """A keyword argument's range check, with the error a config file would give."""
    kind_ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not kind_ok or not value >= minimum or (below is not None and not value < below):
        upper = f" and < {below}" if below is not None else ""
        raise ConfigError(f"{name} must be {'an integer' if integer else 'a number'} >= {minimum:g}{upper}, got {value!r}")


def inner_state_bytes(optimizer: torch.optim.Optimizer, tensors: Sequence[torch.Tensor]) -> dict[str, int]:
    """What an inner optimizer holds, by category: its own ``state_bytes()`` where it has one (``MuonAdamW``,
    ``LowRankQHAdam``), else AdamW's two moments in the tensors' dtype (it allocates them lazily: this is what
    it holds after the first step)."""
    own = getattr(optimizer, "state_bytes", None)
    return own() if callable(own) else {"full_rank_moments": 2 * tensor_bytes(tensors)}


class Strategy(ABC):
    """After-backward logic for the workers (model replicas) this process hosts."""

    name: str = ""
    recoverable = False  # whether it runs on a fault-tolerant communicator (collectives only in rounds)
    shardable = False  # whether it runs on a model sharded over each worker's ranks (FSDP2)

    def __init__(self, models: Sequence[nn.Module], comm: Communicator, *,
                 optimizers: Sequence[torch.optim.Optimizer], grad_clip: float = 0.5, sync_buffers: bool = True) -> None:
        check_number("grad_clip", grad_clip)
        if comm.fault_tolerant and not self.recoverable:
            raise ConfigError(f"strategy {self.name!r} communicates at every step; a fault-tolerant backend (torchft) "
                              "runs the local-update strategies: local-adam, diloco, lordo, lordo-local, lordo-global-noqh")
        if sharded_names(models) and not self.shardable:
            raise ConfigError(f"strategy {self.name!r} averages gradients between workers every step; a model sharded "
                              "over each worker's ranks (FSDP2) runs the local-update strategies: local-adam, diloco, lordo, "
                              "lordo-local, lordo-global-noqh")
        self.comm, self.grad_clip = comm, float(grad_clip)
        self.workers = check_workers(models, comm, optimizers)
        self.steps_done = 0
        self.buffers = [model_buffers(w.model) for w in self.workers] if sync_buffers else [[] for _ in self.workers]

    def total_norm(self, tensors: Sequence[torch.Tensor]) -> float:
        """The 2-norm of ``tensors`` (worker 0's, ordered like its parameters) over the whole model: for a
        sharded model, the sum of the squares over the worker's ranks (a collective inside the worker)."""
        if not any(is_sharded(p) for p in self.workers[0].params):
            if isinstance(tensors, list):
                return float(torch.nn.utils.get_total_norm(tensors))
            norms = [torch.linalg.vector_norm(t) for t in tensors]  # read one at a time (a round held as codes)
            return float(torch.linalg.vector_norm(torch.stack(norms)))
        squares = [t.float().pow(2).sum() for t in tensors]
        sum_over_shards(self.workers[0].params, squares)
        return float(sum(float(s) for s in squares)) ** 0.5

    def average_buffers(self) -> None:
        """Average the models' persistent buffers over the workers (at each synchronisation; ``sync_buffers``)."""
        if self.buffers[0]:
            self.comm.all_reduce_mean(self.buffers, tag="buffers")

    @property
    def models(self) -> list[nn.Module]:
        return [w.model for w in self.workers]

    def grads(self) -> list[list[torch.Tensor]]:
        """Every hosted worker's gradients, in parameter order. A parameter the forward pass did not use has
        none: it gets a zero gradient (like DDP's unused parameters), with one warning naming it; a worker
        with no gradient at all has not run backward, which is an error."""
        out = []
        for w in self.workers:
            frozen = [i for i, p in enumerate(w.params) if not p.requires_grad]
            if frozen:
                names = {id(p): n for n, p in w.model.named_parameters()}
                listed = ", ".join(names.get(id(w.params[i]), "?") for i in frozen[:3]) + (", ..." if len(frozen) > 3 else "")
                raise ConfigError(f"parameter(s) {listed} were frozen (requires_grad=False) after the optimizer was built: "
                                  "it trains, averages and keeps state for every parameter it was built with. Freeze "
                                  "them before building it (they are then left out), or leave them trainable")
            missing = [i for i, p in enumerate(w.params) if p.grad is None]
            if len(missing) == len(w.params):
                raise RuntimeError(f"no parameter of worker {w.rank} has a gradient: call loss.backward() before step()")
            if missing and not getattr(self, "_warned_unused", False):
                names = {id(p): n for n, p in w.model.named_parameters()}
                unused = ", ".join(names.get(id(w.params[i]), "?") for i in missing)
                warnings.warn(f"parameters without a gradient (unused in forward?): {unused}; they get zero gradients "
                              "(set requires_grad=False on parameters you do not train)", RuntimeWarning, stacklevel=3)
                self._warned_unused = True
            for i in missing:
                w.params[i].grad = torch.zeros_like(w.params[i])
            out.append([p.grad for p in w.params if p.grad is not None])
        return out

    def clip(self) -> list[float]:
        """Clip each hosted worker's gradient to ``grad_clip``; returns the norms before clipping."""
        return [clip_gradients(w.params, self.grad_clip) for w in self.workers]

    def set_lr(self, lr: float | None) -> None:
        """Set every inner optimizer group's learning rate (None: keep what the groups hold)."""
        if lr is not None:
            for w in self.workers:
                for group in w.optimizer.param_groups:
                    group["lr"] = lr

    def clip_and_step(self) -> list[float]:
        """Clip each hosted worker's gradient, take one step of its optimizer, clear the gradients.

        Returns the gradient norms before clipping."""
        norms = self.clip()
        for w in self.workers:
            w.optimizer.step()
            w.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return norms

    @abstractmethod
    def step(self, lr: float | None = None) -> dict[str, float]:
        """One optimizer step of every hosted worker from its ``.grad``, including any communication due at
        this step; clears the gradients. ``lr`` sets every inner group's learning rate first (None: the
        groups' own, e.g. from a scheduler). Returns diagnostics for the metrics log."""

    def finish(self) -> dict[str, float]:
        """Bring the workers to one model at the end of training (a final sync if one is pending)."""
        return {}

    @property
    def in_sync(self) -> bool:
        """True when every worker holds the same model (always, for synchronous strategies)."""
        return True

    # state: what every worker holds alike ("shared", saved once) and what each hosted worker holds alone
    # ("workers", one entry per hosted worker: its optimizer's moments, bases, error feedback)

    def shared_state(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done}

    def load_shared_state(self, state: dict[str, Any]) -> None:
        self.steps_done = int(state["steps_done"])

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors, numbers and strings only."""
        return {"shared": self.shared_state(), "workers": [{"optimizer": w.optimizer.state_dict()} for w in self.workers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_shared_state(state["shared"])
        if len(state["workers"]) != len(self.workers):
            raise ValueError(f"state holds {len(state['workers'])} workers, this process hosts {len(self.workers)}")
        for w, saved in zip(self.workers, state["workers"]):
            w.optimizer.load_state_dict(saved["optimizer"])

    # fault tolerance (comm.round): what a round may change, put back when it fails; a recovering worker

    def snapshot(self) -> dict[str, Any]:
        """A copy of everything a round may change on the hosted workers: models (parameters, buffers) and state."""
        # deep copies: state dicts hold references to the live tensors
        return copy.deepcopy({"models": [w.model.state_dict() for w in self.workers], "state": self.state_dict()})

    def restore(self, snapshot: dict[str, Any]) -> None:
        for w, saved in zip(self.workers, snapshot["models"], strict=True):
            w.model.load_state_dict(saved)
        self.load_state_dict(snapshot["state"])

    # memory: what is accounted from shapes (state_bytes) and what is measured from the live tensors (footprint.py)

    def held(self, worker: int) -> dict[str, list[Any]]:
        """What this strategy keeps for hosted worker ``worker`` besides its inner optimizer, by category (objects
        whose tensors :func:`~lordo.strategies.footprint.measure` counts); shared ones (the anchor) in every worker's."""
        return {}

    def host_categories(self) -> frozenset[str]:
        """Categories kept in host memory by choice (counted as such also on a CPU run)."""
        return frozenset()

    def measured_state_bytes(self, worker: int = 0) -> dict[str, int]:
        """Bytes by category of the live tensors hosted worker ``worker``'s optimizer and this strategy hold for it,
        each storage once (``... (host)``: in host memory)."""
        from .footprint import measure

        w = self.workers[worker]
        return measure(self.held(worker), w.optimizer, self.models, w.tensors[0].device, self.host_categories())

    def forget_own_errors(self) -> None:  # noqa: B027 (nothing to forget unless the strategy keeps errors)
        """Zero what only this worker had yet to deliver (error feedback): a recovering worker received a peer's."""

    def mirror_round(self, kind: str, resume_at: int) -> None:
        """Take part, without contributing, in the round the others are in (a recovering worker)."""
        raise ConfigError(f"strategy {self.name!r} cannot recover a worker")

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state one worker holds, by category."""

    def step_payload_bytes(self) -> int:
        """Bytes one worker would all-reduce per step under ``ddp`` (the full gradient): the reference (a rank's
        shard of it for a sharded model, as the ledger counts a rank's share)."""
        return tensor_bytes(self.workers[0].tensors)
