"""Strategies: what happens after backward. ``build_strategy`` picks one by ``strategy.name``."""

from __future__ import annotations

from torch import nn

from ..comm import Communicator
from ..config import Config
from ..errors import ConfigError
from ..model.params import ParamGroup
from .base import Strategy
from .ddp import DDPStrategy
from .local_adam import LocalAdamStrategy, LocalUpdateStrategy
from .lordo import LoRDOGlobalNoQHStrategy, LoRDOLocalStrategy, LoRDOStrategy
from .lowrank_ddp import LowRankDDPStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s
    for s in (
        DDPStrategy,
        LocalAdamStrategy,
        LoRDOStrategy,
        LoRDOGlobalNoQHStrategy,
        LoRDOLocalStrategy,
        LowRankDDPStrategy,
    )
}


def build_strategy(cfg: Config, models: list[nn.Module], groups: list[list[ParamGroup]], comm: Communicator) -> Strategy:
    name = cfg.strategy.name
    if name not in STRATEGIES:
        raise ConfigError(f"strategy.name must be one of {', '.join(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name](models, groups, cfg, comm)


__all__ = ["Strategy", "DDPStrategy", "LocalAdamStrategy", "LocalUpdateStrategy", "LoRDOStrategy", "LoRDOGlobalNoQHStrategy",
           "LoRDOLocalStrategy", "LowRankDDPStrategy", "STRATEGIES", "build_strategy"]
