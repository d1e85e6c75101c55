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

A block-coded round (int8, int4) whose compression residual is folded into the model (``compress_residual =
"model"``) is held as codes (:class:`CodedDeltas`): what a worker sent is x − e, exactly the Δ_m a late landing
keeps, so the worker keeps its sent payloads, and the mean as the payloads that arrive; both are decoded at the
landing, one tensor at a time (:class:`CodedTensors`), and the round is encoded shard by shard from Δ computed one
tensor at a time (:class:`AnchorDeltas`). The two float32 copies of the model's size become two of the codec's (an
eighth of them at int4), and no float32 copy of the whole model is made on either side.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..comm.base import Communicator, RoundHandle
from ..comm.codec import BlockCodec, average, decode_span, exchange_shards, padded_numel, shard_numel, shard_payloads
from ..errors import ConfigError

if TYPE_CHECKING:
    from .anchor import Anchor
    from .base import Worker

Lists = list[list[torch.Tensor]]  # per hosted worker, per tensor


class Overlapped(Protocol):
    """What :func:`start_round` and :func:`land_round` use of a strategy (``LocalUpdateStrategy`` is one): its
    workers and anchor, the codecs of its payloads, and the parts of its blocking round they run apart."""
    anchor: Anchor
    workers: list[Worker]
    codecs: dict[str, Any]
    comm: Communicator
    fold_residuals: bool
    steps_done: int

    def worker_moments(self, key: str) -> Lists:
        """Each hosted worker's optimizer moments ``key`` of its averaged parameters (live tensors; those held
        compact only inside :meth:`moments_open`)."""
        ...

    def worker_moment_copies(self, key: str) -> Lists:
        """The same moments as new float32 tensors (decoded where held compact)."""
        ...

    def moments_open(self, keys: tuple[str, ...]) -> contextlib.AbstractContextManager:
        """The moments ``keys`` held compact as float32 tensors in the optimizers' state inside the block."""
        ...

    def averaged_params(self, worker: int) -> list[torch.Tensor]: ...

    def coded_rounds(self) -> bool:
        """Whether a round in flight holds the pseudo-gradients as codes."""
        ...

    def round_residuals(self) -> Lists:
        """Each worker's compression residuals for the round (buffers, or zeros to fold into the model)."""
        ...

    def round_input(self) -> Any: ...

    def restore_round_input(self, value: Any) -> None: ...

    def apply_round(self, delta: Sequence[torch.Tensor], own: Sequence[Sequence[torch.Tensor]] | None = None) -> dict[str, float]:
        """The averaged pseudo-gradient arrived: bases, outer step, new replicas (``own``: a late landing's Δ_m)."""
        ...


@dataclass
class CodedDeltas:
    """Each hosted worker's pseudo-gradient of a block-coded round as the payloads it sent (one per shard), and
    once the round has arrived, the mean's payloads (``[payload]`` per shard, as :func:`exchange_shards` gives)."""
    codec: BlockCodec
    shapes: list[torch.Size]
    sent: Lists  # per hosted worker, per shard
    received: list[list[list[torch.Tensor]]] | None = None

    @classmethod
    @torch.no_grad()
    def encode(cls, own: Sequence[AnchorDeltas], codec: BlockCodec, world: int) -> CodedDeltas:
        shapes = own[0].shapes
        shard = shard_numel(padded_numel(shapes, codec), world, codec)
        return cls(codec, shapes, [shard_payloads(mine, world, shard, codec) for mine in own])

    @property
    def shard(self) -> int:
        """Elements per shard (the world is the number of payloads each worker sent)."""
        return shard_numel(padded_numel(self.shapes, self.codec), len(self.sent[0]), self.codec)

    def exchange(self, comm: Communicator, tag: str, shard_residuals: list[torch.Tensor] | None) -> None:
        self.received = exchange_shards(comm, self.sent, f"{tag}_{self.codec.name}", self.codec, self.shard,
                                        shard_residuals)

    def own(self) -> list[CodedTensors]:
        """Each hosted worker's Δ as sent (x − e), each tensor decoded when it is read."""
        return [CodedTensors([[b] for b in mine], self.shapes, self.shard, self.codec) for mine in self.sent]

    def mean(self, h: int) -> CodedTensors:
        assert self.received is not None, "the round has not arrived"
        return CodedTensors(self.received[h], self.shapes, self.shard, self.codec)


class CodedTensors(Sequence[torch.Tensor]):
    """The tensors of a round's flat vector (:func:`~lordo.comm.codec.shard_payloads`' layout) held as its shards'
    payloads: tensor ``i`` is decoded from the blocks that hold it each time it is read, so a landing holds one
    tensor's float32 values at a time, never the whole vector (the same values as decoding it whole)."""

    def __init__(self, sources: list[list[torch.Tensor]], shapes: list[torch.Size], shard: int, codec: BlockCodec) -> None:
        self.sources, self.shapes, self.shard, self.codec = sources, shapes, shard, codec
        self.starts: list[int] = []
        start = 0
        for shape in shapes:
            self.starts.append(start)
            start += math.ceil(math.prod(shape) / codec.block) * codec.block

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, i):
        if not isinstance(i, int):
            raise TypeError(f"CodedTensors is read one tensor at a time, by an int index, not {type(i).__name__}")
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        start = self.starts[i]
        span = decode_span(self.sources, self.shard, self.codec, start, start + math.prod(self.shapes[i]))
        return span.view(self.shapes[i])


class AnchorDeltas(Sequence[torch.Tensor]):
    """A worker's pseudo-gradient θ_anchor − θ_m, each tensor computed when it is read (a round encoded shard by
    shard never holds the whole float32 Δ)."""

    def __init__(self, anchor: Anchor, tensors: Sequence[torch.Tensor]) -> None:
        self.anchor, self.tensors = anchor, tensors
        self.shapes = [t.shape for t in tensors]
        self.numels = [t.numel() for t in tensors]
        self.device = tensors[0].device

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i):
        return self.anchor.own_one(i, self.tensors[i])


def pick(tensors: Sequence[torch.Tensor], index: Sequence[int]) -> Sequence[torch.Tensor]:
    """``tensors[i]`` for each ``i`` of ``index``: a list where ``tensors`` is one, else a view that reads each when
    it is read (a round held as codes stays decoded one tensor at a time)."""
    if isinstance(tensors, list):
        return [tensors[i] for i in index]
    return _Picked(tensors, list(index))


class _Picked(Sequence[torch.Tensor]):
    def __init__(self, tensors: Sequence[torch.Tensor], positions: list[int]) -> None:
        self.tensors, self.positions = tensors, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, k):
        return self.tensors[self.positions[k]]


@dataclass
class RoundInFlight:
    sent_at: int  # the local step at whose end the round started
    own: Lists  # each hosted worker's pseudo-gradient as sent (empty when ``coded``)
    mean: Lists  # the buffers the exchange averages in place: the round's Δ once it has arrived (empty when ``coded``)
    moments: dict[str, tuple[Lists, Lists]]  # moment key → (each worker's moments at sent_at, their averages)
    basis_input: Any = None  # what the basis policy needs at the landing (LocalBasis: each worker's own gradients)
    handle: RoundHandle | None = None  # None once the exchange has arrived
    coded: CodedDeltas | None = None  # the pseudo-gradients as codes instead of ``own`` and ``mean``

    def own_deltas(self) -> Sequence[Sequence[torch.Tensor]]:
        """Each hosted worker's pseudo-gradient as it sent it (read one tensor at a time when held as codes)."""
        return self.coded.own() if self.coded is not None else self.own

    def mean_delta(self) -> Sequence[torch.Tensor]:
        """The round's averaged pseudo-gradient (hosted worker 0's copy; read one tensor at a time when held as
        codes)."""
        return self.coded.mean(0) if self.coded is not None else self.mean[0]

    def wait(self) -> None:
        """Block until the exchange has arrived (at once if it has)."""
        if self.handle is not None:
            handle, self.handle = self.handle, None
            handle.wait()

    def worker_share(self, h: int) -> list[Any]:
        """What hosted worker ``h`` holds of the round (its tensors, live)."""
        moments = [[sent[h], means[h]] for sent, means in self.moments.values()]
        deltas = [self.own[h], self.mean[h]] if self.coded is None else [
            self.coded.sent[h], None if self.coded.received is None else self.coded.received[h]]
        return [*deltas, moments, None if self.basis_input is None else self.basis_input[h]]

    def worker_state(self, h: int) -> dict[str, Any]:
        """What hosted worker ``h`` saves of the arrived round (tensors only, ``weights_only``-loadable)."""
        if self.coded is not None:
            assert self.coded.received is not None, "the round has not arrived"
            deltas = {"own_codes": [t.clone() for t in self.coded.sent[h]],
                      "mean_codes": [src[0].clone() for src in self.coded.received[h]]}
        else:
            deltas = {"own": [t.clone() for t in self.own[h]], "mean": [t.clone() for t in self.mean[h]]}
        return {
            **deltas,
            "moments": {key: [[t.clone() for t in sent[h]], [t.clone() for t in means[h]]]
                        for key, (sent, means) in self.moments.items()},
            "basis_input": None if self.basis_input is None else [t.clone() for t in self.basis_input[h]],
        }

    @classmethod
    def from_state(cls, sent_at: int, saved: list[dict[str, Any]], codec: Any, shapes: list[torch.Size]) -> RoundInFlight:
        """An arrived round from each hosted worker's :meth:`worker_state` (``codec``, ``shapes``: the
        pseudo-gradient's, for a round held as codes)."""
        keys = list(saved[0]["moments"])
        moments = {key: ([list(s["moments"][key][0]) for s in saved], [list(s["moments"][key][1]) for s in saved])
                   for key in keys}
        inputs = [s["basis_input"] for s in saved]
        basis_input = None if inputs[0] is None else [list(i) for i in inputs]
        if "own_codes" not in saved[0]:
            return cls(sent_at, [list(s["own"]) for s in saved], [list(s["mean"]) for s in saved], moments, basis_input)
        if not isinstance(codec, BlockCodec):
            raise ValueError("the state holds a block-coded synchronisation in flight, but this strategy's rounds "
                             f"are not block-coded (compress {getattr(codec, 'name', codec)!r})")
        coded = CodedDeltas(codec, shapes, [list(s["own_codes"]) for s in saved],
                            [[[t] for t in s["mean_codes"]] for s in saved])
        return cls(sent_at, [], [], moments, basis_input, coded=coded)


@torch.no_grad()
def start_round(s: Overlapped, moment_keys: tuple[str, ...]) -> RoundInFlight:
    """Start strategy ``s``'s synchronisation behind the next steps: its exchange handed to the communicator, what
    the landing needs kept (as codes where ``s.coded_rounds()``)."""
    moments = {}
    for key in moment_keys:
        sent = s.worker_moment_copies(key)
        if sent[0]:
            moments[key] = (sent, [[m.clone() for m in ms] for ms in sent])
    codecs, fold = s.codecs, s.fold_residuals
    shard_residuals = [w.shard_residual for w in s.workers if w.shard_residual is not None] or None
    own: Lists = []
    if s.coded_rounds():  # each shard's Δ computed and encoded alone: the float32 Δ never whole
        deltas = [AnchorDeltas(s.anchor, w.tensors) for w in s.workers]
        coded: CodedDeltas | None = CodedDeltas.encode(deltas, codecs["pseudo_gradient"], s.comm.world_size)
        mean: Lists = []
        residuals: Lists = []
    else:
        own = [s.anchor.own(w.tensors) for w in s.workers]
        coded, mean, residuals = None, [[d.clone() for d in mine] for mine in own], s.round_residuals()

    def exchange(comm: Communicator) -> None:  # the blocking round's collectives, in its order
        for key, (_, means) in moments.items():
            average(comm, means, key, codecs[key])
        if coded is not None:
            coded.exchange(comm, "pseudo_gradient", shard_residuals)
            return
        average(comm, mean, "pseudo_gradient", codecs["pseudo_gradient"], residuals, shard_residuals)
        if fold:  # what each worker sent, x − e: landing with it leaves −e in the model
            for mine, lost in zip(own, residuals, strict=True):
                torch._foreach_sub_(mine, lost)
            residuals.clear()

    r = RoundInFlight(s.steps_done, own, mean, moments, s.round_input(), coded=coded)
    r.handle = s.comm.start_round(exchange)
    return r


@torch.no_grad()
def land_round(s: Overlapped, r: RoundInFlight) -> dict[str, float]:
    """Apply round ``r`` to strategy ``s``, merged with the local steps taken since it started."""
    r.wait()
    delay = s.steps_done - r.sent_at
    with s.moments_open(tuple(r.moments)):
        for key, (sent, means) in r.moments.items():  # the averages replayed through the τ steps' decay
            beta, moments = (0 if key == "exp_avg" else 1), s.worker_moments(key)
            for i, w in enumerate(s.workers):
                betas = {id(p): g["betas"][beta] for g in w.optimizer.param_groups for p in g["params"]}
                for p, at_send, m, live in zip(s.averaged_params(i), sent[i], means[i], moments[i]):
                    live.add_(m - at_send, alpha=betas[id(p)] ** delay)
    captured_now = s.round_input()  # this step's, for the round it starts (τ = K): kept aside
    s.restore_round_input(r.basis_input)
    stats = s.apply_round(r.mean_delta(), r.own_deltas() if delay else None)
    s.restore_round_input(captured_now)
    stats["sync_delay_steps"] = float(delay)
    return stats


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
