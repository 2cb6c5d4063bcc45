"""The order the two xdist workers take test files in (`make test`: `-n 2 --dist loadfile --no-loadscope-reorder`).

xdist hands each worker whole files, and by default the files with the most tests first, so files with few but
long tests (real engines and routers started per module) came last and one worker could run alone for minutes at
the end. Here the files measured longest go first, longest first; the rest follow in collection order (each took
under 15 s). The list is a measurement, not a contract: a missing or renamed file only runs later.
"""

from __future__ import annotations

import pytest

# seconds of setup and calls per file, over 2 s per test (`pytest --durations=0`, 2-core AMD EPYC, 2026-12-07)
LONGEST_FIRST = (
    "tests/router/test_kv_pull.py", "tests/engine/model/test_hf_equality.py", "tests/engine/server/test_deltas.py",
    "tests/router/test_deterministic_fleet.py", "tests/router/pools/test_pools_app.py",
    "tests/router/tenants/test_usage_ledger_app.py", "tests/engine/spec/test_spec_engine.py",
    "tests/router/http/test_integration.py", "tests/engine/server/test_structured_api.py", "tests/deploy/test_local.py",
    "tests/router/epp/test_picker_engines.py", "tests/engine/server/test_keepalive.py", "tests/engine/test_engine_oom.py",
    "tests/dashboards/test_prometheus_fleet.py", "tests/engine/server/test_drain.py",
    "tests/engine/test_structured_engine.py", "tests/router/http/test_first_chunk_engine.py",
    "tests/router/http/test_request_edge.py", "tests/engine/server/test_openai_api.py",
    "tests/engine/spec/test_draft_model.py", "tests/router/epp/test_picker_fake.py",
    "tests/router/tenants/test_metering_engines.py", "tests/router/tenants/test_ratelimit_engine.py",
    "tests/router/test_two_models.py", "tests/router/tenants/test_cached_pricing_engine.py",
    "tests/router/http/test_structured_router.py", "tests/engine/server/test_cache_control.py",
    "tests/engine/lora/test_lora_exactness.py", "tests/router/tenants/test_ratelimit_app.py",
    "tests/engine/server/test_oom.py",
)
_RANK = {path: i for i, path in enumerate(LONGEST_FIRST)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Stable: tests keep their order within a file."""
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (_RANK.get(item.nodeid.split("::", 1)[0], len(_RANK)), order[id(item)]))
