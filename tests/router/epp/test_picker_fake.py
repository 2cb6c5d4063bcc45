"""The endpoint picker in front of fake engines (loadtest/fake_engine.py: the engine's HTTP surface, no model),
asked through the test gateway over gRPC: readiness follows the endpoints; every bad request gets its clear
error as an ImmediateResponse; a body past 62,000 bytes goes back in several mutations; tenants are identified
by their key (401 without one) and their budget is settled on the served response; a full pool's fair queue
holds the stream until a seat frees."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from router.tenants.registry import key_sha256
from tests.router.conftest import fake_engine, free_port, metric, wait_for
from tests.router.epp.gateway import Gateway, health, wait_serving

KEY = "sk-epp-Tq81mXr0"
PROMPT = list(range(100, 120))  # token ids: no tokenizer needed


def picker(procs, replicas: list[str], *extra: str):
    port, metrics_port = free_port(), free_port()
    p = procs(["-m", "router.epp.main", "--port", str(port), "--replicas", ",".join(replicas), "--model", "",
               "--default-model", "smollm2", "--health-interval", "0.2", "--scrape-interval", "0.2",
               "--metrics-port", str(metrics_port), "--log-level", "warning", *extra],
              f"http://127.0.0.1:{metrics_port}", f"epp-{port}")
    address = f"127.0.0.1:{port}"
    wait_serving(address, p, timeout=60)
    return p, address


def _completion(**extra) -> dict:
    return {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, **extra}


def test_readiness_follows_the_endpoints(procs):
    engine = fake_engine(procs, "solo")
    engine.wait_ready()
    p, address = picker(procs, [engine.url])
    assert [health(address, s) for s in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")] \
        == ["SERVING"] * 3
    assert httpx.get(p.url + "/ready").status_code == 200
    engine.kill()
    wait_for(lambda: health(address) == "NOT_SERVING", what="readiness NOT_SERVING once no endpoint is ready")
    assert health(address, "liveness") == "SERVING"
    assert httpx.get(p.url + "/ready").json() == {"status": "no ready replica"}
    got = Gateway(address).send("/v1/completions", _completion())
    assert got.status == 503 and got.json()["error"]["code"] == "no_ready_replica"


def test_bad_requests_get_clear_errors_and_big_bodies_come_back_in_pieces(procs):
    engine = fake_engine(procs, "e0")
    engine.wait_ready()
    _, address = picker(procs, [engine.url], "--max-body-bytes", "300000")
    gw = Gateway(address, chunk_bytes=10_000)
    cases = [(b"{not json", 400), (b'{"model": "smollm2", "prompt": "x", "max_tokens": -1}', 400),
             (b'{"model": "nope", "prompt": "x"}', 404)]
    for body, status in cases:
        got = gw.send("/v1/completions", body)
        assert got.status == status, (body, got.body)
        assert got.json()["error"]["message"]
    assert gw.send("/v1/completions", b'{"prompt": "' + b"x" * 400_000 + b'"}').status == 413
    big = _completion(prompt="word " * 30_000)  # 150 kB: three body mutations of at most 62,000 bytes
    got = gw.send("/v1/completions", big)
    assert got.status == 200, got.body
    assert got.chunks == 3 and len(got.upstream_body) > 124_000
    # anything but a completion passes to a ready endpoint, nothing admitted
    listing = gw.send("/v1/models", b"", method="GET")
    assert listing.status == 200 and listing.json()["data"][0]["id"] == "smollm2"


def test_tenants_by_key_and_budgets_settled_on_the_served_response(procs, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f'tenants:\n  acme:\n    api_key_sha256: ["{key_sha256(KEY)}"]\n    tokens_per_minute: 100000\n')
    engine = fake_engine(procs, "e0")
    engine.wait_ready()
    p, address = picker(procs, [engine.url], "--tenants", str(tenants))
    gw = Gateway(address)
    assert gw.send("/v1/completions", _completion()).status == 401
    for stream in (False, True):
        got = gw.send("/v1/completions", _completion(stream=stream), headers={"authorization": f"Bearer {KEY}"})
        assert got.status == 200, got.body
        assert "x-ratelimit-remaining-tokens" in got.headers
        assert b'"usage"' not in got.body or not stream  # the usage the picker asked for is taken out again
    text = httpx.get(p.url + "/metrics").text
    assert metric(text, "kvfleet_router_ratelimit_requests_total", tenant="acme", outcome="admitted") == 2
    assert metric(text, "kvfleet_router_ratelimit_reserved_tokens", tenant="acme") == 0  # both settled


def test_a_full_pool_holds_the_stream_in_its_fair_queue(procs):
    engine = fake_engine(procs, "slow", "--delay-ms", "600")
    engine.wait_ready()
    p, address = picker(procs, [engine.url], "--replica-slots", "1")
    done: dict[str, float] = {}

    def one(name: str) -> None:
        got = Gateway(address).send("/v1/completions", _completion(), headers={
            "x-llm-d-inference-fairness-id": name})
        assert got.status == 200, got.body
        done[name] = time.monotonic()

    first = threading.Thread(target=one, args=("a",))
    first.start()
    time.sleep(0.2)
    second = threading.Thread(target=one, args=("b",))
    second.start()
    wait_for(lambda: metric(httpx.get(p.url + "/metrics").text, "kvfleet_router_queued_requests", tenant="b") == 1,
             what="b held in the queue")
    first.join(timeout=30)
    second.join(timeout=30)
    assert done["b"] - done["a"] >= 0.5  # b went on only once a's seat freed


@pytest.mark.parametrize("flag, message", [("--fallbacks=-1", "--fallbacks"), ("--objectives=/nonexistent", "objectives")])
def test_bad_flags_are_refused_at_start(procs, flag, message):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "router.epp.main", "--replicas", "http://127.0.0.1:1", flag],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_request_whose_picker_dies_mid_stream_is_recorded_once_with_what_its_engine_sent(procs, tmp_path,
                                                                                              redis_server):
    """The picker sends the ledger's x-request-id to the engine and names the replica in the pending record, as
    the router does: when it is SIGKILLed mid-stream, a router sharing its Redis closes the record from the
    engine's usage lookup (router_lost_settled), once."""
    import json
    import subprocess
    import sys

    from tests.router.conftest import router

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f'tenants:\n  acme:\n    api_key_sha256: ["{key_sha256(KEY)}"]\n    tokens_per_minute: 100000\n')
    engine = fake_engine(procs, "e0", "--chunks", "6")
    engine.wait_ready()
    common = ["--tenants", str(tenants), "--redis-url", redis_server.url, "--usage-reconcile-after", "1"]
    p, address = picker(procs, [engine.url], *common)
    body = _completion(stream=True, max_tokens=6)
    sender = threading.Thread(target=lambda: _swallow(lambda: Gateway(address).send(
        "/v1/completions", body, headers={"authorization": f"Bearer {KEY}", "x-fake-chunk-delay-ms": "1000"})),
        daemon=True)
    sender.start()
    wait_for(lambda: metric(httpx.get(engine.url + "/metrics").text, "vllm:num_requests_running") == 1, timeout=30,
             what="the stream running on the engine")
    p.kill()
    sender.join(timeout=30)
    router(procs, [engine.url], *common, policy="least-load").wait_ready()  # the survivor that reconciles

    def ledger() -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "kvfleet", "usage", "export", "--redis-url", redis_server.url,
                              "--tenants", str(tenants)], capture_output=True, text=True, check=True).stdout
        return [json.loads(line) for line in out.splitlines()]

    rows = wait_for(lambda: (got := ledger()) and got, timeout=40, what="the dead picker's request in the ledger")
    assert len(rows) == 1 and rows[0]["outcome"] == "router_lost_settled" and rows[0]["replica"] == engine.url
    rid = rows[0]["request_id"]
    said = httpx.post(engine.url + "/v1/kvfleet/usage/lookup", json={"request_ids": [rid]}).json()["data"][rid]
    assert (rows[0]["prompt_tokens"], rows[0]["output_tokens"]) == (said["prompt_tokens"], said["completion_tokens"])
    assert rows[0]["outcome"] != "router_lost" and said["completion_tokens"] >= 1
    time.sleep(5)  # two more reconcile rounds (one a heartbeat, 2 s, as records are due after 1 s): nothing twice
    assert len(ledger()) == 1


def _swallow(fn) -> None:
    try:
        fn()
    except Exception:  # the picker died under the stream: the gateway's side of it fails, as it should
        pass
