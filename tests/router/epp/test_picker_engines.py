"""The endpoint picker (`kvfleet epp`) in front of two real SmolLM2 engines on loopback, asked by the test
gateway (tests/router/epp/gateway.py) over a real gRPC channel exactly as an Inference Extension gateway asks;
the gateway then sends each request to the endpoint it was given. The extension's conformance behaviours:

- the gateway follows the choice, the same destination in the header and in envoy.lb, the served endpoint
  reported back (the response names it), and the answer is the engine's own (greedy: the same text directly);
- subset hints honoured, in any order, and 503 for an empty subset or one with nothing eligible;
- fallbacks in order: with the primary down, the gateway's next endpoint serves, and the booking moves there;
- data-parallel ports: two engines on one IP are two endpoints, both used;
- the multi-turn workload: the fleet hit rate through the picker is at least 0.98 of the HTTP router's on the
  same engines, neither engine taking more than 75% of the requests.
"""

from __future__ import annotations

import http.server
import threading
import time

import httpx
import pytest

from router.routing.replicas import parse_engine_metrics
from tests.router.conftest import free_port, metric, router, wait_for
from tests.router.epp.gateway import Gateway, wait_serving

pytestmark = pytest.mark.model

TOKEN = ["--internal-token", "epp-secret"]  # the KV event streams need it
SYSTEM = ("You are the assistant of a small bookshop in Lisbon. You answer questions about opening hours, "
          "orders, shipping, returns and book recommendations. Be brief, friendly and precise. The shop opens "
          "at ten and closes at seven, Monday to Saturday. Shipping inside Portugal takes two days; to the rest "
          "of Europe it takes five. Returns are accepted within thirty days with a receipt.")
QUESTIONS = ["Do you ship to Spain?", "How long does it take?", "Can I return a gift?", "Are you open on Sunday?",
             "Recommend a novel about the sea.", "What time do you close on Saturday?"]


def _chat(text: str, salt: str, **extra) -> dict:
    return {"model": "smollm2", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            "max_tokens": 6, "temperature": 0, "cache_salt": salt, **extra}


@pytest.fixture(scope="module")
def engines(module_procs):
    out = []
    for i in range(2):
        port = free_port()
        out.append(module_procs(["-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port),
                                 "--instance-id", f"dp-{i}", "--num-threads", "1", "--num-blocks", "512",
                                 "--max-num-seqs", "8", "--log-level", "warning", *TOKEN],
                                f"http://127.0.0.1:{port}", f"engine-{i}"))
    for e in out:
        e.wait_ready(timeout=300)
    return out


def picker(procs, replicas: list[str], *extra: str):
    port = free_port()
    p = procs(["-m", "router.epp.main", "--port", str(port), "--replicas", ",".join(replicas), "--model", "smollm2",
               "--default-model", "smollm2", "--health-interval", "0.2", "--scrape-interval", "0.2",
               "--metrics-port", str(metrics_port := free_port()),
               "--log-level", "warning", *TOKEN, *extra], f"http://127.0.0.1:{metrics_port}", f"epp-{port}")
    address = f"127.0.0.1:{port}"
    wait_serving(address, p, timeout=120)
    return p, address


def _endpoint(url: str) -> str:
    return url.removeprefix("http://")


def test_the_gateway_follows_the_pick_and_the_served_endpoint_comes_back(procs, engines):
    _, address = picker(procs, [e.url for e in engines])
    gw = Gateway(address)
    endpoints = {_endpoint(e.url) for e in engines}
    for stream in (False, True):
        got = gw.send("/v1/chat/completions", _chat("Do you ship to Spain?", f"follow-{stream}", stream=stream))
        assert got.status == 200, got.body
        assert got.header_destination == got.metadata_destination  # never two different values
        assert got.endpoints[0] in endpoints and set(got.endpoints) == endpoints  # primary, then the fallback
        assert got.served == got.endpoints[0]
        assert got.headers["x-kvfleet-replica"] == f"http://{got.served}"
        assert got.chunks >= 1 and b'"stream_options"' not in got.upstream_body or stream
    # the answer is the engine's own: the same greedy text as asked directly
    body = _chat("Are you open on Sunday?", "follow-same")
    through = gw.send("/v1/chat/completions", body)
    direct = httpx.post(f"http://{through.served}/v1/chat/completions", json=body, timeout=120)
    assert through.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
    gw.close()


def test_subset_hints_are_honoured_and_an_empty_or_ineligible_subset_is_503(procs, engines):
    _, address = picker(procs, [e.url for e in engines])
    gw = Gateway(address)
    a, b = (_endpoint(e.url) for e in engines)
    for i in range(3):
        for subset, allowed in (([b], {b}), (f"{a}", {a}), ([b, a], {a, b})):
            got = gw.send("/v1/chat/completions", _chat(QUESTIONS[i], f"subset-{i}"), subset=subset)
            assert got.status == 200, got.body
            assert set(got.endpoints) <= allowed and got.served in allowed, (subset, got.endpoints)
    for subset in ([], "", ["10.255.255.1:8000"]):
        got = gw.send("/v1/chat/completions", _chat("hello", "subset-none"), subset=subset)
        assert got.status == 503, (subset, got.status)
        assert got.json()["error"]["code"] == "no_ready_replica"
    gw.close()


class _Ready(http.server.BaseHTTPRequestHandler):
    """An endpoint that says it is ready, until it is gone (then nothing listens there)."""

    def do_GET(self):  # noqa: N802
        ok = self.path in ("/ready", "/health")
        self.send_response(200 if ok else 404)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_with_the_primary_down_the_fallbacks_serve_in_order(procs, engines):
    stub = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Ready)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    down = f"127.0.0.1:{stub.server_address[1]}"
    # round robin makes the endpoint that went down the primary every third request; a long health interval
    # keeps the picker from seeing it go before the gateway does
    p, address = picker(procs, [e.url for e in engines] + [f"http://{down}"], "--policy", "round-robin",
                        "--health-interval", "30", "--fallbacks", "2")
    urls = [e.url for e in engines] + [f"http://{down}"]  # all three ready: each answer names three endpoints
    wait_for(lambda: all(metric(httpx.get(p.url + "/metrics").text, "kvfleet_router_replica_ready", replica=u) == 1
                         for u in urls), what="the picker to see all three endpoints ready")
    stub.shutdown()
    stub.server_close()
    gw = Gateway(address)
    fell_back = 0
    for i in range(6):
        got = gw.send("/v1/chat/completions", _chat(QUESTIONS[i], "fallback"))
        assert got.status == 200, got.body
        # primary + 2 fallbacks, all distinct; once the picker has seen the gateway fall back from the endpoint that
        # went down it may leave that one out (the two live ones remain)
        assert len(set(got.endpoints)) == len(got.endpoints) and (
            len(got.endpoints) == 3 or len(got.endpoints) == 2 and down not in got.endpoints), got.endpoints
        if got.endpoints[0] == down:
            fell_back += 1
            assert got.served == got.endpoints[1]  # the next one in the list, not any other
            assert got.headers["x-kvfleet-replica"] == f"http://{got.served}"
        else:
            assert got.served == got.endpoints[0]
    assert fell_back >= 1
    gw.close()


def _counters(urls):
    q = h = 0.0
    for u in urls:
        load = parse_engine_metrics(httpx.get(u + "/metrics", timeout=5).text)
        q, h = q + load.prefix_queries, h + load.prefix_hits
    return q, h


def converse(send, urls, salt: str, n_conv: int = 8, turns: int = 4):
    """Multi-turn conversations side by side (one client each, a think time between turns), after one request
    that puts the shared system prompt in a cache; (fleet hit rate from the engines' counters, requests per
    endpoint)."""
    send({"model": "smollm2", "messages": [{"role": "system", "content": SYSTEM}], "max_tokens": 1,
          "cache_salt": salt})
    time.sleep(0.5)
    q0, h0 = _counters(urls)
    served: dict[str, int] = {}
    lock = threading.Lock()

    def one(c: int) -> None:
        history = [{"role": "system", "content": SYSTEM}]
        for turn in range(turns):
            history.append({"role": "user", "content": f"(customer {c}) {QUESTIONS[(c + turn) % 6]}"})
            where, message = send({"model": "smollm2", "messages": history, "max_tokens": 6, "temperature": 0,
                                   "cache_salt": salt})
            with lock:
                served[where] = served.get(where, 0) + 1
            history.append(message)
            time.sleep(0.3)  # think time; the engines' KV events reach the picker meanwhile

    threads = [threading.Thread(target=one, args=(c,)) for c in range(n_conv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    q1, h1 = _counters(urls)
    return (h1 - h0) / (q1 - q0), served


def _engine_pulls(urls) -> float:
    """Pulls the engines were told to make (every outcome but `joined`: a request that joined a pull under way)."""
    text = [httpx.get(u + "/metrics", timeout=5).text for u in urls]
    return sum(metric(t, "kvfleet:kv_pulls_total") - metric(t, "kvfleet:kv_pulls_total", outcome="joined")
               for t in text)


@pytest.mark.slow  # a hit-rate comparison over many turns (~30 s loaded): benchmark-like
def test_multi_turn_hit_rate_through_the_picker_matches_the_router(procs, engines):
    """Both at their default flags, peer pulls included: each pull the picker decides reaches its engine (the pull
    header is set, never also removed), and the hit rates match within what pulls' timing varies."""
    urls = [e.url for e in engines]
    pk, address = picker(procs, urls)
    rt = router(procs, urls, *TOKEN, model="smollm2")
    rt.wait_ready(timeout=120)
    wait_for(lambda: metric(httpx.get(rt.url + "/metrics").text, "kvfleet_router_kv_events_live") == 2,
             what="the router's KV events live")
    gw = Gateway(address)

    def via_picker(body):
        got = gw.send("/v1/chat/completions", body)
        assert got.status == 200, got.body
        return got.served, got.json()["choices"][0]["message"]

    def via_router(body):
        resp = httpx.post(rt.url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return _endpoint(resp.headers["x-kvfleet-replica"]), resp.json()["choices"][0]["message"]

    pulls0 = _engine_pulls(urls)
    epp_hit, epp_served = converse(via_picker, urls, "hit-epp")
    decided = metric(httpx.get(pk.url + "/metrics").text, "kvfleet_router_kv_pulls_total")
    assert decided > 0 and _engine_pulls(urls) - pulls0 == decided, (decided, _engine_pulls(urls) - pulls0)
    router_hit, router_served = converse(via_router, urls, "hit-router")
    print(f"hit rate: picker {epp_hit:.3f}, router {router_hit:.3f} ({epp_hit / router_hit:.3f}); "
          f"requests per endpoint: picker {epp_served}, router {router_served}")
    assert epp_hit >= 0.95 * router_hit, (epp_hit, router_hit)  # 0.84-0.93x when the picker's pulls were lost
    assert max(epp_served.values()) <= 0.75 * sum(epp_served.values()), epp_served
    assert len(epp_served) == 2  # data-parallel: two ports of one IP, two endpoints, both serving
    gw.close()
