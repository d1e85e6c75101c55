"""How a step runs a list of parameters, worked out once and kept while it holds: which group each parameter is
in, which matrices take the batched path, and the stacks (optim/stacked.py) that hold their state.

On a GPU a step of many matrices is bound by host time, so none of this is recomputed per parameter per step.
Each piece is kept with the rule that invalidates it:

- the group index (parameter → group): while the optimizer's group dicts are the same objects with the same
  number of parameters (``add_param_group`` adds one, ``load_state_dict`` replaces them all);
- the split (batched or per matrix): while the same parameters are asked for, the index holds, and no group's
  ``batched`` / ``compile`` changed;
- the stacks of a list of parameters: while the same parameters are asked for, the index holds and every stack
  is intact (a state loaded or a basis set anew replaces the views a stack put there).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .options import runs_batched
from .sharded import is_sharded
from .stacked import MatrixStack

Stacked = list[tuple[MatrixStack, dict, list[slice]]]  # each stack, its group and the row ranges to update


class GroupIndex:
    """Parameter → its group, for the groups it was built from."""

    def __init__(self, groups: Sequence[dict]) -> None:
        self.key = _groups_key(groups)
        self._of = {id(p): g for g in groups for p in g["params"]}

    def fits(self, groups: Sequence[dict]) -> bool:
        return self.key == _groups_key(groups)

    def of(self, param: torch.Tensor) -> dict:
        group = self._of.get(id(param))
        if group is None:
            raise KeyError("parameter is not managed by this optimizer")
        return group

    def by_group(self, params: Sequence[torch.Tensor]) -> list[tuple[dict, list[int]]]:
        """``params`` split by parameter group, in order: (group, positions in ``params``) per group."""
        out: dict[int, tuple[dict, list[int]]] = {}
        of = self._of
        for i, p in enumerate(params):  # once or twice a step over every matrix: kept lean
            group = of.get(id(p))
            if group is None:
                raise KeyError("parameter is not managed by this optimizer")
            entry = out.get(id(group))
            if entry is None:
                entry = out[id(group)] = (group, [])
            entry[1].append(i)
        return list(out.values())


def _groups_key(groups: Sequence[dict]) -> tuple:
    return tuple((id(g), len(g["params"])) for g in groups)


class Planner:
    """The kept plans of one optimizer (see module doc); ``reset`` forgets them all."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._index: GroupIndex | None = None
        self._split: tuple[tuple, GroupIndex, tuple[list[int], list[int]]] | None = None
        self._plan: tuple[tuple, GroupIndex, list[tuple[MatrixStack, dict]]] | None = None
        self._stacks: dict[tuple, MatrixStack] = {}

    def index(self, groups: Sequence[dict]) -> GroupIndex:
        if self._index is None or not self._index.fits(groups):
            self._index = GroupIndex(groups)
        return self._index

    def split(self, params: Sequence[torch.Tensor], groups: Sequence[dict]) -> tuple[list[int], list[int]]:
        """Positions in ``params`` of the matrices the batched path takes, and of the others."""
        index = self.index(groups)
        key = (tuple(id(p) for p in params), tuple((g.get("batched"), g.get("compile")) for g in groups))
        if self._split is None or self._split[0] != key or self._split[1] is not index:
            batched: list[int] = []
            each: list[int] = []
            for i, p in enumerate(params):
                (batched if runs_batched(index.of(p), p, is_sharded(p)) else each).append(i)
            self._split = (key, index, (batched, each))
        return self._split[2]

    def stacks(self, params: Sequence[torch.Tensor], groups: Sequence[dict], state: Mapping,
               verify: bool = True) -> Stacked:
        """The stacks holding the state of ``params`` (every one has state by then: ``project_gradients`` creates it
        first), each with its group and the row ranges to update: consecutive requested rows in one mode.
        ``verify=False`` skips the integrity check (the step's second half: the first one just made it)."""
        index = self.index(groups)
        key = tuple(id(p) for p in params)
        plan = self._plan
        if (plan is None or plan[0] != key or plan[1] is not index
                or (verify and not all(stack.intact() for stack, _ in plan[2]))):
            plan = self._plan = (key, index, self._build(params, index, state))
        wanted = {id(p) for p in params}
        return [(stack, group, [rows for run in stack.uniform_runs() for rows in _runs_within(run, stack, wanted)])
                for stack, group in plan[2]]

    def _build(self, params: Sequence[torch.Tensor], index: GroupIndex, state: Mapping) -> list[tuple[MatrixStack, dict]]:
        """The stacks holding ``params``, built or rebuilt where needed: one per group, shape, dtype and device of the
        matrices that have state."""
        wanted = {id(p) for p in params}
        out = []
        for group, _ in index.by_group(params):
            members: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if "basis" in state[p] and not is_sharded(p):
                    members.setdefault((id(group), tuple(p.shape), p.dtype, p.device), []).append(p)
            for key, ps in members.items():
                if not any(id(p) in wanted for p in ps):
                    continue
                stack = self._stacks.get(key)
                if stack is None or [id(p) for p in stack.params] != [id(p) for p in ps] or not stack.intact():
                    stack = self._stacks[key] = MatrixStack(ps, [state[p] for p in ps])
                out.append((stack, group))
        return out


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
