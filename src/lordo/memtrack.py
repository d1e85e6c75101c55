"""The peak of the bytes tensors hold over a stretch of work, followed op by op rather than sampled.

A walk of the strategy's objects (strategies/footprint.py) sees what is held between steps; what a step or a
round allocates and frees while it runs (the float32 copies of a compact state, a round's decoded shards, a
landing's pseudo-gradients) is gone by the time a walk looks. :class:`PeakTracker` follows it:

- :meth:`PeakTracker.begin` takes a census of every storage a live tensor holds (the garbage collector's view)
  outside ``exclude`` (the models' parameters, gradients and buffers), and follows each until the last tensor
  that refers to it is gone;
- inside :meth:`PeakTracker.tracking` every tensor an op returns in that thread is followed from then on (a
  ``TorchDispatchMode``: factories, views, in-place results and the steps of composite ops alike), and after each
  op the bytes followed and still alive are compared with the peak. A round's exchange thread started while a
  thread is tracking (:func:`carry`, used by the communicators' ``RoundHandle``) is tracked too.

So ``peak - start`` is the most that the tracked work held at once beyond what lived when it began, counted at op
boundaries: a buffer allocated and freed inside one op (a kernel's own scratch) is not seen, and neither is one
allocated while no thread tracks (the forward and backward passes, on purpose). A storage is held while a
followed tensor refers to it; a view made while nothing tracks and outliving every followed tensor would be let go
early. Bytes are storage bytes (a storage counted once, whatever views of it exist).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Key = tuple[str, int]
_current = threading.local()  # .tracker: the PeakTracker this thread is tracking for, if any


def _key(t: torch.Tensor) -> tuple[Key, int] | None:
    """(storage key, bytes) of a plain tensor with memory; None otherwise."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    n = storage.nbytes()
    return ((str(t.device), storage.data_ptr()), n) if n else None


class PeakTracker:
    """Bytes held by the storages followed (``live``), their most at any op boundary (``peak``) and when
    :meth:`begin` was called (``start``)."""

    def __init__(self, exclude: Iterable[Key] = ()) -> None:
        self.exclude = set(exclude)
        self.live = self.peak = self.start = 0
        self.ops = 0
        self._lock = threading.Lock()
        self._held: dict[Key, tuple[int, dict[int, weakref.ref]]] = {}  # key -> (bytes, tensors referring to it)

    def begin(self) -> PeakTracker:
        """Follow every storage a live tensor holds now (outside ``exclude``): the starting point."""
        for obj in gc.get_objects():
            if issubclass(type(obj), torch.Tensor):  # type(): a dead weak proxy would raise on __class__
                self.follow(obj)
        with self._lock:
            self.start = self.peak = self.live
        return self

    def follow(self, t: Any) -> None:
        """Count ``t``'s storage while ``t`` (or another followed tensor on it) is alive."""
        if not isinstance(t, torch.Tensor):
            return
        found = _key(t)
        if found is None or found[0] in self.exclude:
            return
        key, n = found
        with self._lock:
            if key not in self._held:
                self._held[key] = (n, {})
                self.live += n
            refs = self._held[key][1]
            if id(t) not in refs:
                refs[id(t)] = weakref.ref(t, self._gone(key, id(t)))

    def _gone(self, key: Key, ident: int) -> Callable[[weakref.ref], None]:
        def callback(_: weakref.ref) -> None:
            with self._lock:
                held = self._held.get(key)
                if held is None or ident not in held[1]:
                    return
                del held[1][ident]
                if not held[1]:
                    del self._held[key]
                    self.live -= held[0]

        return callback

    def saw(self, out: Any) -> None:
        """An op returned ``out``: follow its tensors, then compare what is held with the peak."""
        for t in tree_leaves(out):
            self.follow(t)
        with self._lock:
            self.ops += 1
            self.peak = max(self.peak, self.live)

    @property
    def transient(self) -> int:
        """The most held at once beyond the start (>= 0)."""
        return max(0, self.peak - self.start)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[PeakTracker]:
        """Follow every op this thread runs inside the block (and the rounds it starts, :func:`carry`)."""
        before = getattr(_current, "tracker", None)
        _current.tracker = self
        try:
            with _Follow(self):
                yield self
        finally:
            _current.tracker = before


class _Follow(TorchDispatchMode):
    def __init__(self, tracker: PeakTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker.saw(out)
        return out


def carry(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` to run in another thread: tracked there by the tracker of the calling thread, if it has one."""
    tracker = getattr(_current, "tracker", None)
    if tracker is None:
        return fn

    def tracked() -> Any:
        with tracker.tracking():
            return fn()

    return tracked
