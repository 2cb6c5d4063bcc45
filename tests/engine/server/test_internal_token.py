"""--require-internal-token: the real engine app (build_app, an engine stand-in that needs no model) answers
401 without the token on every endpoint but /health and /ready."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from contract.errors import ConfigError
from engine.server.app import build_app
from engine.server.auth import token_matches
from engine.server.serving import ServerConfig
from tests.engine.server.conftest import ROOT

TOKEN = "s3cret-internal"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class StandInEngine:
    """What the server asks of a loaded engine outside of generation (no model)."""

    def __init__(self):
        self.dead = None
        self.limits = SimpleNamespace(max_model_len=2048, block_size=16)
        self.hash_seed = 0
        self.subscribers: list[asyncio.Queue] = []

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def stats(self):
        return None

    def subscribe_kv_events(self):
        queue: asyncio.Queue = asyncio.Queue()
        self.subscribers.append(queue)
        return [], 0, queue

    def tier_snapshot(self):
        return ()

    def unsubscribe_kv_events(self, queue) -> None:
        self.subscribers.remove(queue)


def guarded_app(require: bool = True):
    config = ServerConfig(served_model_names=("m",), instance_id="t", internal_token=TOKEN,
                          require_internal_token=require)
    return build_app(config, engine=StandInEngine())


def _loaded(client: TestClient) -> None:
    deadline = time.monotonic() + 10
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the stand-in engine never became ready"
        time.sleep(0.01)


REFUSED = [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/v1/kv/events"), ("POST", "/v1/chat/completions"),
           ("POST", "/v1/completions"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/path"),
           ("DELETE", "/v1/models")]
BAD_AUTH = [None, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": f"Basic {TOKEN}"},
            {"api-key": TOKEN}, {"Authorization": f"Bearer {TOKEN}x"}]


def test_every_endpoint_but_health_and_ready_needs_the_token():
    with TestClient(guarded_app()) as client:
        _loaded(client)
        for method, path in REFUSED:
            for headers in BAD_AUTH:
                r = client.request(method, path, headers=headers, json={"model": "m", "prompt": "x"})
                assert r.status_code == 401, (method, path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json() == {"error": {
                    "message": "this server needs `Authorization: Bearer <internal token>`; only kvfleet routers "
                               "call it", "type": "authentication_error", "param": None,
                    "code": "invalid_internal_token"}}
                assert TOKEN not in r.text
        assert client.get("/health").json() == {"status": "ok"}
        assert client.get("/ready").json() == {"ready": True}


def test_with_the_token_everything_answers_as_before():
    with TestClient(guarded_app()) as client:
        _loaded(client)
        assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "m"
        assert client.get("/v1/models", headers={"authorization": f"bearer  {TOKEN} "}).status_code == 200
        assert "vllm:num_requests_running" in client.get("/metrics", headers=AUTH).text
        r = client.post("/v1/completions", headers=AUTH, json={"model": "nope", "prompt": "x"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"  # reached the handler
        assert client.get("/no/such/path", headers=AUTH).status_code == 404
        with client.stream("GET", "/v1/kv/events", headers=AUTH) as r:
            assert r.status_code == 200
            assert '"type":"snapshot"' in next(r.iter_lines()).replace(" ", "")


def test_without_the_flag_only_kv_events_need_the_token():
    with TestClient(guarded_app(require=False)) as client:
        _loaded(client)
        assert client.get("/v1/models").status_code == 200
        assert client.get("/metrics").status_code == 200
        r = client.get("/v1/kv/events")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token"
        lookup = {"request_ids": ["req_1"]}  # the usage lookup is internal too (contract/usage_lookup.py)
        r = client.post("/v1/kvfleet/usage/lookup", json=lookup)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token"
        r = client.post("/v1/kvfleet/usage/lookup", json=lookup, headers=AUTH)
        assert r.json() == {"object": "kvfleet.usage_lookup", "data": {"req_1": "unknown"}}


def test_token_matches():
    assert token_matches(f"Bearer {TOKEN}", TOKEN) and token_matches(f"BEARER {TOKEN}".encode(), TOKEN)
    assert not token_matches(None, TOKEN) and not token_matches("Bearer", TOKEN)
    assert not token_matches(f"Bearer {TOKEN[:-1]}", TOKEN)


def test_the_flag_needs_a_token():
    with pytest.raises(ConfigError, match="--require-internal-token needs --internal-token"):
        ServerConfig(served_model_names=("m",), require_internal_token=True)
    env = {k: v for k, v in os.environ.items() if k != "KVFLEET_INTERNAL_TOKEN"}
    r = subprocess.run([sys.executable, "-m", "kvfleet", "engine", "--require-internal-token"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--require-internal-token needs --internal-token" in r.stderr
