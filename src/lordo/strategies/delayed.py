"""A synchronisation in flight (``sync_delay`` = τ > 0): started at a sync step, landed τ local steps later.

At the sync step s every worker m sends its pseudo-gradient Δ_m = θ_anchor − θ_m(s) and its moments due, as
they are at s, and keeps training from θ_m(s). The exchange runs behind the training (a thread on its own
process group under torch.distributed; at once on the simulator). At step s + τ the round lands: the outer
step and the averaged moments are applied as if they had arrived at s, and the τ local steps are kept on top:

    θ_m ← θ_new + (θ_m(s+τ) − θ_m(s)) = θ_m(s+τ) + (θ_new − θ_anchor) + Δ_m
    u_m ← u_m(s+τ) + β1^τ·(ū(s) − u_m(s))        v_m ← v_m(s+τ) + β2^τ·(v̄(s) − v_m(s))

The moments' rule is the exponential average's own: replacing u_m(s) by ū(s) and then taking the same τ
steps gives exactly this (and v stays ≥ 0). The new bases come from the round's Δ at s + τ and the merged
moments are rotated into them then; the error feedback of the τ steps stays in the old basis until that
rotation settles it, as at any basis change. With τ = 0 (a round landed at once, as ``finish`` does) this is
the blocking synchronisation. A :class:`RoundInFlight` holds what the landing needs; ``state_dict`` waits for
the exchange (not for the landing), so a checkpoint holds an arrived round and a resume lands it at s + τ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..comm.base import Communicator, RoundHandle
from ..errors import ConfigError

Lists = list[list[torch.Tensor]]  # per hosted worker, per tensor


@dataclass
class RoundInFlight:
    sent_at: int  # the local step at whose end the round started
    own: Lists  # each hosted worker's pseudo-gradient as sent
    mean: Lists  # the buffers the exchange averages in place: the round's Δ once it has arrived
    moments: dict[str, tuple[Lists, Lists]]  # moment key → (each worker's moments at sent_at, their averages)
    basis_input: Any = None  # what the basis policy needs at the landing (LocalBasis: each worker's own gradients)
    handle: RoundHandle | None = None  # None once the exchange has arrived

    def wait(self) -> None:
        """Block until the exchange has arrived (at once if it has)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            handle.wait()

    def worker_share(self, h: int) -> list[Any]:
        """What hosted worker ``h`` holds of the round (its tensors, live)."""
        moments = [[sent[h], means[h]] for sent, means in self.moments.values()]
        return [self.own[h], self.mean[h], moments, None if self.basis_input is None else self.basis_input[h]]

    def worker_state(self, h: int) -> dict[str, Any]:
        """What hosted worker ``h`` saves of the arrived round (tensors only, ``weights_only``-loadable)."""
        return {
            "own": [t.clone() for t in self.own[h]],
            "mean": [t.clone() for t in self.mean[h]],
            "moments": {key: [[t.clone() for t in sent[h]], [t.clone() for t in means[h]]]
                        for key, (sent, means) in self.moments.items()},
            "basis_input": None if self.basis_input is None else [t.clone() for t in self.basis_input[h]],
        }

    @classmethod
    def from_state(cls, sent_at: int, saved: list[dict[str, Any]]) -> RoundInFlight:
        """An arrived round from each hosted worker's :meth:`worker_state`."""
        keys = list(saved[0]["moments"])
        moments = {key: ([list(s["moments"][key][0]) for s in saved], [list(s["moments"][key][1]) for s in saved])
                   for key in keys}
        inputs = [s["basis_input"] for s in saved]
        return cls(sent_at, [list(s["own"]) for s in saved], [list(s["mean"]) for s in saved], moments,
                   None if inputs[0] is None else [list(i) for i in inputs])


def check_delay(comm: Communicator, moment_periods: dict[str, int]) -> None:
    """Refuse ``sync_delay`` > 0 where a round cannot run behind the steps, naming why."""
    if comm.fault_tolerant:
        raise ConfigError("strategy.sync_delay > 0 runs a synchronisation behind the next steps; a fault-tolerant "
                          "backend (torchft) runs each as a round that can fail and be retried: use sync_delay = 0")
    if not comm.overlaps_rounds:
        raise ConfigError("strategy.sync_delay > 0 needs one process per worker (backend gloo or nccl) or the "
                          "simulator; workers made of several ranks (dist.ranks_per_worker > 1) synchronise "
                          "blocking: use sync_delay = 0")
    if any(moment_periods.values()):
        raise ConfigError("strategy.sync_delay > 0 cannot be combined with sync_exp_avg_every / "
                          "sync_exp_avg_sq_every (moments averaged between synchronisations): leave them at 0")
