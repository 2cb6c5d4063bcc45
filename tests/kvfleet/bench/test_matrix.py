"""The stress matrix's pure parts: which scenarios fit a context, the one-row-per-scenario table, its flags."""

from __future__ import annotations

import pytest

from kvfleet.bench import matrix
from kvfleet.bench.matrix import TEMPLATE_TOKENS, longest_context, table


def test_longest_context_counts_history_and_outputs():
    # short-short at scale 1: one turn, 128 words + 32 output + one message's template allowance
    assert longest_context("short-short", 2, 0, 1.0) == 128 + TEMPLATE_TOKENS + 32
    # multi-turn: turn 4 carries 4 user messages of 96, 3 replies of 64, and asks for 64 more
    assert longest_context("multi-turn", 2, 0, 1.0) == 4 * (96 + TEMPLATE_TOKENS) + 3 * (64 + TEMPLATE_TOKENS) + 64
    assert longest_context("long-long", 2, 0, 1.0) > 2048 >= longest_context("long-long", 2, 0, 0.5)


def _res(tok_s: float, ttft: float, hit: float | None) -> dict:
    summary = {"output_tok_s": tok_s, "ttft_ms": {"p50": ttft}, "e2e_ms": {"p99": 2 * ttft}, "completed": 3,
               "requests": 3}
    return {"runs": [{"summary": summary, "fleet": {"prefix_hit_rate": hit}}]}


def test_table_one_row_per_scenario_with_ratio():
    results = {"fleet": {"rag": _res(30.0, 100.0, 0.5), "long-long": None},
               "single": {"rag": _res(20.0, 200.0, 0.25), "long-long": _res(10.0, 50.0, None)}}
    text = table(results, ["fleet", "single"], ["rag", "long-long"])
    rows = text.splitlines()
    assert rows[0].startswith("| scenario | shape | fleet TTFT p50 ms | single TTFT p50 ms |")
    assert rows[2] == ("| rag | RAG: shared template + 3 retrieved chunks of 24 | 100 | 200 | 200 | 400 | 30.0 | 20.0 "
                       "| 50% | 25% | x1.50 |")
    assert rows[3].startswith("| long-long |") and rows[3].endswith("| n/a | - | n/a |")


def test_flags_are_checked():
    with pytest.raises(SystemExit):
        matrix.main(["--targets", "fleet,sglang"])
    with pytest.raises(SystemExit):
        matrix.main(["--scenarios", "nope"])
    with pytest.raises(SystemExit):
        matrix.main(["--num", "0"])
