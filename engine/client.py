"""The one edge between a front end (the HTTP server, a Ray Serve deployment) and an engine.

    stream = client.add_request(request_id, prompt_token_ids, params, cache_salt, arrival_time)
    async for delta in stream: ...      # RequestDelta: only what is new since the previous one
    await stream.aclose()               # before the end: aborts the request and frees its blocks

`add_request` is synchronous: it validates the request once (engine/admission.py) and raises a typed error
from engine/errors.py (InvalidRequestError, QueueFullError, EngineDeadError) before anything is queued,
so a front end answers a bad request before it sends a byte. `engine.async_engine.AsyncLLMEngine` is
the implementation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from contract.kv_transfer import Layout
from engine.admission import EngineLimits
from engine.core.messages import TransferDone
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.structured.grammars import GrammarCache
from engine.tokenizer import Tokenizer


class DeltaStream(Protocol):
    request_id: str

    def __aiter__(self) -> DeltaStream: ...

    async def __anext__(self) -> RequestDelta: ...

    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    model_name: str
    tokenizer: Tokenizer
    limits: EngineLimits
    hash_seed: int
    grammars: GrammarCache
    dead: BaseException | None  # why the engine loop stopped; None while it runs
    kv_layout: Layout  # of its KV cache, for transfers between engines (engine/server/kv_transfer.py)

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> DeltaStream: ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def cached_prefix(self, hashes: Sequence[int]) -> int: ...

    async def export_blocks(self, hashes: Sequence[int], max_blocks: int) -> TransferDone: ...

    async def import_blocks(self, prefix: Sequence[int], hashes: Sequence[int], tokens: Sequence[tuple[int, ...]],
                            lora: str | None, payload: bytes) -> TransferDone: ...

    def subscribe_kv_events(self) -> tuple[list[int], int, asyncio.Queue]: ...

    def tier_snapshot(self) -> tuple[tuple[str, tuple[int, ...]], ...]: ...

    def unsubscribe_kv_events(self, queue: asyncio.Queue) -> None: ...
