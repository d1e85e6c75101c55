"""Run configuration: dataclasses validated at start-up, TOML files and dotted overrides.

Precedence (later wins): defaults < model preset < TOML file < ``--set section.key=value``.
Every error names the field and its allowed values. ``sections`` holds one dataclass per section,
``run_config`` the :class:`Config` that holds them (and the rules across them), ``load`` the building.
"""

from .load import build_config, describe, load_toml, parse_override, tomllib, validate
from .run_config import PRESETS, SECTIONS, Config
from .sections import (
    DEFAULT_LR,
    MUON_STRATEGIES,
    STRATEGY_NAMES,
    CommConfig,
    DataConfig,
    DistConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    StrategyConfig,
    SwitchConfig,
    TrainConfig,
)

__all__ = [
    "DEFAULT_LR", "MUON_STRATEGIES", "PRESETS", "SECTIONS", "STRATEGY_NAMES", "CommConfig", "Config", "DataConfig",
    "DistConfig", "ModelConfig", "OptimConfig", "ScheduleConfig", "StrategyConfig", "SwitchConfig", "TrainConfig", "build_config",
    "describe", "load_toml", "parse_override", "tomllib", "validate",
]
