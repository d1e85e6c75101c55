import math

import pytest

from lordo.config import ScheduleConfig
from lordo.train.schedule import lr_factor


def test_warmup_is_linear_to_peak():
    cfg = ScheduleConfig(kind="constant", warmup_steps=4)
    assert [lr_factor(s, 10, cfg) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_hand_values():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=0, min_lr_ratio=0.1)
    steps = 11  # progress = s / 10
    assert lr_factor(0, steps, cfg) == pytest.approx(1.0)
    assert lr_factor(5, steps, cfg) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(10, steps, cfg) == pytest.approx(0.1)
    assert lr_factor(3, steps, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.3)))


def test_wsd_is_flat_then_decays_linearly_to_floor():
    cfg = ScheduleConfig(kind="wsd", warmup_steps=2, min_lr_ratio=0.0, decay_fraction=0.2)
    values = [lr_factor(s, 20, cfg) for s in range(20)]
    assert values[:2] == [0.5, 1.0]
    assert all(v == 1.0 for v in values[2:16])
    assert values[16:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_automatic_warmup_fits_any_run_length():
    from lordo.config import ScheduleConfig
    from lordo.train.schedule import warmup_steps

    auto = ScheduleConfig()
    assert auto.warmup_steps == -1
    assert [warmup_steps(n, auto) for n in (5, 20, 300, 500, 10_000)] == [0, 2, 30, 50, 50]
    assert lr_factor(0, 20, auto) == pytest.approx(0.5) and lr_factor(1, 20, auto) == pytest.approx(1.0)
    assert lr_factor(0, 5, auto) == pytest.approx(1.0)  # no warm-up at all in a 5-step run
    assert warmup_steps(20, ScheduleConfig(warmup_steps=7)) == 7
