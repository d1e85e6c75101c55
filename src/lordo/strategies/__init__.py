"""Strategies: what happens after backward. ``build_strategy`` makes one from a run's config by
``strategy.name``; the classes take their optimizers and settings as keyword arguments for direct use."""

from __future__ import annotations

from .base import Strategy, Worker
from .basis import BasisPolicy, GlobalBasis, LocalBasis
from .build import BUILDERS as STRATEGIES
from .build import build_strategy, make_adamw, make_lowrank_optimizer, split_lowrank
from .ddp import DDPStrategy
from .local_adam import LocalAdamStrategy, LocalUpdateStrategy, model_averaging
from .lordo import LoRDOStrategy
from .lowrank_ddp import LowRankDDPStrategy

__all__ = ["Strategy", "Worker", "BasisPolicy", "GlobalBasis", "LocalBasis", "DDPStrategy", "LocalAdamStrategy",
           "LocalUpdateStrategy", "LoRDOStrategy", "LowRankDDPStrategy", "STRATEGIES", "build_strategy", "make_adamw",
           "make_lowrank_optimizer", "model_averaging", "split_lowrank"]
