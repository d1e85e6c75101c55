"""Two phases in one run: the ``switch`` section, or :meth:`DistributedOptimizer.switch` in a loop of your own.

The authors' public launch scripts train in two phases (SPEC; not the paper's text): a warm-up phase of W steps
(the learning rate warms up over them, the low-rank optimizer's error feedback warms up), checkpointed; then a
resume with new hyperparameters (ω, Adam's betas with both moments reset, the learning rate halved) to the end.
Here that is one run: after step W the new settings hold, and a resume on either side of W continues as the
uninterrupted run does (the switched hyperparameters travel in the optimizer's state, the phase in the step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import ConfigError
from .optim import LowRankQHAdam
from .strategies.base import check_number

if TYPE_CHECKING:
    from .config import SwitchConfig
    from .distributed_optimizer import DistributedOptimizer


def moments_of(optimizer: torch.optim.Optimizer) -> str:
    """Which kind of Adam moments ``optimizer`` holds ("lowrank": LoRDO's, "torch": torch's Adam / AdamW); refuses
    one without them."""
    if isinstance(optimizer, LowRankQHAdam) and optimizer._SECOND_MOMENT:
        return "lowrank"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return "torch"
    raise ConfigError(f"reset_moments: {type(optimizer).__name__} holds no Adam moments to reset (Muon's momentum "
                      "is not Adam's): leave reset_moments false")


@torch.no_grad()
def reset_moments(optimizer: torch.optim.Optimizer) -> None:
    """Adam's two moments and their step counter zeroed in ``optimizer``, as a freshly built one holds them;
    LoRDO's bases and error feedback stay."""
    if moments_of(optimizer) == "lowrank":
        optimizer.reset_moments()  # type: ignore[attr-defined]
        return
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if key in state:
                state[key].zero_()
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
        elif "step" in state:
            state["step"] = 0


def switch(opt: DistributedOptimizer, *, omega: float | None = None, betas: tuple[float, float] | None = None,
           reset: bool = False, sync_every: int | None = None) -> None:
    """The second phase's settings, from the next step on, in every hosted worker: ``omega`` on every group (as
    ``strategy.omega`` sets it), ``betas`` on every group that has them, Adam's moments ``reset``, ``sync_every`` the
    new K. Right after a synchronisation (``opt.in_sync``), where every worker holds the same model and moments.
    Everything is checked before anything changes: a refused switch leaves the optimizer as it was."""
    strategy: Any = opt.strategy
    if not opt.in_sync:
        raise ConfigError(f"switch() right after a synchronisation (opt.in_sync); this optimizer is "
                          f"{opt.steps_done - getattr(strategy, 'synced_at', 0)} step(s) past its last one")
    if omega is not None:
        _check_unit("omega", omega, closed=True)
        if strategy.name not in ("lordo", "lordo-local"):
            raise ConfigError(f"switch(omega=...) applies to lordo and lordo-local; {strategy.name!r} has no full-rank "
                              "term to weigh")
    if betas is not None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ConfigError(f"switch(betas=...) must be a pair (beta1, beta2), got {betas!r}")
        for b in betas:
            _check_unit("betas", b, closed=False)
    if sync_every is not None:
        check_number("switch(sync_every=...)", sync_every, minimum=1, integer=True)
        if not hasattr(strategy, "sync_every"):
            raise ConfigError(f"switch(sync_every=...) applies to the local-update strategies; {strategy.name!r} has no "
                              "synchronisation period")
    if reset:
        for w in strategy.workers:
            moments_of(w.optimizer)  # refuses an optimizer without Adam's moments, before anything changes
    for g in opt.param_groups:
        if omega is not None and "omega" in g:  # strategy.omega is every group's (QHAdam's full-rank term too)
            g["omega"] = float(omega)
        if betas is not None and "betas" in g:
            g["betas"] = (float(betas[0]), float(betas[1]))
    if sync_every is not None:
        strategy.sync_every = int(sync_every)
    if reset:
        for w in strategy.workers:
            reset_moments(w.optimizer)


def _check_unit(name: str, value: Any, closed: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (0 <= value <= 1 if closed else 0 <= value < 1)
    if not ok:
        raise ConfigError(f"switch({name}=...) must be in [0, 1{']' if closed else ')'}, got {value!r}")


class Phases:
    """The ``switch`` section in ``lordo train``'s loop: :meth:`start` after a resume, :meth:`before_step` before
    each step, :meth:`lr_scale` on the schedule's rate."""

    def __init__(self, cfg: SwitchConfig, sync_every: int) -> None:
        self.cfg, self.sync_every = cfg, sync_every

    def start(self, opt: DistributedOptimizer, step: int) -> None:
        """A run that starts (or resumes) after ``step`` steps takes the K of its phase (the switched
        hyperparameters and moments come with the optimizer's state)."""
        if self.cfg.active and self.cfg.sync_every_before:
            strategy: Any = opt.strategy  # a local-update strategy: the config refuses the others
            strategy.sync_every = self.cfg.sync_every_before if step <= self.cfg.at_step else self.sync_every

    def before_step(self, opt: DistributedOptimizer, step: int) -> str | None:
        """Before step ``step`` (counted from 1): the switch, if this is the first step of the second phase; returns
        what changed, in words (None when nothing did)."""
        c = self.cfg
        if not c.active or step != c.at_step + 1:
            return None
        betas = None
        if c.beta1 != -1 or c.beta2 != -1:
            old = next(g["betas"] for g in opt.param_groups if "betas" in g)
            betas = (old[0] if c.beta1 == -1 else c.beta1, old[1] if c.beta2 == -1 else c.beta2)
        switch(opt, omega=None if c.omega == -1 else c.omega, betas=betas, reset=c.reset_moments,
               sync_every=self.sync_every if c.sync_every_before else None)
        changed = [f"omega {c.omega}" if c.omega != -1 else "", f"betas {betas}" if betas else "",
                   "Adam's moments reset" if c.reset_moments else "", f"lr x{c.lr_scale}" if c.lr_scale != 1 else "",
                   f"sync_every {self.sync_every}" if c.sync_every_before else ""]
        return f"step {c.at_step}: the second phase begins: {', '.join(x for x in changed if x) or 'no change'}"

    def lr_scale(self, step: int) -> float:
        return self.cfg.lr_scale if self.cfg.active and step > self.cfg.at_step else 1.0
