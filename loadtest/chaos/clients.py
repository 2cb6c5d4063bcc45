"""Chaos clients: one OpenAI chat request (streamed or not, optionally dropped at a chosen point), a client that
fails over between routers, and the figures of a batch of results."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from kvfleet.workload import words
from loadtest.chaos.fleet import MODEL

CHAT = "/v1/chat/completions"
CUT_POINTS = ("before_headers", "mid_prefill", "mid_decode")


@dataclass
class Result:
    url: str
    stream: bool
    status: int | None = None  # None: no response (connection error, or dropped before headers)
    error: str | None = None  # transport error, or the error body / SSE error event
    latency: float = 0.0
    first_token: float | None = None
    text: str = ""
    finish_reason: str | None = None
    usage: dict | None = None
    done: bool = False  # a stream ended with [DONE]
    dropped: str | None = None  # the cut point, for a request the client dropped on purpose
    hung: bool = False  # no answer within the client's timeout
    attempts: int = 1
    chunks: int = 0
    broken: bool = False  # the connection broke (a transport error, not an answer)
    resent_after_cut: int = 0  # failover: earlier attempts whose answer (status 200) was cut mid-way
    replica: str | None = None  # the engine a router placed the request on (its x-kvfleet-replica header)
    started: float = 0.0  # perf_counter when it was sent
    max_gap: float = 0.0  # a stream's longest pause between two chunks with text (s)

    @property
    def ok(self) -> bool:
        if self.dropped or self.hung or self.status != 200 or self.error:
            return False
        return self.done if self.stream else self.finish_reason is not None

    @property
    def server_error(self) -> bool:
        return self.status is not None and self.status >= 500


def chat_body(prompt: str, max_tokens: int, stream: bool, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def prompt(rng: random.Random, n_words: int) -> str:
    return words(rng, n_words)


async def request(client: httpx.AsyncClient, url: str, body: dict, key: str | None = None,
                  headers: dict | None = None, timeout: float = 120.0, cut: str | None = None,
                  rng: random.Random | None = None) -> Result:
    """POST `body` to url + /v1/chat/completions; `cut` drops the request at that point on purpose."""
    rng = rng or random.Random()
    hdrs = dict(headers or {})
    if key:
        hdrs["authorization"] = f"Bearer {key}"
    res = Result(url=url, stream=bool(body.get("stream")))
    t0 = res.started = time.perf_counter()
    work = asyncio.ensure_future(_do(client, url, body, hdrs, res, t0, cut, rng))
    limit = rng.uniform(0.0, 0.03) if cut == "before_headers" else timeout
    try:
        await asyncio.wait_for(work, limit)
    except TimeoutError:
        if cut == "before_headers":
            res.dropped = cut
        else:
            res.hung = True
            res.error = f"no answer within {timeout:.0f} s"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        res.broken = True
    res.latency = time.perf_counter() - t0
    return res


async def _do(client, url, body, hdrs, res: Result, t0: float, cut: str | None, rng: random.Random) -> None:
    async with client.stream("POST", url + CHAT, json=body, headers=hdrs) as resp:
        res.status = resp.status_code
        res.replica = resp.headers.get("x-kvfleet-replica")
        if resp.status_code != 200 or not res.stream:
            data = await resp.aread()
            try:
                obj = json.loads(data)
            except ValueError:
                res.error = f"HTTP {resp.status_code}, body not JSON: {data[:200]!r}"
                return
            if resp.status_code != 200:
                res.error = (obj.get("error") or {}).get("message") if isinstance(obj, dict) else str(obj)[:200]
                res.error = res.error or f"HTTP {resp.status_code}"
                return
            choice = obj["choices"][0]
            res.text, res.finish_reason, res.usage = choice["message"]["content"] or "", choice["finish_reason"], \
                obj.get("usage")
            res.first_token = time.perf_counter() - t0
            return
        if cut == "mid_prefill":
            await asyncio.sleep(rng.uniform(0.0, 0.15))
            res.dropped = cut
            return
        stop_after = rng.randint(1, max(1, int(body.get("max_tokens", 2)) - 1)) if cut == "mid_decode" else None
        last = None
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                res.done = True
                break
            obj = json.loads(payload)
            if "error" in obj:
                res.error = str(obj["error"].get("message"))
                continue
            if obj.get("usage"):
                res.usage = obj["usage"]
            for ch in obj.get("choices") or ():
                delta = (ch.get("delta") or {}).get("content")
                if delta:
                    now = time.perf_counter() - t0
                    if res.first_token is None:
                        res.first_token = now
                    res.max_gap = max(res.max_gap, now - (last or now))
                    last = now
                    res.text += delta
                    res.chunks += 1
                if ch.get("finish_reason"):
                    res.finish_reason = ch["finish_reason"]
            if stop_after is not None and res.chunks >= stop_after:
                res.dropped = cut
                return


async def failover(client: httpx.AsyncClient, urls: list[str], start: int, body: dict, key: str | None,
                   timeout: float = 120.0, tries: int = 4) -> Result:
    """What a client of two routers behind nothing but each other does: send to urls[start], and when the
    connection fails (before or during the answer: a stream cut by a dying router is sent again whole) or a
    draining router answers 503, send to the next (up to `tries` attempts)."""
    res, cut = None, 0
    for attempt in range(tries):
        url = urls[(start + attempt) % len(urls)]
        res = await request(client, url, body, key, timeout=timeout)
        res.attempts, res.resent_after_cut = attempt + 1, cut
        cut += res.broken and res.status == 200
        retry = res.broken or (res.status == 503 and "shutting down" in (res.error or ""))
        if not retry:
            return res
        await asyncio.sleep(0.05 * (attempt + 1))
    return res


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


@dataclass
class Tally:
    """Counts of a batch of results, by outcome."""
    results: list[Result] = field(default_factory=list)

    def add(self, r: Result) -> Result:
        self.results.append(r)
        return r

    def count(self, pred) -> int:
        return sum(1 for r in self.results if pred(r))

    @property
    def n(self) -> int:
        return len(self.results)

    @property
    def ok(self) -> int:
        return self.count(lambda r: r.ok)

    @property
    def server_errors(self) -> int:
        return self.count(lambda r: r.server_error)

    @property
    def hung(self) -> int:
        return self.count(lambda r: r.hung)

    def statuses(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            k = str(r.status) if r.status is not None else ("dropped" if r.dropped else "no-response")
            out[k] = out.get(k, 0) + 1
        return dict(sorted(out.items()))

    def latency(self, q: float) -> float | None:
        return percentile([r.latency for r in self.results if r.ok], q)
