"""The strategy interface: everything that happens after ``loss.backward()``.

A strategy owns the optimizer state and any communication. The training loop only computes
gradients and calls ``step``; it never touches an optimizer directly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

from ..model.params import ParamGroup


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Strategy(ABC):
    """After-backward logic for one process's model replica(s)."""

    name: str = ""

    def __init__(self, model: nn.Module, groups: list[ParamGroup]) -> None:
        self.model = model
        self.groups = groups

    @abstractmethod
    def step(self, lr: float) -> dict[str, float]:
        """Apply one optimizer step from the gradients in ``.grad`` at learning rate ``lr``, then clear them.

        Returns diagnostics for the metrics log (e.g. ``grad_norm``)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: tensors, numbers and strings only."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of optimizer state held per worker, by category."""
