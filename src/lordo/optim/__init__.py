"""LoRDO's optimizer math: pure functions and a torch.optim.Optimizer. Never imports torch.distributed."""

from .functional import lowrank_qh_adam_update, qh_adam_update
from .lowrank import back_project, project, project_with_feedback, rotate_moments
from .optimizer import LowRankQHAdam
from .subspace import captured_energy, check_rank, grad_of, overlap, side_of, subspace_iteration_basis, svd_basis

__all__ = [
    "LowRankQHAdam",
    "back_project",
    "captured_energy",
    "check_rank",
    "grad_of",
    "lowrank_qh_adam_update",
    "overlap",
    "project",
    "project_with_feedback",
    "qh_adam_update",
    "rotate_moments",
    "side_of",
    "subspace_iteration_basis",
    "svd_basis",
]
