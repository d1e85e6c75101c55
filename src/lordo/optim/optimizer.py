"""``LowRankQHAdam``: LoRDO's local optimizer as a ``torch.optim.Optimizer``.

Parameter groups with ``rank`` set keep rank-r Adam moments in a basis of each matrix, with error feedback
and a full-rank quasi-hyperbolic term; groups with ``rank=None`` take full-rank QHAdam. Usable on its own
in a single process: the basis of a matrix is taken from its first gradient unless the caller sets one
(``set_basis``, which rotates the moments). State is tensors only, so ``state_dict()`` round-trips through
``torch.load(..., weights_only=True)``; LR schedulers work through ``param_groups`` as usual.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .functional import lowrank_qh_adam_update, qh_adam_update
from .lowrank import back_project, project_with_feedback, rotate_moments
from .subspace import check_rank, grad_of, side_of, subspace_iteration_basis, svd_basis

QH_SOURCES = ("grad", "grad+error")
BASIS_METHODS = ("svd", "subspace")


class LowRankQHAdam(torch.optim.Optimizer):
    """LoRDO's local optimizer for one process: low-rank QH-Adam with error feedback.

    Parameter groups with an integer ``rank`` hold 2-D matrices whose moments live in a rank-r subspace
    (the smaller side is compressed): each step projects G + E (E: error feedback of what earlier
    projections dropped), updates the low-rank moments and applies
    ``ω·back(û/D) + (1 − ω)·G/mean(D)``; the ``1 − ω`` full-rank term lets the weights, and so the next
    basis, leave the subspace. Groups with ``rank=None`` take full-rank QHAdam with the same ω. A matrix's
    basis comes from its first gradient unless set; :meth:`refresh_basis` / :meth:`set_basis` change it and
    rotate the moments (LDAdam). ``omega=1`` is plain low-rank Adam; ``omega=1, rank=None`` is AdamW.
    ``basis_method``: ``svd`` (exact) or ``subspace`` (warm-started subspace iteration).
    ``qh_source``: ``grad`` (G, the paper) or ``grad+error`` (G + E) in the full-rank term.
    ``error_feedback_dtype``: dtype of the error-feedback buffers (default: the parameter's); bfloat16
    halves them, while G + E is still formed in the parameter's precision each step.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        omega: float = 0.98,
        rank: int | None = None,
        error_feedback: bool = True,
        qh_source: str = "grad",
        basis_method: str = "svd",
        error_feedback_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            omega=omega,
            rank=rank,
            error_feedback=error_feedback,
            qh_source=qh_source,
            basis_method=basis_method,
            error_feedback_dtype=error_feedback_dtype,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_group(group)

    @staticmethod
    def _check_group(group: dict) -> None:
        if not group["lr"] >= 0:
            raise ValueError(f"lr must be >= 0, got {group['lr']}")
        b1, b2 = group["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {group['betas']}")
        if not group["eps"] > 0:
            raise ValueError(f"eps must be > 0, got {group['eps']}")
        if not 0 <= group["omega"] <= 1:
            raise ValueError(f"omega must be in [0, 1], got {group['omega']}")
        if group["qh_source"] not in QH_SOURCES:
            raise ValueError(f"qh_source must be one of {QH_SOURCES}, got {group['qh_source']!r}")
        if group["basis_method"] not in BASIS_METHODS:
            raise ValueError(f"basis_method must be one of {BASIS_METHODS}, got {group['basis_method']!r}")
        if group["rank"] is not None:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"a low-rank group (rank={group['rank']}) takes 2-D matrices only, got shape {tuple(p.shape)}")
                check_rank(group["rank"], tuple(p.shape))

    # ---------------------------------------------------------------------------------------------------
    # bases

    def lowrank_params(self) -> list[tuple[torch.Tensor, dict]]:
        return [(p, g) for g in self.param_groups if g["rank"] is not None for p in g["params"]]

    def _group_of(self, param: torch.Tensor) -> dict:
        # cached per identity of the group dicts and their sizes: add_param_group and load_state_dict (which
        # replaces the dicts) rebuild it
        key = tuple((id(g), len(g["params"])) for g in self.param_groups)
        cached = self.__dict__.get("_group_index")
        if cached is None or cached[0] != key:
            cached = (key, {id(p): g for g in self.param_groups for p in g["params"]})
            self.__dict__["_group_index"] = cached
        group = cached[1].get(id(param))
        if group is None:
            raise KeyError("parameter is not managed by this optimizer")
        return group

    def _init_lowrank_state(self, p: torch.Tensor, group: dict, basis: torch.Tensor) -> dict:
        state = self.state[p]
        r = group["rank"]
        shape = (p.shape[0], r) if side_of(p.shape) == "right" else (r, p.shape[1])
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["basis"] = basis.to(device=p.device, dtype=torch.float32).clone()  # never alias the caller's tensor
        state["exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        if group["error_feedback"]:
            state["error_feedback"] = torch.zeros_like(p, dtype=group.get("error_feedback_dtype") or p.dtype)
        return state

    def compute_basis(self, p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor | None:
        """The new basis of ``p`` from ``matrix`` (same shape) by the group's method; None if it failed."""
        group = self._group_of(p)
        previous = self.state[p].get("basis")
        if group["basis_method"] == "subspace":
            return subspace_iteration_basis(matrix, group["rank"], previous)
        return svd_basis(matrix, group["rank"])

    @torch.no_grad()
    def set_basis(self, p: torch.Tensor, basis: torch.Tensor) -> None:
        """Use ``basis`` for ``p`` from now on, rotating its moments from the old basis (LDAdam)."""
        group = self._group_of(p)
        side = side_of(p.shape)
        expected = (p.shape[1] if side == "right" else p.shape[0], group["rank"])
        if tuple(basis.shape) != expected:
            raise ValueError(f"basis for a {tuple(p.shape)} matrix at rank {group['rank']} must be {expected}, got {tuple(basis.shape)}")
        state = self.state[p]
        if "basis" not in state:
            self._init_lowrank_state(p, group, basis)
            return
        new = basis.to(device=p.device, dtype=torch.float32)
        b1, b2 = group["betas"]
        rotate_moments(state["exp_avg"], state["exp_avg_sq"], state["basis"], new, side, int(state["step"]), b1, b2)
        state["basis"].copy_(new)

    def refresh_basis(self, p: torch.Tensor, matrix: torch.Tensor) -> bool:
        """Recompute p's basis from ``matrix`` and rotate the moments; False (basis kept) if it failed."""
        basis = self.compute_basis(p, matrix)
        if basis is None:
            return False
        self.set_basis(p, basis)
        return True

    # ---------------------------------------------------------------------------------------------------
    # the step, in two halves so that a strategy can all-reduce the projected gradients in between

    @torch.no_grad()
    def project_gradient(self, p: torch.Tensor) -> torch.Tensor:
        """g = proj(G + E) for a low-rank matrix, updating its error feedback; creates the state (basis from
        this gradient) on first use."""
        group = self._group_of(p)
        if "basis" not in self.state[p]:
            basis = svd_basis(grad_of(p), group["rank"])
            if basis is None:
                raise RuntimeError("could not compute an initial basis (SVD failed on the first gradient)")
            self._init_lowrank_state(p, group, basis)
        state = self.state[p]
        return project_with_feedback(grad_of(p), state.get("error_feedback"), state["basis"], side_of(p.shape))

    @torch.no_grad()
    def apply_lowrank(self, p: torch.Tensor, g: torch.Tensor, qh_grad: torch.Tensor | None = None) -> None:
        """Moment update and weight update of a low-rank matrix from its projected gradient ``g``.

        ``qh_grad`` defaults to the group's source: G, or G+E (error feedback after this step's update
        plus back(g))."""
        group = self._group_of(p)
        state = self.state[p]
        state["step"] += 1
        if qh_grad is None and group["omega"] < 1:
            qh_grad = p.grad
            if group["qh_source"] == "grad+error" and "error_feedback" in state:
                # A = G + E_before = E_after + back(g)
                qh_grad = state["error_feedback"] + back_project(g, state["basis"], side_of(p.shape))
        b1, b2 = group["betas"]
        lowrank_qh_adam_update(
            p, g, qh_grad, state["exp_avg"], state["exp_avg_sq"], state["basis"], side_of(p.shape), int(state["step"]),
            group["lr"], b1, b2, group["eps"], group["weight_decay"], group["omega"],
        )

    @torch.no_grad()
    def apply_full_rank(self, p: torch.Tensor) -> None:
        group = self._group_of(p)
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        b1, b2 = group["betas"]
        qh_adam_update(
            p, grad_of(p), state["exp_avg"], state["exp_avg_sq"], int(state["step"]),
            group["lr"], b1, b2, group["eps"], group["weight_decay"], group["omega"],
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["rank"] is None:
                    self.apply_full_rank(p)
                else:
                    self.apply_lowrank(p, self.project_gradient(p))
        return loss

    # ---------------------------------------------------------------------------------------------------
    # accounting

    def state_bytes(self) -> dict[str, int]:
        """Bytes of state by category: low-rank moments, full-rank moments, bases, error feedback."""
        out = {"lowrank_moments": 0, "full_rank_moments": 0, "bases": 0, "error_feedback": 0}
        for group in self.param_groups:
            for p in group["params"]:
                itemsize = p.element_size()
                if group["rank"] is None:
                    out["full_rank_moments"] += 2 * p.numel() * itemsize
                    continue
                r = group["rank"]
                big = p.shape[0] if side_of(p.shape) == "right" else p.shape[1]
                out["lowrank_moments"] += 2 * big * r * itemsize
                out["bases"] += min(p.shape) * r * 4
                if group["error_feedback"]:
                    ef_dtype = group.get("error_feedback_dtype") or p.dtype
                    out["error_feedback"] += p.numel() * torch.empty((), dtype=ef_dtype).element_size()
        return out
