"""Learning-rate schedules as a multiplier of the peak lr for step s in [0, steps)."""

from __future__ import annotations

import math

from ..config import ScheduleConfig


def warmup_steps(steps: int, cfg: ScheduleConfig) -> int:
    """``schedule.warmup_steps``, with -1 (the default) resolved to min(50, steps // 10): any run length works."""
    return cfg.warmup_steps if cfg.warmup_steps >= 0 else min(50, steps // 10)


def lr_factor(step: int, steps: int, cfg: ScheduleConfig) -> float:
    """Linear warm-up to 1, then constant, cosine to ``min_lr_ratio``, or warmup-stable-decay (wsd)."""
    warmup = warmup_steps(steps, cfg)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.kind == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    if cfg.kind == "cosine":
        span = max(1, steps - 1 - warmup)
        progress = min(1.0, (step - warmup) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.kind == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * steps)) if cfg.decay_fraction > 0 else 0
        decay_start = steps - decay_steps
        if decay_steps == 0 or step < decay_start:
            return 1.0
        progress = (step - decay_start + 1) / decay_steps
        return 1 - (1 - floor) * progress
    raise ValueError(f"schedule.kind must be cosine, wsd or constant, got {cfg.kind!r}")
