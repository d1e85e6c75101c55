"""LoRDO: local low-rank QH-Adam steps with error feedback, synchronised every K steps.

- ``lordo`` (LoRDO-Global): one basis per matrix for all workers, the top-r basis of the all-reduced
  pseudo-gradient at each sync; the low-rank moments are averaged and rotated into the new basis; each
  local step adds a full-rank quasi-hyperbolic term (weight 1 − ω) so the pseudo-gradient, and with it the
  next basis, can leave the current subspace.
- ``lordo-global-noqh``: the same with ω = 1, which stagnates in a fixed subspace (the paper's ablation).
- ``lordo-local``: each worker takes its basis from its own stochastic gradient at each sync; moments
  stay local.

The initial global basis comes from the first step's gradient, all-reduced once (counted in the ledger).
Bases are computed from identical inputs with a deterministic algorithm on every worker, so they agree
without a broadcast (a test checks this across gloo processes).
"""

from __future__ import annotations

import re

import torch

from ..errors import ConfigError
from ..model.params import ParamGroup
from ..optim import LowRankQHAdam, captured_energy, grad_of, overlap, svd_basis
from .local_adam import LocalUpdateStrategy


def split_lowrank(groups: list[ParamGroup], pattern: str, rank: int) -> tuple[list[dict], list[str]]:
    """Optimizer parameter groups: the 2-D parameters selected by ``pattern`` become low-rank at ``rank``.

    ``pattern`` is ``"auto"`` (the parameters of groups whose rule marks them as block matrices) or a regular
    expression searched in parameter names."""
    regex = None if pattern == "auto" else re.compile(pattern)

    def is_lowrank(group: ParamGroup, name: str, p: torch.Tensor) -> bool:
        return p.ndim == 2 and (group.rule.matrix if regex is None else regex.search(name) is not None)

    out, lowrank_names = [], []
    for g in groups:
        low = [(n, p) for n, p in zip(g.names, g.params) if is_lowrank(g, n, p)]
        full = [(n, p) for n, p in zip(g.names, g.params) if not is_lowrank(g, n, p)]
        for n, p in low:
            if rank > min(p.shape):
                raise ConfigError(
                    f"strategy.rank must be in [1, {min(p.shape)}] for {n} {tuple(p.shape)} (the smallest low-rank "
                    f"dimension), got {rank}; lower the rank or narrow strategy.lowrank_pattern"
                )
        if low:
            out.append({"params": [p for _, p in low], "rank": rank, "name": g.rule.group, "decay": g.rule.weight_decay})
            lowrank_names += [n for n, _ in low]
        if full:
            out.append({"params": [p for _, p in full], "rank": None, "name": g.rule.group, "decay": g.rule.weight_decay})
    if not lowrank_names:
        what = "no parameter group holds block matrices" if regex is None else f"{pattern!r} matches no 2-D parameter"
        raise ConfigError(f"strategy.lowrank_pattern: {what}; nothing would be trained low-rank")
    return out, lowrank_names


@torch.no_grad()
def error_feedback_ratio(opt: LowRankQHAdam, params: list[torch.Tensor], weights: list[torch.Tensor]) -> float | None:
    """Mean over low-rank matrices of ‖E‖/‖W‖ (None without error feedback): watches E's growth."""
    ratios = []
    for p, w in zip(params, weights, strict=True):
        error = opt.error_feedback(p)
        if error is not None:
            ratios.append(float(error.float().norm()) / max(float(w.float().norm()), 1e-12))
    return sum(ratios) / len(ratios) if ratios else None


def make_lowrank_optimizer(groups: list[ParamGroup], cfg, omega: float, error_feedback: bool | None = None) -> LowRankQHAdam:
    s, o = cfg.strategy, cfg.optim
    specs, _ = split_lowrank(groups, s.lowrank_pattern, s.rank)
    param_groups = [
        {
            "params": spec["params"],
            "rank": spec["rank"],
            "name": spec["name"],
            "weight_decay": o.weight_decay if spec["decay"] else 0.0,
        }
        for spec in specs
    ]
    return LowRankQHAdam(
        param_groups,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        omega=omega,
        error_feedback=s.error_feedback if error_feedback is None else error_feedback,
        qh_source=s.qh_source,
        basis_method=s.basis_method,
        basis_iterations=s.basis_iterations,
        error_feedback_after_qh=s.error_feedback_after_qh,
        error_feedback_dtype=getattr(torch, s.error_feedback_dtype),
    )


class LoRDOStrategy(LocalUpdateStrategy):
    optimizers: list[LowRankQHAdam]  # type: ignore[assignment]
    name = "lordo"
    default_average = "lowrank"
    projection = "global"

    def __init__(self, models, groups, cfg, comm) -> None:
        self.omega = self.fixed_omega if hasattr(self, "fixed_omega") else cfg.strategy.omega
        super().__init__(models, groups, cfg, comm)
        lowrank = {id(p) for p, _ in self.optimizers[0].lowrank_params()}
        self.lowrank_index = [i for i, p in enumerate(self.params[0]) if id(p) in lowrank]
        self._local_grads: list[list[torch.Tensor]] | None = None

    def make_optimizer(self, worker_groups) -> LowRankQHAdam:
        return make_lowrank_optimizer(worker_groups, self.cfg, self.omega)

    def lowrank(self, worker: int) -> list[torch.Tensor]:
        return [self.params[worker][i] for i in self.lowrank_index]

    def averaged_params(self, worker: int) -> list[torch.Tensor]:
        if self.average == "all":
            return self.params[worker]
        return self.lowrank(worker) if self.average == "lowrank" else []

    @torch.no_grad()
    def before_local_step(self) -> dict[str, float]:
        if self.projection == "global" and self.steps_done == 0:
            # the initial basis: the top-r basis of the first gradient, all-reduced once
            grads = [[grad_of(p).detach().clone() for p in self.lowrank(w)] for w in range(len(self.models))]
            self.comm.all_reduce_mean(grads, tag="initial_basis_gradient")
            for i, g in enumerate(grads[0]):
                basis = svd_basis(g, self.cfg.strategy.rank)
                if basis is None:
                    raise RuntimeError("SVD of the initial averaged gradient failed")
                for w, opt in enumerate(self.optimizers):
                    opt.set_basis(self.lowrank(w)[i], basis)
        elif self.projection == "local" and (self.steps_done + 1) % self.sync_every == 0:
            # lordo-local: the next bases come from each worker's own gradient at the sync step
            self._local_grads = [[grad_of(p).detach().clone() for p in self.lowrank(w)] for w in range(len(self.models))]
        return {}

    @torch.no_grad()
    def after_average(self, delta: list[torch.Tensor]) -> dict[str, float]:
        opt0 = self.optimizers[0]
        # worker 0's error feedback against the weights it belongs to (the anchor: the parameters hold Δ now)
        ef_ratio = error_feedback_ratio(opt0, self.lowrank(0), [self.anchor[i] for i in self.lowrank_index])
        overlaps, outside, energy = [], 0.0, 0.0
        for k, i in enumerate(self.lowrank_index):
            d = delta[i]
            p0 = self.params[0][i]
            old = opt0.state[p0]["basis"].clone()
            total = float(d.float().pow(2).sum())
            energy += total
            outside += total * (1 - captured_energy(d, old))
            if self.projection == "global":
                new = opt0.compute_basis(p0, d)
                if new is None:  # SVD failed: keep the old basis (warned)
                    overlaps.append(1.0)
                    continue
                for w, opt in enumerate(self.optimizers):
                    opt.set_basis(self.lowrank(w)[k], new)
            elif self._local_grads is None:  # a final sync off the K-grid: no next round, keep the bases
                overlaps.append(1.0)
                continue
            else:
                for w, opt in enumerate(self.optimizers):
                    opt.refresh_basis(self.lowrank(w)[k], self._local_grads[w][k])
                new = opt0.state[p0]["basis"]
            overlaps.append(overlap(new, old))
        self._local_grads = None
        stats = {
            "basis_overlap": sum(overlaps) / len(overlaps),
            "residual_energy": outside / energy if energy > 0 else 0.0,
        }
        if ef_ratio is not None:
            stats["error_feedback_norm"] = ef_ratio
        return stats

    def optimizer_bytes(self) -> dict[str, int]:
        return self.optimizers[0].state_bytes()


class LoRDOGlobalNoQHStrategy(LoRDOStrategy):
    name = "lordo-global-noqh"
    fixed_omega = 1.0


class LoRDOLocalStrategy(LoRDOStrategy):
    name = "lordo-local"
    default_average = "none"
    projection = "local"


