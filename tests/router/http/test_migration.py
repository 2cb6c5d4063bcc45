"""Streams that survive their replica's SIGKILL, exactly: two real SmolLM2 engines (float32: their prefill and
decode agree, so a greedy continuation is the same tokens) and the router, on loopback.

One batch runs twice through the same router: uninterrupted (the reference), then with every request on one
replica (the other paused while they start) that is SIGKILLed mid-stream, at the moment the stop-string stream
has shown the text before its stop string (so the break falls inside it, while the replica holds it back).
Greedy chat (token ids asked by the client), chat with logprobs and continuous usage, completions with n = 2,
completions with a stop string straddling the break, a non-streamed chat (retried whole), and a sampled chat
(the right number of tokens): the same text, tokens and usage, one [DONE], no error."""

from __future__ import annotations

import json
import os
import re
import signal
import threading

import httpx
import pytest

from tests.router.conftest import free_port, metric, ready_replicas, router, wait_for

pytestmark = pytest.mark.model

STORY = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
SEA = [{"role": "user", "content": "Write a short poem about the sea."}]
PROMPT = "The history of the bicycle begins in"
N = 32  # tokens per choice


def engine(procs, name: str):
    port = free_port()
    return procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--dtype", "float32", "--port", str(port),
                  "--instance-id", name, "--num-threads", "1", "--num-blocks", "512", "--max-num-seqs", "8",
                  "--log-level", "warning"], f"http://127.0.0.1:{port}", name)


@pytest.fixture(scope="module")
def fleet(module_procs):
    a, b = engine(module_procs, "a"), engine(module_procs, "b")
    r = router(module_procs, [a.url, b.url], "--log-level", "info", policy="least-load", model="smollm2")
    for p in (a, b, r):
        p.wait_ready(timeout=300)
    wait_for(lambda: ready_replicas(r) == 2, timeout=30, what="both replicas ready")
    return a, b, r


def batch(stop: str | None) -> dict[str, tuple[str, dict]]:
    greedy = {"temperature": 0, "ignore_eos": True, "max_tokens": N, "stream": True}
    cases = {
        "chat": ("/v1/chat/completions", {"messages": STORY, **greedy, "return_token_ids": True,
                                          "stream_options": {"include_usage": True}}),
        "logprobs": ("/v1/chat/completions", {"messages": SEA, **greedy, "logprobs": True, "top_logprobs": 2,
                                              "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}}),
        "n2": ("/v1/completions", {"prompt": PROMPT, **greedy, "n": 2, "stream_options": {"include_usage": True}}),
        "stop": ("/v1/completions", {"prompt": "Once upon a time", **greedy, "max_tokens": 2 * N,
                                     "return_token_ids": True}),
        "whole": ("/v1/chat/completions", {"messages": SEA, **greedy, "stream": False}),
        "sampled": ("/v1/chat/completions", {"messages": STORY, **greedy, "temperature": 1.0, "seed": 7,
                                             "return_token_ids": True, "stream_options": {"include_usage": True}}),
    }
    if stop is not None:
        cases["stop"][1]["stop"] = [stop]
    return cases


class Run(threading.Thread):
    """One request through the router, read as it streams; `on_text(text, token ids so far)` after each chunk."""

    def __init__(self, url: str, path: str, body: dict, on_text=None):
        super().__init__(daemon=True)
        self.url, self.path, self.body, self.on_text = url, path, body, on_text
        self.replica = None
        self.events: list = []
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.url + self.path, json=self.body, timeout=120) as resp:
            self.replica = resp.headers.get("x-kvfleet-replica")
            self.started.set()
            if not self.body.get("stream"):
                self.events = [json.loads(resp.read())]
                return
            text, ids = "", 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                self.events.append(ev)
                if isinstance(ev, dict) and ev.get("choices"):
                    text += ev["choices"][0].get("text") or ev["choices"][0].get("delta", {}).get("content") or ""
                    ids += len(ev["choices"][0].get("token_ids") or ())
                    if self.on_text is not None:
                        self.on_text(text, ids)


def outcome(run: Run) -> dict:
    """Per choice: text, token ids (where the client asked), logprob tokens and values, finish, stop reason;
    the last usage; the [DONE] count; errors."""
    if not run.body.get("stream"):
        body = run.events[0]
        return {"text": body["choices"][0]["message"]["content"], "usage": body["usage"]}
    choices: dict[int, dict] = {}
    usage = None
    for ev in run.events:
        if ev == "[DONE]":
            continue
        usage = ev.get("usage") or usage
        for ch in ev.get("choices", ()):
            c = choices.setdefault(ch["index"], {"text": "", "ids": [], "lp": [], "finish": None, "stop": None})
            c["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
            c["ids"] += ch.get("token_ids") or []
            lp = ch.get("logprobs") or {}
            c["lp"] += [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]])
                        for e in lp.get("content", ())]
            c["finish"] = ch.get("finish_reason") or c["finish"]
            c["stop"] = ch.get("stop_reason") or c["stop"]
    return {"choices": choices, "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens")} if usage
            else None, "done": run.events.count("[DONE]"), "errors": [e for e in run.events if "error" in e]}


def run_all(url: str, cases, on_text=None) -> dict[str, Run]:
    runs = {k: Run(url, path, body, on_text if k == "stop" else None) for k, (path, body) in cases.items()}
    for r in runs.values():
        r.start()
    return runs


def join(runs) -> dict[str, dict]:
    for r in runs.values():
        r.join(timeout=180)
        assert not r.is_alive()
    return {k: outcome(r) for k, r in runs.items()}


@pytest.mark.slow  # 37 s; test_migration_fake.py and test_deterministic_fleet.py's moved stream stay in make test
def test_streams_survive_their_replicas_sigkill_exactly(fleet):
    a, b, r = fleet
    # the reference, uninterrupted; the stop string: 24 characters of the stop stream's text, ten words in
    probe = join(run_all(r.url, {"stop": batch(None)["stop"]}))["stop"]["choices"][0]["text"]
    at = [i for i, ch in enumerate(probe) if ch == " "][9]
    stop = probe[at:at + 24]
    assert probe.find(stop) == at
    ref = join(run_all(r.url, batch(stop)))
    assert ref["stop"]["choices"][0]["text"] == probe[:at] and ref["stop"]["choices"][0]["stop"] == stop
    # every request on `a`: `b` paused while they start, then back before `a` is killed
    os.killpg(b.popen.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: ready_replicas(r) == 1, timeout=10, what="the router sees b paused")
        killed = threading.Event()
        b_back = threading.Event()

        shown: dict[str, int] = {}
        lock = threading.Lock()

        def trigger(text: str, ids: int) -> None:
            # the stop stream showed what precedes its stop string, and the replica generated two tokens more
            # (their ids come, their text is held back: it begins the stop string): kill there
            with lock:
                if len(text) >= at:
                    shown.setdefault("at", ids)
                shown["ids"] = ids
                if not killed.is_set() and ids >= shown.get("at", ids + 3) + 2 and b_back.is_set():
                    killed.set()
                    a.kill()

        runs = run_all(r.url, batch(stop), trigger)
        streams = [run for name, run in runs.items() if name != "whole"]  # a whole response's headers come last
        for run in streams:
            assert run.started.wait(60)
    finally:
        os.killpg(b.popen.pid, signal.SIGCONT)
    wait_for(lambda: ready_replicas(r) == 2, timeout=10, what="b back")
    b_back.set()
    trigger("", shown.get("ids", 0))
    assert {run.replica for run in streams} == {a.url}
    wait_for(killed.is_set, timeout=120, what="the kill")
    got = join(runs)
    for name in ("chat", "logprobs", "n2", "stop"):
        g, want = got[name], ref[name]
        assert g["errors"] == [] and g["done"] == 1, (name, g)
        assert g["usage"] == want["usage"], name
        for i, c in want["choices"].items():
            gc = g["choices"][i]
            assert (gc["text"], gc["ids"], gc["finish"], gc["stop"]) == (c["text"], c["ids"], c["finish"], c["stop"]), \
                (name, i)
            assert [(t, top) for t, _, top in gc["lp"]] == [(t, top) for t, _, top in c["lp"]], name
            assert all(abs(x - y) < 1e-3 for (_, x, _), (_, y, _) in zip(gc["lp"], c["lp"], strict=True)), name
    assert got["whole"]["text"] == ref["whole"]["text"]  # retried whole on b
    sampled = got["sampled"]
    assert sampled["errors"] == [] and sampled["done"] == 1 and len(sampled["choices"][0]["ids"]) == N
    assert sampled["usage"]["completion_tokens"] == N
    held = re.findall(r"\((\d+) characters held back\)", r.tail(100_000))
    assert held and int(held[-1]) > 0  # the break fell inside the stop string, which the replica held back
    text = httpx.get(r.url + "/metrics").text
    moved = metric(text, "kvfleet_router_migrations_total", outcome="completed")
    assert moved >= 5 and metric(text, "kvfleet_router_migrations_total") == moved, text
