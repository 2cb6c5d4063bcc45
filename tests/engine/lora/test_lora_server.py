"""LoRA adapters through a real `kvfleet engine` process (the engine core in its own process): adapters named
as the request's model with the official `openai` client, streaming and not; /v1/models; vLLM's load and
unload endpoints behind the internal token; errors that name the field (4xx), after which the engine still
serves; the prefix cache keyed by adapter, seen in the engine's metrics; vllm:lora_requests_info.
Adapters are written directly in PEFT's format (random, rank 8 and 16), no Hugging Face model needed.
"""

from __future__ import annotations

import signal

import httpx
import openai
import pytest

from tests.engine.lora._adapters import SMOLLM2, write_adapter
from tests.engine.server.conftest import start_engine

pytestmark = pytest.mark.model

TOKEN = "lora-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "Write one sentence about the sea."
LONG = "Prefix isolation: " + "the quick brown fox jumps over the lazy dog " * 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(str(root / name), rank=rank, targets=targets, seed=seed)
            for name, rank, targets, seed in (("sea", 8, ("q_proj", "v_proj"), 1),
                                              ("sky", 16, ("gate_proj", "up_proj", "down_proj"), 2),
                                              ("late", 8, ("o_proj", "k_proj"), 3))} | {"root": str(root)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
    srv = start_engine(str(tmp_path_factory.mktemp("lora-engine")), "--dtype", "float32", "--num-blocks", "256",
                       "--max-model-len", "512", "--max-num-seqs", "8", "--internal-token", TOKEN,
                       "--lora-modules", f"sea={adapters['sea']}", f"sky={adapters['sky']}",
                       "--max-loras", "2", "--max-lora-rank", "16")
    yield srv
    srv.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _chat(client, model: str, stream: bool = False, content: str = PROMPT) -> str:
    kw = dict(model=model, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content
    return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                   if c.choices)


def _post(server, path: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def test_models_lists_adapters_with_their_parent(server, adapters):
    data = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
    assert data["smollm2"]["parent"] is None
    for name in ("sea", "sky"):
        assert data[name]["parent"] == "smollm2" and data[name]["root"] == adapters[name]


def test_requests_by_adapter_name_streaming_and_not(client):
    base = _chat(client, "smollm2")
    sea, sky = _chat(client, "sea"), _chat(client, "sky")
    assert _chat(client, "sea", stream=True) == sea
    assert _chat(client, "sky", stream=True) == sky
    assert len({base, sea, sky}) == 3, (base, sea, sky)
    assert _chat(client, "smollm2") == base  # the base model is untouched by the adapters' slots


def test_unknown_adapter_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        _chat(client, "no-such-adapter")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_load_and_unload_behind_the_internal_token(server, client, adapters):
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]},
                 headers={}).status_code == 401
    r = _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]})
    assert r.status_code == 200, r.text
    first = _chat(client, "late")
    assert "late" in {m.id for m in client.models.list().data}
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}, headers={}).status_code == 401
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _chat(client, "late")
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": adapters["late"]}).status_code == 200
    assert _chat(client, "late") == first  # unload + load: the same tokens
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


BAD = [  # (case, the field the error names, words of its message)
    ("missing", "lora_path", "is not a directory"),
    ("no-weights", "lora_path", "adapter_model.safetensors"),
    ("other-base", "lora_path", "do not fit the base model"),
    ("rank-too-large", "r", "exceeds --max-lora-rank 16"),
    ("unsupported-target", "target_modules", "lm_head"),
    ("duplicate-name", "lora_name", "already been loaded"),
    ("no-path", "lora_path", "non-empty string"),
]


def test_bad_adapters_are_clear_400s_and_the_engine_keeps_serving(server, client, adapters):
    import os

    root = adapters["root"]
    for case, param, words in BAD:
        name, path = f"bad-{case}", os.path.join(root, case)
        if case == "no-weights":
            write_adapter(path)
            os.remove(os.path.join(path, "adapter_model.safetensors"))
        elif case == "other-base":  # a Llama with 64-wide layers, not SmolLM2's 576
            write_adapter(path, shapes={**SMOLLM2, "layers": 2, "q_proj": (64, 64), "v_proj": (64, 32)})
        elif case == "rank-too-large":
            write_adapter(path, rank=32)
        elif case == "unsupported-target":
            write_adapter(path, target_modules=["q_proj", "v_proj", "lm_head"])
        elif case == "duplicate-name":
            name, path = "sea", adapters["sea"]
        body = {"lora_name": name} if case == "no-path" else {"lora_name": name, "lora_path": path}
        r = _post(server, "/v1/load_lora_adapter", body)
        assert r.status_code == 400, (case, r.text)
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], (case, error)
        assert error["type"] == "invalid_request_error"
    served = {m.id for m in client.models.list().data}
    assert not any(name.startswith("bad-") for name in served)
    assert _chat(client, "sea") and _chat(client, "smollm2")  # still serving, adapters and base


def test_prefix_cache_is_keyed_by_adapter(server, client):
    """The same 3-block prompt under sea, then sky: no cached token; under sea again: cached (engine metrics)."""

    def hits(model: str) -> float:
        before = server.metric("vllm:prefix_cache_hits_total")
        client.completions.create(model=model, prompt=LONG, max_tokens=1, temperature=0)
        return server.metric("vllm:prefix_cache_hits_total") - before

    assert hits("sea") == 0
    assert hits("sky") == 0
    assert hits("sea") >= 32
    assert hits("smollm2") == 0


def test_lora_requests_info_metric(server):
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line and 'waiting_lora_adapters=""' in line
