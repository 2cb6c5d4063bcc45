"""A pool's max_tokens cap in front of a real SmolLM2 engine: it holds for every spelling of max_tokens
(absent, null, either field, both), whatever the client sends or omits, and says so in a header; a body the
tokenizer cannot read is a 400 at the engine as at the router."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.router.conftest import free_port, router

pytestmark = pytest.mark.model

POOLS = """
pools:
  default:
    version: v1
    weight: 1
    replicas: [{replica}]
    max_tokens_cap: 8
"""


@pytest.fixture(scope="module")
def engine(module_procs):
    port = free_port()
    e = module_procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--num-threads", "2",
                      "--num-blocks", "256", "--max-num-seqs", "8"], f"http://127.0.0.1:{port}", "engine")
    return e.wait_ready(timeout=300)


@pytest.fixture(scope="module")
def capped_router(module_procs, engine, tmp_path_factory):
    path = tmp_path_factory.mktemp("pools") / "pools.yaml"
    path.write_text(POOLS.format(replica=engine.url))
    return router(module_procs, None, "--pools", str(path)).wait_ready()


@pytest.mark.parametrize("fields", [{}, {"max_tokens": None}, {"max_completion_tokens": None},
                                    {"max_completion_tokens": None, "max_tokens": 60}, {"max_tokens": 60},
                                    {"max_completion_tokens": 60}, {"max_completion_tokens": 60, "max_tokens": 70}])
@pytest.mark.parametrize("stream", [False, True])
def test_the_cap_holds_for_every_spelling(capped_router, fields, stream):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to one hundred."}],
            "ignore_eos": True, "temperature": 0, **fields}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    resp = httpx.post(capped_router.url + "/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kvfleet-max-tokens-lowered"] == "8"
    if stream:
        events = [json.loads(line[6:]) for line in resp.text.splitlines()
                  if line.startswith("data: {")]
        usage = events[-1]["usage"]
    else:
        usage = resp.json()["usage"]
    assert usage["completion_tokens"] == 8


def test_completions_are_capped_too(capped_router):
    resp = httpx.post(capped_router.url + "/v1/completions", json={"prompt": "Once upon a time", "ignore_eos": True,
                                                                    "max_tokens": 100}, timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
    assert resp.headers["x-kvfleet-max-tokens-lowered"] == "8"


def test_a_lone_surrogate_is_a_400_at_the_engine_too(engine, capped_router):
    body = b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800x"}]}'
    for url in (engine.url, capped_router.url):
        resp = httpx.post(url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                          timeout=30)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"].startswith("messages")
    ok = httpx.post(engine.url + "/v1/chat/completions", timeout=30, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200  # the engine is still serving
