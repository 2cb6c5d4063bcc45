"""Per-request latency targets, as llm-d's predicted-latency scheduling spells them: the headers
`x-llm-d-slo-ttft-ms` (time to first token) and `x-llm-d-slo-tpot-ms` (time per output token), each a positive
number of milliseconds. Parsed once at the edge; a bad value is the request's 400, naming the header."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from contract.request import RequestError

TTFT_HEADER = "x-llm-d-slo-ttft-ms"
TPOT_HEADER = "x-llm-d-slo-tpot-ms"
HEADERS = (TTFT_HEADER, TPOT_HEADER)
MAX_MS = 3_600_000.0  # an hour: anything longer is no latency target
# kvfleet's engines size each step to this share of the strictest TPOT target running (engine/scheduler.py), a margin
# for their step-time model's ~10% error; the router predicts with it (router/routing/latency_model.py bounded_tpot)
TPOT_MARGIN = 0.9


def step_bound(bound_s: float) -> float:
    """The step time a kvfleet engine aims at to keep a bound (a TPOT target, or --max-step-ms): TPOT_MARGIN of it."""
    return TPOT_MARGIN * bound_s


@dataclass(frozen=True, slots=True)
class LatencyTargets:
    ttft_s: float | None = None
    tpot_s: float | None = None


def _ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw.strip())
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_MS:
        raise RequestError(f"{name} must be a number of milliseconds in (0, {MAX_MS:.0f}], got {raw!r}", name)
    return value / 1000.0


def latency_targets(headers: Mapping[str, str]) -> LatencyTargets:
    """The targets the request's headers (lower-case names) carry; absent ones are None."""
    return LatencyTargets(_ms(headers, TTFT_HEADER), _ms(headers, TPOT_HEADER))
