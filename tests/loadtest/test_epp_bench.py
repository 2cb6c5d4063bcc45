"""loadtest/epp_bench.py's parts on a small scale (not the benchmark): stub endpoints in one process, a picker over
them, and the ext_proc exchange the latency benchmark times; the hit-rate run's gateway path is the engine test's
(tests/router/epp/test_picker_engines.py)."""

from __future__ import annotations

import asyncio

import httpx

from loadtest.epp_bench import consecutive_ports, http_latency, picker_latency, start_picker
from loadtest.router_procs import PY, Proc


def test_stub_endpoints_and_one_timed_exchange_per_path(tmp_path):
    base = consecutive_ports(3)
    stubs = Proc([PY, "-m", "loadtest.many_endpoints", "--ports", str(base), "--count", "3"],
                 f"http://127.0.0.1:{base}", str(tmp_path), "stubs")
    picker = None
    try:
        stubs.wait_ready(30)
        urls = [f"http://127.0.0.1:{base + k}" for k in range(3)]
        assert all(httpx.get(u + "/v1/models").json()["data"][0]["id"] == "smollm2" for u in urls)
        picker, address = start_picker(str(tmp_path), urls, ["--model", "", "--default-model", "smollm2"])
        got = asyncio.run(picker_latency(address, rate=10, duration=0.3))
        assert got and all(0 < a < 5 and 0 < b < 5 for a, b in got)
        direct = asyncio.run(http_latency(urls[0], rate=10, duration=0.3))
        assert direct and all(0 < t < 5 for t in direct)
    finally:
        if picker is not None:
            picker.stop()
        stubs.stop()
