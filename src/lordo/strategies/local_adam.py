"""Local-update strategies: K local optimizer steps per worker, then the workers average.

At a synchronisation every worker sends its pseudo-gradient Δ_m = θ_anchor − θ_m. The mean Δ becomes the
``.grad`` of the anchor (the model at the last synchronisation, one copy per process) and an outer
``torch.optim`` optimizer steps it: SGD at lr 1 is plain model averaging (θ_new = θ_anchor − Δ), SGD with
Nesterov momentum is DiLoCo. Every worker then restarts from θ_new. Optimizer moments can be averaged too,
at every sync or with periods of their own (DES-LOC). Payloads travel through a codec (``comm.codec``:
fp32, bf16, int8), with error feedback of what a lossy codec dropped (the moments: ``moments.py``). With
``sync_delay`` = τ > 0 a synchronisation runs behind the next τ local steps and lands merged with them
(``delayed.py``).

``local-adam`` is this class with AdamW as the inner optimizer; LoRDO's strategies (``lordo.py``) extend it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm import Communicator
from ..comm.basis_codec import SparseSettings, check_sparse
from ..comm.codec import ALL_COMPRESSIONS, BlockCodec, add_shard, average, padded_numel, shard_numel
from ..comm.payloads import sync_codecs
from ..errors import ConfigError, NonFiniteError
from .anchor import Anchor
from .base import Strategy, check_number, inner_state_bytes, tensor_bytes
from .delayed import RoundInFlight, check_delay, land_round, start_round
from .moments import MOMENTS, MomentAveraging

RESIDUALS = ("buffer", "model")
AVERAGED = ("none", "lowrank", "all")
OuterFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def model_averaging(anchor: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The default outer optimizer: SGD at lr 1 on the averaged pseudo-gradient, i.e. θ_new = mean of θ_m."""
    return torch.optim.SGD(anchor, lr=1.0)


class LocalUpdateStrategy(MomentAveraging, Strategy):
    """``LocalUpdateStrategy(models, comm, optimizers=[...], sync_every=32)``: K local steps, then average.

    ``outer_optimizer``: builds the outer optimizer over the anchor tensors (default :func:`model_averaging`;
    e.g. ``lambda a: torch.optim.SGD(a, lr=0.7, momentum=0.9, nesterov=True)`` for DiLoCo).
    ``average_moments``: none | all (every parameter's ``exp_avg``/``exp_avg_sq``); ``moment_periods``: steps
    between averages of each (0 = at every sync). ``compress``: none | bf16 | int8 | int4 payloads, sparse
    (chunk-wise top-k) or basis (coefficients in a shared basis plus a sparse residual: LoRDO's global variants),
    the last two as ``compress_settings`` says; ``compression_feedback`` keeps what compressing the
    pseudo-gradient lost for the next round.
    ``offload_anchor``: keep the anchor in host memory (pinned when a GPU is present), copied to the device one
    tensor at a time at each synchronisation: the device holds no full-size copy of the model for it.
    ``sync_delay``: τ in [0, sync_every], the local steps a synchronisation runs behind before it lands
    (0: it blocks every worker; ``delayed.py`` says how a late round is merged)."""

    name = "local-adam"
    recoverable = True
    shardable = True  # everything it exchanges is per-parameter: a rank exchanges its shards (Worker.tensors)

    def __init__(self, models: Sequence[nn.Module], comm: Communicator, *, optimizers: Sequence[torch.optim.Optimizer],
                 sync_every: int, outer_optimizer: OuterFactory = model_averaging, average_moments: str = "none",
                 moment_periods: dict[str, int] | None = None, compress: str = "none",
                 compress_settings: SparseSettings | None = None, compression_feedback: bool = True,
                 grad_clip: float = 0.5, sync_buffers: bool = True,
                 offload_anchor: bool = False, sync_delay: int = 0, anchor_dtype: str = "float32",
                 compression_residual: str = "buffer") -> None:
        super().__init__(models, comm, optimizers=optimizers, grad_clip=grad_clip, sync_buffers=sync_buffers)
        check_number("sync_every", sync_every, minimum=1, integer=True)
        check_number("sync_delay", sync_delay, integer=True)
        if sync_delay > sync_every:
            raise ConfigError(f"sync_delay must be in [0, sync_every = {sync_every}] (a round lands before the next "
                              f"one starts), got {sync_delay}")
        if average_moments not in AVERAGED:
            raise ConfigError(f"average_moments must be one of {', '.join(AVERAGED)}, got {average_moments!r}")
        if compress not in ALL_COMPRESSIONS:
            raise ConfigError(f"compress must be one of {', '.join(ALL_COMPRESSIONS)}, got {compress!r}")
        if compress in ("sparse", "basis"):
            check_sparse(compress, compress_settings or SparseSettings(), comm, self.name, self.shared_bases)
        self.moment_periods = dict.fromkeys(MOMENTS, 0) | dict(moment_periods or {})
        for key, period in self.moment_periods.items():
            if key not in MOMENTS:
                raise ConfigError(f"moment_periods keys are {', '.join(MOMENTS)}, got {key!r}")
            check_number(f"moment_periods[{key!r}]", period, integer=True)
        if comm.fault_tolerant and any(self.moment_periods.values()):
            raise ConfigError("strategy.sync_exp_avg_every / sync_exp_avg_sq_every (moment_periods) average moments "
                              "between synchronisations; a fault-tolerant backend (torchft) communicates only at "
                              "synchronisations: leave them at 0")
        if comm.fault_tolerant and compress in ("int8", "int4"):
            raise ConfigError(f"strategy.compress = {compress!r} gathers quantised shards; a fault-tolerant backend "
                              "(torchft) only averages: use none or bf16")
        if sync_delay:
            check_delay(comm, self.moment_periods)
        self.sync_every, self.average, self.sync_delay = sync_every, average_moments, sync_delay
        self.in_flight: RoundInFlight | None = None
        self.codecs = sync_codecs(compress, compress_settings)
        # the anchor (last synchronised model) is the same on every worker: one copy per process (anchor.py); with
        # one worker and plain averaging only what the bases are computed from needs one
        alone = comm.world_size == 1 and not comm.fault_tolerant and compress == "none"
        keep = self.anchor_needed() if alone else None
        self.anchor = Anchor(self.workers[0].tensors, outer_optimizer, dtype=anchor_dtype, offload=offload_anchor,
                             keep=keep)
        self.outer = self.anchor.outer
        self.offload_anchor = offload_anchor
        self.syncs = 0
        self.synced_at = 0  # the step of the last synchronisation (0: the replicas start equal)
        # called with each averaged pseudo-gradient as it arrives, before the strategy acts on it (bases, outer
        # step): a benchmark or a diagnostic that wants the rounds' Δ; must not change it
        self.round_observers: list[Callable[[Sequence[torch.Tensor]], None]] = []
        if compression_residual not in RESIDUALS:
            raise ConfigError(f"compression_residual must be one of {', '.join(RESIDUALS)}, got {compression_residual!r}")
        # what compressing the pseudo-gradient lost: in buffers until the next round adds it, or folded into each
        # worker's model after the round (the next round's pseudo-gradient then holds it: no buffer between rounds).
        # A block codec loses twice: the worker's encoding, and the shard owner's re-encoding of the mean; a folded
        # blocking round folds the second too (M times it into the owner's model: its next Δ brings it to the mean),
        # a round in flight keeps it in the owner's buffer (it arrives when the model has moved on)
        self.fold_residuals = compress != "none" and compression_feedback and compression_residual == "model"
        # the shard owner's loss folded too: blocking block-coded rounds (a round in flight keeps it in a buffer)
        self.fold_shard_residuals = (self.fold_residuals and not sync_delay
                                     and isinstance(self.codecs["pseudo_gradient"], BlockCodec))
        if compress != "none" and compression_feedback:
            codec = self.codecs["pseudo_gradient"]
            for w in self.workers:
                w.residuals = [] if self.fold_residuals else [torch.zeros_like(t) for t in w.tensors]
                if isinstance(codec, BlockCodec) and not self.fold_shard_residuals:
                    padded = padded_numel([t.numel() for t in w.tensors], codec)
                    w.shard_residual = torch.zeros(shard_numel(padded, comm.world_size, codec), device=w.tensors[0].device)

    def anchor_needed(self) -> list[bool]:
        """Which tensors need an anchor when a synchronisation leaves the model as it is (one worker, plain averaging):
        those whose Δ the strategy reads at a synchronisation (none here)."""
        return [False] * len(self.workers[0].tensors)

    def anchor_weights(self, indices: Sequence[int]) -> list[torch.Tensor]:
        """Worker 0's weights at the last synchronisation for tensors ``indices`` (float32, on the device): the anchor,
        or for a tensor without one (a synchronisation leaves it as it is) worker 0's own."""
        return [self.anchor.decoded(i) if self.anchor.keep[i] else self.workers[0].tensors[i] for i in indices]

    @property
    def shared_bases(self) -> bool:
        """Whether every worker holds the same low-rank bases (what ``compress = "basis"`` sends in)."""
        return False

    def averaged_params(self, worker: int) -> list[torch.Tensor]:
        """Parameters whose optimizer moments are averaged."""
        return self.workers[worker].params if self.average == "all" else []

    def before_local_step(self) -> dict[str, float]:
        """Hook: runs after backward, before any local optimizer step (gradients are in ``.grad``)."""
        return {}

    def after_average(self, delta: Sequence[torch.Tensor]) -> dict[str, float]:
        """Hook: runs at a sync with the averaged pseudo-gradient ``delta`` (ordered like the anchor), before
        the outer step."""
        return {}

    def step(self, lr: float | None = None) -> dict[str, float]:
        self.set_lr(lr)
        self.grads()  # raises if backward was not called
        stats = self.before_local_step()
        stats["grad_norm"] = self.clip_and_step()[0]
        if self.in_flight is not None and self.steps_done - self.in_flight.sent_at >= self.sync_delay:
            stats.update(self.land())
        if self.steps_done % self.sync_every == 0:
            if self.sync_delay:
                self.send()
                stats["sync_started"] = 1.0
            else:
                stats.update(self.comm.round("sync", self.sync_round, self, self.steps_done))
        else:
            self.average_moments(False)
        return stats

    def sync_round(self) -> dict[str, float]:
        """What a synchronisation exchanges: the moments due, then the pseudo-gradients."""
        self.average_moments(True)
        return self.synchronise()

    def finish(self) -> dict[str, float]:
        stats = self.land() if self.in_flight is not None else {}  # a round in flight lands now
        if not self.in_sync:
            stats.update(self.comm.round("final", self.final_round, self, self.steps_done))
        return stats

    def final_round(self) -> dict[str, float]:
        return self.synchronise(final=True)

    def round_input(self) -> Any:
        """Hook: what ``after_average`` will need of this step's state, handed to a round in flight."""
        return None

    def restore_round_input(self, value: Any) -> None:  # noqa: B027 (nothing to restore unless round_input gives it)
        """Hook: put back, at the landing, what :meth:`round_input` handed to the round."""

    def send(self) -> None:
        """Start a synchronisation without blocking (``sync_delay`` > 0): each worker's pseudo-gradient and
        moments due, as they are now, averaged behind the next local steps (``delayed.py``)."""
        self.in_flight = start_round(self, MOMENTS)

    def coded_rounds(self) -> bool:
        """Whether a round in flight holds the pseudo-gradients as codes: block-coded rounds whose compression
        residual is folded into the model, over more than one worker."""
        return self.fold_residuals and isinstance(self.codecs["pseudo_gradient"], BlockCodec) and self.comm.world_size > 1

    def land(self) -> dict[str, float]:
        """Apply the round in flight, merged with the local steps taken since it started (``delayed.py``)."""
        r, self.in_flight = self.in_flight, None
        assert r is not None
        return land_round(self, r)

    def mirror_round(self, kind: str, resume_at: int) -> None:
        # the received model is the anchor: a pseudo-gradient of zero, left out of every mean anyway
        self.steps_done = resume_at
        rounds = {"sync": self.sync_round, "final": self.final_round}
        if kind not in rounds:
            raise ValueError(f"cannot take part in a {kind!r} round")
        rounds[kind]()

    @torch.no_grad()
    def forget_own_errors(self) -> None:
        for w in self.workers:
            for e in w.residuals:
                e.zero_()
            if w.shard_residual is not None:
                w.shard_residual.zero_()

    @property
    def in_sync(self) -> bool:
        return self.synced_at == self.steps_done

    @torch.no_grad()
    def synchronise(self, final: bool = False) -> dict[str, float]:
        """A blocking round; ``final``: the last of the run, after which every worker holds the same model (a
        folded residual is not carried: no round follows to deliver it, as a buffered one is not either)."""
        # each worker's parameters become its pseudo-gradient in place (they are overwritten below anyway)
        pseudo = [[t.data for t in self.anchor.pseudo_gradients(w.tensors)] for w in self.workers]
        codec, world = self.codecs["pseudo_gradient"], self.comm.world_size
        shard_residuals = [w.shard_residual for w in self.workers if w.shard_residual is not None] or None
        fold_shards = self.fold_shard_residuals and world > 1
        if fold_shards:  # zeros the round fills with what re-encoding each owned shard's mean lost
            shard = shard_numel(padded_numel([t.numel() for t in pseudo[0]], codec), world, codec)
            shard_residuals = [torch.zeros(shard, device=pseudo[0][0].device) for _ in self.workers]
        residuals = self.round_residuals()
        average(self.comm, pseudo, "pseudo_gradient", codec, residuals, shard_residuals)
        stats = self.apply_round(pseudo[0])
        if self.fold_residuals and not final:  # each worker starts the next round at θ_new − e: its next Δ carries e
            for h, (w, lost) in enumerate(zip(self.workers, residuals, strict=True)):
                if fold_shards:  # and the owner of a shard at θ_new − M·r there: its next Δ brings r to the mean
                    assert shard_residuals is not None
                    add_shard(lost, shard_residuals[h] * world, self.comm.local_ranks[h], world, codec.block)
                torch._foreach_sub_(w.tensors, lost)
        return stats

    def round_residuals(self) -> list[list[torch.Tensor]]:
        """Each worker's compression residuals for this round: its buffers, or zeros that the round fills with what
        it loses and that are folded into the model after it (``compression_residual = "model"``)."""
        if self.fold_residuals:
            return [[torch.zeros_like(t) for t in w.tensors] for w in self.workers]
        return [w.residuals for w in self.workers]

    @torch.no_grad()
    def apply_round(self, delta: Sequence[torch.Tensor],
                    own: Sequence[Sequence[torch.Tensor]] | None = None) -> dict[str, float]:
        """The averaged pseudo-gradient ``delta`` arrived: bases (``after_average``), outer step, new replicas.
        ``own``: each worker's pseudo-gradient of a round that landed late; the workers then keep their local
        steps since (θ_m += θ_new − θ_anchor + Δ_m) instead of restarting from θ_new."""
        finite = all(bool(torch.isfinite(d).all()) for d in delta)
        if getattr(self.comm, "sharded", False):  # each rank checked its own shards: all must take one branch
            finite = not self.comm.agree([not finite])[0]
        if not finite:
            self.anchor.restore([w.tensors for w in self.workers])  # roll back: every replica holds the last good model
            raise NonFiniteError(
                f"the averaged pseudo-gradient is not finite at synchronisation {self.syncs + 1} (after optimizer "
                f"step {self.steps_done}); every worker was reset to the model of the previous synchronisation"
                f"{self._state_verdict()}"
            )
        stats = {"synced": 1.0, "pseudo_grad_norm": self.total_norm(delta)}
        for observe in self.round_observers:
            observe(delta)
        stats.update(self.after_average(delta))
        self.anchor.step(delta, [w.tensors for w in self.workers], own)
        if own is None:
            self.synced_at = self.steps_done
        self.average_buffers()
        self.syncs += 1
        return stats

    def _state_verdict(self) -> str:
        """What a caller must know after a failed synchronisation: the model was rolled back, the optimizer state
        (moments, error feedback) was not, and where it is not finite every later synchronisation fails again."""
        bad = [self.comm.local_ranks[i] for i, w in enumerate(self.workers)
               if any(t.is_floating_point() and not bool(torch.isfinite(t).all())
                      for state in w.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))]
        if not bad:
            return "; the optimizer state is finite"
        return (f"; the optimizer state of worker(s) {', '.join(map(str, bad))} is not finite (moments or error "
                "feedback) and was not reset: load a state_dict saved before the failure (or a checkpoint) to go on")

    def state_dict(self) -> dict[str, Any]:
        if self.in_flight is not None:  # a round in flight is saved once it has arrived (its landing stays due)
            self.in_flight.wait()
        state = super().state_dict()
        for h, (saved, w) in enumerate(zip(state["workers"], self.workers)):
            if self.in_flight is not None:
                saved["round_in_flight"] = self.in_flight.worker_state(h)
            if w.residuals:
                saved["compression_error"] = [e.clone() for e in w.residuals]
            if w.shard_residual is not None:
                saved["shard_compression_error"] = w.shard_residual.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for saved, w in zip(state["workers"], self.workers):
            if w.residuals:
                torch._foreach_copy_(w.residuals, list(saved["compression_error"]))
            if w.shard_residual is not None:
                w.shard_residual.copy_(saved["shard_compression_error"])
        sent_at = state["shared"].get("round_in_flight_sent_at", -1)
        self.in_flight = None
        if sent_at >= 0:
            if not self.sync_delay:
                raise ValueError("the state holds a synchronisation in flight, but this strategy has sync_delay = 0")
            self.in_flight = RoundInFlight.from_state(int(sent_at), [w["round_in_flight"] for w in state["workers"]],
                                                      self.codecs["pseudo_gradient"], [t.shape for t in self.workers[0].tensors])

    def shared_state(self) -> dict[str, Any]:
        return {
            "steps_done": self.steps_done,
            "syncs": self.syncs,
            "synced_at": self.synced_at,
            **self.anchor.state_dict(),
            "round_in_flight_sent_at": -1 if self.in_flight is None else self.in_flight.sent_at,
        }

    def load_shared_state(self, state: dict[str, Any]) -> None:
        self.steps_done, self.syncs = int(state["steps_done"]), int(state["syncs"])
        # older checkpoints lack it: they were taken after the step's synchronisation, if one was due
        self.synced_at = int(state.get("synced_at", self.steps_done - self.steps_done % self.sync_every))
        if "outer_optimizer" not in state and "anchor_dtype" not in state:
            # checkpoint format 1: the hand-written outer momentum, one buffer per anchor tensor (or none)
            buffers = list(state.get("outer_momentum", []))
            outer = self.outer.state_dict()
            outer["state"] = {i: {"momentum_buffer": b.clone()} for i, b in enumerate(buffers)}
            state = {**state, "outer_optimizer": outer}
        self.anchor.load_state_dict(state)

    def optimizer_bytes(self) -> dict[str, int]:
        return inner_state_bytes(self.workers[0].optimizer, self.workers[0].tensors)

    def held(self, worker: int) -> dict[str, list[Any]]:
        w, out = self.workers[worker], super().held(worker)
        out["anchor"] = self.anchor.held()
        out["outer_optimizer"] = [self.outer.state]
        out["compression_feedback"] = [w.residuals, w.shard_residual]
        if self.in_flight is not None:
            out["round_in_flight"] = [self.in_flight.worker_share(worker)]
        return out

    def host_categories(self) -> frozenset[str]:
        return frozenset({"anchor"}) if self.offload_anchor else frozenset()

    def state_bytes(self) -> dict[str, int]:
        out = self.optimizer_bytes()
        out["anchor (host)" if self.offload_anchor else "anchor"] = self.anchor.accounted_bytes()
        outer = tensor_bytes(t for s in self.outer.state.values() for t in s.values())
        if outer:
            out["outer_optimizer"] = outer
        if self.sync_delay:  # held while a round is in flight: the pseudo-gradient sent and its mean, moments too
            # (float32 copies, of the compact moments too: the worker's first, without reading the others')
            moments = [t for key in MOMENTS for t in self._moment_copies(0, key)] if self.average != "none" else []
            deltas = 2 * tensor_bytes(self.workers[0].tensors)
            if self.coded_rounds():  # as codes: one payload per shard sent, one per shard received
                codec, world = self.codecs["pseudo_gradient"], self.comm.world_size
                deltas = 2 * world * codec.nbytes(shard_numel(padded_numel([t.shape for t in self.workers[0].tensors],
                                                                           codec), world, codec))
            out["round_in_flight"] = deltas + 2 * tensor_bytes(moments)
        if self.workers[0].residuals or self.workers[0].shard_residual is not None:
            out["compression_feedback"] = tensor_bytes([*self.workers[0].residuals, self.workers[0].shard_residual])
        return out


LocalAdamStrategy = LocalUpdateStrategy
