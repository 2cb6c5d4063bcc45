"""Engine pools in front of real SmolLM2 engines (slow): a stable pool of two replicas, a canary of one, a
long-context pool of one. At 20% canary weight the canary serves 20% +- 5% of 200 sessions; multi-turn hit
rate inside each pool stays >= 0.95 of one replica holding that pool's whole cache; a request over the
regular pools' limit lands on the long-context pool (its engine counters), one over every limit gets the
400; a canary restarted with an injected per-step delay is rolled back (weight 0) within a stated bound with
no failed request.

    pytest -m slow tests/router/pools/test_pools_engine.py -s     # prints the figures
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest

from contract.cacheable import cacheable_blocks
from contract.hashing import DEFAULT_HASH_SEED, hash_blocks
from kvfleet.workload import words
from tests.router.conftest import free_port, metric, router, wait_for

pytestmark = [pytest.mark.model, pytest.mark.slow]

BLOCK = 16
ROLLBACK_BOUND_S = 20.0  # window 10 s, 5 requests, TPOT over 0.25 s: at most this long after the canary slows

POOLS = """
pools:
  stable:
    version: v1
    weight: 80
    replicas: [{s1}, {s2}]
    max_context_tokens: 1024
  canary:
    version: v2
    weight: 20
    canary: true
    replicas: [{c1}]
    max_context_tokens: 1024
  long:
    version: v1-long
    weight: 1
    long_context: true
    replicas: [{l1}]
    max_context_tokens: 4096
degradation:
  window_s: 10
  min_requests: 5
  interval_s: 0.5
  dwell_s: 5
  p99_ttft_s: {{trip: 30, clear: 15}}
  p99_tpot_s: {{trip: 0.25, clear: 0.12}}
"""


def start_engine(procs, name: str, port: int, max_len: int, *extra: str):
    return procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--instance-id", name,
                  "--num-threads", "1", "--max-model-len", str(max_len), "--num-blocks", "640", "--max-num-seqs",
                  "8", *extra], f"http://127.0.0.1:{port}", f"{name}-{port}")


@pytest.fixture(scope="module")
def tokenizer():
    from engine.tokenizer import load_tokenizer

    return load_tokenizer("smollm2")


def sessions(tokenizer, n: int, turns: int) -> list[list[list[int]]]:
    """n seeded sessions of `turns` turns each (token-id prompts): one of four shared system prompts, then
    each turn resends the history with a fixed stand-in reply."""
    systems = [words(random.Random(f"sys-{k}"), 120) for k in range(4)]
    out = []
    for i in range(n):
        rng = random.Random(f"session-{i}")
        msgs = [{"role": "system", "content": systems[i % 4]}]
        prompts = []
        for _t in range(turns):
            msgs.append({"role": "user", "content": words(rng, 40)})
            prompts.append(list(tokenizer.apply_chat_template(msgs)))
            msgs.append({"role": "assistant", "content": words(rng, 20)})
        out.append(prompts)
    return out


def ideal_hit_rate(requests: list[list[int]]) -> float:
    """Hit rate of one replica holding every block these requests stored (in order; no eviction)."""
    seen: set[int] = set()
    hit = total = 0
    for tokens in requests:
        hashes = hash_blocks(tokens, BLOCK, None, DEFAULT_HASH_SEED)
        n = 0
        for h in hashes[:cacheable_blocks(len(tokens), BLOCK)]:
            if h not in seen:
                break
            n += 1
        hit, total = hit + n * BLOCK, total + len(tokens)
        seen.update(hashes)
    return hit / total


async def run(url: str, work: list[tuple[str, list[list[int]]]], concurrency: int, stream: bool = False):
    """Sessions turn after turn, `concurrency` at a time: per request (session, turn, pool, status, usage,
    body tail)."""
    queue = list(reversed(work))
    out = []

    async def worker(client):
        while queue:
            sid, prompts = queue.pop()
            for turn, prompt in enumerate(prompts):
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": stream}
                if stream:
                    body["stream_options"] = {"include_usage": True}
                r = await client.post(url + "/v1/completions", json=body, headers={"x-session-id": sid})
                usage = None
                if r.status_code == 200:
                    if stream:
                        lines = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: {")]
                        usage = next((json.loads(ln)["usage"] for ln in lines if '"usage"' in ln), None)
                    else:
                        usage = r.json()["usage"]
                out.append((sid, turn, r.headers.get("x-kvfleet-pool"), r.status_code, usage, r.text[-60:]))

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return out


def engine_metric(e, name: str) -> float:
    return metric(httpx.get(e.url + "/metrics").text, name)


def test_pools_on_real_engines(procs, tmp_path, tokenizer):
    ports = {n: free_port() for n in ("s1", "s2", "c1", "l1")}
    engines = {n: start_engine(procs, n, p, 4096 if n == "l1" else 1024) for n, p in ports.items()}
    for e in engines.values():
        e.wait_ready(timeout=300)
    path = tmp_path / "pools.yaml"
    path.write_text(POOLS.format(**{n: e.url for n, e in engines.items()}))
    r = router(procs, None, "--pools", str(path), "--log-level", "info", policy="kv").wait_ready(timeout=120)
    wait_for(lambda: httpx.get(r.url + "/ready").json()["ready_replicas"] == 4, timeout=30, what="replicas")

    # 200 two-turn sessions: the canary's share, and the hit rate inside each pool
    work = [(f"user-{i}", s) for i, s in enumerate(sessions(tokenizer, 200, 2))]
    t0 = time.perf_counter()
    results = asyncio.run(run(r.url, work, concurrency=8))
    wall = time.perf_counter() - t0
    assert all(status == 200 for *_, status, _, _ in results), [x for x in results if x[3] != 200][:3]
    first = {sid: pool for sid, turn, pool, *_ in results if turn == 0}
    assert all(pool == first[sid] for sid, _, pool, *_ in results)  # a session keeps its pool
    share = sum(p == "canary" for p in first.values()) / len(first)
    assert 0.15 <= share <= 0.25, share
    prompts = {sid: s for sid, s in work}
    report = [f"200 sessions x 2 turns in {wall:.1f} s; canary share {share:.3f} (weight 20%)"]
    for pool in ("stable", "canary"):
        mine = [x for x in results if x[2] == pool]  # in the order they finished
        got = sum(u["prompt_tokens_details"]["cached_tokens"] for *_, u, _ in mine) / \
            sum(u["prompt_tokens"] for *_, u, _ in mine)
        ideal = ideal_hit_rate([prompts[sid][turn] for sid, turn, *_ in mine])
        report.append(f"{pool}: hit rate {got:.3f} vs one replica holding the pool's cache {ideal:.3f} "
                      f"= {got / ideal:.3f}")
        assert got >= 0.95 * ideal, report

    # long context: over the regular pools' 1024 -> the long pool's engine; over 4096 -> 400
    before = engine_metric(engines["l1"], "vllm:prompt_tokens_total")
    long_prompt = list(range(1000, 2500))
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 4}, timeout=120)
    assert resp.status_code == 200 and resp.headers["x-kvfleet-pool"] == "long"
    assert engine_metric(engines["l1"], "vllm:prompt_tokens_total") == before + 1500
    over = httpx.post(r.url + "/v1/completions", json={"prompt": list(range(5000)), "max_tokens": 4})
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    report.append("long: 1,500-token prompt served by the long pool (its engine counted +1500 prompt tokens); "
                  "5,000 tokens -> 400")

    # the canary comes back slow (a 400 ms step delay); streamed sessions of both pools keep running
    engines["c1"].stop()
    slow = start_engine(procs, "c1-slow", ports["c1"], 1024, "--debug-step-delay-ms", "400").wait_ready(timeout=300)
    wait_for(lambda: httpx.get(r.url + "/ready").json()["ready_replicas"] == 4, timeout=30, what="canary back")
    canary_sids = [sid for sid, pool in first.items() if pool == "canary"][:4]
    stable_sids = [sid for sid, pool in first.items() if pool == "stable"][:4]
    rolled_back_at: list[float] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            if metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_pool_weight", pool="canary",
                      kind="effective") == 0:
                rolled_back_at.append(time.perf_counter())
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t_slow = time.perf_counter()
    load = [(sid, prompts[sid] * 4) for sid in canary_sids + stable_sids]  # 8 turns each, streamed
    results = asyncio.run(run(r.url, load, concurrency=8, stream=True))
    stop.set()
    watcher.join()
    failed = [x for x in results if x[3] != 200 or not x[5].endswith("data: [DONE]\n\n") or '"error"' in x[5]]
    assert failed == [], failed[:3]
    assert rolled_back_at, "the slow canary was not rolled back"
    took = rolled_back_at[0] - t_slow
    on_canary = sum(1 for x in results if x[2] == "canary")
    report.append(f"slow canary rolled back {took:.1f} s after its load started (bound {ROLLBACK_BOUND_S:.0f} s); "
                  f"{len(results)} streamed requests, 0 failed, {on_canary} served by the slow canary")
    assert took <= ROLLBACK_BOUND_S, report
    assert "pool canary (v2): canary rolled back: weight 20 -> 0" in r.tail(10**6)
    assert all(pool == "stable" for sid, turn, pool, *_ in results if sid in canary_sids and turn >= 6)
    print("\n" + "\n".join(report))
    slow.stop()
