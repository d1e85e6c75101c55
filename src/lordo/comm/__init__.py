"""Communicators (in-process simulator and torch.distributed) and the communication ledger."""

from __future__ import annotations

from .base import Communicator, payload_bytes
from .ledger import Ledger
from .simulated import SimCommunicator


def make_communicator(backend: str, workers: int, timeout_s: float = 300.0, device: str = "cpu") -> Communicator:
    """``sim``: all ``workers`` in this process. ``gloo``/``nccl``: this process is one worker of a
    torch.distributed job (environment set by torchrun or by ``lordo train --workers``). ``auto``:
    torch.distributed when a process group is initialised or torchrun launched this process (gloo on CPU,
    nccl on CUDA), else the simulator."""
    import torch.distributed as dist

    from .torch_dist import TorchDistCommunicator, launched_by_torchrun

    if backend == "auto":
        distributed = dist.is_available() and (dist.is_initialized() or launched_by_torchrun())
        backend = ("nccl" if device == "cuda" else "gloo") if distributed else "sim"
    if backend == "sim":
        return SimCommunicator(workers)
    return TorchDistCommunicator(backend, timeout_s)


__all__ = ["Communicator", "Ledger", "SimCommunicator", "make_communicator", "payload_bytes"]
