"""GET /v1/kv/events: a subscriber that applies snapshot + events holds exactly the engine's cached set.

The engine runs with a tiny KV cache (48 blocks of 16 tokens), so a random workload of distinct and
shared-prefix prompts forces evictions ('removed' events) while the subscriber listens.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time

import httpx
import pytest

from tests.engine.server.conftest import start_engine

TOKEN = "s3cret-internal-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEX32 = set("0123456789abcdef")


class Subscriber(threading.Thread):
    """Mirrors the cache from the stream, checking the wire format and that seq numbers have no gaps."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.hashes: set[str] = set()
        self.seq = -1
        self.kinds: dict[str, int] = {}
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.snapshot: dict | None = None

    def run(self) -> None:
        try:
            with httpx.stream("GET", f"{self.url}/v1/kv/events", headers=AUTH, timeout=30) as r:
                assert r.headers["content-type"].startswith("application/x-ndjson")
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    self.apply(json.loads(line))
        except Exception as e:  # reported by the test
            if not self.stop.is_set():
                self.errors.append(repr(e))

    def apply(self, ev: dict) -> None:
        kind = ev["type"]
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        for h in ev.get("block_hashes", []) + ([ev["parent_hash"]] if ev.get("parent_hash") else []):
            if len(h) != 32 or set(h) - HEX32:
                self.errors.append(f"bad hash {h!r}")
        if kind == "snapshot":
            self.snapshot = ev
            self.hashes = set(ev["block_hashes"])
            self.seq = ev["seq"]
            return
        if kind == "heartbeat":
            if ev["seq"] != self.seq:
                self.errors.append(f"heartbeat seq {ev['seq']} != last event seq {self.seq}")
            return
        if ev["seq"] != self.seq + 1:
            self.errors.append(f"gap: {self.seq} -> {ev['seq']}")
        self.seq = ev["seq"]
        if kind == "stored":
            self.hashes |= set(ev["block_hashes"])
        elif kind == "removed":
            self.hashes -= set(ev["block_hashes"])
        elif kind == "cleared":
            self.hashes.clear()
        else:
            self.errors.append(f"unknown event type {kind}")


def first_line(url: str) -> dict:
    with httpx.stream("GET", f"{url}/v1/kv/events", headers=AUTH, timeout=10) as r:
        return json.loads(next(r.iter_lines()))


@pytest.fixture(scope="module")
def small_cache_server(tmp_path_factory):
    server = start_engine(str(tmp_path_factory.mktemp("kv")), "--num-blocks", "48", "--max-model-len", "512",
                          "--max-num-seqs", "4", "--internal-token", TOKEN)
    yield server
    server.stop(signal.SIGTERM)


def test_internal_token_required(small_cache_server):
    url = f"{small_cache_server.url}/v1/kv/events"
    assert httpx.get(url, timeout=10).status_code == 401
    r = httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_internal_token"
    snap = first_line(small_cache_server.url)
    assert snap["type"] == "snapshot" and snap["block_size"] == 16 and isinstance(snap["hash_seed"], int)
    assert snap["instance_id"].startswith("test-")


def test_subscriber_mirrors_cache_through_evictions(small_cache_server):
    url = small_cache_server.url
    sub = Subscriber(url)
    sub.start()
    deadline = time.monotonic() + 10
    while sub.snapshot is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sub.snapshot is not None, sub.errors
    rng = random.Random(1234)
    words = "harbour tide ship anchor sail rope wave storm light keel mast deck crew port dock".split()
    shared = " ".join(rng.choice(words) for _ in range(60))
    evictions_before = small_cache_server.metric("kvfleet:block_evictions_total")
    for _ in range(24):
        own = " ".join(rng.choice(words) for _ in range(rng.randint(20, 160)))
        content = f"{shared} {own}" if rng.random() < 0.5 else own
        body = {"model": "smollm2", "messages": [{"role": "user", "content": content}], "max_tokens": rng.randint(1, 8),
                "cache_salt": rng.choice([None, "tenant-a"])}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    assert small_cache_server.metric("kvfleet:block_evictions_total") > evictions_before
    published = small_cache_server.metric("kvfleet:kv_events_published_total")
    # wait until the subscriber has applied everything published, then compare with a fresh snapshot
    deadline = time.monotonic() + 15
    fresh = first_line(url)
    while sub.seq < fresh["seq"] and time.monotonic() < deadline:
        time.sleep(0.05)
    sub.stop.set()
    assert not sub.errors, sub.errors
    assert sub.seq == fresh["seq"] == published
    assert sub.kinds.get("stored", 0) > 0 and sub.kinds.get("removed", 0) > 0
    assert sub.hashes == set(fresh["block_hashes"])
    assert 0 < len(sub.hashes) <= 48


def test_heartbeat_when_idle(small_cache_server):
    t0 = time.monotonic()
    with httpx.stream("GET", f"{small_cache_server.url}/v1/kv/events", headers=AUTH, timeout=10) as r:
        lines = r.iter_lines()
        snap = json.loads(next(lines))
        beat = json.loads(next(lines))
    assert beat == {"type": "heartbeat", "instance_id": snap["instance_id"], "seq": snap["seq"]}
    assert 1.5 < time.monotonic() - t0 < 5
