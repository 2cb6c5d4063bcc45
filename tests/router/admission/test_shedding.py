"""Load shedding (router/admission/shedding.py): exact pressure levels and who is shed."""

from __future__ import annotations

import pytest

from contract.errors import ConfigError
from router.admission.shedding import Pressure, fleet_pressure, should_shed
from router.config import SheddingConfig

CFG = SheddingConfig(kv_high=0.9, waiting_high=2, kv_critical=0.98, waiting_critical=8, min_cost_tokens=2048)


@pytest.mark.parametrize("kv,waiting,expected", [
    (None, None, Pressure.NONE), (0.5, 20, Pressure.NONE), (0.89, 100, Pressure.NONE),  # KV not high: queues alone never shed
    (0.9, 1.9, Pressure.NONE), (0.9, 2, Pressure.HIGH), (0.97, 7.9, Pressure.HIGH),
    (0.98, 0, Pressure.CRITICAL), (0.9, 8, Pressure.CRITICAL), (1.0, 50, Pressure.CRITICAL),
])
def test_pressure(kv, waiting, expected):
    assert fleet_pressure(kv, waiting, CFG) is expected


@pytest.mark.parametrize("pressure,cost,priority,expected", [
    (Pressure.NONE, 100_000, 0, False),
    (Pressure.HIGH, 2048, 0, True), (Pressure.HIGH, 2047, 0, False),  # lowest priority, expensive only
    (Pressure.HIGH, 100_000, 1, False), (Pressure.HIGH, 100_000, 2, False),  # higher priorities kept
    (Pressure.CRITICAL, 512, 0, True), (Pressure.CRITICAL, 511, 0, False),  # lowest: a quarter of the cost
    (Pressure.CRITICAL, 2048, 1, True), (Pressure.CRITICAL, 2047, 1, False),  # middle: expensive ones
    (Pressure.CRITICAL, 100_000, 2, False),  # the highest priority is never shed
])
def test_who_is_shed_with_priorities_0_to_2(pressure, cost, priority, expected):
    assert should_shed(pressure, cost, priority, lowest=0, highest=2, cfg=CFG) is expected


def test_one_priority_level_sheds_by_cost_alone():
    assert should_shed(Pressure.HIGH, 2048, 5, lowest=5, highest=5, cfg=CFG)
    assert not should_shed(Pressure.HIGH, 2047, 5, lowest=5, highest=5, cfg=CFG)
    assert should_shed(Pressure.CRITICAL, 512, 5, lowest=5, highest=5, cfg=CFG)


def test_config_is_checked():
    with pytest.raises(ConfigError):
        SheddingConfig(kv_high=0.99, kv_critical=0.9).validate()
    with pytest.raises(ConfigError):
        SheddingConfig(min_cost_tokens=0).validate()
