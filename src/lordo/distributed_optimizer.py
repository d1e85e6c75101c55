"""The optimizer the library API returns: every hosted worker's state and communication as one
``torch.optim.Optimizer`` (:class:`DistributedOptimizer`). :func:`lordo.distributed` builds it from a strategy
name and options (``lordo.api``); ``lordo train`` builds it from a :class:`~lordo.config.Config`."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .comm import Communicator
from .config import Config
from .errors import ConfigError
from .model.params import ParamGroup
from .optim.sharded import local
from .replicas import LIVE, WorkerStates, default_groups, fingerprint, reshard
from .reports import Reports
from .strategies import Strategy, build_strategy
from .strategies.base import check_sharded_models


class DistributedOptimizer(Reports, torch.optim.Optimizer):
    """The optimizer state and all communication of the workers this process hosts, as a
    ``torch.optim.Optimizer``.

    Call :meth:`step` once per training step, after ``loss.backward()`` on every hosted replica; it takes
    the local (or synchronous) optimizer step, communicates when due, and clears the gradients.
    ``param_groups`` mirror the inner optimizer's groups (for LoRDO: the low-rank and the full-rank ones),
    each holding that group's parameters of every hosted replica; what a torch LR scheduler or you change
    in them (``lr``, ``weight_decay``, ``betas``, ...) is what the next step uses. ``GradScaler.step(opt)``
    works: gradients are unscaled here, and a step with inf/NaN gradients on any worker is skipped on every
    worker. Build it with :func:`distributed`; ``lordo train`` builds it from a :class:`~lordo.config.Config`.
    End training with :meth:`finish` (every worker then holds the common model), or train inside
    ``with lordo.distributed(...) as opt:``, which finishes at the end of the block; an optimizer left between
    synchronisations at exit is reported on stderr (``check_finish=False`` turns that off).

    A scheduler and mixed precision, as with any torch optimizer (docs/integrations.md runs this pattern)::

        opt = lordo.distributed(model, "lordo", lr=3e-3)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
        scaler = torch.amp.GradScaler("cuda")  # float16 autocast only; bfloat16 needs none
        for batch in batches:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model, batch)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            schedule.step()
        opt.finish()
    """

    _step_supports_amp_scaling = True  # GradScaler hands us grad_scale and found_inf; see step()

    def __init__(
        self,
        models: Sequence[nn.Module],
        cfg: Config | None,
        comm: Communicator,
        groups: Sequence[Sequence[ParamGroup]] | None = None,
        owns_comm: bool = False,
        check_finish: bool = True,
        strategy: StrategyFactory | None = None,
    ) -> None:
        """``cfg`` (a run's config) builds the strategy; or ``cfg=None`` and ``strategy``, a factory that builds
        one from the replicas and the communicator (:func:`distributed` documents both)."""
        self.models = list(models)
        if len(self.models) != len(comm.local_ranks):
            raise ConfigError(
                f"{len(self.models)} model replica(s) given, but this process hosts {len(comm.local_ranks)} worker(s)"
            )
        if (cfg is None) == (strategy is None):
            raise ConfigError("give a DistributedOptimizer either a Config or a strategy factory, not both or neither")
        if strategy is not None and comm.fault_tolerant:
            raise ConfigError("a strategy built by your own factory cannot run on torchft: a worker that joins compares "
                              "its settings with the run's, which only a named strategy has; use lordo.distributed(model, "
                              "'<name>', backend='torchft', ...)")
        self.cfg, self.comm, self._owns_comm = cfg, comm, owns_comm
        if comm.fault_tolerant and cfg is not None:  # a worker that joins compares its settings with the run's (comm/ft.py)
            from .train.resume_settings import config_differences, trajectory_settings

            settings = trajectory_settings(cfg.to_dict())
            settings["dist"].pop("workers", None)  # each worker's own count may be 1 (from the environment)
            comm.settings, comm.compare_settings = settings, config_differences
        check_sharded_models(self.models, comm)
        # replicas start equal: worker 0's parameters everywhere (counted in the ledger as the initial broadcast;
        # a sharded model's ranks each send their shards). Which replicas it changed is remembered: a state
        # loaded into them before (each worker's own weights of a mid-round resume) was overwritten
        before = [fingerprint(m) for m in self.models]
        comm.broadcast([[local(p).data for p in m.parameters()] for m in self.models], tag="init")
        after = [fingerprint(m) for m in self.models]
        self._replaced = {i: a for i, (b, a) in enumerate(zip(before, after)) if not torch.equal(b, a)}
        if groups is None:
            groups = [default_groups(m) for m in self.models]
        self.groups = [list(g) for g in groups]
        self.strategy: Strategy = (build_strategy(cfg, self.models, self.groups, comm) if cfg is not None
                                   else _own_strategy(strategy, self.models, comm))
        self.last_stats: dict[str, float] = {}
        inner = [w.optimizer for w in self.strategy.workers]
        mirrored = [
            {**{k: v for k, v in group.items() if k != "params"},
             "params": [p for opt in inner for p in opt.param_groups[i]["params"]]}
            for i, group in enumerate(inner[0].param_groups)
        ]
        self._building = True
        super().__init__(mirrored, defaults=dict(inner[0].defaults))  # schedulers read betas, momentum there
        self._building = False
        if check_finish:  # checked at exit: a forgotten finish() leaves every worker with its own model
            LIVE.add(self)
        # opt.state[p], as tools written for torch.optim read it: the inner optimizer's state of p (live)
        self.state = WorkerStates([w.optimizer for w in self.strategy.workers])  # type: ignore[assignment]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction (a :class:`ConfigError`): every worker's inner optimizer, anchor, bases and
        payload layout are built over the parameters the model had then, and the workers must agree on them. To
        train more parameters, build the optimizer over a model that has them (to train fewer, freeze them first)."""
        if not getattr(self, "_building", False):
            raise ConfigError("a DistributedOptimizer holds the whole model from its construction; parameters cannot "
                              "be added later (build it over a model that has them)")
        super().add_param_group(param_group)

    # --- the training step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, lr: float | None = None) -> Any:
        """One optimizer step of every hosted worker from its ``.grad`` (clipped to ``grad_clip``), with the
        communication due at this step; clears the gradients. ``closure`` (optional) recomputes the loss
        and gradients, as in torch; ``lr`` sets every group's learning rate first (or use a torch LR
        scheduler). Returns the closure's loss; the step's diagnostics (gradient norm; at a synchronisation
        ``synced``, ``pseudo_grad_norm``, ``basis_overlap``, ``residual_energy``, ``error_feedback_norm``)
        are in :attr:`last_stats`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if lr is not None:
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr >= 0 and lr < float("inf")):
                raise ConfigError(f"step(lr=...) must be a finite number >= 0, got {lr!r}")
            for group in self.param_groups:
                group["lr"] = float(lr)
        if self._amp_skip():
            self.zero_grad(set_to_none=True)
            self.last_stats = {"amp_skipped": 1.0}
            return loss
        for w in self.strategy.workers:  # the hyperparameters the groups hold now, into every inner optimizer
            for mine, theirs in zip(self.param_groups, w.optimizer.param_groups, strict=True):
                theirs.update({k: v for k, v in mine.items() if k != "params"})
        # a worker of several ranks steps as one: their gradients averaged first (nothing for one rank)
        self.comm.average_within_worker(self.strategy.grads())
        self.last_stats = self.strategy.step()
        return loss

    def _amp_skip(self) -> bool:
        """Under ``GradScaler.step(opt)``: unscale the gradients, and say whether to skip this step (every
        worker skips when any found inf/NaN: a worker that stepped alone would leave the others' collectives)."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        (skip,) = self.comm.agree([bool(found_inf.item() > 0)])
        scale = getattr(self, "grad_scale", None)
        if not skip and scale is not None:  # None: the user already called scaler.unscale_(opt)
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))
        return skip

    def finish(self) -> dict[str, float]:
        """Synchronise once more if local steps are pending, so every worker holds the same model. Call it
        at the end of training (and before evaluating or saving a model mid-training if you need the
        global model; between synchronisations each worker holds its own)."""
        return self.strategy.finish()

    @property
    def in_sync(self) -> bool:
        """True when every worker holds the same model: always for ``ddp`` and ``lowrank-ddp``; for the
        local-update strategies right after a synchronisation (and at the start)."""
        return self.strategy.in_sync

    def switch(self, *, omega: float | None = None, betas: tuple[float, float] | None = None, reset: bool = False,
               sync_every: int | None = None) -> None:
        """The second phase of a two-phase run, from the next step, right after a synchronisation: new ``omega``,
        ``betas``, Adam's moments ``reset``, a new ``sync_every`` (:func:`lordo.phases.switch`)."""
        from .phases import switch

        switch(self, omega=omega, betas=betas, reset=reset, sync_every=sync_every)

    @torch.no_grad()
    def average_into(self, model: nn.Module) -> None:
        """Load into ``model`` (a spare replica of the same architecture) the mean of every worker's current
        parameters: the model all workers would hold if they synchronised now, without changing the run.
        A collective (every process must call it) that is not counted in the ledger; between
        synchronisations it is the fair model to evaluate, where worker 0's own model has drifted."""
        for m in (*self.models, model):
            reshard(m)  # a sharded model evaluated since its last backward holds gathered parameters
        mine = [[local(p).detach().clone() for p in m.parameters()] for m in self.models]
        self.comm.all_reduce_mean(mine, tag="evaluation", accounted=False)
        for target, mean in zip(model.parameters(), mine[0], strict=True):
            local(target).copy_(mean)

    def join(self) -> int:
        """Fault tolerance (``backend="torchft"``): call once, before the first step. With the other workers
        starting too, it checks they start from the same weights; if they are ahead (this worker restarted
        after a failure, or started late), it receives the state of one of them, takes part in the round they
        are in, and returns the step counter to continue from (your loop, data and LR schedule resume there).
        On other backends it returns :attr:`steps_done` and does nothing."""
        return self.comm.join(self.strategy)

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken (the local-step counter that decides when to synchronise)."""
        return self.strategy.steps_done

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (tensors, numbers, strings; ``torch.save`` it per process):
        ``shared`` (the same on every worker), ``workers`` (one entry per hosted worker) and the ledger."""
        state = self.strategy.state_dict()
        state["ledger"] = self.comm.ledger.state_dict()
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        state["identity"] = self._identity()
        return state

    def _identity(self) -> dict[str, Any]:
        """What a state must match to load here: the strategy, the trained tensors' shapes, each group's rank."""
        return {"strategy": self.strategy.name,
                "shapes": [list(t.shape) for t in self.strategy.workers[0].tensors],
                "ranks": [g.get("rank") for g in self.strategy.workers[0].optimizer.param_groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, in a process hosting the same workers: build this optimizer,
        load each model's own state, then this (building copies worker 0's weights to every worker; a state
        saved between synchronisations over weights that copy replaced is refused with a clear error)."""
        missing = {"shared", "workers"} - set(state) if isinstance(state, dict) else {"shared", "workers"}
        if missing:
            raise ValueError(f"not a lordo optimizer state: keys {sorted(missing)} are missing")
        self._check_state(state)  # before anything is loaded: a refused state changes nothing
        undo = copy.deepcopy(self.strategy.state_dict())  # what a state refused half-way through is rolled back to
        try:
            self.strategy.load_state_dict({"shared": state["shared"], "workers": state["workers"]})
            self._check_load_order()
        except Exception as exc:
            self.strategy.load_state_dict(undo)
            if isinstance(exc, ConfigError):
                raise
            cause = f"it lacks {exc} that this optimizer's settings need" if isinstance(exc, KeyError) else \
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise ConfigError(f"this optimizer state does not fit this optimizer; nothing was loaded: {cause} (saved with "
                              "other settings: compression, its residual, sync_delay or the lean state)") from None
        if "ledger" in state:
            self.comm.ledger.load_state_dict(state["ledger"])
        # the groups' hyperparameters: as saved, or (a state without them, as lordo train's checkpoints hold it) as the
        # inner optimizers just loaded them; either way what the next step pushes into them
        inner = self.strategy.workers[0].optimizer.param_groups
        saved_groups = state.get("param_groups") or [{k: v for k, v in g.items() if k != "params"} for g in inner]
        if saved_groups and len(saved_groups) != len(self.param_groups):
            raise ValueError(f"state holds {len(saved_groups)} parameter groups, this optimizer has {len(self.param_groups)}")
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(saved)

    def _check_state(self, state: dict[str, Any]) -> None:
        """Refuse a state saved by another strategy, another rank or another model, naming what differs. States
        saved before ``identity`` existed are compared by their structure (the anchor, the groups' ranks)."""
        mine = self._identity()
        saved = state.get("identity")
        differences = []
        if saved is not None:
            for key, what in (("strategy", "strategy"), ("ranks", "rank of each parameter group"),
                              ("shapes", "shapes of the trained tensors")):
                if saved.get(key) != mine[key]:
                    theirs, ours = saved.get(key), mine[key]
                    if key == "shapes":
                        bad = [i for i, (a, b) in enumerate(zip(theirs or [], ours)) if a != b]
                        theirs = f"{len(theirs or [])} tensors" + (f", #{bad[0]} {theirs[bad[0]]}" if bad else "")
                        ours = f"{len(ours)} tensors" + (f", #{bad[0]} {ours[bad[0]]}" if bad else "")
                    differences.append(f"{what}: saved {theirs}, here {ours}")
        else:
            has_anchor, wants_anchor = "anchor" in state["shared"], "anchor" in self.strategy.shared_state()
            if has_anchor != wants_anchor:
                differences.append("strategy: saved by one " + ("with" if has_anchor else "without") + " an anchor "
                                   "(local-update or synchronous), here " + self.strategy.name)
            groups = state["workers"][0].get("optimizer", {}).get("param_groups", []) if state["workers"] else []
            ranks = [g.get("rank") for g in groups]
            if groups and ranks != mine["ranks"]:
                differences.append(f"rank of each parameter group: saved {ranks}, here {mine['ranks']}")
        if differences:
            raise ConfigError("this optimizer state does not fit this optimizer; nothing was loaded. It differs in: "
                              + "; ".join(differences))

    def _check_load_order(self) -> None:
        """A mid-round state needs each worker's own weights; refuse them if the initial broadcast replaced them
        (the model's state loaded *before* this optimizer was built) and they were not loaded again since."""
        if self.strategy.in_sync or not self._replaced:
            return
        stale = [i for i, after in self._replaced.items() if torch.equal(after, fingerprint(self.models[i]))]
        if stale:
            raise ConfigError(
                f"this state was saved between synchronisations (step {self.strategy.steps_done}), where each worker "
                f"holds its own weights, but the weights of hosted worker(s) {stale} are worker 0's: building the "
                "optimizer copies worker 0's weights to every worker, so a model state loaded before was overwritten. "
                "Build the optimizer first, then load each model's state, then this optimizer's state")

    @property
    def world_size(self) -> int:
        """M: the number of workers (processes under torch.distributed, or simulated replicas)."""
        return self.comm.world_size

    @property
    def is_main(self) -> bool:
        """True in the process hosting worker 0 (the one that should log and save)."""
        return self.comm.is_main

    def close(self) -> None:
        """Release the process group if this object created it (not one the caller initialised). A script that
        never calls it still has that group destroyed at exit, before the interpreter's teardown (where a live gloo
        group can abort the process)."""
        if self._owns_comm:
            self.comm.close()

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """``with lordo.distributed(...) as opt:``: at the end of the block, :meth:`finish` (unless an exception
        ends it: a collective then could wait on a failed peer) and :meth:`close`."""
        try:
            if exc_type is None:
                self.finish()
        finally:
            self.close()

    def __repr__(self) -> str:
        if self.cfg is None:
            return (f"DistributedOptimizer(strategy={type(self.strategy).__name__}, workers={self.comm.world_size}, "
                    f"hosted={len(self.models)})")
        s = self.cfg.strategy
        return (
            f"DistributedOptimizer(strategy={s.name!r}, workers={self.comm.world_size}, "
            f"hosted={len(self.models)}, rank={s.rank}, sync_every={s.sync_every}, omega={s.omega})"
        )


StrategyFactory = Callable[[list[nn.Module], Communicator], Strategy]


def _own_strategy(factory: StrategyFactory | None, models: list[nn.Module], comm: Communicator) -> Strategy:
    assert factory is not None
    built = factory(models, comm)
    if not isinstance(built, Strategy):
        raise ConfigError(f"the strategy factory must return a lordo.strategies Strategy, got {type(built).__name__}")
    built.name = built.name or type(built).__name__
    return built


__all__ = ["DistributedOptimizer", "StrategyFactory", "default_groups", "reshard"]
