"""Structured outputs through a real `kvfleet router` in front of a real engine (bundled SmolLM2): the fields
pass through untouched, answers validate, tool calls stream, and the router counts constrained requests."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.engine.server.test_structured_api import PARAMS, TOOLS, WEATHER, _calls_from_stream
from tests.router.conftest import free_port, metric

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def fleet(module_procs):
    port = free_port()
    engine = module_procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--num-threads", "2",
                           "--max-num-seqs", "4", "--num-blocks", "512", "--max-model-len", "2048"],
                          f"http://127.0.0.1:{port}", "engine").wait_ready(timeout=300)
    rport = free_port()
    return module_procs(["-m", "router.main", "--port", str(rport), "--replicas", engine.url, "--model", "",
                         "--policy", "kv", "--health-interval", "0.2", "--log-level", "warning"],
                        f"http://127.0.0.1:{rport}", "router").wait_ready()


def test_schema_and_tool_calls_through_the_router(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    out = client.chat.completions.create(model="smollm2", messages=msgs, temperature=1.0, seed=4, max_tokens=200,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(out.choices[0].message.content), WEATHER)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, stream in (("required", False), ("required", True), (named, False), (named, True)):
        # one call: with parallel calls allowed a sampled answer may go on calling until max_tokens (it did for
        # seed 9 on an Intel AMX machine: finish "length"), which is the model's choice, not the router's doing
        kw = dict(model="smollm2", messages=msgs, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=9,
                  max_tokens=200, parallel_tool_calls=False)
        if stream:
            calls, finish = _calls_from_stream(client.chat.completions.create(**kw, stream=True))
        else:
            o = client.chat.completions.create(**kw)
            finish = o.choices[0].finish_reason
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in o.choices[0].message.tool_calls]
        assert finish == "tool_calls" and calls
        if choice is named:
            assert [c["name"] for c in calls] == ["get_weather"]
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), PARAMS[c["name"]])
    bad = httpx.post(fleet.url + "/v1/chat/completions", json={
        "model": "smollm2", "messages": msgs, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "nope"}}}]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools[0].function.parameters"
    text = httpx.get(fleet.url + "/metrics").text
    assert metric(text, "kvfleet_router_constrained_requests_total", kind="json_schema") == 1
    assert metric(text, "kvfleet_router_constrained_requests_total", kind="tools") == 5
