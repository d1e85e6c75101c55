"""``lowrank-ddp``: synchronous low-rank Adam (GaLore-style DDP), the paper's strongest low-rank baseline.

Every step each worker projects its gradient (plus its error feedback) onto the shared basis and the
projected gradients are all-reduced together with the full gradients of the full-rank parameters. Every K
steps (and before the first) one full gradient of the low-rank matrices is all-reduced to refresh the
basis (top-r, moments rotated). There is no full-rank QH term (it would need the full gradient): the inner
optimizers run with ω = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..comm import Communicator
from ..errors import ConfigError
from ..optim import LowRankQHAdam, grad_of
from .base import Strategy, check_number
from .basis import change_bases, error_feedback_ratio, residual_energy


class LowRankDDPStrategy(Strategy):
    """``LowRankDDPStrategy(models, comm, optimizers=[LowRankQHAdam(..., omega=1)], refresh_every=32)``."""

    name = "lowrank-ddp"

    def __init__(self, models: Sequence[nn.Module], comm: Communicator, *, optimizers: Sequence[LowRankQHAdam],
                 refresh_every: int, grad_clip: float = 0.5, sync_buffers: bool = True) -> None:
        if not all(isinstance(opt, LowRankQHAdam) for opt in optimizers):
            raise ConfigError("lowrank-ddp's optimizers must be lordo.optim.LowRankQHAdam instances")
        super().__init__(models, comm, optimizers=optimizers, grad_clip=grad_clip, sync_buffers=sync_buffers)
        check_number("refresh_every", refresh_every, minimum=1, integer=True)
        self.refresh_every = refresh_every
        self.optimizers: list[LowRankQHAdam] = list(optimizers)
        for opt in self.optimizers:
            opt.manages_bases = False  # this strategy changes them (every refresh_every steps)
        self.lowrank_sets = [[p for p, _ in opt.lowrank_params()] for opt in self.optimizers]
        ids = [{id(p) for p in low} for low in self.lowrank_sets]
        self.full_sets = [[p for p in w.params if id(p) not in ids[i]] for i, w in enumerate(self.workers)]

    @torch.no_grad()
    def refresh_bases(self) -> dict[str, float]:
        grads = [[grad_of(p).detach().clone() for p in low] for low in self.lowrank_sets]
        self.comm.all_reduce_mean(grads, tag="basis_gradient")
        opt0, low0 = self.optimizers[0], self.lowrank_sets[0]
        residual = residual_energy(grads[0], opt0, low0)
        overlaps = change_bases(self.optimizers, self.lowrank_sets, grads, shared=True)
        if residual is None or not overlaps:  # the initial bases: nothing to compare with
            return {}
        stats = {"basis_overlap": sum(overlaps) / len(overlaps), "residual_energy": residual}
        ef_ratio = error_feedback_ratio(opt0, low0, low0)
        if ef_ratio is not None:
            stats["error_feedback_norm"] = ef_ratio
        return stats

    def step(self, lr: float | None = None) -> dict[str, float]:
        self.set_lr(lr)
        self.grads()  # raises if backward was not called
        stats: dict[str, float] = {"grad_norm": self.clip()[0]}
        if self.steps_done % self.refresh_every == 0:
            stats.update(self.refresh_bases())
        projected = [opt.project_gradients(low) for opt, low in zip(self.optimizers, self.lowrank_sets)]
        payload = [proj + [grad_of(p) for p in full] for proj, full in zip(projected, self.full_sets)]
        self.comm.all_reduce_mean(payload, tag="projected_gradient")
        for opt, low, proj, full in zip(self.optimizers, self.lowrank_sets, projected, self.full_sets):
            opt.apply_lowrank(low, proj)
            opt.apply_full_rank(full)
            opt.zero_grad(set_to_none=True)
        self.average_buffers()
        self.steps_done += 1
        return stats

    def state_bytes(self) -> dict[str, int]:
        return self.optimizers[0].state_bytes()
