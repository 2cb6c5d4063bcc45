"""KV event subscriber: keeps the exact prefix index in step with one replica's prefix cache.

The lines at GET /v1/kv/events are decoded by contract/kv_wire.py: a snapshot first, then events with
consecutive sequence numbers, and a heartbeat carrying the last sequence number every ~2 s. A gap in the
sequence, a heartbeat that says events were missed, a malformed line, silence past the heartbeat timeout
or a dropped connection all lead to the same recovery: forget the replica's blocks and reconnect for a fresh
snapshot. A replica without the endpoint (404/405/501: e.g. a third-party engine) is marked `unavailable`, and
the router falls back to its approximate index for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import httpx

from contract.kv_events import Heartbeat, KVEventKind, KVMessage, Snapshot, follows
from contract.kv_wire import KVWireError, decode_line
from router.routing.prefix_index import PrefixIndex

log = logging.getLogger("kvfleet.router.kv_events")


class EventApplier:
    """Applies one replica's decoded messages to the index; pure (no I/O). `apply` returns False when the
    stream can no longer be trusted (gap, event before the snapshot) and a resync is needed."""

    def __init__(self, replica: str, index: PrefixIndex):
        self.replica = replica
        self.index = index
        self.last_seq: int | None = None

    def apply(self, message: KVMessage) -> bool:
        if isinstance(message, Snapshot):
            self.index.reset(self.replica, message.block_hashes, message.block_size, message.hash_seed,
                             [h for _, hashes in message.tiers for h in hashes])
            self.last_seq = message.seq
            return True
        if self.last_seq is None or not follows(self.last_seq, message):
            return False
        if isinstance(message, Heartbeat):
            return True
        if message.kind is KVEventKind.STORED:
            self.index.store(self.replica, message.block_hashes, message.medium)
        elif message.kind is KVEventKind.REMOVED:
            self.index.remove(self.replica, message.block_hashes, message.medium)
        else:
            self.index.clear(self.replica)
        self.last_seq = message.seq
        return True


class KVEventSubscriber:
    """One background task per replica: connect, apply the snapshot and live events, resync on trouble."""

    UNAVAILABLE_STATUSES = (404, 405, 501)

    def __init__(self, url: str, index: PrefixIndex, client: httpx.AsyncClient, heartbeat_timeout_s: float,
                 internal_token: str | None = None, on_status=None, on_resync=None,
                 retry_unavailable_s: float = 30.0):
        self.url = url
        self.index = index
        self.client = client
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.headers = {"authorization": f"Bearer {internal_token}"} if internal_token else {}
        self.on_status = on_status or (lambda status: None)
        self.on_resync = on_resync or (lambda reason: None)
        self.retry_unavailable_s = retry_unavailable_s
        self.status = "connecting"
        self._warned_auth = False
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Reconnect now instead of at the end of the backoff (the replica just turned ready: its stream, refused
        while it loaded, is there now)."""
        self._wake.set()

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds`, or until `wake()`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()

    def _set_status(self, status: str) -> None:
        self.status = status
        self.on_status(status)

    async def run(self) -> None:
        backoff = 0.1
        while True:
            reason = await self._session()
            self.index.drop(self.url)
            if self.status == "unavailable":
                await self._pause(self.retry_unavailable_s)
                continue
            if self.status == "live":
                backoff = 0.1  # it worked until now: reconnect at once
            self._set_status("connecting")
            self.on_resync(reason)
            log.info("KV events of %s: resync (%s)", self.url, reason)
            await self._pause(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _session(self) -> str:
        """One connection; returns why it ended."""
        applier = EventApplier(self.url, self.index)
        timeout = httpx.Timeout(connect=2.0, read=self.heartbeat_timeout_s, write=2.0, pool=2.0)
        try:
            async with self.client.stream("GET", self.url + "/v1/kv/events", headers=self.headers,
                                          timeout=timeout) as resp:
                if resp.status_code in self.UNAVAILABLE_STATUSES:
                    self._set_status("unavailable")
                    return "unavailable"
                if resp.status_code != 200:
                    if resp.status_code in (401, 403) and not self._warned_auth:
                        self._warned_auth = True
                        log.warning("KV events of %s: HTTP %d - the engine wants an internal token "
                                    "(--internal-token / KVFLEET_INTERNAL_TOKEN); routing to it without its "
                                    "cache contents until then", self.url, resp.status_code)
                    return f"http-{resp.status_code}"
                async for line in resp.aiter_lines():
                    if not line.strip():
                        continue
                    message = decode_line(line).message
                    if not applier.apply(message):
                        return "heartbeat-gap" if isinstance(message, Heartbeat) else "gap"
                    if isinstance(message, Snapshot):
                        self._set_status("live")
                return "closed"
        except httpx.ReadTimeout:
            return "heartbeat-timeout"
        except httpx.HTTPError as e:
            return f"connection: {type(e).__name__}"
        except KVWireError as e:
            log.warning("KV events of %s: bad event (%s)", self.url, e)
            return "bad-event"
