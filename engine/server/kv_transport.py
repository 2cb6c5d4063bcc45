"""How a pulling engine reaches its source's blocks: the transport behind KV pulls (engine/server/kv_transfer.py).

    async with transport.open(source_url, pull_request) as chunks:   # raises LayoutRefused / SourceFailed
        async for data in chunks: ...                                # the frames of contract/kv_transfer.py

`HttpTransport` is the one that runs everywhere: `POST /v1/kv/blocks` on the source, over TCP, behind the internal
token. A transport that moves the payload another way (NIXL, UCX, Mooncake's transfer engine between GPUs) keeps
this interface: the puller verifies and imports whatever frames it yields.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

import aiohttp

from contract.kv_transfer import PATH, PullRequest

READ_CHUNK = 1 << 20


class LayoutRefused(Exception):
    """The source's KV layout is not the puller's (it answered 409)."""


class SourceFailed(Exception):
    """The source answered something other than the blocks."""


class KVTransport(Protocol):
    def open(self, source: str, want: PullRequest) -> AbstractAsyncContextManager[AsyncIterator[bytes]]: ...

    async def close(self) -> None: ...


class HttpTransport:
    def __init__(self, internal_token: str | None):
        self._headers = {"content-type": "application/json"}
        if internal_token:
            self._headers["authorization"] = f"Bearer {internal_token}"
        self._session: aiohttp.ClientSession | None = None

    @asynccontextmanager
    async def open(self, source: str, want: PullRequest) -> AsyncIterator[AsyncIterator[bytes]]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        async with self._session.post(source + PATH, data=want.to_json(), headers=self._headers) as resp:
            if resp.status == 409:
                raise LayoutRefused(await resp.text())
            if resp.status != 200:
                raise SourceFailed(f"HTTP {resp.status}")
            yield resp.content.iter_chunked(READ_CHUNK)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
