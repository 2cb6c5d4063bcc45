"""Hostile and slow clients, at router-0 and straight at engine-0 while a well-behaved probe client measures
latency: 500 connections to each that never send a byte, 20 + 5 streams read at 1 byte/s, 100 MB bodies
(with Content-Length and chunked), then fuzzed bodies (hypothesis) through the routers and at the engines.

Pass: zero 5xx; idle connections closed by the servers' header timeout (descriptors back to their baseline);
100 MB bodies refused with 413 and memory bounded (RSS growth under 100 MB per process); the probe's median
latency under attack at most twice its baseline + 0.25 s, and no probe failure.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

from loadtest.chaos.clients import Tally, chat_body, prompt
from loadtest.chaos.common import Options, Probe, check_no_leak, client
from loadtest.chaos.fleet import KEYS, Fleet, Proc
from loadtest.chaos.fuzz_bodies import draw
from loadtest.chaos.verdict import Verdict
from serving.http_limits import HttpLimits

NAME = "hostile and slow clients"
MEMORY_BOUND = 100 << 20
IDLE = 500
FD_SLACK = 40  # the router keeps connections to engines alive for 30 s after the attack's own streams


def _head(port: int, path: str, length: int | None, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"host: 127.0.0.1:{port}", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _idle(port: int, n: int) -> list:
    conns = []
    for _ in range(n):
        conns.append(await asyncio.open_connection("127.0.0.1", port))
    return conns


async def _closed_by_server(conns, wait: float) -> int:
    """How many of the idle connections the server has closed (EOF) within `wait` s."""
    async def eof(reader):
        try:
            return await asyncio.wait_for(reader.read(1), wait) == b""
        except (TimeoutError, ConnectionError):
            return False
    got = await asyncio.gather(*(eof(r) for r, _ in conns))
    for _, w in conns:
        w.close()
    return sum(got)


async def _slow_reader(port: int, headers: dict[str, str], seconds: float, rng: random.Random) -> int:
    """A stream read one byte a second for `seconds`, then dropped; the bytes read."""
    body = json.dumps(chat_body(prompt(rng, 30), 40, True)).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1)
    writer.transport.set_write_buffer_limits(0)
    writer.write(_head(port, "/v1/chat/completions", len(body), headers) + body)
    await writer.drain()
    got, t0 = 0, time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            b = await reader.read(1)
            if not b:
                break
            got += 1
            await asyncio.sleep(1.0)
    finally:
        writer.close()
    return got


async def _big_body(port: int, headers: dict[str, str], size: int, chunked: bool) -> str:
    """Send a `size`-byte body (announced or chunked) until the server answers or closes; its status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_head(port, "/v1/chat/completions", None if chunked else size, headers))
    status = asyncio.ensure_future(reader.readline())
    chunk = b"x" * (1 << 20)
    sent = 0
    try:
        while sent < size and not status.done():
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
            await writer.drain()
            sent += len(chunk)
        line = await asyncio.wait_for(status, 30)
    except (TimeoutError, ConnectionError) as e:
        line = (status.result() if status.done() and not status.exception() else f"{type(e).__name__}".encode())
    finally:
        writer.close()
    return line.decode(errors="replace").strip() + f" after {sent >> 20} MB"


async def _sample(procs: list[Proc], out: dict, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for p in procs:
            out.setdefault(p.name, []).append((p.rss_bytes(), p.open_fds()))
        await asyncio.sleep(0.25)


async def _fuzz(fleet: Fleet, n: int, seed: int) -> Tally:
    bodies = await asyncio.to_thread(draw, n, seed)
    targets = [(r.url, {"authorization": f"Bearer {KEYS['fuzz']}"}) for r in fleet.routers]
    targets += [(e.url, fleet.auth) for e in fleet.engines]
    tally = Tally()
    sem = asyncio.Semaphore(16)
    async with client(32, timeout=120) as c:
        async def one(k, path, body):
            url, headers = targets[k % len(targets)]
            async with sem:
                from loadtest.chaos.clients import Result
                res = Result(url=url + path, stream=False)
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    r = await c.post(url + path, content=content, headers={**headers,
                                                                           "content-type": "application/json"})
                    res.status = r.status_code
                    if r.status_code >= 500:
                        res.error = r.text[:300] + f" <- {content[:300]!r}"
                except Exception as e:  # noqa: BLE001 - a transport failure is a finding too
                    res.error = f"{type(e).__name__}: {e} <- {content[:300]!r}"
                tally.add(res)
        await asyncio.gather(*(one(k, p, b) for k, (p, b) in enumerate(bodies)))
    return tally


async def run(fleet: Fleet, opts: Options) -> Verdict:
    v = Verdict(NAME)
    router, engine = fleet.routers[0], fleet.engines[0]
    limits = HttpLimits()
    procs = [router, engine]
    base = {p.name: (p.rss_bytes(), p.open_fds()) for p in procs}
    probe = Probe(router.url).start()
    await asyncio.sleep(opts.scale(8, 5))
    baseline = probe.p(0.5)
    n_base = len(probe.latencies)
    samples: dict = {}
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(_sample(procs, samples, stop))
    rng = random.Random(opts.seed + 7)
    idle_r = await _idle(router.port, IDLE)
    idle_e = await _idle(engine.port, IDLE)
    readers = [_slow_reader(router.port, {"authorization": f"Bearer {KEYS['alpha']}"}, 20, rng) for _ in range(20)]
    readers += [_slow_reader(engine.port, fleet.auth, 20, rng) for _ in range(5)]
    slow = asyncio.ensure_future(asyncio.gather(*readers))
    big = []
    for port, headers in ((router.port, {"authorization": f"Bearer {KEYS['alpha']}"}), (engine.port, fleet.auth)):
        for chunked in (False, True, False):
            big.append(await _big_body(port, headers, 100 << 20, chunked))
    closed = await asyncio.gather(_closed_by_server(idle_r, limits.header_timeout_s + 5),
                                  _closed_by_server(idle_e, limits.header_timeout_s + 5))
    slow_bytes = await slow
    stop.set()
    await sampler
    attacked = probe.latencies[n_base:]
    await probe.stop()
    after_fds = {p.name: p.open_fds() for p in procs}
    under = sorted(attacked)[len(attacked) // 2] if attacked else None
    growth = {name: max(s[0] for s in series) - base[name][0] for name, series in samples.items()}
    peak_fds = {name: max(s[1] for s in series) for name, series in samples.items()}
    v.figures["idle connections closed by the server (router, engine)"] = f"{closed[0]}/{IDLE}, {closed[1]}/{IDLE}"
    v.figures["open descriptors: baseline / peak / after (router, engine)"] = [
        (base[p.name][1], peak_fds[p.name], after_fds[p.name]) for p in procs]
    v.figures["RSS growth under attack (MB, router, engine)"] = [round(growth[p.name] / 2**20, 1) for p in procs]
    v.figures["100 MB bodies (router x3, engine x3)"] = big
    v.figures["bytes read by the 1 byte/s readers in 20 s"] = f"min {min(slow_bytes)}, max {max(slow_bytes)}"
    v.figures["probe p50 latency: baseline / under attack (s)"] = (round(baseline or 0, 3), round(under or 0, 3))
    v.check("idle connections closed by the header timeout", closed == [IDLE, IDLE]
            and all(after_fds[p.name] <= base[p.name][1] + FD_SLACK for p in procs),
            f"closed {closed}; descriptors after {after_fds} vs baseline {[base[p.name][1] for p in procs]}")
    v.check("100 MB bodies get 413", all(" 413 " in b + " " for b in big), "; ".join(big))
    v.check("memory bounded (RSS growth < 100 MB)", all(g < MEMORY_BOUND for g in growth.values()),
            f"{ {k: round(g / 2**20, 1) for k, g in growth.items()} } MB")
    v.check("other clients unaffected", under is not None and baseline is not None
            and under <= 2 * baseline + 0.25 and not probe.failures,
            f"probe p50 {under} s vs baseline {baseline} s; {len(probe.failures)} probe failures")
    # fuzz
    n = opts.scale(10_000, 1_000)
    tally = await _fuzz(fleet, n, opts.seed)
    errs = [r for r in tally.results if r.server_error or r.status is None]
    v.figures["fuzzed bodies (routers and engines) by status"] = tally.statuses()
    v.check("fuzz: zero 5xx, no broken connection", not errs,
            f"{len(errs)} of {tally.n}" + (f", e.g. {errs[0].url}: {errs[0].status} {errs[0].error}" if errs else ""))
    v.check("processes alive", all(p.alive() for p in fleet.all_procs()), "")
    await check_no_leak(fleet, v)
    return v
