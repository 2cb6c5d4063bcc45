"""KV blocks between engines over HTTP (contract/kv_transfer.py): the source's endpoint and the puller.

Source: `POST /v1/kv/blocks` streams the leading run of the wanted blocks its prefix cache holds, a frame of
at most FRAME_BLOCKS blocks at a time, each copied out by the engine core between two steps (one frame in
flight: the stream goes as fast as the puller reads, and a frame never holds the core for long).

Puller: a request that comes with `x-kvfleet-kv-pull: <replica URL>` (a router's decision, router/routing/
placement.py) first pulls the blocks of its prompt this engine lacks from that replica, then is added as
usual and finds them in its prefix cache. Each block is checked before it is taken (its hash is the one
computed here from the prompt, the tokens are the prompt's, the hash recomputed from those tokens matches);
the first one that fails ends the pull, refused and counted. The pull is bounded: --kv-pull-timeout seconds
and --kv-pull-max-bytes of payload; whatever did not arrive by then is computed, as is everything when the
source fails, refuses or is gone. Nothing stays held on either side: the source copies, the puller's
blocks enter its cache free. The bytes travel through a `KVTransport` (engine/server/kv_transport.py: HTTP here).
A source whose running prefill is computing the blocks wanted streams them as they are cached; requests for a
prefix a pull is already fetching wait for it instead of computing it. A pull's transfer seconds
(`kvfleet:kv_pull_transfer_seconds`, the router's measured pull cost) leave out its waits for the source's
prefill and for either engine core to finish the step it was running when the copy was asked for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from contract.cacheable import cacheable_blocks
from contract.errors import ConfigError
from contract.hashing import hash_blocks
from contract.kv_transfer import (
    BlockFrame,
    FrameError,
    FrameReader,
    Layout,
    PullRequest,
    Refusal,
    end_frame,
    parse_pull_header,
    verify,
)
from contract.kv_transfer import (
    PullOutcome as Outcome,
)
from engine.core.messages import TransferDone
from engine.server.auth import token_matches
from engine.server.errors import APIError
from engine.server.kv_events import check_internal_token
from engine.server.kv_transport import HttpTransport, KVTransport, LayoutRefused, SourceFailed
from engine.server.serving import ServerState

logger = logging.getLogger("kvfleet.kv_transfer")

FRAME_BLOCKS = 32  # blocks per frame: 11.5 MB of SmolLM2's bf16 KV at 16 tokens a block
MAX_WAIT_S = 60.0  # the longest a source waits for blocks its prefill is computing, whatever the puller asks
EXPECT_S = 1.0  # how long a source waits for a request a router just sent it, when the pull says so
PENDING_POLL_S = 0.01  # how often it looks again meanwhile (the core answers between two steps)


@dataclass(frozen=True)
class PullResult:
    outcome: Outcome
    blocks: int  # imported into this engine's cache
    seconds: float
    waited_s: float = 0.0  # of those seconds, waits for a prefill or a core's step on either side (not transfer)


@dataclass
class _Progress:
    """What a pull got so far (read when it times out)."""

    blocks: int = 0
    waited_s: float = 0.0


async def queued_behind_step(call: Awaitable[TransferDone]) -> tuple[TransferDone, float]:
    """The core's answer to a transfer and how long the command waited for the core to take it up (the step it
    was running): time that counts as waiting, not as moving blocks, in the pull's transfer seconds."""
    sent = time.monotonic()
    done = await call
    return done, max(0.0, done.started_at - sent) if done.started_at else 0.0


async def kv_blocks(state: ServerState, request: Request) -> Response:
    """The source's side: stream the wanted blocks it holds."""
    check_internal_token(state, request)
    engine = state.engine_or_503()
    try:
        want = PullRequest.from_json(await request.body())
    except ConfigError as e:
        raise APIError(400, str(e), e.field, "invalid_kv_pull") from None
    mine: Layout = engine.kv_layout
    field = mine.mismatch(want.layout)
    metrics = request.app.state.metrics
    if field is not None:
        metrics.kv_refusals.labels(metrics.model_name, Refusal.LAYOUT.value).inc()
        raise APIError(409, f"KV layout differs in {field}: this engine has {getattr(mine, field)!r}, the puller "
                            f"{getattr(want.layout, field)!r}", f"layout.{field}", "kv_layout_mismatch")
    max_blocks = want.max_bytes // mine.block_bytes

    started = time.monotonic()
    deadline = started + min(want.wait_s, MAX_WAIT_S)
    expect_until = started + min(want.expect_s, MAX_WAIT_S)

    async def frames() -> AsyncIterator[bytes]:
        sent = 0
        waited = 0.0  # since the last frame: time spent waiting for the prefill, not moving blocks
        hashes = want.hashes[:max_blocks]
        while sent < len(hashes):
            chunk = hashes[sent:sent + FRAME_BLOCKS]
            done, queued = await queued_behind_step(engine.export_blocks(chunk, len(chunk)))
            waited += queued  # the core finishing a step (its prefill, say) before copying: not transfer time
            if done.hashes:
                sent += len(done.hashes)
                metrics.kv_blocks.labels(metrics.model_name, "export").inc(len(done.hashes))
                metrics.kv_bytes.labels(metrics.model_name, "export").inc(len(done.payload))
                yield BlockFrame(done.hashes, done.tokens, done.lora, done.payload, waited).encode()
                waited = 0.0
            if len(done.hashes) == len(chunk):
                continue
            now = time.monotonic()
            # nothing held nor computing yet, but a router just sent the request that computes it: it may be on its way
            expecting = not done.hashes and not sent and now < expect_until
            if (not done.pending and not expecting) or now >= deadline:
                break
            t = time.monotonic()
            await asyncio.sleep(PENDING_POLL_S)  # its prefill is computing the next block: stream it when cached
            waited += time.monotonic() - t
        yield end_frame(sent)

    return StreamingResponse(frames(), media_type="application/octet-stream")


def source_url(value: str) -> str | None:
    """The replica URL of a pull header, normalized (scheme://host:port), or None when it is not one."""
    try:
        parts = urlsplit(value.strip())
        parts.port  # noqa: B018 - raises ValueError for a port that is not one
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or parts.query:
        return None
    return f"{parts.scheme}://{parts.netloc}"


class KVPuller:
    def __init__(self, state: ServerState, metrics, timeout: float, max_bytes: int):
        self.state = state
        self.metrics = metrics
        self.timeout = timeout
        self.max_bytes = max_bytes
        self.transport: KVTransport = HttpTransport(state.config.internal_token)
        self._inflight: list[tuple[set[int], asyncio.Future]] = []  # pulls running: the hashes each fetches

    def allowed(self, request: Request) -> bool:
        """Pull hints are obeyed from routers only: with an internal token set, the request must carry it."""
        token = self.state.config.internal_token
        return token is None or token_matches(request.headers.get("authorization"), token)

    async def close(self) -> None:
        await self.transport.close()

    async def pull(self, header: str | None, prompt: list[int], salt: str | None, adapter: str | None) -> None:
        """Before a request is added: wait for pulls in flight here that fetch its blocks (another request's: one
        pull per prefix, however many requests want it), then, with a header, pull what is still missing."""
        if header is None and not self._inflight:
            return
        t0 = time.perf_counter()
        m, name = self.metrics, self.metrics.model_name
        engine = self.state.engine_or_503()
        layout: Layout = engine.kv_layout
        bs = layout.block_size
        hashes = hash_blocks(prompt[:cacheable_blocks(len(prompt), bs) * bs], bs, salt, layout.hash_seed,
                             adapter=adapter)
        joined = await self._join(engine, hashes, t0 + self.timeout)
        if joined and header is None:
            m.kv_pulls.labels(name, Outcome.JOINED.value).inc()
        if header is None:
            return
        url, pending = parse_pull_header(header)
        # the pull it joined streamed all the source's prefill gave: the rest is asked for once, not waited for
        pending = pending and not joined
        source = source_url(url)
        if source is None:
            m.kv_pulls.labels(name, Outcome.INVALID.value).inc()
            return
        first = engine.cached_prefix(hashes)
        if first >= len(hashes):
            m.kv_pulls.labels(name, Outcome.HELD.value).inc()
            return
        entry = (set(hashes[first:]), asyncio.get_running_loop().create_future())
        self._inflight.append(entry)
        try:
            result = await self._pull(engine, source, layout, hashes, first, prompt, salt, adapter, t0, pending)
        finally:
            self._inflight.remove(entry)
            entry[1].set_result(None)
        m.kv_pulls.labels(name, result.outcome.value).inc()
        m.kv_pull_seconds.labels(name).observe(result.seconds)
        if result.blocks:
            m.kv_pull_transfer_seconds.inc(max(0.0, result.seconds - result.waited_s))

    async def _join(self, engine, hashes: list[int], deadline: float) -> bool:
        """Wait (until deadline) while a pull in flight fetches the first block of `hashes` not cached; whether
        it waited."""
        waited = False
        while True:
            first = engine.cached_prefix(hashes)
            busy = next((fut for want, fut in self._inflight if first < len(hashes) and hashes[first] in want), None)
            left = deadline - time.perf_counter()
            if busy is None or left <= 0:
                return waited
            waited = True
            try:
                await asyncio.wait_for(asyncio.shield(busy), left)
            except TimeoutError:
                return waited

    async def _pull(self, engine, source: str, layout: Layout, hashes: list[int], first: int, prompt: list[int],
                    salt: str | None, adapter: str | None, t0: float, pending: bool) -> PullResult:
        got = _Progress()
        outcome = Outcome.FAILED
        try:
            async with asyncio.timeout(self.timeout):
                outcome = await self._stream(engine, source, layout, hashes, first, prompt, salt, adapter, got, pending)
        except TimeoutError:
            outcome = Outcome.TIMEOUT
        except (aiohttp.ClientError, ConnectionError, FrameError) as e:
            logger.info("KV pull from %s failed: %s", source, e)
            if isinstance(e, FrameError):
                self.metrics.kv_refusals.labels(self.metrics.model_name, Refusal.STREAM.value).inc()
                outcome = Outcome.REFUSED
        return PullResult(outcome, got.blocks, time.perf_counter() - t0, got.waited_s)

    async def _stream(self, engine, source: str, layout: Layout, hashes: list[int], first: int, prompt: list[int],
                      salt: str | None, adapter: str | None, got: _Progress, pending: bool) -> Outcome:
        m, name = self.metrics, self.metrics.model_name
        want = PullRequest(tuple(hashes[first:]), layout, self.max_bytes, self.timeout,
                           min(EXPECT_S, self.timeout) if pending else 0.0)
        at = first
        try:
            async with self.transport.open(source, want) as chunks:
                reader = FrameReader()
                async for data in chunks:
                    for frame in reader.feed(data):
                        got.waited_s += frame.waited_s
                        ok, why = verify(frame, layout, hashes, prompt, at, hashes[at - 1] if at else None, salt,
                                         adapter)
                        if ok:
                            done, queued = await queued_behind_step(engine.import_blocks(
                                hashes[:at], frame.hashes[:ok], frame.tokens[:ok], adapter,
                                frame.payload[:ok * layout.block_bytes]))
                            got.waited_s += queued
                            got.blocks += done.imported
                            m.kv_blocks.labels(name, "import").inc(done.imported)
                            m.kv_bytes.labels(name, "import").inc(done.imported * layout.block_bytes)
                            m.kv_pulled_tokens.inc(done.imported * layout.block_size)
                            at += ok
                        if why is not None:
                            m.kv_refusals.labels(name, why.value).inc()
                            return Outcome.REFUSED
                    if reader.ended:
                        break
                if not reader.ended:
                    return Outcome.FAILED  # the source died mid-stream: what arrived whole is kept
        except LayoutRefused:
            m.kv_refusals.labels(name, Refusal.LAYOUT.value).inc()
            return Outcome.REFUSED
        except SourceFailed as e:
            logger.info("KV pull from %s: %s", source, e)
            return Outcome.FAILED
        if at >= len(hashes):
            return Outcome.PULLED
        return Outcome.PARTIAL if at > first else Outcome.NONE
