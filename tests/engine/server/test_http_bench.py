"""loadtest.http_bench against the real test server: every request produces exactly its max_tokens."""

from __future__ import annotations

import asyncio
import math

from kvfleet.workload import generate_trace
from loadtest.http_bench import percentile, run_level


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 0.99) == 1.99
    assert math.isnan(percentile([], 0.5))


def test_run_level_counts_tokens_and_latencies(api_server):
    trace = generate_trace(4, seed=5, min_output_tokens=6, max_output_tokens=10)
    r = asyncio.run(run_level(api_server.url, "smollm2", trace, 2, "kvfleet", 0.0, 120))
    assert r.failed == 0 and r.num_requests == 4, r.errors
    assert r.output_tokens == sum(t.max_tokens for t in trace)  # EOS banned: exactly max_tokens each
    assert 0 < r.ttft_p50 <= r.ttft_p99 and 0 < r.tpot_p50 <= r.tpot_p99
    assert r.output_tok_s > 0
