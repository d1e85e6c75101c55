"""Strategies: what happens after backward. ``build_strategy`` picks one by ``strategy.name``."""

from __future__ import annotations

from torch import nn

from ..config import Config
from ..errors import ConfigError
from ..model.params import ParamGroup
from .base import Strategy
from .ddp import DDPStrategy

STRATEGIES = {"ddp": DDPStrategy}


def build_strategy(cfg: Config, model: nn.Module, groups: list[ParamGroup]) -> Strategy:
    name = cfg.strategy.name
    if name not in STRATEGIES:
        raise ConfigError(f"strategy.name must be one of {', '.join(STRATEGIES)}, got {name!r}")
    return STRATEGIES[name](model, groups, cfg.optim)


__all__ = ["Strategy", "DDPStrategy", "STRATEGIES", "build_strategy"]
