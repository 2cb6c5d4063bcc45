"""KV that moves (issue 31): real SmolLM2 engines (bf16, --deterministic) pulling cached prefixes from each other over HTTP,
and the router that tells them to.

- Exactness: after a pulled prefix (whole, or a multi-turn conversation's earlier turns) the greedy tokens are
  those of an engine computing everything (the reference runs under its own cache_salt: no prefix hit).
- Refusals: a source that sends other tokens, another hash, a short payload, another adapter, another layout,
  or that dies mid-stream or stalls: the request is computed, exactly as the reference; the refusal is counted
  by reason; no block stays held on either engine.
- Obeyed from routers only: with an internal token set, a client's pull header without it is ignored.
- Through the router with pulls on, a burst on a new prompt: both replicas serve, the fleet computes the
  prompt about once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time

import httpx
import pytest
from aiohttp import web

from contract.hashing import DEFAULT_HASH_SEED, hash_blocks
from contract.kv_transfer import PATH, PULL_HEADER, FrameReader, Layout, PullRequest, end_frame
from tests.router.conftest import free_port, metric, router, wait_for

pytestmark = pytest.mark.model

TOKEN = "pull-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NUM_BLOCKS = 512
WORDS = ("lighthouse harbor ferry captain storm lantern compass tide anchor gull rope sail keel reef beacon "
         "island mist current chart voyage").split()


def engine(procs, name: str, *extra: str):
    port = free_port()
    return procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--deterministic", "--port", str(port),
                  "--instance-id", name, "--num-threads", "1", "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs",
                  "8", "--internal-token", TOKEN, "--kv-pull-timeout", "6", "--log-level", "warning", *extra],
                 f"http://127.0.0.1:{port}", name)


@pytest.fixture(scope="module")
def fleet(module_procs):
    a, b = engine(module_procs, "a"), engine(module_procs, "b")
    r = router(module_procs, [a.url, b.url], "--internal-token", TOKEN, "--pull-token-cost", "0.05",
               "--pull-fixed-tokens", "32", model="smollm2")
    for p in (a, b, r):
        p.wait_ready(timeout=300)
    wait_for(lambda: httpx.get(r.url + "/ready").json().get("ready_replicas") == 2, timeout=30, what="replicas")
    wait_for(lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_kv_events_live") == 2, timeout=30,
             what="both KV event streams live")
    return a, b, r


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(words))


def complete(url: str, prompt: str, *, salt: str | None = None, pull: str | None = None, auth: bool = True,
             max_tokens: int = 8) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    if salt is not None:
        body["cache_salt"] = salt
    headers = dict(AUTH) if auth else {}
    if pull is not None:
        headers[PULL_HEADER] = pull
    r = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(resp: dict) -> list[int]:
    return resp["choices"][0]["token_ids"]


def cached(resp: dict) -> int:
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def pulls(e, outcome: str) -> float:
    return metric(httpx.get(e.url + "/metrics").text, "kvfleet:kv_pulls_total", outcome=outcome)


def refusals(e, reason: str) -> float:
    return metric(httpx.get(e.url + "/metrics").text, "kvfleet:kv_import_refusals_total", reason=reason)


def idle_and_whole(e) -> None:
    """Nothing runs and every block is free (cached ones among them): nothing leaked."""
    def whole():
        m = httpx.get(e.url + "/metrics").text
        return (metric(m, "kvfleet:num_free_kv_blocks") == NUM_BLOCKS and metric(m, "vllm:num_requests_running") == 0
                and metric(m, "vllm:num_requests_waiting") == 0)
    wait_for(whole, timeout=10, what=f"{e.url} idle with every block free")


# the acceptance's 16 prompts under -m slow; 6 in the default suite (it is near its time budget)
@pytest.mark.parametrize("whole, turns", [(4, 2), pytest.param(12, 4, marks=pytest.mark.slow)])
def test_greedy_tokens_after_a_pulled_prefix_equal_computing_everything(fleet, whole, turns):
    a, b, _ = fleet
    before = pulls(b, "pulled") + pulls(b, "partial")
    for i in range(whole):  # whole prompts the source computed
        prompt = f"Story {i} of {whole}: " + text(i, 120 + 10 * i)
        ref = complete(a.url, prompt, salt=f"ref-{i}")
        complete(a.url, prompt)
        got = complete(b.url, prompt, pull=a.url)
        assert tokens(got) == tokens(ref), i
        assert cached(got) == (got["usage"]["prompt_tokens"] - 1) // 16 * 16, i  # every full block arrived
    for i in range(turns):  # multi-turn: the source holds the earlier turns, the puller computes the new one
        turn1 = f"Conversation {i} of {turns}. User: " + text(40 + i, 150) + "\nAssistant:"
        first = complete(a.url, turn1, max_tokens=12)
        turn2 = turn1 + first["choices"][0]["text"] + "\nUser: " + text(50 + i, 40) + "\nAssistant:"
        ref = complete(a.url, turn2, salt=f"ref-turn-{i}")
        got = complete(b.url, turn2, pull=a.url)
        assert tokens(got) == tokens(ref), i
        assert 0 < cached(got) < got["usage"]["prompt_tokens"] - 16
    assert pulls(b, "pulled") + pulls(b, "partial") - before == whole + turns
    idle_and_whole(a)
    idle_and_whole(b)


def test_a_pull_header_without_the_internal_token_is_ignored(fleet):
    a, b, _ = fleet
    prompt = "Unauthorized: " + text(3, 100)
    complete(a.url, prompt)
    before = sum(pulls(b, o) for o in ("pulled", "partial", "none", "refused", "failed", "timeout", "invalid"))
    got = complete(b.url, prompt, pull=a.url, auth=False)
    assert cached(got) == 0
    assert sum(pulls(b, o) for o in ("pulled", "partial", "none", "refused", "failed", "timeout", "invalid")) == before
    assert complete(b.url, "x " + prompt, pull="ftp://nowhere")["usage"]["prompt_tokens"] > 0
    assert pulls(b, "invalid") >= 1


def test_the_source_refuses_another_layout_naming_the_field(fleet):
    a, _, _ = fleet
    layout = Layout("smollm2", 16, "float32", 30, 3, 64, DEFAULT_HASH_SEED)
    r = httpx.post(a.url + PATH, content=PullRequest((1,), layout, 1 << 20).to_json(), headers=AUTH)
    assert r.status_code == 409
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("kv_layout_mismatch", "layout.dtype")
    assert refusals(a, "layout") >= 1
    assert httpx.post(a.url + PATH, content=b'{"hashes": 3}', headers=AUTH).status_code == 400
    assert httpx.post(a.url + PATH, content=b"{}").status_code == 401  # the internal token, as for KV events


class Tamperer:
    """A source that relays the real engine's blocks, altered as `mode` says."""

    def __init__(self, source: str):
        self.source = source
        self.mode = "tokens"
        self.primed: dict[tuple[int, ...], bytes] = {}  # the source's answer, fetched before the pull (no timing)
        self.asked: list[dict] = []  # mode "relay": the pulls asked of it, answered after a second, unaltered
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        ready = concurrent.futures.Future()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.result(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, ready) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post(PATH, self.handle)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        ready.set_result(None)
        self.loop.run_forever()

    def prime(self, prompt_ids: list[int]) -> None:
        """Fetch the source's blocks of this prompt now, so the puller's request is answered at once."""
        hashes = tuple(hash_blocks(prompt_ids[:(len(prompt_ids) - 1) // 16 * 16], 16, None, DEFAULT_HASH_SEED))
        layout = Layout("smollm2", 16, "bfloat16", 30, 3, 64, DEFAULT_HASH_SEED)
        r = httpx.post(self.source + PATH, content=PullRequest(hashes, layout, 1 << 31).to_json(), headers=AUTH,
                       timeout=60)
        assert r.status_code == 200
        self.primed[hashes] = r.content

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if self.mode == "stall":
            await asyncio.sleep(20)
        if self.mode == "relay":
            self.asked.append(json.loads(body))
            await asyncio.sleep(1.0)
            content = self.primed.get(tuple(int(h, 16) for h in json.loads(body)["hashes"]))
            if content is None:
                async with httpx.AsyncClient() as client:
                    content = (await client.post(self.source + PATH, content=body, headers=AUTH, timeout=30)).content
            return web.Response(body=content, content_type="application/octet-stream")
        if self.mode == "layout":
            d = json.loads(body)
            d["layout"]["dtype"] = "float32"
            body = json.dumps(d).encode()
        content = self.primed.get(tuple(int(h, 16) for h in json.loads(body)["hashes"]))
        if content is None or self.mode == "layout":
            async with httpx.AsyncClient() as client:
                r = await client.post(self.source + PATH, content=body, headers=AUTH, timeout=30)
            if r.status_code != 200:
                return web.Response(status=r.status_code, body=r.content, content_type="application/json")
            content = r.content
        reader = FrameReader()
        frames = reader.feed(content)
        first = frames[0]
        if self.mode == "tokens":
            bad = list(first.tokens)
            bad[1] = tuple(t + 1 for t in bad[1])
            frames[0] = dataclasses.replace(first, tokens=tuple(bad))
        elif self.mode == "hash":
            frames[0] = dataclasses.replace(first, hashes=(first.hashes[0], first.hashes[2], *first.hashes[2:]))
        elif self.mode == "size":
            frames[0] = dataclasses.replace(first, payload=first.payload[:-10])
        elif self.mode == "adapter":
            frames[0] = dataclasses.replace(first, lora="sql-expert")
        resp = web.StreamResponse()
        await resp.prepare(request)
        data = b"".join(f.encode() for f in frames) + end_frame(sum(len(f.hashes) for f in frames))
        if self.mode == "die":  # the first frame whole, then half of the next, then the connection drops
            cut = len(frames[0].encode()) + len(frames[1].encode()) // 2
            await resp.write(data[:cut])
            request.transport.close()
            return resp
        await resp.write(data)
        await resp.write_eof()
        return resp


@pytest.fixture(scope="module")
def tamperer(fleet):
    return Tamperer(fleet[0].url)


@pytest.mark.parametrize("mode, reason, blocks", [("tokens", "tokens", 1), ("hash", "hash", 1), ("size", "size", 0),
                                                  ("adapter", "adapter", 0), ("layout", "layout", 0)])
def test_a_block_that_fails_the_checks_is_refused_and_the_rest_computed(fleet, tamperer, mode, reason, blocks):
    a, b, _ = fleet
    tamperer.mode = mode
    prompt = f"Refusal {mode}: " + text(len(mode) * 13, 140)
    ref = complete(a.url, prompt, salt=f"ref-{mode}")
    tamperer.prime(complete(a.url, prompt)["choices"][0]["prompt_token_ids"])
    before, refused = refusals(b, reason), pulls(b, "refused")
    got = complete(b.url, prompt, pull=tamperer.url)
    assert tokens(got) == tokens(ref)
    assert cached(got) == 16 * blocks  # the blocks before the bad one were good, and kept
    assert refusals(b, reason) == before + 1 and pulls(b, "refused") == refused + 1
    idle_and_whole(b)


def test_a_source_that_dies_mid_stream_or_stalls_leaves_the_request_computed(fleet, tamperer):
    a, b, _ = fleet
    for mode, outcome, arrived in (("die", "failed", 32), ("stall", "timeout", 0)):
        tamperer.mode = mode
        # die: more than two frames of 32 blocks; stall: nothing arrives, any length does
        prompt = f"Broken source {mode}: " + (text(7, 700) if mode == "die" else text(9, 200))
        ref = complete(a.url, prompt, salt=f"ref-{mode}")
        tamperer.prime(complete(a.url, prompt)["choices"][0]["prompt_token_ids"])
        before = pulls(b, outcome)
        got = complete(b.url, prompt, pull=tamperer.url)
        assert tokens(got) == tokens(ref)
        assert cached(got) == 16 * arrived  # the whole frame that arrived is kept, the torn one is not
        assert pulls(b, outcome) == before + 1
        idle_and_whole(b)
    idle_and_whole(a)


def test_a_request_that_joined_a_pull_asks_the_source_for_the_rest_without_waiting_for_it(fleet, tamperer):
    """Two requests on one prefix reach an engine with the same pending pull: the second waits for the first's pull,
    then asks the source once for its own blocks past the prefix, without the second a pending pull may spend
    waiting for a prefill that would compute them (the source holds what the first pull took, nothing more)."""
    a, b, _ = fleet
    tamperer.mode = "relay"
    shared = "Joined pull: " + text(13, 300)
    one, other = shared + " first: " + text(31, 80), shared + " second: " + text(37, 80)  # blocks of their own
    ref = complete(a.url, other, salt="ref-joined")
    tamperer.prime(complete(a.url, one)["choices"][0]["prompt_token_ids"])
    tamperer.asked.clear()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, b.url, one, pull=tamperer.url + "; pending")
        time.sleep(0.3)  # the first pull is in flight (the source answers after a second)
        second = complete(b.url, other, pull=tamperer.url + "; pending")
        first.result()
    assert [x["expect_s"] for x in tamperer.asked] == [1.0, 0.0]
    assert tokens(second) == tokens(ref) and cached(second) >= 16 * 18  # the shared prefix came by the first pull
    idle_and_whole(b)


def test_a_puller_that_goes_away_mid_stream_leaves_the_source_whole(fleet):
    a, _, _ = fleet
    prompt = "Abandoned pull: " + text(11, 900)
    ids = complete(a.url, prompt, max_tokens=1)["choices"][0]["prompt_token_ids"]
    hashes = hash_blocks(ids, 16, None, DEFAULT_HASH_SEED)
    layout = Layout("smollm2", 16, "bfloat16", 30, 3, 64, DEFAULT_HASH_SEED)
    with httpx.stream("POST", a.url + PATH, content=PullRequest(tuple(hashes), layout, 1 << 30).to_json(),
                      headers=AUTH) as r:
        assert r.status_code == 200
        next(r.iter_bytes(1 << 16))  # one read, then the connection closes
    idle_and_whole(a)
    assert complete(a.url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # still serving


def test_a_burst_on_a_new_prompt_through_the_router_is_computed_about_once(fleet):
    a, b, r = fleet
    prompt = "Burst: " + text(23, 500)

    def one(i: int):
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(r.url + "/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        u = resp.json()["usage"]
        return resp.headers["x-kvfleet-replica"], u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    replicas = [rep for rep, _ in results]
    computed = sum(c for _, c in results)
    assert set(replicas) == {a.url, b.url}, replicas
    single = complete(a.url, prompt + " again", salt="single-burst")["usage"]["prompt_tokens"]
    # one engine would compute the prompt once and each other request's last partial block: about `single`
    assert computed <= 1.1 * single + 6 * 16, (computed, single, results)
    assert max(replicas.count(a.url), replicas.count(b.url)) <= 4, replicas  # neither serves more than 70%
    m = httpx.get(r.url + "/metrics").text
    assert metric(m, "kvfleet_router_kv_pulls_total") >= 1
    assert metric(m, "kvfleet_router_pull_token_cost") == 0.05


def test_pull_token_cost_auto_is_measured_from_the_engines_rates(fleet, module_procs):
    """A router with --pull-token-cost auto starts at the prior (0.05); once the engines have prefilled and pulled
    enough tokens since it started, it routes with their measured ratio (here, one thread: well under 0.5 prefill
    tokens per pulled token)."""
    a, b, _ = fleet
    r = router(module_procs, [a.url, b.url], "--internal-token", TOKEN, "--pull-token-cost", "auto", model="smollm2")
    r.wait_ready(timeout=60)
    wait_for(lambda: metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_kv_events_live") == 2, timeout=30,
             what="both KV event streams live")
    assert metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_pull_token_cost") == 0.05
    for i in range(5):  # about 2,000 tokens prefilled on A and pulled by B
        prompt = f"Measured {i}: " + text(90 + i, 380)
        complete(a.url, prompt)
        complete(b.url, prompt, pull=a.url)
    mb = httpx.get(b.url + "/metrics").text
    assert metric(mb, "kvfleet:kv_pulled_tokens_total") > 0 and metric(mb, "kvfleet:kv_pull_transfer_seconds_total") > 0
    ma = httpx.get(a.url + "/metrics").text
    assert metric(ma, "kvfleet:prefill_seconds_total") > 0 and metric(ma, "kvfleet:prefill_computed_tokens_total") > 0

    def measured() -> bool:
        cost = metric(httpx.get(r.url + "/metrics").text, "kvfleet_router_pull_token_cost")
        return cost != 0.05 and 0 < cost < 0.5
    wait_for(measured, timeout=10, what="the measured pull cost in force")


def disagg_router(module_procs, tmp_path_factory, prefill: str, decode: str):
    path = tmp_path_factory.mktemp("disagg") / "pools.yaml"
    path.write_text(f"""pools:
  pre:
    version: "v1"
    weight: 1
    role: prefill
    model: smollm2
    engine: kvfleet
    replicas: ["{prefill}"]
  dec:
    version: "v1"
    weight: 1
    role: decode
    model: smollm2
    engine: kvfleet
    replicas: ["{decode}"]
""")
    r = router(module_procs, None, "--internal-token", TOKEN, "--pools", str(path), model="smollm2")
    r.wait_ready(timeout=60)
    return r


def test_a_pull_from_a_busy_source_counts_only_the_copy_as_transfer_time(fleet):
    """A source whose core is in the middle of a long prefill copies the blocks when its step ends: that wait is
    the pull's, not transfer time, so the seconds the router's measured pull cost reads leave it out."""
    a, b, _ = fleet
    prompt = "Busy source: " + text(41, 300)
    complete(a.url, prompt)  # cached on A
    mb = httpx.get(b.url + "/metrics").text
    whole0, transfer0 = metric(mb, "kvfleet:kv_pull_seconds_sum"), metric(mb, "kvfleet:kv_pull_transfer_seconds_total")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # a prefill step of about 900 tokens: 1-2 s on one thread, well inside the 6 s pull timeout
        busy = pool.submit(complete, a.url, "Keeps A busy: " + text(43, 700), max_tokens=1)
        time.sleep(0.3)  # its step is running on A
        pulled = complete(b.url, prompt, pull=a.url)
        busy.result()
    assert cached(pulled) > 0
    mb = httpx.get(b.url + "/metrics").text
    whole = metric(mb, "kvfleet:kv_pull_seconds_sum") - whole0
    transfer = metric(mb, "kvfleet:kv_pull_transfer_seconds_total") - transfer0
    assert whole > 0.3, f"the pull did not wait for A's step ({whole:.3f} s): the test did not test"
    assert transfer < 0.5 * whole, (transfer, whole)


# the acceptance's 16 prompts under -m slow; 4 in the default suite
@pytest.mark.parametrize("conversations", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_prefill_on_one_engine_decode_on_the_other_gives_the_same_greedy_tokens(fleet, module_procs,
                                                                               tmp_path_factory, conversations):
    a, b, _ = fleet
    r = disagg_router(module_procs, tmp_path_factory, a.url, b.url)
    wait_for(lambda: httpx.get(r.url + "/ready").json().get("ready_replicas") == 2, timeout=30, what="replicas")
    before = pulls(b, "pulled") + pulls(b, "partial")
    convs: list[list[dict]] = [[{"role": "user", "content": f"Handoff {i} of {conversations}: " + text(60 + i, 80)}]
                               for i in range(conversations)]
    for turn in range(2):  # conversations x 2 turns, the second turn's history prefilled again
        for i, conv in enumerate(convs):
            body = {"model": "smollm2", "messages": conv, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            got = httpx.post(r.url + "/v1/chat/completions", json=body, timeout=120)
            assert got.status_code == 200, got.text
            assert got.headers["x-kvfleet-replica"] == b.url  # decoded on the decode pool's replica
            ref = httpx.post(a.url + "/v1/chat/completions", json={**body, "cache_salt": f"ref-{turn}-{i}"},
                             headers=AUTH, timeout=120).json()
            g = got.json()
            assert g["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"], (turn, i)
            assert g["usage"]["prompt_tokens_details"]["cached_tokens"] >= g["usage"]["prompt_tokens"] - 16
            conv += [{"role": "assistant", "content": g["choices"][0]["message"]["content"]},
                     {"role": "user", "content": text(70 + i + turn, 10)}]
    assert pulls(b, "pulled") + pulls(b, "partial") - before == 2 * conversations
    m = httpx.get(r.url + "/metrics").text
    assert metric(m, "kvfleet_router_disagg_prefills_total", pool="pre", outcome="ok") == 2 * conversations
    # streamed too: the client's stream comes from the decode replica
    body = {"model": "smollm2", "prompt": "Streamed handoff: " + text(5, 60), "max_tokens": 6, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["x-kvfleet-replica"] == b.url
        assert any(line == "data: [DONE]" for line in resp.iter_lines())
    idle_and_whole(a)
    idle_and_whole(b)


def test_without_a_prefill_replica_the_decode_replica_computes_the_prompt(fleet, module_procs, tmp_path_factory):
    a, b, _ = fleet
    dead = f"http://127.0.0.1:{free_port()}"
    r = disagg_router(module_procs, tmp_path_factory, dead, b.url)
    wait_for(lambda: httpx.get(r.url + "/ready").json().get("ready_replicas") == 1, timeout=30, what="decode ready")
    prompt = "No prefill replica: " + text(31, 90)
    got = httpx.post(r.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    m = httpx.get(r.url + "/metrics").text
    assert metric(m, "kvfleet_router_disagg_prefills_total", pool="pre", outcome="no_replica") == 1


@pytest.mark.slow
def test_a_source_engine_killed_mid_pull_leaves_the_request_computed(fleet, module_procs):
    """A real source: engine C prefills a long prompt in small chunks and streams its blocks to B as they are
    cached; C is SIGKILLed once B has taken some. B's request completes with the reference's tokens, the blocks
    that arrived kept, and B ends idle with every block free."""
    a, b, _ = fleet
    c = engine(module_procs, "c", "--max-num-batched-tokens", "128")
    c.wait_ready(timeout=300)
    prompt = "Killed source: " + text(77, 900)
    ref = complete(a.url, prompt, salt="ref-killed")
    computing = concurrent.futures.ThreadPoolExecutor(1).submit(
        lambda: httpx.post(c.url + "/v1/completions", json={"model": "smollm2", "prompt": prompt, "max_tokens": 1},
                           timeout=120))
    time.sleep(0.3)  # C has the request and is prefilling it
    before = metric(httpx.get(b.url + "/metrics").text, "kvfleet:kv_transfer_blocks_total", direction="import")
    failed = pulls(b, "failed")
    got = concurrent.futures.ThreadPoolExecutor(1).submit(complete, b.url, prompt, pull=c.url)
    wait_for(lambda: metric(httpx.get(b.url + "/metrics").text, "kvfleet:kv_transfer_blocks_total",
                            direction="import") > before, timeout=30, what="B took C's first blocks")
    c.kill()
    resp = got.result(timeout=120)
    assert tokens(resp) == tokens(ref)
    assert 0 < cached(resp) < resp["usage"]["prompt_tokens"] - 16  # what arrived was kept, the rest computed
    assert pulls(b, "failed") == failed + 1
    with pytest.raises(httpx.HTTPError):
        computing.result(timeout=30)
    idle_and_whole(b)
