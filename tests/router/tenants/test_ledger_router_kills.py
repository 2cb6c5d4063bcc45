"""Routers SIGKILLed mid-stream lose nothing from the usage ledger (loadtest/ledger_kill_bench.py): two routers
sharing one real Redis over two real SmolLM2 engines, one router killed and restarted on its port while streams run
through it; at the end the ledger's prompt and output tokens equal the engines' own counters, its cached tokens
what the engines say, no request is recorded twice or missing, and the budget charged equals the ledger's sum."""

from __future__ import annotations

import pytest

from loadtest.ledger_kill_bench import check, report, run

pytestmark = pytest.mark.model


@pytest.mark.slow  # 33 s; test_usage_ledger_app.py's router that dies mid-stream stays in make test
def test_a_router_killed_mid_stream_loses_nothing(tmp_path):
    figures = run(kills=1, clients=6, max_tokens=(8, 32), reconcile_after=2.0, workdir=str(tmp_path))
    assert check(figures) == [], report(figures)
    assert figures["outcomes"].get("router_lost_settled", 0) >= 1


@pytest.mark.slow
def test_twenty_router_kills_mid_stream_lose_nothing(tmp_path):
    figures = run(kills=20, clients=8, max_tokens=(16, 48), reconcile_after=2.0, workdir=str(tmp_path))
    assert check(figures) == [], report(figures)
