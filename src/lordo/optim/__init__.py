"""LoRDO's optimizer math: pure functions and a torch.optim.Optimizer. Imports torch.distributed only to step
parameters sharded by FSDP2 (``sharded.py``, when it meets one)."""

from .functional import lowrank_qh_adam, lowrank_qh_adam_update, qh_adam_update
from .hybrid import MuonAdamW, PrecisionMuon
from .lowrank import back_project, project, project_with_feedback, rotate_moments
from .muon import LowRankMuon, newton_schulz
from .optimizer import LowRankQHAdam
from .sharded import fsdp_placement
from .subspace import Side, captured_energy, check_rank, grad_of, overlap, side_of, subspace_iteration_basis, svd_basis

__all__ = [
    "LowRankMuon",
    "LowRankQHAdam",
    "MuonAdamW",
    "Side",
    "back_project",
    "captured_energy",
    "check_rank",
    "fsdp_placement",
    "grad_of",
    "lowrank_qh_adam",
    "newton_schulz",
    "PrecisionMuon",
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
