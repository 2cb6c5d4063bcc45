"""contract/slo.py: latency-target headers parsed once, a bad one named."""

from __future__ import annotations

import pytest

from contract.request import RequestError
from contract.slo import TPOT_HEADER, TTFT_HEADER, LatencyTargets, latency_targets


def test_targets_in_milliseconds_become_seconds_and_absent_ones_none():
    assert latency_targets({}) == LatencyTargets(None, None)
    assert latency_targets({TTFT_HEADER: "250", TPOT_HEADER: " 40.5 "}) == LatencyTargets(0.25, 0.0405)


@pytest.mark.parametrize("raw", ["", "abc", "0", "-5", "nan", "inf", "3600001"])
def test_a_bad_target_is_a_400_naming_the_header(raw):
    with pytest.raises(RequestError) as e:
        latency_targets({TTFT_HEADER: raw})
    assert e.value.status == 400 and e.value.param == TTFT_HEADER and TTFT_HEADER in str(e.value)
