"""Two models behind one router: a real SmolLM2 engine (`smollm2`) and a real engine of a random-weight tiny Llama
the test writes (`tiny-llama`), one pool each, the router fetching each model's tokenizer from its own engines.
The official `openai` client reaches each by name, streamed and not; a prefix cached under one model is never a
hit under the other (the engines' own counters); an unknown model, and a model the caller's key may not use,
get the same 404 `model_not_found` while the engines see nothing; /v1/models lists both (each key: its own)."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from router.tenants.registry import key_sha256
from tests.engine._tiny_llama import make_tiny_llama
from tests.router.conftest import free_port, metric, router, wait_for

pytestmark = pytest.mark.model

KEY_ALL, KEY_SMALL = "sk-all-models-1", "sk-small-only-2"
SYSTEM = "You are the archivist of a small harbour town and answer in one sentence. " * 12

POOLS = """
pools:
  small:
    version: v1
    weight: 1
    model: smollm2
    replicas: [{small}]
  tiny:
    version: v1
    weight: 1
    model: tiny-llama
    engine: kvfleet
    replicas: [{tiny}]
"""

TENANTS = f"""
tenants:
  everyone:
    api_key_sha256: ["{key_sha256(KEY_ALL)}"]
    tokens_per_minute: 1000000
  small-only:
    api_key_sha256: ["{key_sha256(KEY_SMALL)}"]
    tokens_per_minute: 1000000
    models: [smollm2]
model_token_weights:
  smollm2: 1
"""


def _engine(module_procs, model: str, name: str):
    port = free_port()
    return module_procs(["-m", "kvfleet", "engine", "--model", model, "--served-model-name", name, "--port", str(port),
                         "--num-threads", "1", "--num-blocks", "256", "--max-num-seqs", "4"],
                        f"http://127.0.0.1:{port}", name)


@pytest.fixture(scope="module")
def fleet(module_procs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two-models")
    tiny_path = make_tiny_llama(str(tmp / "tiny-llama"), seed=5)
    small, tiny = _engine(module_procs, "smollm2", "smollm2"), _engine(module_procs, tiny_path, "tiny-llama")
    (tmp / "pools.yaml").write_text(POOLS.format(small=small.url, tiny=tiny.url))
    (tmp / "tenants.yaml").write_text(TENANTS)
    r = router(module_procs, None, "--pools", str(tmp / "pools.yaml"), "--tenants", str(tmp / "tenants.yaml"),
               "--tokenizer-from-engines", "--log-level", "info", default_model=None)
    for e in (small, tiny):
        e.wait_ready(timeout=300)
    r.wait_ready(timeout=60)
    # the whole log: a replica's KV-event resyncs, logged every 2 s until it is ready, can push the first
    # tokenizer's line out of a short tail (CI: one engine ready ~50 s before the other)
    # the line of a fetch that succeeded (`tokenizer of M from URL: vocab ...`): a failed try, retried a second later,
    # logs "fetching the tokenizer of M from URL failed" (CI once went on after one and got 503 "still fetching")
    wait_for(lambda: all(re.search(rf"tokenizer of {m} from \S+: vocab", r.tail(1 << 22))
                         for m in ("tiny-llama", "smollm2")), timeout=120, what="both tokenizers fetched")
    return r, small, tiny


def _client(r, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key=key, max_retries=0, timeout=60)


def _engine_counts(engine) -> tuple[float, float]:
    text = httpx.get(engine.url + "/metrics").text
    return metric(text, "vllm:request_success_total"), metric(text, "vllm:prompt_tokens_total")


def test_each_model_by_name_streamed_and_not(fleet):
    r, small, tiny = fleet
    client = _client(r, KEY_ALL)
    for model, pool in (("smollm2", "small"), ("tiny-llama", "tiny")):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": "Name a harbour bird."}], max_tokens=6, temperature=0)
        answer = raw.parse()
        assert raw.headers["x-kvfleet-pool"] == pool and answer.model == model
        assert answer.usage.completion_tokens >= 1
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a harbour bird."}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert {c.model for c in chunks} == {model}
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == answer.choices[0].message.content  # greedy: the same text either way
        text = client.completions.create(model=model, prompt="The tide came in", max_tokens=4, temperature=0)
        assert text.model == model and text.usage.completion_tokens >= 1


def test_prefix_hits_never_cross_models(fleet):
    r, small, tiny = fleet
    client = _client(r, KEY_ALL)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When was the lighthouse built?"}]

    def cached(model: str) -> int:
        usage = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0).usage
        return usage.prompt_tokens_details.cached_tokens

    hits = metric(httpx.get(tiny.url + "/metrics").text, "vllm:prefix_cache_hits_total")
    assert cached("smollm2") == 0 and cached("smollm2") >= 192  # the second one hits its own model's cache
    assert cached("tiny-llama") == 0  # the same prompt, cached under smollm2 only: a miss here
    assert metric(httpx.get(tiny.url + "/metrics").text, "vllm:prefix_cache_hits_total") == hits
    assert cached("tiny-llama") >= 192


def test_unknown_and_disallowed_models_are_the_same_404_and_reach_no_engine(fleet):
    r, small, tiny = fleet
    before = [_engine_counts(e) for e in (small, tiny)]
    bodies = []
    for key, model in ((KEY_ALL, "gpt-9"), (KEY_SMALL, "tiny-llama"), (KEY_SMALL, "gpt-9")):
        with pytest.raises(openai.NotFoundError) as e:
            _client(r, key).chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
        assert e.value.code == "model_not_found" and e.value.param == "model"
        bodies.append(e.value.body["message"].replace(model, "MODEL"))
    assert len(set(bodies)) == 1  # a key cannot tell a model it may not use from one that does not exist
    with pytest.raises(openai.BadRequestError) as e:  # no model, and no --default-model
        httpx_body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        resp = httpx.post(r.url + "/v1/chat/completions", json=httpx_body, headers={"authorization": f"Bearer {KEY_ALL}"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model"
        raise openai.BadRequestError("400", response=resp, body=resp.json()["error"])
    assert [_engine_counts(e) for e in (small, tiny)] == before
    text = httpx.get(r.url + "/metrics").text
    assert metric(text, "kvfleet_router_ratelimit_requests_total", tenant="small-only", outcome="model_not_found") == 2


def test_models_lists_both_and_each_key_its_own(fleet):
    r, _, _ = fleet
    assert sorted(m.id for m in _client(r, KEY_ALL).models.list()) == ["smollm2", "tiny-llama"]
    assert [m.id for m in _client(r, KEY_SMALL).models.list()] == ["smollm2"]
    assert httpx.get(r.url + "/v1/models").status_code == 401  # tenants on: a key is needed here too
    text = httpx.get(r.url + "/metrics").text
    assert metric(text, "kvfleet_router_pool_requests_total", pool="tiny", model="tiny-llama", status="200") >= 1
