"""Run figures from request records: TTFT, TPOT, ITL and end-to-end latency percentiles, throughput,
goodput under an SLO, errors by type. Pure functions, exact for a recorded run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvfleet.bench.records import RequestRecord

QUANTILES = (50, 95, 99)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default); NaN when empty."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass(frozen=True)
class Slo:
    """A request is good when it succeeded and meets every bound given (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > self.ttft_ms):
            return False
        if self.tpot_ms is not None and r.tpot_s is not None and r.tpot_s * 1e3 > self.tpot_ms:
            return False
        return self.e2e_ms is None or r.end_s * 1e3 <= self.e2e_ms

    def label(self) -> str:
        parts = [f"{k} <= {v:g} ms" for k, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms),
                                                 ("E2E", self.e2e_ms)) if v is not None]
        return ", ".join(parts) or "none"


def _dist(xs: list[float]) -> dict:
    out = {f"p{q}": percentile(xs, q) * 1e3 for q in QUANTILES}
    out["mean"] = sum(xs) / len(xs) * 1e3 if xs else float("nan")
    return out


def wall_time(records: list[RequestRecord]) -> float:
    """From the first send to the last response's end."""
    if not records:
        return 0.0
    return max(r.start_s + r.end_s for r in records) - min(r.start_s for r in records)


def summarize(records: list[RequestRecord], slo: Slo | None = None, wall_s: float | None = None) -> dict:
    """Figures in milliseconds (latencies), per second (rates) and counts; `wall_s` defaults to wall_time."""
    wall = wall_time(records) if wall_s is None else wall_s
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    good = sum(1 for r in ok if (slo or Slo()).met(r))
    per_s = (lambda x: x / wall) if wall > 0 else (lambda x: float("nan"))
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": dict(sorted(Counter(r.error for r in records if not r.ok).items())),
        "wall_s": wall, "req_s": per_s(len(ok)), "output_tok_s": per_s(out_tokens),
        "total_tok_s": per_s(out_tokens + prompt_tokens), "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens, "usage_cached_fraction": cached / prompt_tokens if prompt_tokens else None,
        "ttft_ms": _dist([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _dist([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _dist([g for r in ok for g in r.itl_s]),
        "e2e_ms": _dist([r.end_s for r in ok]),
        "slo": (slo or Slo()).label(), "good": good, "goodput_req_s": per_s(good),
        "good_fraction": good / len(records) if records else float("nan"),
    }
