"""A bounded mixed load on a local fleet's router, so every dashboard series gets data: streamed chats sharing
a system prompt (cache hits, KV usage, a queue), streams the client cancels, requests the engine refuses
(400), a tenant over its budget (429), a request without a key (401)."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import httpx

LOAD_KEY, TINY_KEY = "sk-load-0123456789", "sk-tiny-0123456789"
SYSTEM = ("You are a meticulous assistant for a fleet of language model servers. Answer briefly, in plain "
          "words, and mention block tables, prefix caches and schedulers only when asked about them. ") * 3


def tenants_yaml() -> str:
    def h(k: str) -> str:
        return hashlib.sha256(k.encode()).hexdigest()
    return (f"tenants:\n"
            f"  load:\n    api_key_sha256: [\"{h(LOAD_KEY)}\"]\n    tokens_per_minute: 10000000\n"
            f"  tiny:\n    api_key_sha256: [\"{h(TINY_KEY)}\"]\n    tokens_per_minute: 400\n")


def _chat(i: int, max_tokens: int) -> dict:
    return {"model": "smollm2", "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Question {i % 7}: what is item {i % 7} of a paged KV "
                                                     f"cache, in one sentence?"}]}


class MixedLoad:
    """`threads` clients for `seconds`, then stop; counts what they got back."""

    def __init__(self, router_url: str, threads: int = 10, seconds: float = 40.0, max_tokens: int = 48):
        self.url, self.threads, self.seconds, self.max_tokens = router_url, threads, seconds, max_tokens
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + 1

    def _client(self, k: int, deadline: float) -> None:
        auth = {"Authorization": f"Bearer {LOAD_KEY}"}
        with httpx.Client(base_url=self.url, timeout=120) as c:
            i = k
            while time.monotonic() < deadline:
                i += self.threads
                kind = i % 10
                try:
                    if kind == 0:  # cancelled by the client after the first chunks
                        with c.stream("POST", "/v1/chat/completions", json=_chat(i, 200), headers=auth) as r:
                            for n, _ in enumerate(r.iter_lines()):
                                if n >= 3:
                                    break
                        self._count("cancelled")
                    elif kind == 1:  # the engine refuses it (400)
                        body = {**_chat(i, 8), "stream": False, "temperature": -1}
                        self._count(str(c.post("/v1/chat/completions", json=body, headers=auth).status_code))
                    elif kind == 2:  # a tenant with a tiny budget: 429 once it is spent
                        body = {**_chat(i, 64), "stream": False}
                        r = c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TINY_KEY}"})
                        self._count(f"tiny-{r.status_code}")
                    elif kind == 3 and i % 30 == 3:  # no key
                        self._count(f"nokey-{c.post('/v1/chat/completions', json=_chat(i, 8)).status_code}")
                    else:
                        with c.stream("POST", "/v1/chat/completions", json=_chat(i, self.max_tokens),
                                      headers=auth) as r:
                            for line in r.iter_lines():
                                if line.startswith("data: ") and line != "data: [DONE]":
                                    json.loads(line[6:])
                        self._count(f"stream-{r.status_code}")
                except httpx.HTTPError as e:
                    self._count(type(e).__name__)

    def run(self) -> dict[str, int]:
        deadline = time.monotonic() + self.seconds
        workers = [threading.Thread(target=self._client, args=(k, deadline)) for k in range(self.threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=self.seconds + 180)
        return dict(self.counts)
