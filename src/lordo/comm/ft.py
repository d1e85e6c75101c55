"""Workers that fail without stopping the others: LoRDO's synchronisations over torchft.

Each process is one worker (a torchft replica group of one rank). Every synchronisation is a *round*: the
workers alive form a quorum (torchft's Lighthouse decides who is in), average over the ones that contribute,
and commit only if every collective of the round succeeded. A worker that dies between rounds is left out of
the next quorum; one that dies inside a round makes the round fail on the others, who restore what they held
before it and run it again without it. A worker that starts late or restarts asks for a quorum at once;
torchft sees it is behind and it receives, from a peer, the state that peer held after its last committed
round (model, anchor, moments, bases, counters) and the kind of round the others are in; it takes part in
that round without contributing (its tensors are left out of every mean) and leaves it holding exactly what
the others hold, the same bases included, then trains on from their step.

Means are taken over the workers that contribute: every collective carries a count beside its tensors.
Control traffic that :class:`~lordo.comm.base.Communicator` sends between rounds elsewhere (stop flags,
non-finite checks) stays local here: a per-step collective over a link that may fail would defeat the point.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
import urllib.parse
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import ConfigError
from .base import Communicator, TensorLists
from .torch_dist import CommError

ENV_LIGHTHOUSE, ENV_REPLICA, ENV_REPLICAS = "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"
ENV_MIN = "TORCHFT_MIN_REPLICAS"


def _torchft():
    # torchft's Rust side logs every quorum at INFO (~50 lines per 48 steps): warnings only, unless the user
    # asks (RUST_LOG=info); read when torchft is first imported
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
        from torchft.process_group import ProcessGroupGloo
    except ImportError as exc:
        raise ConfigError("backend 'torchft' needs the torchft package: pip install 'lordo[ft]'") from exc
    return torchft.Manager, ProcessGroupGloo


def check_lighthouse(address: str, timeout_s: float = 5.0) -> None:
    """The Lighthouse's address is ``http://HOST:PORT`` and something listens there; a clear error otherwise
    (torchft itself fails only after its quorum timeout, with a traceback)."""
    parsed = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None:
        raise ConfigError(f"${ENV_LIGHTHOUSE} (the Lighthouse's address) must look like http://HOST:PORT, got {address!r}")
    try:
        socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(f"no Lighthouse answers at {address} ({exc.strerror or exc}): start one there with "
                          f"`torchft_lighthouse --min_replicas 1 --bind [::]:{port}`, or set ${ENV_LIGHTHOUSE} to the one "
                          "the other workers use (docs/multi-node.md)") from None


class _QuorumWatch:
    """A torchft Manager's client, as it was, that also keeps the replica ids of the last quorum it returned (the
    Manager reads them and keeps none): how a worker sees another one under its own replica id."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.replica_ids: list[str] = []

    @classmethod
    def around(cls, manager: Any) -> _QuorumWatch | None:
        client = getattr(manager, "_client", None)
        if client is None or not hasattr(client, "_quorum"):  # another torchft: the start round's check remains
            return None
        if not isinstance(client, cls):
            manager._client = cls(client)
        return manager._client

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self.replica_ids = [str(rid) for rid in getattr(result, "replica_ids", [])]
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class TorchFTCommunicator(Communicator):
    """``TorchFTCommunicator(workers, replica, lighthouse=..., min_workers=...)``: this process is worker
    ``replica`` of ``workers`` (the number the run is planned for: it shards the data and scales the
    accounting); the collectives go through a ``torchft.Manager`` whose quorum needs ``min_workers`` workers.
    ``lighthouse``: the Lighthouse's address (default: ``$TORCHFT_LIGHTHOUSE``). ``timeout_s`` bounds each
    collective and a checkpoint transfer, ``quorum_timeout_s`` the wait for a quorum (longer than the time
    between two synchronisations). A failed round is run again at most ``attempts`` times."""

    fault_tolerant = True

    def __init__(self, workers: int, replica: int, *, lighthouse: str | None = None, min_workers: int = 1,
                 timeout_s: float = 60.0, quorum_timeout_s: float = 600.0, attempts: int = 5) -> None:
        for name, value, low in (("workers", workers, 1), ("min_workers", min_workers, 1), ("attempts", attempts, 1)):
            if not (isinstance(value, int) and value >= low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(replica, int) and 0 <= replica < workers):
            raise ConfigError(f"replica must be an integer in 0 .. {workers - 1} (workers - 1), got {replica!r}")
        if min_workers > workers:
            raise ConfigError(f"min_workers ({min_workers}) cannot exceed workers ({workers})")
        lighthouse = lighthouse or os.environ.get(ENV_LIGHTHOUSE)
        if not lighthouse:
            raise ConfigError(f"backend 'torchft' needs a Lighthouse: set ${ENV_LIGHTHOUSE} (e.g. http://host:29510) or "
                              "pass lighthouse=; start one with `torchft_lighthouse --min_replicas 2` (docs/multi-node.md)")
        check_lighthouse(lighthouse)
        manager_cls, pg_cls = _torchft()
        import torch.distributed as dist

        super().__init__(workers, [replica])
        self.lighthouse = lighthouse
        timeout = _dt.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this replica group's
        self.manager = manager_cls(
            pg=pg_cls(timeout=timeout), load_state_dict=self._receive, state_dict=self._offer,
            min_replica_size=min_workers, use_async_quorum=False, replica_id=f"lordo_{replica}",
            store_addr="localhost", store_port=self._store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
            timeout=timeout, quorum_timeout=_dt.timedelta(seconds=quorum_timeout_s), init_sync=False)
        self._setup(attempts, owns_manager=True)

    @classmethod
    def over(cls, manager: Any, workers: int, replica: int, attempts: int = 5) -> TorchFTCommunicator:
        """Over a ``torchft.Manager`` the caller built (as for torchft's own DiLoCo: ``use_async_quorum=False``):
        lordo's state for a recovering peer is registered with it under the key ``lordo``; it is not shut down
        by :meth:`close`."""
        for name, value, low in (("workers", workers, 1), ("attempts", attempts, 1)):
            if not (isinstance(value, int) and value >= low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if not (isinstance(replica, int) and 0 <= replica < workers):
            raise ConfigError(f"replica must be an integer in 0 .. {workers - 1} (workers - 1), got {replica!r}")
        if getattr(manager, "_use_async_quorum", False):
            raise ConfigError("LoRDO's rounds need the Manager's synchronous quorum: build it with use_async_quorum=False "
                              "(as torchft's DiLoCo requires too)")
        self = cls.__new__(cls)
        Communicator.__init__(self, workers, [replica])
        self.lighthouse = getattr(manager, "_lighthouse_addr", None) or os.environ.get(ENV_LIGHTHOUSE, "")
        self.manager = manager
        manager.register_state_dict_fn("lordo", self._receive, self._offer)
        self._setup(attempts, owns_manager=False)
        return self

    def _setup(self, attempts: int, owns_manager: bool) -> None:
        self._quorums = _QuorumWatch.around(self.manager)
        self.backend = "gloo"  # torchft's process group (recorded in the run's config)
        self.attempts = attempts
        self._owns_manager = owns_manager
        self.contributing = True  # False while a recovering worker takes part in its first round
        self.contributors = 0  # how many workers the last collective averaged over
        self.rounds: list[dict[str, Any]] = []  # per committed round: step, kind, workers; failed attempts
        self._committed: dict[str, Any] | None = None  # what a recovering peer receives
        self._current: tuple[str, int] = ("start", 0)
        self._received: dict[str, Any] | None = None
        self._in_round = False  # collectives only inside a round, where a quorum stands

    @classmethod
    def from_env(cls, workers: int = 1, timeout_s: float = 60.0) -> TorchFTCommunicator:
        """From the environment torchft's launchers set: ``$REPLICA_GROUP_ID``, ``$NUM_REPLICA_GROUPS`` (else
        ``workers``), ``$TORCHFT_LIGHTHOUSE``; ``$TORCHFT_MIN_REPLICAS`` (default 1) workers make a quorum."""
        values = {}
        given = os.environ.get(ENV_REPLICAS)
        if given is not None and workers > 1 and given.strip() != str(workers):
            raise ConfigError(f"${ENV_REPLICAS} = {given} but dist.workers = {workers}: they name the number of workers "
                              f"of this run; set one of them (or both alike)")
        for key, default in ((ENV_REPLICA, None), (ENV_REPLICAS, workers if workers > 1 else None), (ENV_MIN, 1)):
            raw = os.environ.get(key, default)
            if raw is None:
                raise ConfigError(f"backend 'torchft' needs ${key} (this worker's index / the number of workers)")
            try:
                values[key] = int(raw)
            except ValueError:
                raise ConfigError(f"${key} must be an integer, got {raw!r}") from None
        return cls(values[ENV_REPLICAS], values[ENV_REPLICA], min_workers=values[ENV_MIN], timeout_s=timeout_s)

    @property
    def is_main(self) -> bool:
        """Every worker logs and writes its own files (each its own output folder): any of them may fail."""
        return True

    # --- the state a recovering peer receives ----------------------------------------------------------
    def _offer(self) -> dict[str, Any]:
        """Called by torchft (on its quorum thread) when a peer recovers from this worker."""
        kind, resume_at = self._current
        return {"state": self._committed, "kind": kind, "resume_at": resume_at, "settings": self.settings}

    def _receive(self, state: dict[str, Any]) -> None:
        self._received = state

    # --- rounds --------------------------------------------------------------------------------------
    def round(self, kind: str, fn: Callable[[], Any], strategy, resume_at: int) -> Any:
        """Run ``fn`` (the round's collectives and updates) as one round, again without the workers that left
        if one failed mid-round. ``resume_at``: the step counter a worker recovering into this round
        continues from."""
        if self._committed is None:
            raise CommError("under torchft call join() once before the first step (DistributedOptimizer.join): it "
                            "starts the run with the others, or recovers this worker from them")
        saved = strategy.snapshot()
        for attempt in range(1, self.attempts + 1):
            self._current = (kind, resume_at)
            self._start_quorum(kind, strategy.steps_done)
            if self._received is not None:  # only a worker that was behind receives a state
                raise CommError(f"worker {self.local_ranks[0]} was behind the others at a {kind} round; call "
                                "join() once before training (DistributedOptimizer.join)")
            self._in_round = True
            try:
                result = fn()
            except Exception:
                if self.manager.errored() is None:
                    raise
                result = None  # a peer failed mid-round: the inputs were garbage, the round is retried
            finally:
                self._in_round = False
            if self.manager.should_commit():
                self._commit(strategy, kind, attempt)
                return result
            strategy.restore(saved)
            warnings.warn(f"a {kind} round failed (a worker left mid-round; attempt {attempt} of {self.attempts}); "
                          "running it again with the workers that remain", RuntimeWarning, stacklevel=2)
        raise CommError(f"a {kind} round failed {self.attempts} times; giving up")

    def _start_quorum(self, kind: str, step: int) -> None:
        """torchft's quorum, with its failure said in one line: it fails when the Lighthouse stops answering
        (a raw ``TimeoutError`` or ``RuntimeError`` from torchft's client otherwise)."""
        try:
            self.manager.start_quorum()
        except (TimeoutError, ConnectionError, RuntimeError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise CommError(f"no quorum for the {kind} round after step {step}: the Lighthouse at {self.lighthouse} "
                            f"did not answer ({type(exc).__name__}: {first}). Every torchft worker needs it: start a "
                            "Lighthouse and every worker again with the same commands (docs/multi-node.md)") from exc

    def _commit(self, strategy, kind: str, attempt: int) -> None:
        self._committed = strategy.snapshot()
        self.rounds.append({"step": strategy.steps_done, "kind": kind, "workers": self.manager.num_participants(),
                            "contributors": self.contributors, "attempts": attempt})

    def join(self, strategy) -> int:
        """Enter the run: a fresh start with the others, or, if they are ahead, recovery from a peer and one
        round taken part in without contributing. Returns the step counter to continue from."""
        self._committed = strategy.snapshot()
        for attempt in range(1, self.attempts + 1):
            self._received = None
            self._start_quorum("start", strategy.steps_done)
            received, self._received = self._received, None
            self._refuse_a_taken_replica(joining_late=received is not None and received["kind"] != "start")
            self._in_round = True
            if received is None:  # everyone is starting: nothing to recover, the same weights everywhere
                same = self._same_start(strategy)
                self._in_round = False
                if self.manager.should_commit():
                    if same == "replica":
                        raise ConfigError(f"another worker started as replica {self.local_ranks[0]} too "
                                          f"(${ENV_REPLICA}={self.local_ranks[0]}): each worker needs its own index in "
                                          f"0 .. {self.world_size - 1}, or two would train on the same data shard; "
                                          "start each with another $" + ENV_REPLICA)
                    if same == "settings":
                        raise ConfigError("the workers start with different settings (of those that shape the "
                                          "trajectory: learning rate, strategy, model, ...); compare their config.json")
                    if same == "steps":
                        raise ConfigError(f"the workers start at different steps (this one at step {strategy.steps_done}"
                                          ", from its newest checkpoint): a run restarted as a whole resumes every "
                                          "worker from a checkpoint of the same step; set aside the newer "
                                          "checkpoints/step-* folders of the workers that are ahead")
                    if not same:
                        raise ConfigError("the workers start from different weights: build every replica from the "
                                          "same seed (under torchft nothing broadcasts worker 0's weights)")
                    self._commit(strategy, "start", attempt)
                    return strategy.steps_done
                continue
            self._check_settings(received.get("settings"))
            strategy.restore(received["state"])
            strategy.forget_own_errors()
            self.contributing = False
            try:  # a Manager with init_sync (torchft's default) hands the starting workers a peer's start state:
                # they take part in the start round's check without contributing
                self._same_start(strategy) if received["kind"] == "start" else \
                    strategy.mirror_round(received["kind"], received["resume_at"])
            except Exception:
                if self.manager.errored() is None:
                    raise
            finally:
                self.contributing, self._in_round = True, False
            if self.manager.should_commit():
                strategy.steps_done = received["resume_at"]
                self._commit(strategy, "recovered:" + received["kind"], attempt)
                return strategy.steps_done
        raise CommError(f"could not join the run after {self.attempts} attempts")

    def _refuse_a_taken_replica(self, joining_late: bool) -> None:
        """Refuse to enter a quorum that holds another worker under this one's replica id (torchft's
        ``REPLICA_GROUP_ID``): it would train on the same data shard. Starting together, every holder refuses;
        joining a run already going, the newcomer does (the others cannot tell which of them is the late one)."""
        mine = str(getattr(self.manager, "_replica_id", "") or "").split(":")[0]
        if self._quorums is None or not mine:
            return
        if sum(1 for rid in self._quorums.replica_ids if rid.split(":")[0] == mine) < 2:
            return
        index = self.local_ranks[0]
        when = "is already running as replica {}" if joining_late else "started as replica {} too"
        raise ConfigError(f"another worker {when.format(index)} (${ENV_REPLICA}={index}), replica id {mine!r}: "
                          f"each worker needs its own index in 0 .. {self.world_size - 1}, or two would train on the same "
                          f"data shard; start this one with another ${ENV_REPLICA}")

    def _check_settings(self, theirs: dict | None) -> None:
        """Refuse to join a run whose settings differ from this worker's, naming the keys."""
        if theirs is None or self.settings is None or self.compare_settings is None:
            return
        differences = self.compare_settings(theirs, self.settings)
        if differences:
            lines = "\n  ".join(d.replace("in the checkpoint", "in the run") for d in differences)
            raise ConfigError(f"this worker's settings differ from those of the run it joins:\n  {lines}\nstart it "
                              "with the run's settings")

    @torch.no_grad()
    def _same_start(self, strategy) -> bool | str:
        """Whether every worker starts from the same weights (and settings: a digest of them, 48 bits, exact
        in float64, and step); "settings" if the settings differ, "steps" if they start at other steps,
        "replica" if another worker starts with this one's replica index (the same REPLICA_GROUP_ID)."""
        mine = torch.stack([p.detach().double().sum() for p in strategy.workers[0].params]
                           + [torch.tensor(float(strategy.steps_done), dtype=torch.float64)])
        text = json.dumps(self.settings, sort_keys=True, default=str)
        digest = torch.tensor([float(int(hashlib.sha256(text.encode()).hexdigest()[:12], 16))], dtype=torch.float64)
        replicas = torch.zeros(self.world_size, dtype=torch.float64)  # how many workers start as each replica
        replicas[self.local_ranks[0]] = 1.0
        mean, digests = mine.clone(), digest.clone()
        self._all_reduce_mean([[mean, digests, replicas]])
        if float(replicas[self.local_ranks[0]]) * self.contributors > 1.5:
            return "replica"
        if not torch.equal(digests, digest):
            return "settings"
        if float(mean[-1]) != float(mine[-1]):
            return "steps"
        return bool(torch.allclose(mean, mine, rtol=1e-9, atol=1e-12))

    # --- collectives ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _all_reduce_mean(self, per_worker: TensorLists) -> None:
        from torch.distributed import ReduceOp

        if not self._in_round:
            raise CommError("backend 'torchft' communicates only in the synchronisations' rounds (a quorum stands "
                            "there); average models or losses over workers after finish(), or evaluate each worker's own")
        tensors = list(per_worker[0])
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype if t.is_floating_point() else torch.float64, []).append(t)
        for dtype, bucket in by_dtype.items():
            flat = torch.cat([t.reshape(-1).to(dtype) for t in bucket] + [torch.ones(1, dtype=dtype, device=bucket[0].device)])
            if not self.contributing:
                flat.zero_()
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            count = float(flat[-1])
            self.contributors = round(count)
            if count < 0.5:  # nobody contributed: only possible after a failure, which the commit will see
                continue
            offset = 0
            for t in bucket:
                t.copy_((flat[offset: offset + t.numel()] / count).view_as(t))
                offset += t.numel()

    def _all_gather(self, per_worker: TensorLists) -> list[list[list[torch.Tensor]]]:
        raise ConfigError("backend 'torchft' averages only: set strategy.compress to none or bf16")

    def _all_to_all(self, per_worker: TensorLists) -> list[list[torch.Tensor]]:
        raise ConfigError("backend 'torchft' averages only: set strategy.compress to none or bf16")

    def _broadcast(self, per_worker: TensorLists, src: int) -> None:
        # the one broadcast (the initial parameters) is replaced by a check in the start round that every
        # worker starts from the same weights; a recovering worker receives them from a peer
        pass

    def broadcast(self, per_worker: TensorLists, tag: str, src: int = 0) -> None:
        if tag != "init":
            raise ConfigError(f"backend 'torchft' has no broadcast ({tag!r})")

    def barrier(self) -> None:
        """Nothing to wait for: the workers meet at each round's quorum."""

    def close(self, clean: bool = True) -> None:
        if self._owns_manager:  # a Manager the caller built is the caller's to shut down
            self.manager.shutdown(wait=False)

