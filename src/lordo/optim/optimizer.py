"""``LowRankQHAdam``: LoRDO's local optimizer as a ``torch.optim.Optimizer``.

Parameter groups with ``rank`` set keep rank-r Adam moments in a basis of each matrix, with error feedback
and a full-rank quasi-hyperbolic term; groups with ``rank=None`` take full-rank QHAdam. Usable on its own
in a single process: the basis of a matrix is taken from its first gradient unless the caller sets one
(``set_basis``, which rotates the moments). State is tensors and one bool flag, so ``state_dict()`` round-trips
through ``torch.load(..., weights_only=True)``; LR schedulers work through ``param_groups`` as usual.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable

import torch

from .functional import lowrank_qh_adam_update_many, qh_adam_update_many
from .lowrank import project, project_with_feedback, remove_projection, rotate_moments
from .sharded import check_sharding, gather, is_sharded, local, sum_over_shards
from .stacked import DEFERRED, INSIDE, SCALE, MatrixStack
from .subspace import check_rank, grad_of, side_of, subspace_iteration_basis, svd_basis

# a basis that no one changed for this many steps, with update_proj_gap = None, is probably a forgotten refresh
FIXED_BASIS_WARNING_STEPS = 1000

QH_SOURCES = ("grad", "grad+error")
AFTER_QH = ("keep", "remove")
BASIS_METHODS = ("svd", "subspace")
LOWRANK_TERMS = ("adam", "momentum")


GALORE_PROJ_TYPES = ("std",)


EXECUTION = ("batched", "compile")  # group options that choose how the step runs, not what it computes
FOLD_BELOW = 2.0**-10  # a deferred buffer's factor (SCALE) is multiplied in once it falls below this


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient this rank updates ``p`` with: its shard of it for a sharded (FSDP2) parameter."""
    return local(grad_of(p))


def _check_dense(p: torch.Tensor) -> None:
    grad = grad_of(p)
    if grad.is_sparse:
        raise ValueError(f"LowRankQHAdam does not take sparse gradients (a parameter of shape {tuple(p.shape)}); "
                         "use nn.Embedding(..., sparse=False)")


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


# torch.optim's flags: what they ask for is refused by name where this optimizer does not do it (its kernels are
# chosen by the group options batched / compile), accepted where it is a no-op
TORCH_FLAGS = {"foreach": (None, False, True), "fused": (None, False), "capturable": (False,),
               "differentiable": (False,), "maximize": (False,)}


def _check_torch_flags(group: dict) -> None:
    for key, allowed in TORCH_FLAGS.items():
        if key in group and group[key] not in allowed:
            hint = {"maximize": "negate the loss instead", "fused": "use batched=True / compile=True",
                    "capturable": "CUDA graphs are not supported", "differentiable": "the step is not differentiable"}
            raise ValueError(f"{key}={group[key]!r} is not supported by LowRankQHAdam ({hint.get(key, '')}); "
                             f"allowed: {', '.join(map(repr, allowed))}")


def _shrink_error_feedback(states: list[dict], omega: float) -> None:
    """E ← ω·E (the full-rank term applied (1 − ω)·E of what lies outside the subspace: E keeps the rest); a
    deferred buffer's factor shrinks instead of the buffer (see LowRankQHAdam's deferred error feedback)."""
    buffers = [s[INSIDE] for s in states if INSIDE in s]  # low-rank, cheap
    for s in states:
        if "error_feedback" not in s:
            continue
        if not s.get(DEFERRED):
            buffers.append(s["error_feedback"])
        elif (scale := s.get(SCALE, 1.0) * omega) < FOLD_BELOW:
            s["error_feedback"].mul_(scale)
            s.pop(SCALE, None)
        else:
            s[SCALE] = scale
    if buffers:
        torch._foreach_mul_(buffers, omega)


def _tensor_steps(state_dict: dict) -> dict:
    """A state whose ``step`` entries are numbers (older torch optimizers' format; torch's own
    test_load_nontensor_step) with them as the 0-d float32 tensors this optimizer keeps."""
    if not any("step" in s and not isinstance(s["step"], torch.Tensor) for s in state_dict.get("state", {}).values()):
        return state_dict
    state = {k: ({**s, "step": torch.tensor(float(s["step"]), dtype=torch.float32)}
                 if "step" in s and not isinstance(s["step"], torch.Tensor) else s)
             for k, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


@functools.cache
def _eager_step():
    return torch.compiler.disable(torch.no_grad()(LowRankQHAdam._step))


def _runs_within(run: slice, stack: MatrixStack, wanted: set[int]) -> list[slice]:
    """The consecutive ranges of rows of ``run`` whose parameters are ``wanted``."""
    chosen, start = [], None
    for i in range(run.start, run.stop + 1):
        inside = i < run.stop and id(stack.params[i]) in wanted
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            chosen.append(slice(start, i))
            start = None
    return chosen


class LowRankQHAdam(torch.optim.Optimizer):
    """LoRDO's local optimizer for one process: low-rank QH-Adam with error feedback.

    For each matrix W (p×q) of a group with an integer ``rank`` r, with basis P of its smaller side (the
    right side when p ≥ q: P is q×r, proj(A) = A·P, back(g) = g·Pᵀ; else P is p×r, proj(A) = Pᵀ·A,
    back(g) = P·g), gradient G (clip it before ``step``) and error feedback E (zero at first)::

        A = G + E                                  # A = G without error feedback
        g = proj(A) ;  E ← A − back(g)             # what the projection drops is fed back next step
        u ← β1·u + (1−β1)·g ;  v ← β2·v + (1−β2)·g² ;  t ← t + 1
        û = u/(1−β1^t) ;  D = sqrt(v/(1−β2^t)) + ε
        Q = G (qh_source "grad") or A (qh_source "grad+error")
        L = û/D (lowrank_term "adam") or û (lowrank_term "momentum": the authors' research code)
        W ← W·(1 − η·λ) − η·(ω·back(L) + (1−ω)·Q/mean(D))
        E ← ω·E                                    # only with grad+error and error_feedback_after_qh "remove"

    Groups with ``rank=None`` take full-rank QHAdam with the same ω: W ← W(1 − ηλ) − η((1−ω)·G + ω·û)/D.
    ``omega=1`` is plain low-rank Adam (no full-rank term: the weights stay in the subspace between basis
    changes); ``omega=1, rank=None`` is AdamW. A matrix's basis comes from its first gradient unless set;
    :meth:`set_basis` / :meth:`refresh_basis` change it and rotate u, v into the new basis (LDAdam), E kept.

    Clip the gradient before ``step`` (``torch.nn.utils.clip_grad_norm_``; the trainer clips at 0.5): the
    full-rank term is divided by the low-rank moments' mean D, and unclipped it can outgrow the rest of the
    step when the gradient inside the bases shrinks faster than outside them (docs/concepts.md).

    GaLore's group keys ``update_proj_gap``, ``scale`` and ``proj_type`` are also constructor defaults for every
    group (Hugging Face's ``optimizer_cls_and_kwargs`` passes them so); a group that takes ``rank`` from the
    defaults trains its 1-D tensors full-rank (:meth:`add_param_group`); :func:`lordo.param_groups` builds the
    groups from a model.

    ``lowrank_term = "momentum"`` is the step of the authors' public research code (its ``GaLoreGlobal``): the
    back-projected bias-corrected momentum, not divided by √v̂ + ε, beside the full-rank term divided by the
    mean denominator. Its scale differs from Adam's (no per-coordinate normalisation): tune its learning rate.

    ``basis_method``: ``svd`` (exact) or ``subspace`` (``basis_iterations`` steps of subspace iteration
    warm-started from the previous basis). ``qh_source = "grad+error"`` is the research code's full-rank
    term; with it the term applies (1 − ω)·E of the error feedback every step, which ``keep`` leaves in E
    too (E then sums every dropped gradient while a basis stays and can grow without bound) and ``remove``
    takes out. ``error_feedback_dtype``: dtype of E (default: the parameter's); bfloat16 halves it, while
    A is still formed in the parameter's precision. State is tensors, bool flags and floats only, so ``state_dict()``
    loads with ``torch.load(..., weights_only=True)``; LR schedulers work through ``param_groups``.

    ``batched`` (a group option, like torch's ``foreach``): run the low-rank step for all matrices of one
    shape as one batch (optim/stacked.py; same formulas, fewer kernel launches). None (default): on
    accelerators, not on the CPU; True / False: always / never. ``compile`` (a group option): run each batch's
    update through ``torch.compile`` (its elementwise work fused into few kernels; compiled at the first step,
    which takes seconds to a minute; on the CPU it needs a C++ compiler). It applies to the batched path, so
    ``compile=True`` with ``batched=None`` batches on the CPU too; with ``batched=False`` it is refused.

    Parameters sharded by FSDP2 (``fully_shard``; DTensor) are stepped shard by shard, to the same result
    (optim/sharded.py): each low-rank matrix must be split along its long side, which
    ``fully_shard(..., shard_placement_fn=lordo.optim.fsdp_placement)`` does; bases are computed from the
    gathered matrix and are whole on every rank; state is each rank's shards (save it per rank). Sharded
    matrices take the per-matrix path, not the batched one (nor the compiled one).
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
        qh_source: str = "grad+error",
        basis_method: str = "svd",
        error_feedback_dtype: torch.dtype | None = None,
        error_feedback_after_qh: str = "remove",
        basis_iterations: int = 1,
        batched: bool | None = None,
        compile: bool = False,
        lowrank_term: str = "adam",
        update_proj_gap: int | None = None,
        scale: float = 1.0,
        proj_type: str = "std",
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
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
            error_feedback_after_qh=error_feedback_after_qh,
            basis_iterations=basis_iterations,
            batched=batched,
            compile=compile,
            lowrank_term=lowrank_term,
            update_proj_gap=update_proj_gap,  # GaLore's keys (_check_galore_keys): as defaults for every group too
            scale=scale,
            proj_type=proj_type,
            # torch.optim's flags, checked by name (TORCH_FLAGS): foreach is a no-op (multi-tensor ops are used
            # anyway), the others are refused unless off
            foreach=foreach, fused=fused, maximize=maximize, capturable=capturable, differentiable=differentiable,
        )
        super().__init__(params, defaults)  # checks each group in add_param_group
        # whether the bases are this optimizer's to keep fresh (update_proj_gap); a strategy that changes them
        # itself sets False (then no warning about a basis that never changes)
        self.manages_bases = True

    def add_param_group(self, param_group: dict) -> None:
        """torch's ``add_param_group``, with every option checked (a bad group is not added). A group that takes
        its ``rank`` from the defaults (``LowRankQHAdam(model.parameters(), rank=4)``, or Hugging Face's decay /
        no-decay groups) trains its matrices low-rank and its other tensors (biases, norms) full-rank: those are
        split off into a group of their own with ``rank=None``. A group that sets ``rank`` itself takes
        matrices only."""
        if "rank" not in param_group and self.defaults.get("rank") is not None:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            matrices = [p for p in params if p.ndim == 2]
            others = [p for p in params if p.ndim != 2]
            if matrices and others:
                self.add_param_group({**param_group, "params": matrices})
                self.add_param_group({**param_group, "params": others, "rank": None})
                return
            if others:
                param_group = {**param_group, "params": others, "rank": None}
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    @staticmethod
    def _check_group(group: dict) -> None:
        _check_torch_flags(group)
        if isinstance(group["lr"], torch.Tensor) and group["lr"].numel() != 1:
            raise ValueError(f"lr must be a number or a one-element tensor, got a tensor of shape {tuple(group['lr'].shape)}")
        if not group["lr"] >= 0:
            raise ValueError(f"lr must be >= 0, got {group['lr']}")
        if not group["weight_decay"] >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
        _check_galore_keys(group)
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
        if group["lowrank_term"] not in LOWRANK_TERMS:
            raise ValueError(f"lowrank_term must be one of {LOWRANK_TERMS}, got {group['lowrank_term']!r}")
        if group["error_feedback_after_qh"] not in AFTER_QH:
            raise ValueError(f"error_feedback_after_qh must be one of {AFTER_QH}, got {group['error_feedback_after_qh']!r}")
        iters = group["basis_iterations"]
        if not (isinstance(iters, int) and not isinstance(iters, bool) and iters >= 1):
            raise ValueError(f"basis_iterations must be an integer >= 1, got {iters!r}")
        if group["batched"] not in (None, True, False):
            raise ValueError(f"batched must be None (batch the low-rank step on accelerators, not on the CPU), True or "
                             f"False, got {group['batched']!r}")
        if group["compile"] not in (True, False):
            raise ValueError(f"compile must be True or False, got {group['compile']!r}")
        if group["compile"] and group["batched"] is False:
            raise ValueError("compile=True compiles the batched step: it needs batched=True or None, got batched=False")
        for p in group["params"]:
            check_sharding(p, lowrank=group["rank"] is not None)
        if group["rank"] is not None:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"a low-rank group (rank={group['rank']}) takes 2-D matrices only, got shape {tuple(p.shape)}")
                check_rank(group["rank"], tuple(p.shape))

    # ---------------------------------------------------------------------------------------------------
    # bases

    def lowrank_params(self) -> list[tuple[torch.Tensor, dict]]:
        return [(p, g) for g in self.param_groups if g["rank"] is not None for p in g["params"]]

    def _group_index(self) -> dict[int, dict]:
        """id(parameter) → its group; cached per identity of the group dicts and their sizes (add_param_group
        and load_state_dict, which replaces the dicts, rebuild it). Look it up once per call of the step's
        halves, not once per parameter: on a GPU the step is bound by host time."""
        key = tuple((id(g), len(g["params"])) for g in self.param_groups)
        cached = self.__dict__.get("_group_index_cache")
        if cached is None or cached[0] != key:
            cached = (key, {id(p): g for g in self.param_groups for p in g["params"]})
            self.__dict__["_group_index_cache"] = cached
        return cached[1]

    def _group_of(self, param: torch.Tensor, index: dict[int, dict] | None = None) -> dict:
        group = (self._group_index() if index is None else index).get(id(param))
        if group is None:
            raise KeyError("parameter is not managed by this optimizer")
        return group

    def _by_group(self, params: list[torch.Tensor]) -> list[tuple[dict, list[int]]]:
        """``params`` split by parameter group, in order: (group, positions in ``params``) per group."""
        index = self._group_index()
        by_group: dict[int, tuple[dict, list[int]]] = {}
        for i, p in enumerate(params):
            group = self._group_of(p, index)
            by_group.setdefault(id(group), (group, []))[1].append(i)
        return list(by_group.values())

    def _init_lowrank_state(self, p: torch.Tensor, group: dict, basis: torch.Tensor) -> dict:
        state = self.state[p]
        r = group["rank"]
        side, p = side_of(p.shape), local(p)  # a shard's state is its rows (right side) or columns (left)
        shape = (p.shape[0], r) if side == "right" else (r, p.shape[1])
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["basis"] = basis.to(device=p.device, dtype=torch.float32).clone()  # never alias the caller's tensor
        # low-rank moments are small (r per row): float32 even for a bf16/fp16 matrix, where Adam's g² and ε
        # would underflow
        moment_dtype = torch.promote_types(p.dtype, torch.float32)
        state["exp_avg"] = torch.zeros(shape, dtype=moment_dtype, device=p.device)
        state["exp_avg_sq"] = torch.zeros(shape, dtype=moment_dtype, device=p.device)
        if group["error_feedback"]:
            state["error_feedback"] = torch.zeros_like(p, dtype=group.get("error_feedback_dtype") or p.dtype)
        return state

    def compute_basis(self, p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor | None:
        """The new basis of ``p`` from ``matrix`` (same shape; for a sharded parameter, this rank's shard of it:
        the shards are gathered) by the group's method; None if it failed."""
        group = self._group_of(p)
        matrix = self.whole(p, matrix)
        previous = self.state[p].get("basis")
        if group["basis_method"] == "subspace":
            return subspace_iteration_basis(matrix, group["rank"], previous, iters=group["basis_iterations"])
        return svd_basis(matrix, group["rank"])

    def whole(self, p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """``matrix`` shaped like ``p``: as given, or gathered from every rank's shard when ``p`` is sharded and
        ``matrix`` is this rank's shard (a collective over ``p``'s mesh: call it on every rank)."""
        if is_sharded(matrix):
            return matrix.full_tensor()  # type: ignore[attr-defined]
        if is_sharded(p) and tuple(matrix.shape) != tuple(p.shape):
            return gather(p, matrix)
        return matrix

    @torch.no_grad()
    def set_basis(self, p: torch.Tensor, basis: torch.Tensor) -> None:
        """Use ``basis`` for ``p`` from now on, rotating its moments from the old basis (LDAdam)."""
        group = self._group_of(p)
        side = side_of(p.shape)
        expected = (p.shape[1] if side == "right" else p.shape[0], group["rank"])
        if tuple(basis.shape) != expected:
            raise ValueError(f"basis for a {tuple(p.shape)} matrix at rank {group['rank']} must be {expected}, got {tuple(basis.shape)}")
        new = basis.to(device=p.device, dtype=torch.float32)
        deviation = float((new.T @ new - torch.eye(new.shape[1], device=new.device)).abs().max())
        if not deviation <= 1e-3:  # NaN fails too
            raise ValueError(f"a basis must have orthonormal columns (max |PᵀP − I| = {deviation:.3g})")
        state = self.state[p]
        if "basis" not in state:
            self._init_lowrank_state(p, group, new)
            return
        self.__dict__["_bases_changed"] = True
        self._settle(p)  # E in the old basis
        b1, b2 = group["betas"]
        rotate_moments(state["exp_avg"], state["exp_avg_sq"], state["basis"], new, side, int(state["step"]), b1, b2)
        state["basis"].copy_(new)

    def _warn_fixed_basis(self) -> None:
        if not self.manages_bases or self.__dict__.get("_bases_changed") or self.__dict__.get("_warned_fixed_basis"):
            return  # a strategy (or the caller) changes the bases: nothing forgotten
        self.__dict__["_warned_fixed_basis"] = True
        warnings.warn(f"LowRankQHAdam: no basis has changed in {FIXED_BASIS_WARNING_STEPS} steps: with update_proj_gap="
                      "None (the default) the low-rank bases stay those of the first gradient unless you call "
                      "refresh_basis / set_basis; pass update_proj_gap=200 (GaLore's default) to recompute them from "
                      "the gradient every 200 steps", RuntimeWarning, stacklevel=4)

    def refresh_basis(self, p: torch.Tensor, matrix: torch.Tensor) -> bool:
        """Recompute p's basis from ``matrix`` and rotate the moments; False (basis kept) if it failed."""
        basis = self.compute_basis(p, matrix)
        if basis is None:
            return False
        self.set_basis(p, basis)
        return True

    # ---------------------------------------------------------------------------------------------------
    # the step, in two halves so that a strategy can all-reduce the projected gradients in between

    def _split_batched(self, params: list[torch.Tensor]) -> tuple[list[int], list[int]]:
        """Positions in ``params`` of the matrices the batched path takes (their group's ``batched``; None: on
        accelerators) and of the others; kept while the same matrices are asked for with the same groups and
        group options."""
        index = self._group_index()
        key = (tuple(id(p) for p in params), tuple((g.get("batched"), g.get("compile")) for g in self.param_groups))
        cached = self.__dict__.get("_split_cache")
        if cached is not None and cached[0] == key and cached[1] is index:
            return cached[2]
        batched: list[int] = []
        each: list[int] = []
        for i, p in enumerate(params):
            group = self._group_of(p, index)
            choice = group.get("batched")  # absent in state dicts saved before it existed
            default = p.device.type != "cpu" or bool(group.get("compile"))
            stack = (default if choice is None else choice) and not is_sharded(p)
            (batched if stack else each).append(i)
        self.__dict__["_split_cache"] = (key, index, (batched, each))
        return batched, each

    def _stacks(self, params: list[torch.Tensor], verify: bool = True) -> list[tuple[MatrixStack, dict, list[slice]]]:
        """The stacks (optim/stacked.py) holding the state of the low-rank ``params``, each with its group and
        the row ranges to update: consecutive requested rows in one mode. Which stacks hold ``params`` is
        worked out once and kept while the same matrices are asked for, the groups are the same and every
        stack is intact (host time is what a GPU step of many matrices costs). Every asked-for matrix has
        state by then (``project_gradients`` creates it first), so a kept plan covers them all; a matrix
        outside them that gets state later changes no stack the plan holds. ``verify=False`` skips the
        integrity check (the step's second half: the first one just made it)."""
        index = self._group_index()
        key = tuple(id(p) for p in params)
        plan = self.__dict__.get("_stack_plan")
        if (plan is None or plan[0] != key or plan[1] is not index
                or (verify and not all(stack.intact() for stack, _ in plan[2]))):
            plan = (key, index, self._plan_stacks(params))
            self.__dict__["_stack_plan"] = plan
        wanted = {id(p) for p in params}
        return [(stack, group, [rows for run in stack.uniform_runs() for rows in _runs_within(run, stack, wanted)])
                for stack, group in plan[2]]

    def _plan_stacks(self, params: list[torch.Tensor]) -> list[tuple[MatrixStack, dict]]:
        """The stacks holding ``params``, built or rebuilt where needed: one per group, shape, dtype and device
        of the matrices that have state."""
        cache: dict = self.__dict__.setdefault("_stack_cache", {})
        wanted = {id(p) for p in params}
        out = []
        for group, _ in self._by_group(params):
            by_key: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if "basis" in self.state[p] and not is_sharded(p):
                    by_key.setdefault((id(group), tuple(p.shape), p.dtype, p.device), []).append(p)
            for key, members in by_key.items():
                if not any(id(p) in wanted for p in members):
                    continue
                stack = cache.get(key)
                if stack is None or [id(p) for p in stack.params] != [id(p) for p in members] or not stack.intact():
                    stack = cache[key] = MatrixStack(members, [self.state[p] for p in members])
                out.append((stack, group))
        return out

    @torch.no_grad()
    def _project_stacked(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        position = {id(p): i for i, p in enumerate(params)}
        out: list[torch.Tensor | None] = [None] * len(params)
        for stack, group, slices in self._stacks(params):
            for rows in slices:
                for i, g in zip(range(rows.start, rows.stop), stack.project(group, rows).unbind(0)):
                    out[position[id(stack.params[i])]] = g
        return out  # type: ignore[return-value]

    @torch.no_grad()
    def _apply_stacked(self, params: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
        position = {id(p): i for i, p in enumerate(params)}
        for stack, group, slices in self._stacks(params, verify=False):
            for rows in slices:
                stack.apply(group, rows, torch.stack([gs[position[id(stack.params[i])]] for i in range(rows.start, rows.stop)]))

    @torch.no_grad()
    def project_gradients(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """g = proj(G + E) of each low-rank matrix in ``params``, updating its error feedback (batched over the
        matrices of one shape, or the deferred sums in one multi-tensor call); creates a matrix's state (basis
        from its gradient) on first use."""
        index = self._group_index()
        for p in params:
            _check_dense(p)
            group, state = self._group_of(p, index), self.state[p]
            if "basis" not in state:
                basis = svd_basis(self.whole(p, grad_of(p)), group["rank"])
                if basis is None:
                    raise RuntimeError("could not compute an initial basis (SVD failed on the first gradient)")
                self._init_lowrank_state(p, group, basis)
            elif group["update_proj_gap"] and int(state["step"]) % group["update_proj_gap"] == 0:
                self.refresh_basis(p, grad_of(p))  # GaLore's schedule: a new basis from this step's gradient
            elif group["update_proj_gap"] is None and int(state["step"]) == FIXED_BASIS_WARNING_STEPS:
                self._warn_fixed_basis()
        batched, each = self._split_batched(params)
        out: list[torch.Tensor | None] = [None] * len(params)
        for positions, project_many in ((batched, self._project_stacked), (each, self._project_each)):
            if positions:
                for i, g in zip(positions, project_many([params[i] for i in positions])):
                    out[i] = g
        return out  # type: ignore[return-value]

    def _project_each(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        by_scale: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p in params:
            state = self.state[p]
            if state.get(DEFERRED):
                buffers, grads = by_scale.setdefault(state.get(SCALE, 1.0), ([], []))
                buffers.append(state["error_feedback"])
                grads.append(_grad(p))
        for scale, (buffers, grads) in by_scale.items():
            # E has no component in the basis's subspace: proj(G + E) = proj(G); E accumulates G (see below)
            torch._foreach_add_(buffers, grads, alpha=1 / scale)
        out = []
        for p in params:
            state, grad, side = self.state[p], _grad(p), side_of(p.shape)
            basis = state["basis"] if state["basis"].dtype == grad.dtype else state["basis"].to(grad.dtype)
            if state.get(DEFERRED):
                g = project(grad, basis, side)
                if INSIDE in state:
                    state[INSIDE].add_(g)  # proj(S) follows S
                out.append(g)
                continue
            error = state.get("error_feedback")
            out.append(project_with_feedback(grad, error, basis, side))
            if error is not None and error.dtype == grad.dtype and error.dtype in (torch.float32, torch.float64):
                state[DEFERRED] = True
                group = self._group_of(p)
                if group["qh_source"] == "grad+error" and group["omega"] < 1:
                    state[INSIDE] = torch.zeros_like(out[-1])  # E lies outside the subspace: proj(E) = 0
        return out

    # Deferred error feedback. After a step in basis P, E = A − back(proj(A)) has no component in P's subspace
    # (E·P = 0 on the right side, up to rounding). While P stays, proj(G + E) = proj(G), and the E of step t is
    # (E_s + G_s+1 + ... + G_t) with its component in the subspace removed: the buffer only needs to sum the
    # gradients (one elementwise pass instead of a pass and two GEMMs per step), and the projection is removed
    # once, when the basis changes. The flag (a bool in the state, so saved and restored with it: a resumed run
    # continues bit for bit) says the buffer holds that sum S. With qh_source "grad+error" the full-rank term
    # needs A = G + E_before = S − back(c_before) every step; c = proj(S) is kept alongside (low-rank, updated
    # with each projected gradient), so A is never formed: back(c) joins the low-rank update's GEMM. Used for
    # buffers at the gradient's precision only (a bf16 running sum would drown the small outside part in the
    # large inside one). With error_feedback_after_qh "remove", E ← ω·E after every step would be one more
    # full-size pass: a deferred buffer instead holds S/SCALE and the factor SCALE (a float in the state) is
    # what shrinks; gradients are added as G/SCALE and the factor is multiplied in when the projection is
    # removed (the same GEMM) or once it falls below FOLD_BELOW.

    def _settle(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state.pop(INSIDE, None)
        scale = state.pop(SCALE, 1.0)
        if state.pop(DEFERRED, False):
            remove_projection(state["error_feedback"], state["basis"], side_of(p.shape), scale)

    @torch.no_grad()
    def settled_error_feedback(self, p: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback buffer E of ``p`` itself (this rank's shard, if sharded), any deferred sum folded
        in first, so that changing it in place (averaging it over workers) changes E; None without one."""
        state = self.state.get(p, {})
        if state.get("error_feedback") is None:
            return None
        self._settle(p)
        return local(state["error_feedback"])

    @torch.no_grad()
    def forget_error_feedback(self) -> None:
        """Zero every error-feedback buffer (a worker that takes over another's state starts with nothing owed)."""
        for state in self.state.values():
            state.pop(SCALE, None)
            for key in ("error_feedback", INSIDE):
                if key in state:
                    state[key].zero_()

    @torch.no_grad()
    def error_feedback(self, p: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback buffer E of low-rank matrix ``p`` (None if it has none yet or error feedback is
        off). A copy when the buffer is deferred; reading it never changes the run."""
        state = self.state.get(p, {})
        error = state.get("error_feedback")
        if error is None or not state.get(DEFERRED):
            return error
        error = error.clone()
        remove_projection(error, state["basis"], side_of(p.shape), state.get(SCALE, 1.0))
        return error

    @torch.no_grad()
    def apply_lowrank(self, params: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
        """Moment and weight updates of low-rank matrices from their projected gradients ``gs``: batched over
        the matrices of one shape (group option ``batched``), else multi-tensor moment math per group. With
        ``qh_source = "grad+error"`` the ``gs`` must be the projections of this step's own gradients (what
        :meth:`project_gradients` returned): A is rebuilt from them."""
        batched, each = self._split_batched(params)
        for positions, apply_many in ((batched, self._apply_stacked), (each, self._apply_each)):
            if positions:
                apply_many([params[i] for i in positions], [gs[i] for i in positions])

    def _apply_each(self, params: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
        for group, index in self._by_group(params):
            ps = [params[i] for i in index]
            gs_group = [gs[i] for i in index]
            states = [self.state[p] for p in ps]
            qh, lows, qh_scales = self._qh_inputs(group, ps, states, gs_group)
            b1, b2 = group["betas"]
            sharded = any(is_sharded(p) for p in ps)
            numels = [p.shape[0 if side_of(p.shape) == "right" else 1] * group["rank"] for p in ps] if sharded else None
            lowrank_qh_adam_update_many(
                [local(p) for p in ps], gs_group, qh, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["basis"] for s in states], [side_of(p.shape) for p in ps], [s["step"] for s in states],
                lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
                omega=group["omega"], qh_lowranks=lows, qh_scales=qh_scales, lowrank_scale=group["scale"],
                moment_numels=numels, lowrank_term=group.get("lowrank_term", "adam"),
                sum_totals=functools.partial(sum_over_shards, ps) if sharded else None,
            )
            if group["omega"] < 1 and group["qh_source"] == "grad+error" and group["error_feedback_after_qh"] == "remove":
                _shrink_error_feedback(states, group["omega"])

    def _qh_inputs(self, group: dict, ps: list[torch.Tensor], states: list[dict],
                   gs: list[torch.Tensor]) -> tuple[list, list | None, list[float] | None]:
        """The full-rank term's input per matrix as (full-size part, low-rank part, factor on the full-size
        part): A = factor·full − back(low)."""
        if group["omega"] == 1:
            return [None] * len(ps), None, None
        if group["qh_source"] == "grad":
            return [_grad(p) for p in ps], None, None
        full: list[torch.Tensor | None] = []
        lows: list[torch.Tensor | None] = []
        factors: list[float] = []
        for p, state, g in zip(ps, states, gs):
            error = state.get("error_feedback")
            factor = 1.0
            if error is None:  # error feedback off: A = G
                full.append(_grad(p))
                lows.append(None)
            elif INSIDE in state:  # deferred: A = S − back(c − g), S = SCALE·buffer the running sum after this step
                full.append(error)
                lows.append(state[INSIDE] - g)
                factor = state.get(SCALE, 1.0)
            else:  # A = G + E_before = E_after + back(g)
                full.append(error)
                lows.append(-g)
            factors.append(factor)
        return full, lows, factors

    @torch.no_grad()
    def apply_full_rank(self, params: list[torch.Tensor]) -> None:
        """Full-rank QHAdam on ``params``, one multi-tensor call per parameter group."""
        for p in params:
            _check_dense(p)
        for group, index in self._by_group(params):
            ps = [params[i] for i in index]
            states = [self.state[p] for p in ps]
            for p, state in zip(ps, states):
                if "step" not in state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    # float32 moments for a bf16/fp16 parameter: Adam's g² and ε underflow in half precision
                    state["exp_avg"] = torch.zeros_like(local(p), dtype=torch.promote_types(p.dtype, torch.float32))
                    state["exp_avg_sq"] = torch.zeros_like(state["exp_avg"])
            b1, b2 = group["betas"]
            qh_adam_update_many(
                [local(p) for p in ps], [_grad(p) for p in ps], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states], lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                weight_decay=group["weight_decay"], omega=group["omega"],
            )

    @torch.no_grad()
    def step(self, closure=None):
        if torch.compiler.is_compiling():
            # torch.compile(opt.step): the step runs eagerly, a graph break (dynamo, tracing the host-side scalar
            # math of the bias corrections, failed with "Guard failed on the same frame it was created"); for a
            # compiled step use the group option compile=True, which compiles the batched update itself. The
            # wrapper is made here, not at import: importing torch._dynamo takes seconds
            return _eager_step()(self, closure)
        return self._step(closure)

    def _step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if group["rank"] is None:
                self.apply_full_rank(with_grad)
                continue
            self.apply_lowrank(with_grad, self.project_gradients(with_grad))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, keeping each state tensor's saved dtype: torch casts them to their
        parameter's, which would round float32 bases and moments of a bf16 matrix to bf16 and turn a bf16
        error-feedback buffer into float32. How the step runs (``batched``, ``compile``) stays this optimizer's
        choice, not the saved one's: a checkpoint from a GPU run loads on a CPU as it was built there."""
        how = [{key: g[key] for key in EXECUTION} for g in self.param_groups]
        state_dict = _tensor_steps(state_dict)
        super().load_state_dict(state_dict)
        for group, options in zip(self.param_groups, how, strict=True):
            group.update(options)
        params = [p for g in self.param_groups for p in g["params"]]
        for index, saved in state_dict["state"].items():
            state = self.state[params[int(index)]]
            for key, value in saved.items():
                if isinstance(value, torch.Tensor) and state[key].dtype != value.dtype:
                    state[key] = value.to(device=state[key].device, copy=True)

    # ---------------------------------------------------------------------------------------------------
    # accounting

    def state_bytes(self) -> dict[str, int]:
        """Bytes of state by category: low-rank moments, full-rank moments, bases, error feedback."""
        out = {"lowrank_moments": 0, "full_rank_moments": 0, "bases": 0, "error_feedback": 0}
        for group in self.param_groups:
            for param in group["params"]:
                p = local(param)  # this rank's shard of a sharded parameter: what this device holds
                itemsize = p.element_size()
                if group["rank"] is None:
                    out["full_rank_moments"] += 2 * p.numel() * max(itemsize, 4)
                    continue
                r = group["rank"]
                big = p.shape[0] if side_of(param.shape) == "right" else p.shape[1]
                out["lowrank_moments"] += 2 * big * r * max(itemsize, 4)
                out["bases"] += min(param.shape) * r * 4  # the basis is whole on every rank
                if group["error_feedback"]:
                    ef_dtype = group.get("error_feedback_dtype") or p.dtype
                    out["error_feedback"] += p.numel() * torch.empty((), dtype=ef_dtype).element_size()
                    deferrable = ef_dtype == p.dtype and p.dtype in (torch.float32, torch.float64)
                    if deferrable and group["qh_source"] == "grad+error" and group["omega"] < 1:
                        out["error_feedback"] += big * r * itemsize  # proj(E) of the deferred buffer
        return out
