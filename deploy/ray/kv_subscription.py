"""KV events from an engine replica to a request router over Ray: the engine's /v1/kv/events stream (the same
NDJSON codec, contract/kv_wire.py) read through a streaming call of EngineReplica.kv_events on that one replica,
applied to the router's exact PrefixIndex by the HTTP router's own EventApplier (router/routing/kv_events.py).

Recovery is the HTTP subscriber's: a gap in sequence numbers, a bad line, silence past the heartbeat timeout or
a failed call drop the replica's blocks and resubscribe for a fresh snapshot.

`stream_from_replica` is the one place that reaches below Serve's public API: a DeploymentHandle call goes
wherever the request router sends it, and a subscription must reach one given replica, so it sends the call
to that RunningReplica itself (PendingRequest + Serve's internal RequestMetadata, pinned to Ray 2.60).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from contract.kv_events import Heartbeat, Snapshot
from contract.kv_wire import KVWireError, decode_line
from router.routing.kv_events import EventApplier
from router.routing.prefix_index import PrefixIndex
from router.states import KVEventsState

log = logging.getLogger("kvfleet.ray.kv_events")


async def stream_from_replica(replica, method: str) -> AsyncIterator:
    """Items of a streaming call of `method` (no arguments) on one RunningReplica."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    rid = f"kvfleet-{method}-{uuid.uuid4().hex[:12]}"
    pr = PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id=rid, internal_request_id=rid,
                                                                     call_method=method, is_streaming=True))
    result = replica.try_send_request(pr, with_rejection=False)
    try:
        while True:
            try:
                item = await result.__anext__()
            except StopAsyncIteration:
                return
            yield item
    finally:
        result.cancel()


class ReplicaKVSubscription:
    """One background task per replica and request router: subscribe, apply, resync on trouble."""

    def __init__(self, key: str, open_stream: Callable[[], AsyncIterator[bytes]], index: PrefixIndex,
                 heartbeat_timeout_s: float = 10.0, on_status: Callable[[KVEventsState], None] | None = None):
        self.key = key
        self.open_stream = open_stream
        self.index = index
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_status = on_status or (lambda status: None)
        self.resyncs = 0

    async def run(self) -> None:
        backoff = 0.1
        try:
            while True:
                live, reason = await self._session()
                if self.index.has(self.key):
                    self.index.drop(self.key)
                self.on_status(KVEventsState.CONNECTING)
                self.resyncs += 1
                log.info("KV events of replica %s: resync (%s)", self.key, reason)
                backoff = 0.1 if live else min(backoff * 2, 2.0)
                await asyncio.sleep(backoff)
        finally:
            if self.index.has(self.key):
                self.index.drop(self.key)

    async def _session(self) -> tuple[bool, str]:
        """One subscription; returns whether it went live and why it ended."""
        applier = EventApplier(self.key, self.index)
        stream = self.open_stream()
        live, buf = False, b""
        try:
            while True:
                # asyncio.timeout, not wait_for: wait_for runs __anext__ as a task of its own and, on
                # Python 3.11, returns its result when a cancellation lands as it completes, so the
                # subscription swallowed close() and resubscribed forever.
                try:
                    async with asyncio.timeout(self.heartbeat_timeout_s):
                        chunk = await stream.__anext__()
                except StopAsyncIteration:
                    return live, "closed"
                except TimeoutError:
                    return live, "heartbeat-timeout"
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    message = decode_line(line).message
                    if not applier.apply(message):
                        return live, "heartbeat-gap" if isinstance(message, Heartbeat) else "gap"
                    if isinstance(message, Snapshot) and not live:
                        live = True
                        self.on_status(KVEventsState.LIVE)
        except KVWireError as e:
            log.warning("KV events of replica %s: bad event (%s)", self.key, e)
            return live, "bad-event"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the replica died or the call failed: resubscribe
            return live, f"call failed: {type(e).__name__}: {e}"
        finally:
            await stream.aclose()
