"""The usage ledger through real router processes sharing a real Redis, in front of a fake engine that reports
usage (loadtest/fake_engine.py): every settled request leaves one record, written with its settlement; a tenant
reads its own usage from any router in OpenAI's shape; a Redis outage loses no record (those settled on local
budgets meanwhile reach the ledger once Redis answers again)."""

from __future__ import annotations

import csv
import io
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from router.tenants.registry import key_sha256
from tests.router.conftest import fake_engine, router, wait_for

KEYS = ("sk-led-one-Qw3Er5Ty", "sk-led-two-Ui7Op9As")
TENANTS = f"""
tenants:
  acme:
    api_key_sha256: ["{key_sha256(KEYS[0])}", "{key_sha256(KEYS[1])}"]
    tokens_per_minute: 1000000
  other:
    api_key_sha256: ["{key_sha256('sk-led-other-Df2Gh4Jk')}"]
    tokens_per_minute: 1000000
model_prices:
  smollm2: {{input: 0.10, cached_input: 0.01, output: 0.40}}
"""
PROMPT = list(range(200, 232))  # 32 token ids


def usage(url: str, key: str, **params) -> httpx.Response:
    q = {"start_time": int(time.time()) - 600, "bucket_width": "1h", **params}
    return httpx.get(url + "/v1/organization/usage/completions", params=q, headers={"authorization": f"Bearer {key}"})


def totals(page: dict) -> dict:
    out = {"input_tokens": 0, "input_cached_tokens": 0, "output_tokens": 0, "num_model_requests": 0}
    for b in page["data"]:
        for r in b["results"]:
            for k in out:
                out[k] += r[k]
    return out


@pytest.fixture
def fleet(procs, tmp_path, redis_server):
    engine = fake_engine(procs, "e1", "--chunks", "6").wait_ready()
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    common = ["--tenants", str(path), "--redis-url", redis_server.url, "--ratelimit-on-store-error", "open"]
    return [router(procs, [engine.url], *common, policy="least-load").wait_ready() for _ in range(2)], redis_server


def reported_usage(r: httpx.Response, stream: bool) -> dict:
    """The usage the engine reported, as the client got it (a stream's last usage chunk)."""
    if not stream:
        return r.json()["usage"]
    chunks = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    return [json.loads(c) for c in chunks if '"usage":{' in c][-1]["usage"]


def test_every_request_leaves_one_record_that_any_router_reads(fleet, tmp_path):
    routers, redis_server = fleet
    sent = {"input_tokens": 0, "input_cached_tokens": 0, "output_tokens": 0}
    ids = set()
    for i in range(12):
        stream = i % 3 == 0
        body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 6, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = httpx.post(routers[i % 2].url + "/v1/completions", json=body,
                       headers={"authorization": f"Bearer {KEYS[i % 2]}"})
        assert r.status_code == 200, r.text
        ids.add(r.headers["x-request-id"])
        u = reported_usage(r, stream)
        sent["input_tokens"] += u["prompt_tokens"]
        sent["input_cached_tokens"] += u["prompt_tokens_details"]["cached_tokens"]
        sent["output_tokens"] += u["completion_tokens"]
    assert len(ids) == 12 and all(i.startswith("req_") for i in ids)
    now = int(time.time())  # one window for both reads (a default end_time is each read's own now)
    pages = [usage(rt.url, KEYS[0], start_time=now - 600, end_time=now + 1).json() for rt in routers]
    assert pages[0] == pages[1]  # one ledger
    assert totals(pages[0]) == {**sent, "num_model_requests": 12}  # what the engine reported, to the token
    assert sent["input_cached_tokens"] > 0
    by_key = usage(routers[0].url, KEYS[1], group_by="api_key_id").json()
    keys = {r["api_key_id"]: r["num_model_requests"] for b in by_key["data"] for r in b["results"]}
    assert keys == {"key_" + key_sha256(KEYS[0])[:16]: 6, "key_" + key_sha256(KEYS[1])[:16]: 6}
    assert totals(usage(routers[1].url, "sk-led-other-Df2Gh4Jk").json())["num_model_requests"] == 0  # its own only
    assert usage(routers[0].url, "sk-unknown-0000").status_code == 401
    bad = usage(routers[0].url, KEYS[0], bucket_width="2h")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bucket_width"
    # the operator's export: every record, each request once, as JSON Lines and as CSV
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    base = [sys.executable, "-m", "kvfleet", "usage", "export", "--redis-url", redis_server.url, "--tenants",
            str(tenants)]
    lines = subprocess.run(base, capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    assert {r["request_id"] for r in rows} == ids and {r["tenant"] for r in rows} == {"acme"}
    assert sum(r["prompt_tokens"] for r in rows) == sent["input_tokens"]
    assert all(r["cost_usd"] and r["outcome"] == "200" and r["replica"] for r in rows)
    table = list(csv.DictReader(io.StringIO(subprocess.run(base + ["--format", "csv"], capture_output=True,
                                                           text=True, check=True).stdout)))
    assert sorted(r["request_id"] for r in table) == sorted(ids)
    assert sum(int(r["cached_tokens"]) for r in table) == sent["input_cached_tokens"]


def test_a_redis_outage_loses_no_record(fleet):
    routers, redis_server = fleet
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 6}
    auth = {"authorization": f"Bearer {KEYS[0]}"}
    for rt in routers:
        assert httpx.post(rt.url + "/v1/completions", json=body, headers=auth).status_code == 200
    redis_server.popen.send_signal(signal.SIGSTOP)  # Redis hangs: every call times out, nothing is lost in it
    try:
        for i in range(6):  # served on the routers' local shares of the budget
            assert httpx.post(routers[i % 2].url + "/v1/completions", json=body, headers=auth,
                              timeout=30).status_code == 200
        assert usage(routers[0].url, KEYS[0]).status_code == 503  # the ledger cannot be read meanwhile
    finally:
        redis_server.popen.send_signal(signal.SIGCONT)
    # each router reads the ledger plus what it still holds for it; both see all 8 once both have flushed theirs
    wait_for(lambda: [totals(usage(rt.url, KEYS[0]).json())["num_model_requests"] for rt in routers] == [8, 8],
             timeout=30, what="the records settled during the outage in the ledger")
    time.sleep(5.0)  # two more heartbeats: no flush writes any of them twice
    page = usage(routers[1].url, KEYS[0]).json()
    got = totals(page)
    assert (got["input_tokens"], got["output_tokens"], got["num_model_requests"]) == (8 * 32, 8 * 6, 8)


def test_a_request_whose_router_dies_mid_stream_is_recorded_once_with_what_its_engine_sent(procs, tmp_path,
                                                                                              redis_server):
    """A router SIGKILLed between admission and settlement leaves a pending record in Redis naming the replica; once
    it is due another router asks that engine what the request used and closes the record with it (outcome
    router_lost_settled, the rest of the reservation refunded), exactly once."""
    engine = fake_engine(procs, "e1", "--chunks", "6").wait_ready()
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    common = ["--tenants", str(path), "--redis-url", redis_server.url, "--usage-reconcile-after", "1"]
    doomed, survivor = (router(procs, [engine.url], *common, policy="least-load").wait_ready() for _ in range(2))
    auth = {"authorization": f"Bearer {KEYS[0]}"}
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 6, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", doomed.url + "/v1/completions", json=body,
                                                 headers={**auth, "x-fake-chunk-delay-ms": "1000"}) as r:
        lost_id = r.headers["x-request-id"]
        # the engine's stream has begun; `lines` is kept until the kill: a line iterator dropped before it closes the
        # connection (httpcore closes it on the generator's GeneratorExit), and the router would settle the request
        # as disconnected before it dies
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        doomed.kill()
        del lines
    ok = [httpx.post(survivor.url + "/v1/completions", json={**body, "stream": False}, headers=auth)
          for _ in range(3)]
    assert all(r.status_code == 200 for r in ok)

    def ledger() -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "kvfleet", "usage", "export", "--redis-url", redis_server.url,
                              "--tenants", str(path)], capture_output=True, text=True, check=True).stdout
        return [json.loads(line) for line in out.splitlines()]

    rows = wait_for(lambda: (got := ledger()) and len(got) == 4 and got, timeout=40,
                    what="the dead router's request reconciled into the ledger")
    lost = [r for r in rows if r["request_id"] == lost_id]
    def lookup():
        return httpx.post(engine.url + "/v1/kvfleet/usage/lookup", json={"request_ids": [lost_id]}).json()["data"][lost_id]

    said = wait_for(lambda: got if isinstance(got := lookup(), dict) else None, timeout=20,
                    what="the engine's usage of the lost request (not running, known)")
    assert said["outcome"] == "aborted" and 1 <= said["completion_tokens"] < 6  # the engine saw its client go
    assert len(lost) == 1 and lost[0]["outcome"] == "router_lost_settled" and lost[0]["replica"] == engine.url
    assert (lost[0]["prompt_tokens"], lost[0]["cached_tokens"], lost[0]["output_tokens"]) == (
        said["prompt_tokens"], said["cached_tokens"], said["completion_tokens"])
    assert lost[0]["budget_tokens"] < len(PROMPT) + 6  # less than the reservation (prompt + max_tokens)
    time.sleep(5)  # two more reconcile rounds (one a heartbeat, 2 s, as records are due after 1 s): nothing twice
    assert sorted(r["request_id"] for r in ledger()) == sorted(r["request_id"] for r in rows)
