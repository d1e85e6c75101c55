"""What a strategy holds, measured: the bytes of the live tensors of its optimizer state, anchor, outer optimizer,
compression residuals and rounds in flight, read from the tensors themselves rather than computed from shapes.

:func:`measure` counts one worker's share (what a process hosting that worker alone would hold): its inner
optimizer's whole object (state, kept plans and stacks; parameters and gradients excluded) and what the strategy
lists in :meth:`~lordo.strategies.Strategy.held` for that worker. Every storage is counted once, whole, under the
first category that reaches it (a view of a stack or a shared code book is not counted twice). An optimizer of
any kind is walked the same way, through dicts, lists, objects' attributes and tensor subclasses (an 8-bit
optimizer's codes and scales, a DTensor's shard), so an optimizer a user brings is counted as it is.

Placement: a tensor on another device type than the worker's parameters is in host memory, as is what the
strategy declares host-side (``offload_anchor`` on a CPU run): its category is reported with `` (host)``.

A walk reaches what the objects it starts from refer to; a round in flight also holds tensors in its exchange
thread's frames and closures, which no object refers to. :func:`live_storages` is the process's own view (every
tensor the garbage collector tracks, wherever it is referred from) and :func:`unreached` what it holds beyond a
baseline, the models and every walk: :class:`InFlightPeak` samples it while a round's thread runs.
"""

from __future__ import annotations

import gc
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

HOST = " (host)"
_SKIP = (nn.Module, torch.device, torch.dtype, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
         str, bytes, int, float, bool, type(None))


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, data pointer) of a tensor's storage; None for one without memory (meta, empty)."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
        return (str(t.device), storage.data_ptr()) if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # a tensor without a storage of its own (a functional wrapper)
        return None


def plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors holding ``t``'s memory: itself, a DTensor's local shard, a tensor subclass's inner tensors."""
    to_local = getattr(t, "to_local", None)
    if callable(to_local):  # DTensor (an FSDP2 parameter too)
        yield from plain_tensors(to_local())
        return
    if type(t) in (torch.Tensor, nn.Parameter) or isinstance(t, nn.Parameter):
        yield t
        return
    flatten = getattr(t, "__tensor_flatten__", None)
    if callable(flatten):
        names, _ = flatten()
        for name in names:
            yield from plain_tensors(getattr(t, name))
        return
    yield t


def walk(obj: Any, path: tuple = (), seen: set[int] | None = None) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Every tensor reachable from ``obj`` with the path to it: through dicts (keys and values), lists, tuples, sets,
    objects' ``__dict__`` and ``__slots__``; not through modules, functions or classes."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, _SKIP):
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        for t in plain_tensors(obj):
            yield path, t
        return
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            name = key if isinstance(key, (str, int)) else "item"
            if isinstance(key, torch.Tensor):  # a state dict keyed by parameter: the key is the parameter, excluded
                yield from walk(key, (*path, "key"), seen)
            yield from walk(value, (*path, name), seen)
        return
    if isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(list(obj)):
            yield from walk(value, (*path, i), seen)
        return
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        yield from walk(attrs, path, seen)
    for slot in getattr(type(obj), "__slots__", ()):
        if isinstance(slot, str) and hasattr(obj, slot):
            yield from walk(getattr(obj, slot), (*path, slot), seen)


def excluded_storages(models: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None = None) -> set[tuple[str, int]]:
    """The storages of the models' parameters, their gradients and buffers, and of the parameters the optimizer
    steps: the model's, not the optimizer's (FSDP2 swaps a module's sharded parameters for gathered ones after a
    forward pass, so the optimizer's shards are not always the module's parameters)."""
    out: set[tuple[str, int]] = set()
    stepped = [p for group in optimizer.param_groups for p in group["params"]] if optimizer is not None else []
    for t in [*(t for m in models for t in (*m.parameters(), *m.buffers())), *stepped]:
        for source in (t, t.grad):
            if source is not None:
                out.update(k for x in plain_tensors(source) if (k := storage_key(x)) is not None)
    return out


def state_category(optimizer: torch.optim.Optimizer, param: torch.Tensor, path: tuple, t: torch.Tensor) -> str:
    """The category of tensor ``t`` at ``path`` in ``param``'s state: the optimizer's own ``state_category(param,
    path)`` where it has one (lordo's optimizers), else by the entry's name and size (torch's, GaLore's, 8-bit
    optimizers' state)."""
    own = getattr(optimizer, "state_category", None)
    names = [str(x) for x in path]
    if callable(own):
        return own(param, names)
    if any("ortho" in n or "proj" in n for n in names):
        return "bases"  # GaLore's projector
    local = sum(x.numel() for x in plain_tensors(param))  # a sharded parameter's shard, as ``t`` is
    if param.ndim == 2 and t.ndim == 2 and 0 < t.numel() <= local // 2:
        return "lowrank_moments"  # GaLore's moments of the projected gradient
    return "full_rank_moments"


def measure(held: dict[str, list[Any]], optimizer: torch.optim.Optimizer, models: Sequence[nn.Module],
            device: torch.device, host_categories: frozenset[str] = frozenset()) -> dict[str, int]:
    """Bytes by category of the optimizer's object and of ``held`` (category → objects to walk), each storage once;
    categories on another device type than ``device``, or named in ``host_categories``, get `` (host)``."""
    skip = excluded_storages(models, optimizer)
    counted: set[tuple[str, int]] = set()
    out: dict[str, int] = {}

    def add(category: str, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key is None or key in skip or key in counted:
            return
        counted.add(key)
        if t.device.type != device.type or category in host_categories:
            category += HOST
        out[category] = out.get(category, 0) + t.untyped_storage().nbytes()

    for param, state in list(optimizer.state.items()):
        for path, t in walk(state):
            add(state_category(optimizer, param, path, t), t)
    rest = {k: v for k, v in vars(optimizer).items() if k not in ("state", "param_groups")}
    for _, t in walk(rest):  # kept plans and stacks, inner optimizers' objects: views of the state counted above
        add("optimizer_other", t)
    for category, objects in held.items():
        for _, t in walk(objects):
            add(category, t)
    return out


def report(measured: dict[str, int], adamw: int) -> dict[str, int]:
    """``measured`` with ``total``, ``device_total`` (not in host memory) and ``adamw`` (the reference) added."""
    out = dict(measured)
    out["total"] = sum(measured.values())
    out["device_total"] = out["total"] - sum(v for k, v in measured.items() if k.endswith(HOST))
    out["adamw"] = adamw
    return out


def live_storages() -> dict[tuple[str, int], int]:
    """Bytes of every storage a live Python tensor holds (the garbage collector's view: a thread's locals, a
    closure's cells and a future's result included), by storage key."""
    out: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # type(), not isinstance: a dead weak proxy would raise on __class__
            for t in plain_tensors(obj):
                key = storage_key(t)
                if key is not None:
                    out[key] = t.untyped_storage().nbytes()
    return out


def reached(strategy: Any) -> set[tuple[str, int]]:
    """The storages every hosted worker's count reaches (its optimizer's object and what the strategy holds for it)."""
    keys: set[tuple[str, int]] = set()
    for w in range(len(strategy.workers)):
        for objects in (strategy.held(w), vars(strategy.workers[w].optimizer)):
            keys |= {k for _, t in walk(objects) if (k := storage_key(t)) is not None}
    return keys


def unreached(strategy: Any, models: Sequence[nn.Module], baseline: Iterable[tuple[str, int]]) -> int:
    """Bytes the process holds beyond ``baseline`` (what lived before the strategy), the models' parameters,
    gradients and buffers, and every hosted worker's count: what a round's thread holds that no walk reaches."""
    skip = set(baseline) | excluded_storages(models) | reached(strategy)
    return sum(n for key, n in live_storages().items() if key not in skip)


class InFlightPeak:
    """The most :func:`unreached` bytes seen while ``busy()`` holds (a round's exchange thread running), sampled
    every ``interval`` seconds, and once more after it (what the round keeps until it lands)."""

    def __init__(self, strategy: Any, models: Sequence[nn.Module], baseline: Iterable[tuple[str, int]]) -> None:
        self.strategy, self.models, self.baseline = strategy, models, set(baseline)
        self.peak, self.samples = 0, 0

    def sample(self) -> int:
        found = unreached(self.strategy, self.models, self.baseline)
        self.peak, self.samples = max(self.peak, found), self.samples + 1
        return found

    def follow(self, busy: Callable[[], bool], interval: float = 0.001, limit_s: float = 600.0) -> int:
        deadline = time.monotonic() + limit_s
        while busy() and time.monotonic() < deadline:
            self.sample()
            time.sleep(interval)
        self.sample()
        return self.peak
