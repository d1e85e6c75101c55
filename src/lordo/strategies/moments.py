"""The moments of a local-update strategy's workers, as the strategy averages and reads them: averaged over the
workers at a synchronisation or on periods of their own (DES-LOC), opened in float32 where an optimizer holds them
compact (LoRDO's ``lowrank_moments_dtype``), copied for a round in flight (``delayed.py``). A mixin: the workers,
communicator and codecs are :class:`~lordo.strategies.LocalUpdateStrategy`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..comm import Communicator
from ..comm.codec import average
from ..optim.sharded import local

if TYPE_CHECKING:
    from .base import Worker

MOMENTS = ("exp_avg", "exp_avg_sq")


class MomentAveraging:
    """Moment handling of :class:`~lordo.strategies.LocalUpdateStrategy` (see the module doc)."""

    if TYPE_CHECKING:  # what the strategy it is mixed into provides
        workers: list[Worker]
        comm: Communicator
        codecs: dict[str, Any]
        moment_periods: dict[str, int]
        average: str
        steps_done: int

        def averaged_params(self, worker: int) -> list[torch.Tensor]: ...

    def average_moments(self, sync_due: bool) -> None:
        due = [key for key, period in self.moment_periods.items()
               if ((self.steps_done % period == 0) if period else sync_due)]
        if self.average == "none" or not due:
            return
        with self.moments_open(tuple(due)):
            for key in due:
                moments = self.worker_moments(key)
                if moments[0]:
                    # compressed moments need no error feedback: they are running averages, not sums to deliver
                    average(self.comm, moments, key, self.codecs[key])

    @contextlib.contextmanager
    def moments_open(self, keys: tuple[str, ...] = MOMENTS) -> Iterator[None]:
        """Inside the block, the averaged parameters' moments ``keys`` that an optimizer holds compact (LoRDO's
        ``lowrank_moments_dtype``) are float32 tensors in its state (:meth:`worker_moments` reads and averages them);
        stored compact again after it."""
        with contextlib.ExitStack() as stack:
            for i, w in enumerate(self.workers):
                opener = getattr(w.optimizer, "moments_expanded", None)
                if opener is not None:
                    stack.enter_context(opener(self.averaged_params(i), keys))
            yield

    def worker_moments(self, key: str) -> list[list[torch.Tensor]]:
        """Each hosted worker's moments ``key`` of its averaged parameters (their shards, if sharded)."""
        # (an optimizer without that moment, as the Muon form without v, gives none)
        return [[local(s[key]) for p in self.averaged_params(i) if key in (s := w.optimizer.state[p])]
                for i, w in enumerate(self.workers)]

    def _moment_copies(self, worker: int, key: str) -> list[torch.Tensor]:
        w = self.workers[worker]
        copy = getattr(w.optimizer, "moment_copy", None)
        if copy is None:  # a torch optimizer: its moments as they are
            return [local(s[key]).clone() for p in self.averaged_params(worker) if key in (s := w.optimizer.state[p])]
        return [m for p in self.averaged_params(worker) if (m := copy(p, key)) is not None]

    def worker_moment_copies(self, key: str) -> list[list[torch.Tensor]]:
        """Each hosted worker's moments ``key`` of its averaged parameters as new float32 tensors (those an optimizer
        holds compact, decoded), in :meth:`worker_moments`' order; reading them changes nothing."""
        return [self._moment_copies(i, key) for i in range(len(self.workers))]
