"""Communicators (in-process simulator and torch.distributed) and the communication ledger."""

from __future__ import annotations

from .base import Communicator, payload_bytes
from .ledger import Ledger
from .simulated import SimCommunicator


def make_communicator(backend: str, workers: int, timeout_s: float = 300.0, device: str = "cpu",
                      ranks_per_worker: int = 1, sharded: bool = False) -> Communicator:
    """``sim``: all ``workers`` in this process. ``gloo``/``nccl``: this process is one worker of a
    torch.distributed job (environment set by torchrun or by ``lordo train --workers``), or with
    ``ranks_per_worker`` > 1 one rank of a worker made of that many processes. ``auto``: torch.distributed
    when a process group is initialised or torchrun launched this process (gloo on CPU, nccl on CUDA), else
    the simulator. ``sharded``: the model is sharded over each worker's ranks (FSDP2; see
    :class:`~.torch_dist.WorkerGroupCommunicator`)."""
    import torch.distributed as dist

    from ..errors import ConfigError
    from .torch_dist import TorchDistCommunicator, WorkerGroupCommunicator, launched_by_torchrun

    if backend == "torchft":
        from .ft import TorchFTCommunicator

        return TorchFTCommunicator.from_env(workers, timeout_s)
    if backend == "auto":
        distributed = dist.is_available() and (dist.is_initialized() or launched_by_torchrun())
        backend = ("nccl" if device == "cuda" else "gloo") if distributed else "sim"
    if backend == "sim":
        if ranks_per_worker != 1:
            raise ConfigError("dist.ranks_per_worker > 1 needs torch.distributed (backend gloo or nccl, several "
                              "processes); the simulator runs one rank per worker")
        return SimCommunicator(workers)
    base = TorchDistCommunicator(backend, timeout_s)
    if ranks_per_worker == 1 and not sharded:
        return base
    try:
        return WorkerGroupCommunicator(base, ranks_per_worker, sharded=sharded)
    except BaseException:
        base.close(clean=False)
        raise


__all__ = ["Communicator", "Ledger", "SimCommunicator", "make_communicator", "payload_bytes"]
