"""``LowRankQHAdam``: LoRDO's local optimizer as a ``torch.optim.Optimizer``.

Parameter groups with ``rank`` set keep rank-r Adam moments in a basis of each matrix, with error feedback
and a full-rank quasi-hyperbolic term; groups with ``rank=None`` take full-rank QHAdam. Usable on its own
in a single process: the basis of a matrix is taken from its first gradient unless the caller sets one
(``set_basis``, which rotates the moments). State is tensors, bool flags and floats, so ``state_dict()`` round-trips
through ``torch.load(..., weights_only=True)``; LR schedulers work through ``param_groups`` as usual.

Where each part lives: the options and their checks in ``options.py``; the update kernels (one functional entry,
a per-matrix and a batched implementation) in ``functional.py``; error feedback and its deferred form in
``feedback.py``; state creation, its bytes and the one place a sharded FSDP2 parameter becomes this rank's shard
in ``state.py`` (``sharded.py`` holds the sharding itself); the batched state layout in ``stacked.py`` and the
kept plans in ``plan.py``; the bases (computed, set, refreshed) in ``bases.py`` and what strategies and reports
read and change of the state (moments, error feedback, bytes) in ``access.py``, both mixins; the Muon form,
a subclass, in ``muon.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch

from . import compact_step, feedback
from .access import StateAccess
from .bases import BasisMethods
from .functional import lowrank_qh_adam, qh_adam_update_many
from .options import EXECUTION, STORAGE, check_group
from .plan import Planner
from .sharded import whole
from .state import Lists, compact_formats, conform, ensure_state, group_lists, restore_saved_dtypes, tensor_steps


@functools.cache
def _eager_step():
    return torch.compiler.disable(torch.no_grad()(LowRankQHAdam._step))


class LowRankQHAdam(BasisMethods, StateAccess, torch.optim.Optimizer):
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
    A is still formed in the parameter's precision; ``"int8"`` / ``"int4"`` / ``"fp8"`` hold E in blocks of 8 / 4-bit
    codes or e4m3 values with a scale each (optim/compact.py). ``moments_dtype = "int8"`` (or ``"fp8"``: e4m3, √v
    rounded stochastically by arithmetic, optim/float8.py) holds the full-rank groups' moments so, and
    ``lowrank_moments_dtype`` the low-rank matrices' u and v (each matrix then stepped alone, its state expanded to
    float32 meanwhile; the Adam form only). ``lordo.optim.float8.use_compiled()`` compiles the e4m3 codec.
    State is tensors, bool flags and floats only, so ``state_dict()``
    loads with ``torch.load(..., weights_only=True)``; LR schedulers work through ``param_groups``.

    ``batched`` (a group option, like torch's ``foreach``): run the low-rank step for all matrices of one
    shape as one batch (optim/stacked.py; same formulas and error feedback, fewer kernel launches). None
    (default): on accelerators, not on the CPU; True / False: always / never. ``compile`` (a group option): run each batch's
    update through ``torch.compile`` (its elementwise work fused into few kernels; compiled at the first step,
    which takes seconds to a minute; on the CPU it needs a C++ compiler). It applies to the batched path, so
    ``compile=True`` with ``batched=None`` batches on the CPU too; with ``batched=False`` it is refused.

    Parameters sharded by FSDP2 (``fully_shard``; DTensor) are stepped shard by shard, to the same result
    (optim/sharded.py): each low-rank matrix must be split along its long side, which
    ``fully_shard(..., shard_placement_fn=lordo.optim.fsdp_placement)`` does; bases are computed from the
    gathered matrix and are whole on every rank; state is each rank's shards (save it per rank). Sharded
    matrices take the per-matrix path, not the batched one (nor the compiled one).
    """

    _SECOND_MOMENT = True  # low-rank state keeps v (a subclass with one moment, the Muon form, sets False)

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
        error_feedback_dtype: torch.dtype | str | None = None,
        error_feedback_after_qh: str = "remove",
        basis_iterations: int = 1,
        batched: bool | None = None,
        compile: bool = False,
        lowrank_term: str = "adam",
        update_proj_gap: int | None = None,
        scale: float = 1.0,
        proj_type: str = "std",
        moments_dtype: str | None = None,
        lowrank_moments_dtype: str | None = None,
        *,
        foreach: bool | None = None,
        fused: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, omega=omega, rank=rank,
            error_feedback=error_feedback, qh_source=qh_source, basis_method=basis_method,
            error_feedback_dtype=error_feedback_dtype, error_feedback_after_qh=error_feedback_after_qh,
            basis_iterations=basis_iterations, batched=batched, compile=compile, lowrank_term=lowrank_term,
            # GaLore's keys (options.py): as defaults for every group too
            update_proj_gap=update_proj_gap, scale=scale, proj_type=proj_type, moments_dtype=moments_dtype,
            lowrank_moments_dtype=lowrank_moments_dtype,
            # torch.optim's flags, checked by name (options.TORCH_FLAGS): foreach is a no-op (multi-tensor ops are
            # used anyway), the others are refused unless off
            foreach=foreach, fused=fused, maximize=maximize, capturable=capturable, differentiable=differentiable,
        )
        super().__init__(params, defaults)  # checks each group in add_param_group
        # whether the bases are this optimizer's to keep fresh (update_proj_gap); a strategy that changes them
        # itself sets False (then no warning about a basis that never changes)
        self.manages_bases = True
        self._reset_bookkeeping()

    def _reset_bookkeeping(self) -> None:
        self._planner = Planner()  # how the step runs its parameters, kept while it holds (optim/plan.py)
        self._bases_changed = False  # has any basis changed (else a warning after FIXED_BASIS_WARNING_STEPS)
        self._warned_fixed_basis = False
        self._positions: dict[int, int] = {}  # a parameter's place in the optimizer: seeds its stochastic rounding

    def _position(self, p: torch.Tensor) -> int:
        if id(p) not in self._positions:
            self._positions = {id(q): i for i, q in enumerate(q for g in self.param_groups for q in g["params"])}
        return self._positions[id(p)]

    def __setstate__(self, state: dict) -> None:  # a copy or an unpickled optimizer: nothing kept is valid
        super().__setstate__(state)
        if not hasattr(self, "manages_bases"):  # pickled before it existed
            self.manages_bases = True
        self._reset_bookkeeping()

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
            check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def lowrank_params(self) -> list[tuple[torch.Tensor, dict]]:
        return [(p, g) for g in self.param_groups if g["rank"] is not None for p in g["params"]]

    def _group_of(self, p: torch.Tensor) -> dict:
        return self._planner.index(self.param_groups).of(p)

    def _init_group(self, group: dict, params: list[torch.Tensor], ensure: bool = True) -> Lists:
        """The kernels' lists for ``params`` of ``group``, state created on first use unless ``ensure`` is False
        (optim/state.py: the one place a sharded parameter becomes this rank's shard)."""
        return group_lists(group, params, self.state, ensure, self._SECOND_MOMENT)

    def whole(self, p: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
        """``matrix`` shaped like ``p``, gathered from every rank's shard when ``p`` is sharded (a collective)."""
        return whole(p, matrix)

    # ---------------------------------------------------------------------------------------------------
    # the step, in two halves so that a strategy can all-reduce the projected gradients in between

    @torch.no_grad()
    def project_gradients(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """g = proj(G + E) of each low-rank matrix in ``params``, updating its error feedback (optim/feedback.py;
        batched over the matrices of one shape where the group says so); creates a matrix's state (basis from its
        gradient) on first use."""
        groups = self._planner.index(self.param_groups).by_group(params)
        for group, positions in groups:
            ensure_state(group, [params[i] for i in positions], self.state, self._SECOND_MOMENT)
            self._refresh_on_schedule(group, [params[i] for i in positions])
        out: list[torch.Tensor | None] = [None] * len(params)
        batched, each = self._planner.split(params, self.param_groups)
        if batched:
            position = {id(p): i for i, p in enumerate(params)}
            for stack, group, slices in self._planner.stacks([params[i] for i in batched], self.param_groups, self.state):
                for rows in slices:
                    for p, g in zip(stack.params[rows], stack.project(group, rows).unbind(0)):
                        out[position[id(p)]] = g
            per_matrix = set(each)
            groups = [(group, [i for i in positions if i in per_matrix]) for group, positions in groups]
        for group, positions in groups:
            plain = [i for i in positions if not compact_formats(group, params[i])]
            for i in positions:  # compact error feedback: one matrix at a time, E in float32 only meanwhile
                if i not in plain:
                    with self._expanded(group, params[i], ("error_feedback",)):
                        (out[i],) = self._project_each(group, [params[i]])
            if plain:
                for i, g in zip(plain, self._project_each(group, [params[i] for i in plain])):
                    out[i] = g
        return out  # type: ignore[return-value]

    def _project_each(self, group: dict, params: list[torch.Tensor]) -> list[torch.Tensor]:
        lists = self._init_group(group, params, ensure=False)  # project_gradients made the state
        defer = [not compact_formats(group, p) for p in params]  # a compact buffer is never a running sum
        return feedback.project_each(lists.grads, lists.states, [s["basis"] for s in lists.states], lists.sides,
                                     [feedback.keeps_inside(group)] * len(params), defer)

    def _expanded(self, group: dict, p: torch.Tensor, keys: tuple[str, ...] | None = None, salt: int = 0):
        """``p``'s compact state (its entries ``keys``, default all) in float32 inside the block
        (optim/compact_step.py)."""
        return compact_step.expanded(self.state[p], group, p, self._position(p), keys, salt)

    @torch.no_grad()
    def apply_lowrank(self, params: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
        """Moment and weight updates of low-rank matrices from their projected gradients ``gs``. With
        ``qh_source = "grad+error"`` the ``gs`` must be the projections of this step's own gradients (what
        :meth:`project_gradients` returned): A is rebuilt from them."""
        position = {id(p): i for i, p in enumerate(params)}
        batched, each = self._planner.split(params, self.param_groups)
        for stack, group, slices in self._planner.stacks([params[i] for i in batched], self.param_groups, self.state,
                                                         verify=False):
            for rows in slices:
                stack.apply(group, rows, torch.stack([gs[position[id(p)]] for p in stack.params[rows]]))
        for group, positions in self._planner.index(self.param_groups).by_group([params[i] for i in each]):
            plain = [i for i in positions if not compact_formats(group, params[each[i]])]
            for i in positions:
                if i not in plain:
                    with self._expanded(group, params[each[i]]):
                        self._apply_each(group, self._init_group(group, [params[each[i]]], ensure=False), [gs[each[i]]])
            if plain:
                lists = self._init_group(group, [params[each[i]] for i in plain], ensure=False)  # project made it
                self._apply_each(group, lists, [gs[each[i]] for i in plain])

    def _apply_each(self, group: dict, lists: Lists, gs: list[torch.Tensor]) -> None:
        qh = [feedback.qh_input(s, g, grad) if group["qh_source"] == "grad+error" else (grad, None, 1.0)
              for s, g, grad in zip(lists.states, gs, lists.grads)] if group["omega"] < 1 else [(None, None, 1.0)] * len(gs)
        fulls, lows, factors = (list(column) for column in zip(*qh))
        b1, b2 = group["betas"]
        lowrank_qh_adam(
            lists.weights, gs, [s["exp_avg"] for s in lists.states], [s["exp_avg_sq"] for s in lists.states],
            [s["basis"] for s in lists.states], lists.sides, [s["step"] for s in lists.states], fulls, lows, factors,
            lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"],
            omega=group["omega"], scale=group["scale"], lowrank_term=group.get("lowrank_term", "adam"),
            moment_numels=lists.moment_numels, sum_totals=lists.sum_totals)
        if feedback.shrinks(group):
            feedback.shrink(lists.states, group["omega"])

    @torch.no_grad()
    def apply_full_rank(self, params: list[torch.Tensor]) -> None:
        """Full-rank QHAdam on ``params``, one multi-tensor call per parameter group."""
        for group, positions in self._planner.index(self.param_groups).by_group(params):
            b1, b2 = group["betas"]
            update = functools.partial(qh_adam_update_many, lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                                       weight_decay=group["weight_decay"], omega=group["omega"])
            plain, held = compact_step.split(group, [params[i] for i in positions])
            lists = self._init_group(group, [params[i] for i in positions])
            if plain:
                lists = self._init_group(group, plain, ensure=False)
                update(lists.weights, lists.grads, [s["exp_avg"] for s in lists.states],
                       [s["exp_avg_sq"] for s in lists.states], [s["step"] for s in lists.states])
            for p in held:  # compact moments: chunk by chunk (optim/compact_step.py)
                compact_step.full_rank_step(p, self.state[p], group, self._position(p), update)

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
            plain, held = compact_step.split(group, with_grad)
            if plain:
                self.apply_lowrank(plain, self.project_gradients(plain))
            for p in held:  # one matrix at a time, its compact state in float32 through both halves of its step
                ensure_state(group, [p], self.state, self._SECOND_MOMENT)
                with self._expanded(group, p):
                    self.apply_lowrank([p], self.project_gradients([p]))
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, keeping each state tensor's saved dtype: torch casts them to their
        parameter's, which would round float32 bases and moments of a bf16 matrix to bf16 and turn a bf16
        error-feedback buffer into float32. How the step runs (``batched``, ``compile``) and how the state is stored
        (``error_feedback_dtype``, ``moments_dtype``, ``lowrank_moments_dtype``) stay this optimizer's choice, not
        the saved one's: a checkpoint from a GPU run loads on a CPU as it was built there, and a float32 state into a
        compact one (or back)."""
        how = [{key: g[key] for key in (*EXECUTION, *STORAGE)} for g in self.param_groups]
        state_dict = tensor_steps(state_dict)
        super().load_state_dict(state_dict)
        for group, options in zip(self.param_groups, how, strict=True):
            group.update(options)
        restore_saved_dtypes(self.state, [p for g in self.param_groups for p in g["params"]], state_dict["state"])
        for group in self.param_groups:  # a state saved in another storage (an older checkpoint): into this one's
            for p in group["params"]:
                if p in self.state:
                    conform(self.state[p], group, p)
