"""Local-update strategies: K local optimizer steps per worker, then the workers average.

At a synchronisation every worker sends its pseudo-gradient Δ_m = θ_anchor − θ_m; with the mean Δ the
outer step is θ_new = θ_anchor − η_out·Δ (η_out = 1 is plain model averaging; an optional outer SGD
momentum, Nesterov by default, as in DiLoCo), and every worker restarts from θ_new. Optimizer moments can
be averaged too, at every sync or with periods of their own (DES-LOC).

``local-adam`` uses AdamW as the local optimizer; LoRDO's strategies (``lordo.py``) reuse this class.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import NonFiniteError
from .base import Strategy, make_adamw, tensor_bytes


class LocalUpdateStrategy(Strategy):
    default_average = "none"  # which moments strategy.average_moments = "auto" averages

    def __init__(self, models, groups, cfg, comm) -> None:
        super().__init__(models, groups, cfg, comm)
        s = cfg.strategy
        self.sync_every, self.outer_lr = s.sync_every, s.outer_lr
        self.momentum, self.nesterov = s.outer_momentum, s.outer_nesterov
        self.average = self.default_average if s.average_moments == "auto" else s.average_moments
        self.moment_periods = {"exp_avg": s.sync_exp_avg_every, "exp_avg_sq": s.sync_exp_avg_sq_every}
        self.optimizers = [self.make_optimizer(worker_groups) for worker_groups in groups]
        # the anchor (last synchronised model) and the outer momentum are the same on every worker:
        # one copy per process
        self.anchor = [p.detach().clone() for p in self.params[0]]
        self.outer_momentum = [torch.zeros_like(p) for p in self.anchor] if self.momentum > 0 else []
        self.syncs = 0

    def make_optimizer(self, worker_groups) -> torch.optim.Optimizer:
        return make_adamw(worker_groups, self.cfg.optim)

    def averaged_params(self, worker: int) -> list[torch.Tensor]:
        """Parameters whose optimizer moments are averaged (``self.average`` = none | lowrank | all)."""
        return self.params[worker] if self.average == "all" else []

    def before_local_step(self) -> dict[str, float]:
        """Hook: runs after backward, before any local optimizer step (gradients are in ``.grad``)."""
        return {}

    def after_average(self, delta: list[torch.Tensor]) -> dict[str, float]:
        """Hook: runs at a sync with the averaged pseudo-gradient ``delta`` (ordered like ``self.params[0]``)."""
        return {}

    def step(self, lr: float) -> dict[str, float]:
        stats = self.before_local_step()
        norms = self.clip_and_step(lr)
        stats["grad_norm"] = norms[0]
        sync_due = self.steps_done % self.sync_every == 0
        self.average_moments(sync_due)
        if sync_due:
            stats.update(self.synchronise())
        return stats

    def average_moments(self, sync_due: bool) -> None:
        if self.average == "none":
            return
        for key, period in self.moment_periods.items():
            if (self.steps_done % period == 0) if period else sync_due:
                moments = [
                    [opt.state[p][key] for p in self.averaged_params(w)] for w, opt in enumerate(self.optimizers)
                ]
                if moments[0]:
                    self.comm.all_reduce_mean(moments, tag=key)

    def finish(self) -> dict[str, float]:
        return self.synchronise() if self.steps_done % self.sync_every else {}

    @torch.no_grad()
    def synchronise(self) -> dict[str, float]:
        # each worker's parameters become its pseudo-gradient in place (they are overwritten below anyway)
        for params in self.params:
            for p, a in zip(params, self.anchor):
                p.sub_(a).neg_()
        pseudo = [[p.data for p in params] for params in self.params]
        self.comm.all_reduce_mean(pseudo, tag="pseudo_gradient")
        delta = pseudo[0]
        if not all(bool(torch.isfinite(d).all()) for d in delta):
            raise NonFiniteError(
                f"the averaged pseudo-gradient is not finite at synchronisation {self.syncs + 1} (after optimizer "
                f"step {self.steps_done})"
            )
        stats = {"synced": 1.0, "pseudo_grad_norm": float(torch.nn.utils.get_total_norm(delta))}
        stats.update(self.after_average(delta))
        if self.momentum > 0:
            for buf, d in zip(self.outer_momentum, delta):
                buf.mul_(self.momentum).add_(d)
            direction = (
                [d + self.momentum * b for d, b in zip(delta, self.outer_momentum)] if self.nesterov else self.outer_momentum
            )
        else:
            direction = delta
        for a, d in zip(self.anchor, direction):
            a.sub_(d, alpha=self.outer_lr)
        for params in self.params:
            for p, a in zip(params, self.anchor):
                p.copy_(a)
        self.syncs += 1
        return stats

    def shared_state(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "syncs": self.syncs,
            "anchor": [a.clone() for a in self.anchor],
            "outer_momentum": [b.clone() for b in self.outer_momentum],
        }

    def load_shared_state(self, state: dict[str, Any]) -> None:
        self.steps_done, self.syncs = int(state["steps_done"]), int(state["syncs"])
        for a, s in zip(self.anchor, state["anchor"], strict=True):
            a.copy_(s)
        for b, s in zip(self.outer_momentum, state["outer_momentum"], strict=True):
            b.copy_(s)

    def step_payload_bytes(self) -> int:
        return tensor_bytes(self.params[0])

    def optimizer_bytes(self) -> dict[str, int]:
        return {"full_rank_moments": 2 * tensor_bytes(self.params[0])}

    def state_bytes(self) -> dict[str, int]:
        out = self.optimizer_bytes()
        out["anchor"] = tensor_bytes(self.anchor)
        if self.outer_momentum:
            out["outer_momentum"] = tensor_bytes(self.outer_momentum)
        return out


class LocalAdamStrategy(LocalUpdateStrategy):
    name = "local-adam"
