"""A parameter's optimizer state: created on first use, gathered into the lists the kernels take, its bytes, and
the conversions a loaded checkpoint needs.

:func:`group_lists` is the one place where the step turns a parameter sharded by FSDP2 (a DTensor) into this
rank's shard of it (optim/sharded.py): the kernels see plain tensors only, and a sharded group's lists carry what
its kernels need besides (each whole matrix's number of moment entries, the sum over the shards).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass

import torch

from . import compact, feedback
from .options import check_dense
from .sharded import is_sharded, local, sum_over_shards, whole
from .subspace import Side, grad_of, side_of, svd_basis


@dataclass
class Lists:
    """One group's parameters as the kernels take them."""

    params: list[torch.Tensor]  # as the caller holds them (DTensors, when sharded)
    weights: list[torch.Tensor]  # what this rank updates: a sharded parameter's shard
    grads: list[torch.Tensor]  # their gradients, likewise
    states: list[dict]
    sides: list[Side]  # low-rank groups only
    moment_numels: list[int] | None = None  # a whole matrix's moment entries, when some are shards
    sum_totals: Callable | None = None  # sums over the shards of each matrix, likewise


def group_lists(group: dict, params: list[torch.Tensor], state: MutableMapping, ensure: bool = True,
                second_moment: bool = True) -> Lists:
    """The lists the kernels take for ``params`` of ``group``, each parameter's state created on first use (a
    low-rank matrix's basis from its whole gradient); ``ensure=False``: the state exists (the step's second half)."""
    if ensure:
        ensure_state(group, params, state, second_moment)
    lowrank = group["rank"] is not None
    lists = Lists(params, [local(p) for p in params], [local(grad_of(p)) for p in params], [state[p] for p in params],
                  [side_of(p.shape) for p in params] if lowrank else [])
    if lowrank and any(is_sharded(p) for p in params):
        lists.moment_numels = [p.shape[0 if s == Side.RIGHT else 1] * group["rank"] for p, s in zip(params, lists.sides)]
        lists.sum_totals = functools.partial(sum_over_shards, params)
    return lists


def ensure_state(group: dict, params: list[torch.Tensor], state: MutableMapping, second_moment: bool = True) -> None:
    """Each parameter's state, created on first use (a low-rank matrix's basis from its whole gradient; its second
    moment unless ``second_moment`` is False: the Muon form keeps one moment)."""
    for p in params:
        check_dense(p)
        if group["rank"] is None and "step" not in state[p]:
            init_full_rank(state[p], p, group)
        elif group["rank"] is not None and "basis" not in state[p]:
            basis = svd_basis(whole(p, grad_of(p)), group["rank"])
            if basis is None:
                raise RuntimeError("could not compute an initial basis (SVD failed on the first gradient)")
            init_lowrank(state[p], p, group, basis, second_moment)


MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# moments_dtype (and lowrank_moments_dtype) "int8": the dynamic maps, √v rounded stochastically by table; "fp8": e4m3,
# √v rounded stochastically by arithmetic (optim/float8.py)
MOMENT_FORMATS = {"int8": {"exp_avg": compact.INT8, "exp_avg_sq": compact.UINT8},
                  "fp8": {"exp_avg": compact.FP8, "exp_avg_sq": compact.UFP8}}


def moment_formats(dtype: str | None) -> dict[str, compact.Format]:
    """The compact formats of the two moments under ``dtype`` (none for float32)."""
    return dict(MOMENT_FORMATS.get(dtype, {})) if isinstance(dtype, str) else {}


def ef_format(group: dict) -> compact.Format | None:
    """The compact format of ``group``'s error feedback (``error_feedback_dtype`` int8, int4 or fp8), else None."""
    dtype = group.get("error_feedback_dtype")
    return compact.BY_NAME[dtype] if isinstance(dtype, str) else None


# low-rank moments are r entries per row or column: a 128-wide matrix's at r = 16 are 2,048, worth holding compact
MIN_COMPACT_MOMENT_NUMEL = 1024


def moment_shape(p: torch.Tensor, rank: int) -> tuple[int, int]:
    """The shape of low-rank matrix ``p``'s moments at ``rank`` (this rank's shard's, when sharded)."""
    weight = local(p)
    return (weight.shape[0], rank) if side_of(p.shape) == Side.RIGHT else (rank, weight.shape[1])


def compact_formats(group: dict, p: torch.Tensor) -> dict[str, compact.Format]:
    """The state entries of ``p`` that ``group`` holds compact (none for tensors too small to gain)."""
    if group["rank"] is None:
        return moment_formats(group.get("moments_dtype")) if compact.worth_compacting(local(p).numel()) else {}
    out: dict[str, compact.Format] = {}
    rows, cols = moment_shape(p, group["rank"])
    if rows * cols >= MIN_COMPACT_MOMENT_NUMEL:
        out.update(moment_formats(group.get("lowrank_moments_dtype")))
    fmt = ef_format(group)
    if fmt is not None and group["error_feedback"] and compact.worth_compacting(local(p).numel()):
        out["error_feedback"] = fmt
    return out


def entry_shapes(group: dict, p: torch.Tensor) -> dict[str, tuple[int, ...]]:
    """The shape of each state entry of ``p`` that can be held compact."""
    shape = tuple(local(p).shape)
    moments = moment_shape(p, group["rank"]) if group["rank"] is not None else shape
    return {"exp_avg": moments, "exp_avg_sq": moments, "error_feedback": shape}


def init_full_rank(state: dict, p: torch.Tensor, group: dict | None = None) -> None:
    state["step"] = torch.zeros((), dtype=torch.float32)
    # float32 moments for a bf16/fp16 parameter: Adam's g² and ε underflow in half precision
    zeros = torch.zeros_like(local(p), dtype=torch.promote_types(p.dtype, torch.float32))
    formats = compact_formats(group, p) if group is not None else {}
    for key in ("exp_avg", "exp_avg_sq"):
        if key in formats:
            compact.store(state, key, zeros, formats[key], seed=0)
        else:
            state[key] = zeros if key == "exp_avg" else torch.zeros_like(zeros)


def init_lowrank(state: dict, p: torch.Tensor, group: dict, basis: torch.Tensor, second_moment: bool = True) -> None:
    param, formats = p, compact_formats(group, p)
    shape = moment_shape(p, group["rank"])  # a shard's state is its rows (right side) or columns (left)
    p = local(p)
    state["step"] = torch.zeros((), dtype=torch.float32)
    state["basis"] = basis.to(device=p.device, dtype=torch.float32).clone()  # never alias the caller's tensor
    # low-rank moments are small (r per row): float32 even for a bf16/fp16 matrix, where Adam's g² and ε would
    # underflow
    moment_dtype = torch.promote_types(p.dtype, torch.float32)
    for key in ("exp_avg", "exp_avg_sq") if second_moment else ("exp_avg",):
        zeros = torch.zeros(shape, dtype=moment_dtype, device=p.device)
        if key in formats:
            compact.store(state, key, zeros, formats[key], seed=0)
        else:
            state[key] = zeros
    if group["error_feedback"]:
        fmt = compact_formats(group, param).get("error_feedback")
        if fmt is not None:
            compact.store(state, "error_feedback", torch.zeros_like(p, dtype=torch.float32), fmt)
        else:  # float32 for a compact format's tensor too small to gain (optim/compact.py)
            dtype = group.get("error_feedback_dtype")
            state["error_feedback"] = torch.zeros_like(p, dtype=dtype if isinstance(dtype, torch.dtype) else
                                                       (p.dtype if dtype is None else torch.promote_types(p.dtype, torch.float32)))


def conform(state: dict, group: dict, p: torch.Tensor) -> None:
    """``p``'s state in the storage ``group`` asks for: entries a checkpoint saved in float32 held compact, compact
    ones expanded where the group keeps float32 (a run resumed with another ``moments_dtype`` or
    ``error_feedback_dtype``; the values carry over, rounded to the new format)."""
    wanted = compact_formats(group, p)
    shapes = entry_shapes(group, p)
    for key in ("exp_avg", "exp_avg_sq", "error_feedback"):
        if key in wanted and key in state and not compact.is_compact(state, key):
            if key == "error_feedback":  # E itself, not a deferred running sum; on a copy (a loaded state can alias
                state[key] = state[key].clone()  # the tensors of the state dict it came from)
                feedback.settle(state, side_of(p.shape))
            compact.store(state, key, state[key].float(), wanted[key], seed=0)
        elif compact.is_compact(state, key) and (saved := _saved_format(state, key, group)) != wanted.get(key):
            state[key] = compact.load(state, key, saved, shapes[key])  # expanded, then held in the format wanted if any
            state.pop(key + compact.CODES)
            state.pop(key + compact.SCALE)
            if key in wanted:
                compact.store(state, key, state[key], wanted[key], seed=0)
    dtype = group.get("error_feedback_dtype")
    if isinstance(dtype, torch.dtype) and isinstance(state.get("error_feedback"), torch.Tensor):
        if state["error_feedback"].dtype != dtype:  # a buffer saved in another precision: into this run's
            state["error_feedback"] = state["error_feedback"].clone()
            feedback.settle(state, side_of(p.shape))
            state["error_feedback"] = state["error_feedback"].to(dtype)


def _saved_format(state: dict, key: str, group: dict) -> compact.Format:
    """The format of a compact entry, from its key and its codes' dtype and size (moments in int8 or fp8; error
    feedback in int8, int4 or fp8)."""
    codes, scale = state[key + compact.CODES], state[key + compact.SCALE]
    float8 = codes.dtype == torch.float8_e4m3fn
    if key in MOMENT_KEYS:
        return MOMENT_FORMATS["fp8" if float8 else "int8"][key]
    if float8:
        return compact.FP8
    return compact.INT4 if codes.numel() * 2 == scale.numel() * compact.INT4.block else compact.INT8


def tensor_steps(state_dict: dict) -> dict:
    """A state whose ``step`` entries are numbers (older torch optimizers' format; torch's own
    test_load_nontensor_step) with them as the 0-d float32 tensors this optimizer keeps."""
    if not any("step" in s and not isinstance(s["step"], torch.Tensor) for s in state_dict.get("state", {}).values()):
        return state_dict
    state = {k: ({**s, "step": torch.tensor(float(s["step"]), dtype=torch.float32)}
                 if "step" in s and not isinstance(s["step"], torch.Tensor) else s)
             for k, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def restore_saved_dtypes(state: MutableMapping, params: Sequence[torch.Tensor], saved: dict) -> None:
    """Each loaded state tensor back at its saved dtype (torch's ``load_state_dict`` casts them to their
    parameter's)."""
    for index, entries in saved.items():
        own = state[params[int(index)]]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor) and own[key].dtype != value.dtype:
                own[key] = value.to(device=own[key].device, copy=True)


def state_bytes(groups: Sequence[dict], lowrank_moments: int = 2) -> dict[str, int]:
    """Bytes of state by category: low-rank moments, full-rank moments, bases, error feedback (this rank's shard of
    a sharded parameter: what this device holds)."""
    out = {"lowrank_moments": 0, "full_rank_moments": 0, "bases": 0, "error_feedback": 0}
    for group in groups:
        for param in group["params"]:
            p = local(param)
            itemsize = p.element_size()
            formats = compact_formats(group, param)
            if group["rank"] is None:
                out["full_rank_moments"] += sum(compact.nbytes(formats[k], p.numel()) if k in formats
                                                else p.numel() * max(itemsize, 4) for k in MOMENT_KEYS)
                continue
            r = group["rank"]
            big = p.shape[0] if side_of(param.shape) == Side.RIGHT else p.shape[1]
            out["lowrank_moments"] += sum(compact.nbytes(formats[k], big * r) if k in formats else big * r * max(itemsize, 4)
                                          for k in MOMENT_KEYS[:lowrank_moments])
            out["bases"] += min(param.shape) * r * 4  # the basis is whole on every rank
            if group["error_feedback"] and "error_feedback" in formats:
                out["error_feedback"] += compact.nbytes(formats["error_feedback"], p.numel())
            elif group["error_feedback"]:
                ef_dtype = group.get("error_feedback_dtype") or p.dtype
                ef_dtype = ef_dtype if isinstance(ef_dtype, torch.dtype) else torch.promote_types(p.dtype, torch.float32)
                out["error_feedback"] += feedback.state_bytes(p.numel(), big * r, ef_dtype, p.dtype, group)
    return out
