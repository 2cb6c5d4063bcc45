"""--deterministic over HTTP with the bundled model in bf16 (its 4-bit projections and 8-bit head, the kernels
users get): two real engines and a router on loopback. A greedy and a seeded request, logprobs on, give the same
tokens and logprobs bit for bit: cold, warm, among 7 and among 63 other requests of mixed lengths, on the other
replica, after an eviction, with the prefix pulled from the peer, and moved mid-stream by the router when its
replica is SIGKILLed (the last test: it kills engine a)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import threading

import httpx
import pytest

from contract.kv_transfer import PULL_HEADER
from tests.router.conftest import free_port, metric, ready_replicas, router, wait_for

pytestmark = pytest.mark.model

TOKEN = "det-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WORDS = ("lighthouse harbor ferry captain storm lantern compass tide anchor gull rope sail keel reef beacon "
         "island mist current chart voyage").split()
PROBE = "Tell me, in order, what a lighthouse keeper does at dusk: " + " ".join(WORDS[i % 20] for i in range(90))
N = 24
KINDS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 1234}}


def engine(procs, name: str, blocks: int):
    port = free_port()
    return procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--dtype", "bfloat16", "--deterministic",
                  "--port", str(port), "--instance-id", name, "--num-threads", "1", "--num-blocks", str(blocks),
                  "--max-num-seqs", "64", "--internal-token", TOKEN, "--kv-pull-timeout", "20",
                  "--log-level", "warning"], f"http://127.0.0.1:{port}", name)


@pytest.fixture(scope="module")
def fleet(module_procs):
    a, b = engine(module_procs, "a", 2048), engine(module_procs, "b", 128)
    r = router(module_procs, [a.url, b.url], "--internal-token", TOKEN, policy="least-load", model="smollm2")
    for p in (a, b, r):
        p.wait_ready(timeout=300)
    wait_for(lambda: ready_replicas(r) == 2, timeout=30, what="both replicas ready")
    return a, b, r


def body(kind: str, prompt: str = PROBE, salt: str | None = None) -> dict:
    b = {"model": "smollm2", "prompt": prompt, "max_tokens": N, "ignore_eos": True, "logprobs": 3,
         "return_token_ids": True, **KINDS[kind]}
    if salt is not None:
        b["cache_salt"] = salt
    return b


def complete(url: str, b: dict, headers: dict | None = None) -> tuple:
    resp = httpx.post(url + "/v1/completions", json=b, headers={**AUTH, **(headers or {})}, timeout=300)
    assert resp.status_code == 200, resp.text
    c = resp.json()["choices"][0]
    lp = c["logprobs"]
    return c["token_ids"], lp["token_logprobs"], lp["top_logprobs"]


def plain(url: str, b: dict) -> None:
    resp = httpx.post(url + "/v1/completions", json=b, headers=AUTH, timeout=300)
    assert resp.status_code == 200, resp.text


def beside(url: str, b: dict, others: int, seed: int) -> tuple:
    """The request sent together with `others` requests of mixed lengths to the same engine."""
    rng = random.Random(seed)
    side = [{"model": "smollm2", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 60))),
             "max_tokens": rng.randrange(1, 30), "temperature": 0.8, "ignore_eos": True} for _ in range(others)]
    with concurrent.futures.ThreadPoolExecutor(others + 1) as pool:
        futs = [pool.submit(plain, url, s) for s in side[: others // 2]]
        mine = pool.submit(complete, url, b)
        futs += [pool.submit(plain, url, s) for s in side[others // 2:]]
        for f in futs:
            f.result()
        return mine.result()


@pytest.fixture(scope="module")
def reference(fleet):
    a, _, _ = fleet
    return {kind: complete(a.url, body(kind)) for kind in KINDS}


@pytest.mark.parametrize("kind", ["greedy", pytest.param("seeded", marks=pytest.mark.slow)])  # seeded: ~20 s more
def test_warm_among_7_and_63_others_and_on_the_other_replica(fleet, reference, kind):
    a, b, _ = fleet
    ref = reference[kind]
    assert len(ref[0]) == N
    assert complete(a.url, body(kind)) == ref  # warm
    assert beside(a.url, body(kind), 7, seed=1) == ref
    assert beside(a.url, body(kind), 63, seed=2) == ref
    assert complete(b.url, body(kind)) == ref  # the other replica, cold


def test_after_an_eviction_on_a_small_cache(fleet, reference):
    _, b, _ = fleet
    complete(b.url, body("seeded"))
    evicted = metric(httpx.get(b.url + "/metrics").text, "kvfleet:block_evictions_total")
    for i in range(4):  # 128 blocks: these push the probe's blocks out
        complete(b.url, {**body("greedy", " ".join(WORDS[(i + j) % 20] for j in range(700))), "max_tokens": 4})
    assert metric(httpx.get(b.url + "/metrics").text, "kvfleet:block_evictions_total") > evicted
    assert complete(b.url, body("seeded")) == reference["seeded"]


def test_with_the_prefix_pulled_from_the_peer(fleet, reference):
    a, b, _ = fleet
    before = metric(httpx.get(b.url + "/metrics").text, "kvfleet:kv_pulls_total", outcome="pulled")
    for kind in KINDS:
        complete(a.url, body(kind, salt=f"pulled-{kind}"))  # a holds the blocks under this salt, b does not
        assert complete(b.url, body(kind, salt=f"pulled-{kind}"), {PULL_HEADER: a.url}) == reference[kind]
    assert metric(httpx.get(b.url + "/metrics").text, "kvfleet:kv_pulls_total", outcome="pulled") - before == 2


def stream(url: str, b: dict, on_token) -> tuple:
    with httpx.stream("POST", url + "/v1/completions", json={**b, "stream": True}, headers=AUTH, timeout=300) as resp:
        assert resp.status_code == 200
        ids, lps, tops = [], [], []
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, ev
            for ch in ev.get("choices", ()):
                ids += ch.get("token_ids") or []
                lp = ch.get("logprobs") or {}
                lps += lp.get("token_logprobs") or []
                tops += lp.get("top_logprobs") or []
                on_token(len(ids))
        return ids, lps, tops


def test_moved_mid_stream_by_the_router_when_its_replica_dies(fleet, reference):
    a, b, r = fleet
    os.killpg(b.popen.pid, signal.SIGSTOP)  # both streams start on a
    killed, b_back = threading.Event(), threading.Event()

    def on_token(n: int) -> None:
        if n >= N // 2 and b_back.is_set() and not killed.is_set():
            killed.set()
            a.kill()

    try:
        wait_for(lambda: ready_replicas(r) == 1, timeout=15, what="the router sees b paused")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = {kind: pool.submit(stream, r.url, body(kind), on_token) for kind in KINDS}
            wait_for(lambda: metric(httpx.get(a.url + "/metrics").text, "vllm:num_requests_running") == 2,
                     timeout=60, what="both streams running on a")
            os.killpg(b.popen.pid, signal.SIGCONT)
            wait_for(lambda: ready_replicas(r) == 2, timeout=15, what="b back")
            b_back.set()
            got = {kind: f.result(timeout=300) for kind, f in futs.items()}
    finally:
        os.killpg(b.popen.pid, signal.SIGCONT)
    assert killed.is_set()
    for kind in KINDS:
        assert got[kind] == reference[kind], kind
    assert metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_migrations_total", outcome="completed") >= 2
