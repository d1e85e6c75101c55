"""The bases of :class:`~lordo.optim.LowRankQHAdam`'s low-rank matrices: computed (exact SVD or warm-started
subspace iteration), set with the moments rotated into them (LDAdam's rotation), refreshed on GaLore's schedule.
A mixin: the optimizer's state, groups and planner are :class:`LowRankQHAdam`'s."""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

import torch

from . import feedback
from .compact_step import ROTATED
from .lowrank import rotate_moments
from .state import init_lowrank
from .subspace import Side, grad_of, side_of, subspace_iteration_basis, svd_basis

# a basis that no one changed for this many steps, with update_proj_gap = None, is probably a forgotten refresh
FIXED_BASIS_WARNING_STEPS = 1000


class BasisMethods:
    """Basis handling of :class:`~lordo.optim.LowRankQHAdam` (see the module doc)."""

    if TYPE_CHECKING:  # what the optimizer it is mixed into provides
        state: Any
        manages_bases: bool
        _bases_changed: bool
        _warned_fixed_basis: bool
        _SECOND_MOMENT: bool

        def _group_of(self, p: torch.Tensor) -> dict: ...

        def whole(self, p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor: ...

        def _expanded(self, group: dict, p: torch.Tensor, keys: tuple[str, ...] | None = None,
                      salt: int = 0) -> contextlib.AbstractContextManager: ...

    def compute_basis(self, p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor | None:
        """The new basis of ``p`` from ``matrix`` (same shape; for a sharded parameter, this rank's shard of it:
        the shards are gathered) by the group's method; None if it failed."""
        group = self._group_of(p)
        matrix = self.whole(p, matrix)
        if group["basis_method"] == "subspace":
            previous = self.state[p].get("basis")
            return subspace_iteration_basis(matrix, group["rank"], previous, iters=group["basis_iterations"])
        return svd_basis(matrix, group["rank"])

    @torch.no_grad()
    def set_basis(self, p: torch.Tensor, basis: torch.Tensor) -> None:
        """Use ``basis`` for ``p`` from now on, rotating its moments from the old basis (LDAdam)."""
        group, side = self._group_of(p), side_of(p.shape)
        expected = (p.shape[1] if side == Side.RIGHT else p.shape[0], group["rank"])
        if tuple(basis.shape) != expected:
            raise ValueError(f"basis for a {tuple(p.shape)} matrix at rank {group['rank']} must be {expected}, got {tuple(basis.shape)}")
        new = basis.to(device=p.device, dtype=torch.float32)
        deviation = float((new.T @ new - torch.eye(new.shape[1], device=new.device)).abs().max())
        if not deviation <= 1e-3:  # NaN fails too
            raise ValueError(f"a basis must have orthonormal columns (max |PᵀP − I| = {deviation:.3g})")
        state = self.state[p]
        if "basis" not in state:
            init_lowrank(state, p, group, new, self._SECOND_MOMENT)
            return
        self._bases_changed = True
        feedback.settle(state, side)  # E in the old basis
        with self._expanded(group, p, ("exp_avg", "exp_avg_sq"), ROTATED):  # moments held compact: in float32
            self._rotate(state, group, new, side)
        state["basis"].copy_(new)

    def _rotate(self, state: dict, group: dict, new: torch.Tensor, side: Side) -> None:
        """The low-rank moments from the basis in ``state`` into ``new`` (LDAdam's rotation)."""
        b1, b2 = group["betas"]
        rotate_moments(state["exp_avg"], state["exp_avg_sq"], state["basis"], new, side, int(state["step"]), b1, b2)

    def refresh_basis(self, p: torch.Tensor, matrix: torch.Tensor) -> bool:
        """Recompute p's basis from ``matrix`` and rotate the moments; False (basis kept) if it failed."""
        basis = self.compute_basis(p, matrix)
        if basis is None:
            return False
        self.set_basis(p, basis)
        return True

    def _warn_fixed_basis(self) -> None:
        if not self.manages_bases or self._bases_changed or self._warned_fixed_basis:
            return  # a strategy (or the caller) changes the bases: nothing forgotten
        self._warned_fixed_basis = True
        warnings.warn(f"LowRankQHAdam: no basis has changed in {FIXED_BASIS_WARNING_STEPS} steps: with update_proj_gap="
                      "None (the default) the low-rank bases stay those of the first gradient unless you call "
                      "refresh_basis / set_basis; pass update_proj_gap=200 (GaLore's default) to recompute them from "
                      "the gradient every 200 steps", RuntimeWarning, stacklevel=4)

    def _refresh_on_schedule(self, group: dict, params: list[torch.Tensor]) -> None:
        """GaLore's schedule: a new basis from this step's gradient every ``update_proj_gap`` steps of a matrix."""
        if group["update_proj_gap"] is None and (not self.manages_bases or self._bases_changed or self._warned_fixed_basis):
            return  # nothing to refresh, nothing to warn about: no host read of every matrix's step count
        for p in params:
            state = self.state[p]
            if "basis" not in state:
                continue
            if group["update_proj_gap"] and int(state["step"]) % group["update_proj_gap"] == 0:
                self.refresh_basis(p, grad_of(p))
            elif group["update_proj_gap"] is None and int(state["step"]) == FIXED_BASIS_WARNING_STEPS:
                self._warn_fixed_basis()
