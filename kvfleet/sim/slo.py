"""Latency targets over a simulation's requests: percentiles, SLO attainment and goodput as DistServe
(Zhong et al., OSDI'24) defines them.

A request meets the SLO when its TTFT is at most `ttft_s` and its TPOT (time per output token after the first)
at most `tpot_s`; one that was dropped, or never finished, misses it; one with a single output token has no TPOT
and is judged on TTFT alone. Attainment is the fraction of requests that meet it. Goodput is the highest request
rate whose attainment reaches `goal` (DistServe: 90%) - here, of the rates tried in ascending order, the highest
one before the first that falls short.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float
    goal: float = 0.9  # the fraction of requests that must meet both

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO: targets must be > 0, got TTFT {self.ttft_s} s, TPOT {self.tpot_s} s")
        if not 0 < self.goal <= 1:
            raise ValueError(f"SLO.goal: must be in (0, 1], got {self.goal}")

    def scaled(self, speedup: float) -> SLO:
        """The same targets for an engine `speedup` times faster (both divided)."""
        return SLO(self.ttft_s / speedup, self.tpot_s / speedup, self.goal)


@dataclass(frozen=True)
class Latency:
    """One request's latencies: ttft_s None when it did not finish (dropped), tpot_s None for one output token."""

    ttft_s: float | None
    tpot_s: float | None


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile of sorted `xs` (0.0 when empty)."""
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def meets(r: Latency, slo: SLO) -> bool:
    return r.ttft_s is not None and r.ttft_s <= slo.ttft_s and (r.tpot_s is None or r.tpot_s <= slo.tpot_s)


def attainment(results: Sequence[Latency], slo: SLO) -> float:
    """The fraction of requests meeting both targets (0.0 for no requests)."""
    return sum(meets(r, slo) for r in results) / len(results) if results else 0.0


def goodput(points: Sequence[tuple[float, float]], goal: float) -> float:
    """The highest rate before the first one whose attainment is below `goal`, from (rate, attainment) pairs
    (sorted by rate here); 0.0 when the lowest rate already falls short."""
    best = 0.0
    for rate, att in sorted(points):
        if att < goal:
            break
        best = rate
    return best
