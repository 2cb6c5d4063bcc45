"""A router without model files: `--tokenizer-from-engines` fetches the tokenizer from a ready engine
(`GET /v1/kvfleet/tokenizer`, behind the internal token), tokenizes exactly as the engine does, and is not
ready before it has it."""

from __future__ import annotations

import io
import tarfile

import httpx
import pytest

from engine.tokenizer import TokenizerError, load_tokenizer, load_tokenizer_archive, tokenizer_archive
from tests.router.conftest import free_port, metric, router, wait_for

pytestmark = pytest.mark.model

TOKEN = "tok-secret-5Rr9"
CHAT = {"model": "smollm2", "max_tokens": 2, "temperature": 0, "messages": [
    {"role": "system", "content": "You answer questions about the opening hours of a museum in one sentence. " * 6},
    {"role": "user", "content": "When do you open on Sundays?"}]}


def test_archive_round_trip_tokenizes_exactly_as_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    tok = load_tokenizer("smollm2")
    data = tokenizer_archive(tok)
    assert tokenizer_archive(tok) is data  # built once
    got = load_tokenizer_archive(data)
    assert got.apply_chat_template(CHAT["messages"]) == tok.apply_chat_template(CHAT["messages"])
    assert got.encode("naïve café, 12 µs ") == tok.encode("naïve café, 12 µs ")
    assert (got.eos_token_ids, got.vocab_size, got.bos_token_id) == (tok.eos_token_ids, tok.vocab_size,
                                                                     tok.bos_token_id)


def test_an_archive_with_paths_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    with pytest.raises(TokenizerError, match="plain files only"):
        load_tokenizer_archive(buf.getvalue())
    assert not (tmp_path / "escape.json").exists()


def test_router_gets_its_tokenizer_from_an_engine(procs, tmp_path):
    port = free_port()
    engine = procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--num-threads", "2",
                    "--internal-token", TOKEN, "--require-internal-token"], f"http://127.0.0.1:{port}", "engine")
    r = router(procs, [engine.url], "--tokenizer-from-engines", "--internal-token", TOKEN, "--log-level", "info",
               policy="kv", model="", env={"KVFLEET_CACHE_DIR": str(tmp_path)}).wait_ready(path="/health")
    assert httpx.get(r.url + "/ready").status_code == 503  # no engine ready yet, so no tokenizer
    engine.wait_ready(timeout=300)
    assert httpx.get(engine.url + "/v1/kvfleet/tokenizer").status_code == 401  # routers only
    wait_for(lambda: httpx.get(r.url + "/ready").status_code == 200, timeout=30, what="router ready")
    assert "tokenizer of smollm2 from http://127.0.0.1" in r.tail()
    # the engine's KV event stream reconnects on its own backoff (up to 2 s) once the engine is ready
    wait_for(lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_kv_events_live") == 1, timeout=30,
             what="the engine's KV events live")
    for _ in range(2):
        assert httpx.post(r.url + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
    text = httpx.get(r.url + "/metrics").text
    # the second request's cached prefix was predicted from the router's own tokens and matched the engine's
    predicted = metric(text, "kvfleet_router_predicted_cached_tokens_total")
    assert predicted > 0 and predicted == metric(text, "kvfleet_router_reported_cached_tokens_total")
