"""What strategies and reports read and change of :class:`~lordo.optim.LowRankQHAdam`'s state: the moments (opened
in float32 where they are held compact, or copied), the error feedback (settled, read, forgotten), the state's bytes
and categories. A mixin: the optimizer's state, groups and compact-state helpers are :class:`LowRankQHAdam`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from . import compact, compact_step, feedback
from .compact import is_compact
from .sharded import local
from .state import compact_formats, entry_shapes, state_bytes
from .subspace import side_of


class StateAccess:
    """State access of :class:`~lordo.optim.LowRankQHAdam` (see the module doc)."""

    if TYPE_CHECKING:  # what the optimizer it is mixed into provides
        state: Any
        param_groups: list[dict]
        _SECOND_MOMENT: bool

        def _group_of(self, p: torch.Tensor) -> dict: ...

        def _expanded(self, group: dict, p: torch.Tensor, keys: tuple[str, ...] | None = None,
                      salt: int = 0) -> contextlib.AbstractContextManager: ...

    @contextlib.contextmanager
    def moments_expanded(self, params: Iterable[torch.Tensor],
                         keys: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> Iterator[None]:
        """Inside the block, the moments ``keys`` of ``params`` held compact (``lowrank_moments_dtype``,
        ``moments_dtype``) are float32 tensors in their state, which a strategy may read and change (averaging them
        over the workers); held compact again after it."""
        with contextlib.ExitStack() as stack:
            for p in params:
                if p in self.state:
                    stack.enter_context(self._expanded(self._group_of(p), p, keys, compact_step.AVERAGED))
            yield

    @torch.no_grad()
    def moment_copy(self, p: torch.Tensor, key: str) -> torch.Tensor | None:
        """``p``'s moment ``key`` (this rank's shard of it) as a new float32 tensor, decoded where it is held
        compact; None where ``p`` has no such moment (yet). Reading it changes nothing."""
        state = self.state.get(p, {})
        if is_compact(state, key):
            group = self._group_of(p)
            return compact.load(state, key, compact_formats(group, p)[key], entry_shapes(group, p)[key])
        return local(state[key]).clone() if key in state else None

    @torch.no_grad()
    def reset_moments(self) -> None:
        """Both moments and their step counter zeroed, as a freshly built optimizer holds them (compact ones stored
        as compact zeros); bases and error feedback stay. The two-phase protocol's reset (``switch.reset_moments``)."""
        for p, state in self.state.items():
            group = self._group_of(p)
            formats, shapes = compact_formats(group, p), entry_shapes(group, p)
            for key in ("exp_avg", "exp_avg_sq"):
                if is_compact(state, key):
                    zeros = torch.zeros(shapes[key], device=state[key + compact.CODES].device)
                    compact.store(state, key, zeros, formats[key], seed=0)
                elif key in state:
                    local(state[key]).zero_()
            if "step" in state:
                state["step"].zero_()

    # ---------------------------------------------------------------------------------------------------
    # error feedback, as strategies read and change it

    @torch.no_grad()
    def settled_error_feedback(self, p: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback buffer E of ``p`` itself (this rank's shard, if sharded), any deferred sum folded
        in first, so that changing it in place (averaging it over workers) changes E; None without one."""
        state = self.state.get(p, {})
        if is_compact(state, "error_feedback"):
            raise ValueError("this error feedback is held compact (error_feedback_dtype int8, int4 or fp8): it cannot be "
                             "changed in place; read it with error_feedback(p)")
        if state.get("error_feedback") is None:
            return None
        feedback.settle(state, side_of(p.shape))
        return local(state["error_feedback"])

    @torch.no_grad()
    def forget_error_feedback(self) -> None:
        """Zero every error-feedback buffer (a worker that takes over another's state starts with nothing owed)."""
        for state in self.state.values():
            feedback.forget(state)

    @torch.no_grad()
    def error_feedback(self, p: torch.Tensor) -> torch.Tensor | None:
        """The error-feedback buffer E of low-rank matrix ``p`` (None if it has none yet or error feedback is
        off). A copy when the buffer is deferred; reading it never changes the run."""
        state = self.state.get(p, {})
        if is_compact(state, "error_feedback"):
            fmt = compact_formats(self._group_of(p), p)["error_feedback"]
            return compact.load(state, "error_feedback", fmt, tuple(local(p).shape))
        return feedback.settled_copy(state, side_of(p.shape))

    # ---------------------------------------------------------------------------------------------------
    # the state as a whole: counted

    def state_bytes(self) -> dict[str, int]:
        """Bytes of state by category as the shapes and storage settings say (accounted: lordo.strategies.footprint
        measures the tensors): low-rank moments, full-rank moments, bases, error feedback."""
        return state_bytes(self.param_groups, 2 if self._SECOND_MOMENT else 1)

    def state_category(self, p: torch.Tensor, path: list[str]) -> str:
        """The category of the state entry at ``path`` (its key first) of ``p``, as :meth:`state_bytes` names them."""
        key = path[0].split(".")[0] if path else ""
        if key in ("exp_avg", "exp_avg_sq", "momentum", "step"):  # the step counter goes with the moments
            return "full_rank_moments" if self._group_of(p)["rank"] is None else "lowrank_moments"
        if key in ("error_feedback", feedback.INSIDE):
            return "error_feedback"
        return "bases" if key == "basis" else "optimizer_other"
