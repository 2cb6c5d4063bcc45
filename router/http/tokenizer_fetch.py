"""`--tokenizer-from-engines`: the router loads the tokenizer of the first ready engine that serves one
(GET /v1/kvfleet/tokenizer), retried every second until one does."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import aiohttp

from router.routing.tokens import PromptTokenizer

log = logging.getLogger("kvfleet.router")


async def tokenizer_from_engines(session: aiohttp.ClientSession, ready_urls: Callable[[], list[str]],
                                 headers: Mapping[str, str]) -> PromptTokenizer:
    from engine.tokenizer import TokenizerError, load_tokenizer_archive

    logged: set[str] = set()
    while True:
        for url in ready_urls():
            try:
                async with session.get(url + "/v1/kvfleet/tokenizer", headers=headers,
                                       timeout=aiohttp.ClientTimeout(total=30)) as resp:
                    if resp.status != 200:
                        raise ValueError(f"HTTP {resp.status}")
                    data = await resp.read()
                tok = await asyncio.to_thread(load_tokenizer_archive, data)
                prompt_tokenizer = await asyncio.to_thread(PromptTokenizer, tok)
                log.info("tokenizer from %s: vocab %d, %d bytes", url, tok.vocab_size, len(data))
                return prompt_tokenizer
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TokenizerError) as e:
                if url not in logged:  # once per replica
                    logged.add(url)
                    log.warning("no tokenizer from %s yet: %s", url, e)
        await asyncio.sleep(1.0)
