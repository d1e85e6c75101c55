"""The options of a :class:`~lordo.optim.LowRankQHAdam` parameter group: their allowed values and the checks that
refuse anything else by name (a bad group is never added)."""

from __future__ import annotations

import torch

from .sharded import check_sharding
from .subspace import check_rank, grad_of

QH_SOURCES = ("grad", "grad+error")
AFTER_QH = ("keep", "remove")
BASIS_METHODS = ("svd", "subspace")
LOWRANK_TERMS = ("adam", "momentum")
GALORE_PROJ_TYPES = ("std",)
EXECUTION = ("batched", "compile")  # group options that choose how the step runs, not what it computes
# group options that choose how the state is stored
STORAGE = ("error_feedback_dtype", "moments_dtype", "lowrank_moments_dtype")

# torch.optim's flags: what they ask for is refused by name where this optimizer does not do it (its kernels are
# chosen by the group options batched / compile), accepted where it is a no-op
TORCH_FLAGS = {"foreach": (None, False, True), "fused": (None, False), "capturable": (False,),
               "differentiable": (False,), "maximize": (False,)}
_FLAG_HINTS = {"maximize": "negate the loss instead", "fused": "use batched=True / compile=True",
               "capturable": "CUDA graphs are not supported", "differentiable": "the step is not differentiable"}
_CHOICES = {"qh_source": QH_SOURCES, "basis_method": BASIS_METHODS, "lowrank_term": LOWRANK_TERMS,
            "error_feedback_after_qh": AFTER_QH}


def check_group(group: dict) -> None:
    """Raise ValueError naming the first option of ``group`` outside its allowed values; fills GaLore's keys'
    defaults in."""
    _check_torch_flags(group)
    _check_numbers(group)
    _check_galore_keys(group)
    _check_storage(group)
    for key, allowed in _CHOICES.items():
        if group[key] not in allowed:
            raise ValueError(f"{key} must be one of {allowed}, got {group[key]!r}")
    _check_execution(group)
    for p in group["params"]:
        check_sharding(p, lowrank=group["rank"] is not None)
    if group["rank"] is not None:
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"a low-rank group (rank={group['rank']}) takes 2-D matrices only, got shape {tuple(p.shape)}")
            check_rank(group["rank"], tuple(p.shape))


def check_dense(p: torch.Tensor) -> None:
    if grad_of(p).is_sparse:
        raise ValueError(f"LowRankQHAdam does not take sparse gradients (a parameter of shape {tuple(p.shape)}); "
                         "use nn.Embedding(..., sparse=False)")


def _check_torch_flags(group: dict) -> None:
    for key, allowed in TORCH_FLAGS.items():
        if key in group and group[key] not in allowed:
            raise ValueError(f"{key}={group[key]!r} is not supported by LowRankQHAdam ({_FLAG_HINTS.get(key, '')}); "
                             f"allowed: {', '.join(map(repr, allowed))}")


def _check_numbers(group: dict) -> None:
    if isinstance(group["lr"], torch.Tensor) and group["lr"].numel() != 1:
        raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape {tuple(group['lr'].shape)}")
    if not group["lr"] >= 0:
        raise ValueError(f"lr must be >= 0, got {group['lr']}")
    if not group["weight_decay"] >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    b1, b2 = group["betas"]
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"betas must be in [0, 1), got {group['betas']}")
    if not group["eps"] > 0:
        raise ValueError(f"eps must be > 0, got {group['eps']}")
    if not 0 <= group["omega"] <= 1:
        raise ValueError(f"omega must be in [0, 1], got {group['omega']}")
    iters = group["basis_iterations"]
    if not (isinstance(iters, int) and not isinstance(iters, bool) and iters >= 1):
        raise ValueError(f"basis_iterations must be an integer >= 1, got {iters!r}")


def _check_galore_keys(group: dict) -> None:
    """GaLore's group keys, with GaLore's meaning: ``update_proj_gap`` (recompute the basis from the gradient
    every N steps of the matrix), ``scale`` (factor on the low-rank update), ``proj_type`` (only ``std``, the
    side rule used here: compress the smaller side)."""
    gap = group.setdefault("update_proj_gap", None)
    if gap is not None and not (isinstance(gap, int) and not isinstance(gap, bool) and gap >= 1):
        raise ValueError(f"update_proj_gap must be None or an integer >= 1, got {gap!r}")
    scale = group.setdefault("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a number > 0, got {scale!r}")
    proj_type = group.setdefault("proj_type", "std")
    if proj_type not in GALORE_PROJ_TYPES:
        raise ValueError(f"proj_type {proj_type!r} is not supported: LowRankQHAdam compresses the smaller side of each "
                         f"matrix (GaLore's 'std'); use proj_type='std' or leave it out")


EF_DTYPES = (None, torch.float32, torch.float64, torch.bfloat16, torch.float16, "int8", "int4", "fp8")
MOMENTS_DTYPES = (None, "float32", "int8", "fp8")


def _check_storage(group: dict) -> None:
    """``error_feedback_dtype``, ``moments_dtype`` and ``lowrank_moments_dtype``: how E, the full-rank moments and the
    low-rank moments are stored."""
    ef = group.setdefault("error_feedback_dtype", None)
    if ef not in EF_DTYPES:
        raise ValueError(f"error_feedback_dtype must be one of None, torch.float32, torch.float64, torch.bfloat16, "
                         f"torch.float16, 'int8', 'int4' or 'fp8', got {ef!r}")
    moments = group.setdefault("moments_dtype", None)
    if moments not in MOMENTS_DTYPES:
        raise ValueError(f"moments_dtype must be None, 'float32', 'int8' or 'fp8' (the full-rank groups' Adam moments), "
                         f"got {moments!r}")
    if moments == "float32":
        group["moments_dtype"] = None
    lowrank = group.setdefault("lowrank_moments_dtype", None)
    if lowrank not in MOMENTS_DTYPES:
        raise ValueError(f"lowrank_moments_dtype must be None, 'float32', 'int8' or 'fp8' (the low-rank matrices' moments), "
                         f"got {lowrank!r}")
    if lowrank == "float32":
        group["lowrank_moments_dtype"] = None
    if lowrank in ("int8", "fp8") and group.get("compile"):
        raise ValueError(f"lowrank_moments_dtype={lowrank!r} steps each matrix alone (its moments expanded meanwhile): "
                         "compile=True compiles the batched step; leave compile=False")
    if isinstance(ef, str) and group.get("compile"):
        raise ValueError(f"error_feedback_dtype={ef!r} steps each matrix alone (its E expanded meanwhile): compile=True "
                         "compiles the batched step; leave compile=False")


def _check_execution(group: dict) -> None:
    if group["batched"] not in (None, True, False):
        raise ValueError(f"batched must be None (batch the low-rank step on accelerators, not on the CPU), True or "
                         f"False, got {group['batched']!r}")
    if group["compile"] not in (True, False):
        raise ValueError(f"compile must be True or False, got {group['compile']!r}")
    if group["compile"] and group["batched"] is False:
        raise ValueError("compile=True compiles the batched step: it needs batched=True or None, got batched=False")


def runs_batched(group: dict, p: torch.Tensor, sharded: bool) -> bool:
    """Whether the low-rank step of ``p`` takes the batched path: the group's ``batched`` (None: on accelerators, or
    when compiled); never for a sharded matrix or compact error feedback or low-rank moments (stepped one matrix at a
    time)."""
    choice = group.get("batched")  # absent in state dicts saved before it existed
    default = p.device.type != "cpu" or bool(group.get("compile"))
    compact = (isinstance(group.get("error_feedback_dtype"), str) and group["error_feedback"]) or bool(
        group.get("lowrank_moments_dtype"))
    return (default if choice is None else choice) and not sharded and not compact
