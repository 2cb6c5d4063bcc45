"""LoRA adapters through a router in front of two real kvfleet engines (slow): with the official `openai` client,
requests by adapter name, streamed and not; the router learns the adapters from /v1/models, hashes an adapter's
prompt as the engines do (its predicted cached tokens equal the engine's for a prefix cached under the same
adapter, and it predicts none across adapters); with `adapters:` in the pool the second engine, which starts
without adapters, or the first, is made to load a cold adapter through /v1/load_lora_adapter (internal token)
"""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.engine.lora._adapters import write_adapter
from tests.router.conftest import free_port, metric, router, wait_for

pytestmark = [pytest.mark.model, pytest.mark.slow]
TOKEN = "lora-router-token"
SYSTEM = "You are the archivist of a small harbour town and answer in one sentence. " * 8

POOLS = """
pools:
  small:
    version: v1
    weight: 1
    model: smollm2
    adapters: {{sea: {sea}, sky: {sky}}}
    replicas: [{e1}, {e2}]
"""


def _engine(module_procs, *extra: str):
    port = free_port()
    return module_procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--num-threads", "1",
                         "--num-blocks", "256", "--max-num-seqs", "4", "--dtype", "float32", "--max-loras", "2",
                         "--internal-token", TOKEN, "--enable-lora", *extra], f"http://127.0.0.1:{port}", f"e{port}")


@pytest.fixture(scope="module")
def fleet(module_procs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora-fleet")
    sea = write_adapter(str(tmp / "sea"), 8, ("q_proj", "v_proj"), seed=1)
    sky = write_adapter(str(tmp / "sky"), 8, ("gate_proj", "up_proj"), seed=2)
    e1 = _engine(module_procs, "--lora-modules", f"sea={sea}")
    e2 = _engine(module_procs)
    (tmp / "pools.yaml").write_text(POOLS.format(sea=sea, sky=sky, e1=e1.url, e2=e2.url))
    r = router(module_procs, None, "--pools", str(tmp / "pools.yaml"), "--internal-token", TOKEN,
               "--tokenizer-from-engines", "--log-level", "info", default_model=None)
    for e in (e1, e2):
        e.wait_ready(timeout=300)
    r.wait_ready(timeout=60)
    wait_for(lambda: httpx.post(r.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 1},
                                timeout=60).status_code == 200, timeout=120, interval=1.0, what="the router serving")
    wait_for(lambda: metric(httpx.get(r.url + "/metrics", timeout=10).text, "kvfleet_router_kv_events_live") == 2,
             timeout=60, what="both KV event streams live")
    return r, e1, e2


def _client(r) -> openai.OpenAI:
    return openai.OpenAI(base_url=r.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _models(e) -> set[str]:
    return {m["id"] for m in httpx.get(e.url + "/v1/models", timeout=10).json()["data"]}


def test_adapters_by_name_streamed_and_not_and_prefix_affinity(fleet):
    r, e1, e2 = fleet
    client = _client(r)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When was the lighthouse built?"}]
    wait_for(lambda: "sea" in httpx.get(r.url + "/v1/models", timeout=10).text, timeout=30, what="sea learned")
    answer = client.chat.completions.create(model="sea", messages=messages, max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="sea", messages=messages, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == answer.choices[0].message.content
    assert "sea" not in _models(e2)  # e1 held sea: nothing was loaded on e2 for it
    time.sleep(1.0)  # the engine's KV events reach the router
    again = client.chat.completions.create(model="sea", messages=messages, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    text = httpx.get(r.url + "/metrics", timeout=10).text
    predicted = metric(text, "kvfleet_router_predicted_cached_tokens_total")
    assert predicted >= again.usage.prompt_tokens_details.cached_tokens  # the router hashed it as the engine did
    # sky is held by nobody: loaded on demand on one replica, then served from there with its own cache
    first = client.chat.completions.create(model="sky", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # sea's blocks are not sky's
    holders = [e for e in (e1, e2) if "sky" in _models(e)]
    assert len(holders) == 1
    time.sleep(1.0)
    second = client.chat.completions.create(model="sky", messages=messages, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
