"""``lowrank-ddp``: synchronous low-rank Adam (GaLore-style DDP), the paper's strongest low-rank baseline.

Every step each worker projects its gradient (plus its error feedback) onto the shared basis and the
projected gradients are all-reduced together with the full gradients of the full-rank parameters. Every K
steps (and before the first) one full gradient of the low-rank matrices is all-reduced to refresh the
basis (top-r, moments rotated). There is no full-rank QH term (it would need the full gradient): ω = 1.
"""

from __future__ import annotations

import torch

from ..optim import LowRankQHAdam, captured_energy, grad_of, overlap
from .base import Strategy, clip_gradients, tensor_bytes
from .lordo import error_feedback_ratio, make_lowrank_optimizer


class LowRankDDPStrategy(Strategy):
    optimizers: list[LowRankQHAdam]  # type: ignore[assignment]
    name = "lowrank-ddp"

    def __init__(self, models, groups, cfg, comm) -> None:
        super().__init__(models, groups, cfg, comm)
        self.refresh_every = cfg.strategy.sync_every
        self.optimizers = [make_lowrank_optimizer(g, cfg, omega=1.0) for g in groups]
        self.lowrank_sets = [[p for p, _ in opt.lowrank_params()] for opt in self.optimizers]
        ids = [{id(p) for p in low} for low in self.lowrank_sets]
        self.full_sets = [[p for p in params if id(p) not in ids[w]] for w, params in enumerate(self.params)]

    @torch.no_grad()
    def refresh_bases(self) -> dict[str, float]:
        grads = [[grad_of(p).detach().clone() for p in low] for low in self.lowrank_sets]
        self.comm.all_reduce_mean(grads, tag="basis_gradient")
        opt0 = self.optimizers[0]
        overlaps, outside, energy = [], 0.0, 0.0
        for k, g in enumerate(grads[0]):
            p0 = self.lowrank_sets[0][k]
            old = opt0.state[p0]["basis"].clone() if "basis" in opt0.state[p0] else None
            new = opt0.compute_basis(p0, g)
            if new is None:
                continue
            if old is not None:
                total = float(g.float().pow(2).sum())
                energy += total
                outside += total * (1 - captured_energy(g, old))
                overlaps.append(overlap(new, old))
            for w, opt in enumerate(self.optimizers):
                opt.set_basis(self.lowrank_sets[w][k], new)
        if not overlaps:
            return {}
        stats = {"basis_overlap": sum(overlaps) / len(overlaps), "residual_energy": outside / energy if energy else 0.0}
        ef_ratio = error_feedback_ratio(opt0, self.lowrank_sets[0], self.lowrank_sets[0])
        if ef_ratio is not None:
            stats["error_feedback_norm"] = ef_ratio
        return stats

    def step(self, lr: float) -> dict[str, float]:
        self.grads()  # raises if backward was not called
        norms = [clip_gradients(params, self.cfg.optim.grad_clip) for params in self.params]
        stats: dict[str, float] = {"grad_norm": norms[0]}
        if self.steps_done % self.refresh_every == 0:
            stats.update(self.refresh_bases())
        projected = [opt.project_gradients(low) for opt, low in zip(self.optimizers, self.lowrank_sets)]
        payload = [proj + [grad_of(p) for p in full] for proj, full in zip(projected, self.full_sets)]
        self.comm.all_reduce_mean(payload, tag="projected_gradient")
        for w, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.apply_lowrank_many(self.lowrank_sets[w], projected[w])
            opt.apply_full_rank_many(self.full_sets[w])
            opt.zero_grad(set_to_none=True)
        self.steps_done += 1
        return stats

    def step_payload_bytes(self) -> int:
        return tensor_bytes(self.params[0])

    def state_bytes(self) -> dict[str, int]:
        return self.optimizers[0].state_bytes()
