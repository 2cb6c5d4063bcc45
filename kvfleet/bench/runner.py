"""kvfleet's own load driver: streams OpenAI chat requests and records every chunk's arrival time.

Closed loop (`concurrency` workers, each takes the next conversation when its last ends), open loop
(conversations start at Poisson arrivals of `rate` per second, seeded; or at a replayed trace's own times),
and multi-turn conversations: turn k is sent when turn k-1 has ended, with the whole history, the reply
the server actually streamed included. guidellm drives the single-turn loads as well (see
kvfleet/bench/guidellm_driver.py); this driver exists for what guidellm lacks: sessions that resend their
real history, per-chunk records for exact figures, and no second venv.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import httpx

from kvfleet.bench.records import RequestRecord, error_type, record_from_sse
from kvfleet.bench.scenarios import Conversation
from kvfleet.workload import words


@dataclass(frozen=True)
class Load:
    """Exactly one of: `concurrency` (closed loop), `rate` (open loop, Poisson), `replay` (trace times)."""

    concurrency: int | None = None
    rate: float | None = None
    replay: bool = False

    def __post_init__(self):
        given = [self.concurrency is not None, self.rate is not None, self.replay]
        if sum(given) != 1:
            raise ValueError("give exactly one of --concurrency, --rate, --replay-times")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"--rate must be > 0, got {self.rate}")

    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return f"rate {self.rate:g}/s" if self.rate is not None else "trace times"


@dataclass(frozen=True)
class RequestOptions:
    model: str = "smollm2"
    api_key: str | None = None
    ignore_eos: bool = True  # every request produces its max_tokens (servers that know the flag)
    temperature: float = 0.0
    timeout_s: float = 600.0
    think_s: float = 0.0  # pause between a conversation's turns


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals: n start offsets with exponential gaps of mean 1/rate (the first after one gap)."""
    rng = random.Random(f"{seed}-arrivals")
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def request_body(conv: Conversation, messages: list[dict], max_tokens: int, opts: RequestOptions) -> dict:
    body = {"model": opts.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": opts.temperature}
    if conv.n > 1:
        body["n"] = conv.n
        body["temperature"] = max(opts.temperature, 0.7)  # n greedy copies would be identical
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send(client: httpx.AsyncClient, url: str, body: dict, opts: RequestOptions, *, scenario: str,
               t_run: float, session: str | None, turn: int) -> RequestRecord:
    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    if session:
        headers["x-session-id"] = session
    lines: list[tuple[float, str]] = []
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return RequestRecord(scenario, t0 - t_run, (), time.perf_counter() - t0,
                                     error=error_type(r.status_code), session=session, turn=turn)
            async for line in r.aiter_lines():
                lines.append((time.perf_counter() - t0, line))
    except httpx.TimeoutException:
        err = "timeout"
    except httpx.HTTPError:
        err = "connection"
    else:
        return record_from_sse(lines, scenario=scenario, start_s=t0 - t_run, end_s=time.perf_counter() - t0,
                               session=session, turn=turn)
    return RequestRecord(scenario, t0 - t_run, (), time.perf_counter() - t0, error=err, session=session, turn=turn)


async def run_conversation(client, url: str, conv: Conversation, opts: RequestOptions, scenario: str,
                           t_run: float, done) -> list[RequestRecord]:
    history = [dict(m) for m in conv.prefix]
    out = []
    session = conv.id if len(conv.turns) > 1 else None
    for k, turn in enumerate(conv.turns):
        if k and opts.think_s:
            await asyncio.sleep(opts.think_s)
        history.append({"role": "user", "content": turn.user})
        rec = await send(client, url, request_body(conv, list(history), turn.max_tokens, opts), opts,
                         scenario=scenario, t_run=t_run, session=session, turn=k)
        out.append(rec)
        done(rec)
        # the real reply; a stand-in of the asked length if the turn failed, so later turns still run
        reply = rec.text or words(random.Random(f"{conv.id}-{k}"), turn.max_tokens)
        history.append({"role": "assistant", "content": reply})
    return out


async def run_load(url: str, conversations: list[Conversation], load: Load, opts: RequestOptions, *,
                   scenario: str, seed: int = 0, progress=None) -> tuple[list[RequestRecord], float]:
    """All conversations under `load`; returns the records (in completion order) and the wall time."""
    url = url.rstrip("/")
    records: list[RequestRecord] = []

    def done(rec: RequestRecord) -> None:
        records.append(rec)
        if progress is not None:
            progress.update(1)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(opts.timeout_s), limits=limits) as client:
        t_run = time.perf_counter()
        if load.concurrency is not None:
            queue = list(reversed(conversations))

            async def worker():
                while queue:
                    await run_conversation(client, url, queue.pop(), opts, scenario, t_run, done)

            await asyncio.gather(*(worker() for _ in range(min(load.concurrency, len(conversations)))))
        else:
            if load.replay:
                base = min((c.arrival_s or 0.0) for c in conversations)
                starts = [(c.arrival_s or 0.0) - base for c in conversations]
            else:
                starts = arrival_times(len(conversations), load.rate, seed)

            async def at(start: float, conv: Conversation):
                await asyncio.sleep(max(0.0, start - (time.perf_counter() - t_run)))
                await run_conversation(client, url, conv, opts, scenario, t_run, done)

            await asyncio.gather(*(at(s, c) for s, c in zip(starts, conversations, strict=True)))
        wall = time.perf_counter() - t_run
    return records, wall
