"""The engine server reads the fairness id the router sends (contract/fairness.py) and the TPOT target header
(contract/slo.py) into the request's params."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from contract.fairness import FAIRNESS_HEADER
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.server.errors import APIError
from engine.server.serving import fairness_of


def request(*headers: tuple[bytes, bytes]) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": list(headers)})


def test_the_header_is_the_fairness_id_and_none_is_the_empty_one():
    assert fairness_of(request((FAIRNESS_HEADER.encode(), b" team-a "))) == "team-a"
    assert fairness_of(request()) == ""
    assert SamplingParams().fairness_id == ""


def test_an_overlong_id_is_a_400_naming_the_header():
    with pytest.raises(APIError) as e:
        fairness_of(request((FAIRNESS_HEADER.encode(), b"x" * 257)))
    assert e.value.status == 400 and e.value.param == FAIRNESS_HEADER
    with pytest.raises(SamplingParamsError, match="fairness_id"):
        SamplingParams(fairness_id="x" * 257)


def test_the_target_headers_become_seconds_and_a_bad_one_is_a_400_naming_it():
    from contract.slo import TPOT_HEADER, TTFT_HEADER
    from engine.server.serving import targets_of

    both = targets_of(request((TPOT_HEADER.encode(), b"50"), (TTFT_HEADER.encode(), b"1500")))
    assert (both.ttft_s, both.tpot_s) == (1.5, 0.05)
    empty = targets_of(request())
    assert (empty.ttft_s, empty.tpot_s) == (None, None)
    for header in (TPOT_HEADER, TTFT_HEADER):
        with pytest.raises(APIError) as e:
            targets_of(request((header.encode(), b"-1")))
        assert e.value.status == 400 and e.value.param == header
    with pytest.raises(SamplingParamsError, match="tpot_target_s"):
        SamplingParams(tpot_target_s=0.0)
    with pytest.raises(SamplingParamsError, match="ttft_target_s"):
        SamplingParams(ttft_target_s=float("nan"))
