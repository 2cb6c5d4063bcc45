"""Continuing a broken stream on another replica: the I/O of router/migration/.

The proxy hands over a stream whose replica failed after tokens went out (the connection broke, or an error
event said the replica failed). Each unfinished choice goes on as a /v1/completions request (continuation.py)
on a replica the placement core leases (the dead ones excluded; its prompt's cached blocks count as for any
request), its chunks relayed to the client as the same stream (relay.py), the choices of an `n > 1` request
side by side; then the whole request's usage and one `[DONE]`. A continuation that breaks too is moved again,
up to `--max-migrations` breaks per request; one that cannot start anywhere, or that a replica refuses with a
4xx (the request's own fault), ends the stream with an error event, as before. Nothing here runs after the
client went away: the app cancels the proxy's task.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from contract.request import OpenAIRequest
from router.migration.continuation import continuation_body, remaining, top_logprobs
from router.migration.progress import ChoiceState, Progress, replica_failed
from router.migration.relay import Relay, final_events, sse
from router.migration.straddle import Straddle, held_text
from router.requests.usage import StreamUsage
from router.routing.lease import Lease
from router.routing.prepare import COMPLETIONS_PATH, PreparedRequest
from router.routing.tokens import PromptTokenizer
from router.states import StrEnum

log = logging.getLogger("kvfleet.router.migrate")

_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)


class Outcome(StrEnum):
    """How a stream whose replica failed ended (values label kvfleet_router_migrations_total)."""

    COMPLETED = "completed"  # it went on elsewhere and finished: the client saw one stream
    LIMIT = "limit"  # it broke more than --max-migrations times
    FAILED = "failed"  # no replica could take the continuation, or one refused it
    UNSUPPORTED = "unsupported"  # what was sent cannot be continued exactly (no prompt ids, no tokenizer for stops)


@dataclass(slots=True)
class Resume:
    """A stream that may move: set up by the app for each streamed request that can (continuation.why_not)."""

    req: OpenAIRequest  # as it went upstream, with return_token_ids
    pool: str
    keep_ids: bool  # the client asked for token ids itself
    tokenizer: PromptTokenizer | None  # to find text the dead replica held back (stop strings)
    max_migrations: int
    last_at: float = 0.0  # perf_counter when the client last got a chunk
    migrations: int = 0  # breaks moved so far
    gap_open: bool = False  # a break happened and no chunk went out since

    def progress(self) -> Progress:
        return Progress(self.req.endpoint, self.req.n, strip=not self.keep_ids)

    @property
    def stream_options(self) -> dict:
        opts = self.req.get("stream_options")
        return opts if isinstance(opts, dict) else {}


class _Broken(Exception):
    """The continuation's replica failed mid-stream: move again."""


class _Refused(Exception):
    """The continuation cannot go on anywhere (no replica, a 4xx, nothing to continue from)."""


class Migrator:
    def __init__(self, metrics, session: aiohttp.ClientSession, max_attempts: int):
        self.metrics = metrics
        self.session = session
        self.max_attempts = max_attempts

    async def resume(self, send, r: Resume, progress: Progress, dead: str, fwd_headers,
                     lease: Callable[[PreparedRequest, set[str]], Lease | None], follower: StreamUsage | None,
                     attempts) -> bool:
        """Finish the stream on other replicas; True if the client got the whole of it (ends it then)."""
        outcome = await self._resume(send, r, progress, {dead}, fwd_headers, lease, follower, attempts)
        self.metrics.migrations.labels(r.pool, outcome).inc()
        if outcome is not Outcome.COMPLETED:
            return False
        opts = r.stream_options
        tail = final_events(progress, opts.get("include_usage") is True)
        if follower is not None:
            tail = follower.feed(tail) + follower.flush()
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        attempts.usage = (follower.last if follower is not None else None) or progress.usage()
        attempts.ended_at = time.perf_counter()
        return True

    async def _resume(self, send, r, progress, dead, fwd_headers, lease, follower, attempts) -> Outcome:
        while progress.unfinished():
            if r.migrations >= r.max_migrations:
                return Outcome.LIMIT
            r.migrations += 1
            r.gap_open = True
            tasks = [asyncio.ensure_future(self._continue(send, r, progress, c, dead, fwd_headers, lease, follower,
                                                          attempts)) for c in progress.unfinished()]
            try:  # the choices go on side by side, each on the replica placement picks for it
                done = await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                for t in tasks:
                    t.cancel()
            refused = [e for e in done if isinstance(e, _Refused)]
            if refused:
                log.warning("stream not moved: %s", refused[0])
                return Outcome.UNSUPPORTED if isinstance(refused[0], _Unsupported) else Outcome.FAILED
            failed = [e for e in done if isinstance(e, BaseException) and not isinstance(e, _Broken)]
            if failed:
                raise failed[0]
        return Outcome.COMPLETED

    def _relay(self, r: Resume, progress: Progress, c: ChoiceState) -> Relay:
        stops = r.req.get("stop")
        stops = (stops,) if isinstance(stops, str) else tuple(s for s in stops or () if isinstance(s, str))
        straddle = None
        if stops:
            if r.tokenizer is None:
                raise _Unsupported("stop strings, and no tokenizer in the router to read the held-back text")
            decoded = r.tokenizer.tok.decode(c.ids, skip_special_tokens=r.req.get("skip_special_tokens") is not False)
            straddle = Straddle(held_text(decoded, c.text), stops, r.req.get("include_stop_str_in_output") is True)
        opts = r.stream_options
        return Relay(progress, c, straddle, top_logprobs(r.req), r.keep_ids,
                     opts.get("continuous_usage_stats") is True and opts.get("include_usage") is True)

    async def _emit(self, send, r: Resume, chunks: list[dict], follower: StreamUsage | None) -> None:
        if not chunks:
            return
        data = b"".join(sse(ch) for ch in chunks)
        if follower is not None:
            data = follower.feed(data)
        now = time.perf_counter()
        if r.gap_open and r.last_at:
            self.metrics.migration_gap.labels(r.pool).observe(now - r.last_at)
        r.gap_open, r.last_at = False, now
        await send({"type": "http.response.body", "body": data, "more_body": True})

    async def _continue(self, send, r: Resume, progress: Progress, c: ChoiceState, dead: set[str], fwd_headers,
                        lease, follower, attempts) -> None:
        """Finish one choice; `dead`: the replicas that failed this request so far (none is tried again)."""
        prompt = progress.prompt_of(c)
        if prompt is None:
            raise _Unsupported("the replica sent no prompt token ids")
        relay = self._relay(r, progress, c)
        log.info("continuing choice %d after %d tokens%s", c.index, len(c.ids),
                 f" ({len(relay.straddle.held)} characters held back)" if relay.straddle is not None else "")
        left = remaining(r.req, len(c.ids))
        if left is not None and left <= 0:  # max_tokens reached: ends here, as the replica would have ended it
            await self._emit(send, r, relay.event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}),
                             follower)
            return
        body = json.dumps(continuation_body(r.req, prompt, c.ids), separators=(",", ":"),
                          ensure_ascii=False).encode()
        prep = PreparedRequest(token_ids=prompt + c.ids, cache_salt=r.req.cache_salt, session_key=None, stream=True)
        headers = [(k, v) for k, v in fwd_headers if k.lower() != "content-type"]
        headers.append(("content-type", "application/json"))
        tried = set(dead)
        for _ in range(self.max_attempts):
            ls = lease(prep, tried)
            if ls is None:
                raise _Refused("no replica left to continue on")
            tried.add(ls.url)
            attempts.replica = ls.url
            try:
                if await self._stream(send, r, ls, body, headers, relay, follower):
                    return
            except _Broken:
                dead.add(ls.url)
                raise
            finally:
                ls.release()
            dead.add(ls.url)
        raise _Refused(f"{self.max_attempts} replicas failed to start the continuation")

    async def _stream(self, send, r: Resume, ls: Lease, body: bytes, headers, relay: Relay,
                      follower: StreamUsage | None) -> bool:
        """One continuation attempt: True when the choice finished; False when it failed before it streamed
        anything (try another replica); _Broken when it failed after (a new migration starts from what the
        client has); _Refused on a 4xx."""
        url = ls.url
        try:
            resp = await self.session.post(url + COMPLETIONS_PATH, data=body, headers=headers)
        except _UPSTREAM_ERRORS:
            ls.failed()
            return False
        sent = False
        try:
            if resp.status != 200:
                text = (await resp.read())[:300].decode(errors="replace")
                if 400 <= resp.status < 500 and resp.status != 429:
                    ls.succeeded()
                    raise _Refused(f"{url} refused the continuation: HTTP {resp.status} {text}")
                if resp.status in (429, 503):
                    ls.refused()
                else:
                    ls.failed()
                return False
            pending = b""
            async for data in resp.content.iter_any():
                pending += data
                end = pending.rfind(b"\n\n")
                if end < 0:
                    continue
                events, pending = pending[:end].split(b"\n\n"), pending[end + 2:]
                for ev in events:
                    if not ev.startswith(b"data: {"):
                        continue
                    obj = json.loads(ev[6:])
                    if "error" in obj and not obj.get("choices"):
                        if not replica_failed(obj):
                            ls.succeeded()
                            raise _Refused(f"{url} failed the continuation: {obj['error']}")
                        raise _UpstreamFailed(str(obj["error"]))
                    if not sent:
                        ls.first_token()
                        sent = True  # the choice's state moves on from here
                    await self._emit(send, r, relay.event(obj), follower)
                    if relay.done:
                        ls.succeeded()
                        return True
            raise _UpstreamFailed("the continuation ended before its choice finished")
        except (*_UPSTREAM_ERRORS, _UpstreamFailed, ValueError) as e:
            ls.failed()
            self.metrics.upstream_failures.labels(url, "mid-stream" if sent else "before-first-byte").inc()
            log.warning("continuation on %s failed: %s", url, e)
            if sent:
                raise _Broken() from None
            return False
        finally:
            resp.close()  # a choice that ended on a stop string the router found: the engine aborts the rest


class _Unsupported(_Refused):
    pass


class _UpstreamFailed(Exception):
    pass
