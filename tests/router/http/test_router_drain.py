"""The router drains on SIGTERM: /ready turns 503, new requests get 503 + Retry-After (a client or load
balancer sends them to the other router), running streams finish, then it exits 0; a second signal exits at
once."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx

from tests.router.conftest import fake_engine, router, wait_for

BODY = {"prompt": list(range(100, 120)), "stream": True, "max_tokens": 50}
SLOW = {"x-fake-chunks": "20", "x-fake-chunk-delay-ms": "150"}  # a 3-second stream


def stream(url: str) -> tuple[int, str]:
    with httpx.stream("POST", url + "/v1/completions", json=BODY, headers=SLOW, timeout=30) as r:
        return r.status_code, r.read().decode()


def test_sigterm_during_20_streams(procs):
    engine = fake_engine(procs, "e1").wait_ready()
    a = router(procs, [engine.url], "--drain-timeout", "20", "--log-level", "info").wait_ready()
    b = router(procs, [engine.url]).wait_ready()
    for r in (a, b):
        wait_for(lambda r=r: httpx.get(r.url + "/ready").json().get("ready_replicas") == 1, what="ready")
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        running = [pool.submit(stream, a.url) for _ in range(20)]
        wait_for(lambda: httpx.get(engine.url + "/fake/stats").json()["running"] == 20, what="20 streams")
        t0 = time.monotonic()
        a.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(a.url + "/ready").status_code == 503, timeout=5, what="draining")
        assert httpx.get(a.url + "/ready").json() == {"status": "draining"}
        refused = httpx.post(a.url + "/v1/completions", json={**BODY, "stream": False})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        other = httpx.post(b.url + "/v1/completions", json={**BODY, "stream": False})  # the other router serves
        assert other.status_code == 200
        results = [f.result() for f in running]
    assert all(status == 200 and text.endswith("data: [DONE]\n\n") for status, text in results)
    assert all(text.count("data: {") == 20 for _, text in results)  # every chunk, none cut
    assert a.popen.wait(timeout=15) == 0
    assert time.monotonic() - t0 >= 2.0  # it waited for the streams (each about 3 s)
    assert "draining: 20 requests in flight" in a.tail() and "drained" in a.tail()


def test_a_second_signal_exits_at_once(procs):
    engine = fake_engine(procs, "e1").wait_ready()
    a = router(procs, [engine.url], "--drain-timeout", "60").wait_ready()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        f = pool.submit(stream, a.url)
        wait_for(lambda: httpx.get(engine.url + "/fake/stats").json()["running"] == 1, what="stream")
        a.popen.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(a.url + "/ready").status_code == 503, timeout=5, what="draining")
        t0 = time.monotonic()
        a.popen.send_signal(signal.SIGTERM)
        a.popen.wait(timeout=10)
        assert time.monotonic() - t0 < 5
        f.exception(timeout=10)  # the stream was cut; it does not hang
