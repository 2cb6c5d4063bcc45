"""Lifecycle of one replica: /ready is 503 while the model loads; overload beyond
--max-queued-requests is a 429; SIGTERM drains: /ready turns false, new requests get 503, running
ones finish until the drain timeout (longer ones are aborted then), and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.engine.server.conftest import start_engine

DRAIN_TIMEOUT = 10.0


def stream_chat(url: str, max_tokens: int, out: dict, started: threading.Event) -> None:
    body = {"model": "smollm2", "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Describe the harbour at night."}]}
    out.update(tokens=0, finish=None, error=None, done=False, usage=None)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            msg = json.loads(line[6:])
            if "error" in msg:
                out["error"] = msg["error"]
                continue
            out["usage"] = msg.get("usage") or out["usage"]
            for ch in msg["choices"]:
                if ch["delta"].get("content"):
                    out["tokens"] += 1
                    started.set()
                out["finish"] = ch.get("finish_reason") or out["finish"]


def wait_for(url: str, status: int, timeout: float = 300) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == status:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never answered {status}")


def test_not_ready_while_loading_then_sigterm_drains_then_exits(tmp_path):
    server = start_engine(str(tmp_path), "--drain-timeout", str(DRAIN_TIMEOUT), "--max-model-len", "2048",
                          "--max-num-seqs", "2", "--max-queued-requests", "0", wait_ready=False)
    try:
        # the HTTP server is up before the model: alive, not ready, requests refused with 503
        wait_for(f"{server.url}/health", 200)
        r = httpx.get(f"{server.url}/ready", timeout=5)
        assert r.status_code == 503 and r.json() == {"ready": False, "reason": "loading"}
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        wait_for(f"{server.url}/ready", 200)
        short, long_ = {}, {}
        started_s, started_l = threading.Event(), threading.Event()
        threads = [threading.Thread(target=stream_chat, args=(server.url, 24, short, started_s)),
                   threading.Thread(target=stream_chat, args=(server.url, 1800, long_, started_l))]
        for t in threads:
            t.start()
        assert started_s.wait(60) and started_l.wait(60)
        # both sequence slots are busy and no queueing is allowed: overload is a 429, not a pile-up
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["code"] == "engine_overloaded"
        assert r.headers.get("retry-after") == "1"
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.get(f"{server.url}/ready", timeout=5)
        assert r.status_code == 503 and r.json() == {"ready": False, "reason": "draining"}
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=5,
                       json={"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert r.headers.get("retry-after") == "1"
        for t in threads:
            t.join(60)
        # the short request finished normally during the drain
        assert short["finish"] == "length" and short["usage"]["completion_tokens"] == 24 and short["done"]
        # the long one could not finish within the drain timeout: aborted, and told so
        assert long_["error"] is not None and long_["error"]["code"] == "aborted" and long_["done"]
        assert long_["tokens"] < 1800
        assert server.proc.wait(30) == 0
        elapsed = time.monotonic() - t0
        assert DRAIN_TIMEOUT - 0.5 < elapsed < DRAIN_TIMEOUT + 15
    finally:
        server.stop()


def test_a_stream_the_drain_aborts_before_its_first_token_gets_a_503(tmp_path):
    """One sequence slot, held by a slow request; a stream queued behind it has sent nothing (keep-alives
    off) when the drain deadline aborts both: it is answered 503 `aborted` with a JSON body, not a stream."""
    server = start_engine(str(tmp_path), "--drain-timeout", "1", "--max-model-len", "2048", "--max-num-seqs", "1",
                          "--debug-step-delay-ms", "200", "--sse-keepalive", "0")
    try:
        chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Describe the harbour."}],
                "ignore_eos": True}
        answers: dict[str, httpx.Response] = {}

        def post(name: str, body: dict) -> None:
            answers[name] = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)

        threads = [threading.Thread(target=post, args=("running", {**chat, "max_tokens": 500}))]
        threads[0].start()
        wait_metric(server, "vllm:num_requests_running", 1)
        threads.append(threading.Thread(target=post, args=("queued", {**chat, "max_tokens": 8, "stream": True})))
        threads[1].start()
        wait_metric(server, "vllm:num_requests_waiting", 1)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        queued = answers["queued"]
        assert queued.status_code == 503 and queued.headers["content-type"] == "application/json", queued.text
        assert queued.json()["error"]["code"] == "aborted"
        assert answers["running"].status_code == 503 and answers["running"].json()["error"]["code"] == "aborted"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def wait_metric(server, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while server.metric(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)
