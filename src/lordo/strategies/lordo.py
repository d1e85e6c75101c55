"""LoRDO: local low-rank QH-Adam steps with error feedback, synchronised every K steps.

One class, three configurations (``strategies.build`` makes them from a config):

- ``lordo`` (LoRDO-Global): :class:`~.basis.GlobalBasis`; the low-rank moments are averaged and rotated into
  the new basis; each local step adds a full-rank quasi-hyperbolic term (weight 1 − ω) so the
  pseudo-gradient, and with it the next basis, can leave the current subspace.
- ``lordo-global-noqh``: the same with ω = 1 in the inner optimizers: stagnates in a fixed subspace (the
  paper's ablation).
- ``lordo-local``: :class:`~.basis.LocalBasis`, each worker's own; moments stay local.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..comm.basis_codec import BasisCodec
from ..comm.codec import average
from ..errors import ConfigError
from ..optim import LowRankQHAdam
from ..optim.subspace import side_of
from .basis import BasisPolicy, GlobalBasis, error_feedback_ratio, residual_energy
from .delayed import pick
from .local_adam import LocalUpdateStrategy


def _check_error_feedback_average(optimizers: Sequence[LowRankQHAdam], options: dict) -> None:
    if not all(g["error_feedback"] for opt in optimizers for g in opt.param_groups if g["rank"] is not None):
        raise ConfigError("strategy.average_error_feedback averages the error-feedback buffers: it needs "
                          "strategy.error_feedback = true")
    if any(isinstance(g.get("error_feedback_dtype"), str) for opt in optimizers for g in opt.param_groups):
        raise ConfigError("strategy.average_error_feedback averages E in place, which error_feedback_dtype int8 / int4 "
                          "holds compact between steps: use float32 or bfloat16 error feedback with it")
    if options.get("compress", "none") not in ("none", "bf16"):
        raise ConfigError(f"strategy.average_error_feedback sends the error-feedback buffers in fp32 or bf16: use "
                          f"strategy.compress = none or bf16, got {options['compress']!r}")
    if options.get("sync_delay", 0):
        raise ConfigError("strategy.average_error_feedback averages E at the synchronisation, which a delayed round "
                          "(strategy.sync_delay > 0) would overwrite with the steps taken meanwhile: use sync_delay = 0")


class LoRDOStrategy(LocalUpdateStrategy):
    """``LoRDOStrategy(models, comm, optimizers=[LowRankQHAdam(...)], sync_every=32, basis=GlobalBasis())``.

    The inner optimizers decide which matrices are low-rank (their groups with a ``rank``), their rank and ω;
    ``basis`` where the bases come from; ``average_moments`` (default ``lowrank``: the low-rank moments, small)
    and the other keywords are :class:`LocalUpdateStrategy`'s. ``average_error_feedback``: the low-rank
    matrices' error-feedback buffers E are averaged over the workers at each synchronisation, before the bases
    change (full-size tensors, counted in the ledger as ``error_feedback``)."""

    name = "lordo"

    def __init__(self, models: Sequence[nn.Module], comm: Communicator, *, optimizers: Sequence[LowRankQHAdam],
                 sync_every: int, basis: BasisPolicy | None = None, average_moments: str = "lowrank",
                 average_error_feedback: bool = False, **options: Any) -> None:
        if not all(isinstance(opt, LowRankQHAdam) for opt in optimizers):
            raise ConfigError("LoRDO's inner optimizers must be lordo.optim.LowRankQHAdam instances")
        if average_error_feedback:
            _check_error_feedback_average(optimizers, options)
            if comm.fault_tolerant:
                raise ConfigError("strategy.average_error_feedback is not supported on a fault-tolerant backend "
                                  "(torchft): a worker that joins has no error feedback to average")
        self.average_error_feedback = average_error_feedback
        self.basis = basis if basis is not None else GlobalBasis()
        if not isinstance(self.basis, BasisPolicy):
            raise ConfigError(f"basis must be a BasisPolicy (GlobalBasis() or LocalBasis()), got {type(self.basis).__name__}")
        if average_moments == "all" and any(g.get("moments_dtype") for opt in optimizers for g in opt.param_groups
                                            if g["rank"] is None):
            raise ConfigError("strategy.average_moments = \"all\" averages the full-rank moments in place, which "
                              "moments_dtype = \"int8\" holds compact: use average_moments = lowrank (or none), or "
                              "moments_dtype = float32")
        super().__init__(models, comm, optimizers=optimizers, sync_every=sync_every, average_moments=average_moments, **options)
        for opt in self.optimizers:
            opt.manages_bases = False  # the basis policy changes them at each synchronisation
        lowrank = {id(p) for p, _ in self.optimizer(0).lowrank_params()}
        self.lowrank_index = [i for i, p in enumerate(self.workers[0].params) if id(p) in lowrank]

    def anchor_needed(self) -> list[bool]:
        """Global bases come from the low-rank matrices' Δ: they need an anchor even with one worker."""
        if not isinstance(self.basis, GlobalBasis):
            return super().anchor_needed()
        lowrank = {id(p) for p, _ in self.workers[0].optimizer.lowrank_params()}  # type: ignore[attr-defined]
        return [id(p) in lowrank for p in self.workers[0].params]

    def optimizer(self, worker: int) -> LowRankQHAdam:
        opt = self.workers[worker].optimizer
        assert isinstance(opt, LowRankQHAdam)
        return opt

    @property
    def optimizers(self) -> list[LowRankQHAdam]:
        return [self.optimizer(i) for i in range(len(self.workers))]

    def lowrank(self, worker: int) -> list[torch.Tensor]:
        return [self.workers[worker].params[i] for i in self.lowrank_index]

    def averaged_params(self, worker: int) -> list[torch.Tensor]:
        if self.average == "all":
            return self.workers[worker].params
        return self.lowrank(worker) if self.average == "lowrank" else []

    @torch.no_grad()
    def before_local_step(self) -> dict[str, float]:
        lowrank = [self.lowrank(w) for w in range(len(self.workers))]
        step = self.steps_done

        def bases() -> None:
            self.basis.before_step(step, self.sync_every, lowrank, self.optimizers, self.comm)

        if step == 0 and isinstance(self.basis, GlobalBasis):  # the initial basis is all-reduced: a round
            self.comm.round("initial_basis", bases, self, 1)
        else:
            bases()
        return {}

    @torch.no_grad()
    def mirror_round(self, kind: str, resume_at: int) -> None:
        if kind != "initial_basis":
            super().mirror_round(kind, resume_at)
            return
        for p in self.lowrank(0):  # no gradient of its own: zeros, left out of the mean anyway
            p.grad = torch.zeros_like(p)
        self.basis.before_step(0, self.sync_every, [self.lowrank(0)], self.optimizers, self.comm)
        for p in self.lowrank(0):
            p.grad = None
        self.steps_done = resume_at  # its first local step is the others' first one: it sits that one out

    @torch.no_grad()
    def forget_own_errors(self) -> None:
        super().forget_own_errors()
        for opt in self.optimizers:
            opt.forget_error_feedback()

    @property
    def shared_bases(self) -> bool:
        return isinstance(self.basis, GlobalBasis)

    def _bind_bases(self) -> None:
        """Hand the round's bases to a basis codec: each payload tensor's (P, side), None for full-rank ones."""
        codec = self.codecs["pseudo_gradient"]
        if not isinstance(codec, BasisCodec):
            return
        state, lowrank = self.optimizer(0).state, set(self.lowrank_index)
        codec.bases = [(state[p]["basis"], side_of(p.shape)) if i in lowrank and "basis" in state[p] else None
                       for i, p in enumerate(self.workers[0].params)]

    def synchronise(self, final: bool = False) -> dict[str, float]:
        self._bind_bases()
        return super().synchronise(final)

    def send(self) -> None:
        self._bind_bases()
        super().send()

    def sync_round(self) -> dict[str, float]:
        if self.average_error_feedback:
            buffers = [[self.optimizer(w).settled_error_feedback(p) for p in self.lowrank(w)] for w in range(len(self.workers))]
            if all(e is not None for row in buffers for e in row):  # none before the first step
                average(self.comm, buffers, "error_feedback", self.codecs["pseudo_gradient"])  # type: ignore[arg-type]
        return super().sync_round()

    def round_input(self) -> Any:
        return self.basis.take_round_input()  # lordo-local: each worker's own gradients of the sync step

    def restore_round_input(self, value: Any) -> None:
        self.basis.give_round_input(value)

    @torch.no_grad()
    def after_average(self, delta: Sequence[torch.Tensor]) -> dict[str, float]:
        opt0, low0 = self.optimizer(0), self.lowrank(0)
        delta_low = pick(delta, self.lowrank_index)  # a round held as codes: decoded one matrix at a time
        # worker 0's error feedback against the weights it belongs to (the anchor: the parameters hold Δ now)
        ef_ratio = error_feedback_ratio(opt0, low0, self.anchor_weights(self.lowrank_index))
        stats = {"residual_energy": residual_energy(delta_low, opt0, low0) or 0.0}
        overlaps = self.basis.at_sync(delta_low, [self.lowrank(w) for w in range(len(self.workers))], self.optimizers)
        stats["basis_overlap"] = sum(overlaps) / len(overlaps)
        if ef_ratio is not None:
            stats["error_feedback_norm"] = ef_ratio
        return stats

    def optimizer_bytes(self) -> dict[str, int]:
        return self.optimizer(0).state_bytes()

    def held(self, worker: int) -> dict[str, list[Any]]:
        out = super().held(worker)
        captured = getattr(self.basis, "_captured", None)  # lordo-local: the sync step's own gradients
        if captured is not None:
            out["round_in_flight"] = [*out.get("round_in_flight", []), captured[worker]]
        return out
