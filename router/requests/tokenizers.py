"""The prompt tokenizer of each model the fleet serves: the router counts and hashes a request's prompt with
its model's tokenizer and chat template, exactly as that model's engines do.

Where a model's tokenizer comes from, first that applies:
1. a pool that serves it names one in the pools file (`tokenizer: PATH`), loaded here;
2. `--tokenizer-from-engines`: fetched from a ready kvfleet engine serving the model
   (GET /v1/kvfleet/tokenizer, behind the internal token), retried every second until one answers; until then
   the model is *pending* (its requests get 503 + Retry-After); vLLM and SGLang pools serve no tokenizer;
3. `--model`: the one tokenizer loaded at start-up (a single-model fleet's).
A model with none of these is routed without prompt tokens (session and load only).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable, Mapping

import aiohttp

from router.routing.tokens import PromptTokenizer

log = logging.getLogger("kvfleet.router")

THIRD_PARTY = ("vllm", "sglang")  # engines without kvfleet's tokenizer endpoint
LOAD_TIMEOUT_S = 120.0  # a fetched tokenizer's load (seconds, normally) past this is retried


async def _load(name: str) -> PromptTokenizer:
    from engine.tokenizer import load_tokenizer

    tok = await asyncio.to_thread(load_tokenizer, name)
    return await asyncio.to_thread(PromptTokenizer, tok)


class Tokenizers:
    def __init__(self, fallback: PromptTokenizer | None = None):
        self.fallback = fallback  # --model's (or the one a test passes in)
        self.by_path: dict[str, PromptTokenizer] = {}  # pools file `tokenizer:` paths, loaded
        self.fetched: dict[str, PromptTokenizer] = {}  # model -> fetched from its engines
        self.paths: dict[str, str] = {}  # model -> the `tokenizer:` path of a pool serving it
        self._tasks: dict[str, asyncio.Task] = {}  # model (fetch) or path (load) -> its task

    def get(self, model: str | None) -> PromptTokenizer | None:
        """The model's tokenizer, or None (pending, or none to be had: see `pending`)."""
        if model is None:
            return self.fallback
        path = self.paths.get(model)
        if path is not None:
            return self.by_path.get(path)
        return self.fetched.get(model, self.fallback)

    def pending(self, model: str | None) -> bool:
        """Whether the model's tokenizer is being loaded or fetched (its requests wait: 503 + Retry-After)."""
        if model is None:
            return False
        task = self._tasks.get(self.paths.get(model, model))
        return task is not None and not task.done()

    def any_ready(self) -> bool:
        return self.fallback is not None or bool(self.by_path) or bool(self.fetched)

    def load_paths(self, paths: Mapping[str, str]) -> None:
        """model -> `tokenizer:` path of the pools file in force; new paths start loading."""
        self.paths = dict(paths)
        for path in set(paths.values()) - set(self.by_path):
            if path not in self._tasks:
                self._tasks[path] = asyncio.create_task(self._load_path(path))

    async def _load_path(self, path: str) -> None:
        try:
            self.by_path[path] = await _load(path)
            log.info("tokenizer %s loaded", path)
        except Exception as e:  # a bad path: its models are routed without prompt tokens
            log.error("cannot load the tokenizer %s (pools file): %s", path, e)
        gc.freeze()

    def fetch(self, model: str, session: aiohttp.ClientSession, urls: Callable[[], list[str]],
              headers: Mapping[str, str]) -> None:
        """Start fetching the model's tokenizer from its engines (`urls()`: the ready ones serving it), once."""
        if model in self.fetched or model in self.paths or model in self._tasks:
            return
        self._tasks[model] = asyncio.create_task(self._fetch(model, session, urls, headers))

    async def _fetch(self, model: str, session, urls, headers) -> None:
        self.fetched[model] = await tokenizer_from_engines(session, urls, headers, model)
        gc.freeze()

    def stop(self) -> None:
        for t in self._tasks.values():
            t.cancel()


async def tokenizer_from_engines(session: aiohttp.ClientSession, ready_urls: Callable[[], list[str]],
                                 headers: Mapping[str, str], model: str = "") -> PromptTokenizer:
    """The tokenizer of the first of `ready_urls()` that serves one, retried every second until one does."""
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
                try:  # bounded: a load stuck in its thread must not keep the model without a tokenizer
                    tok = await asyncio.wait_for(asyncio.to_thread(load_tokenizer_archive, data), LOAD_TIMEOUT_S)
                    prompt_tokenizer = await asyncio.wait_for(asyncio.to_thread(PromptTokenizer, tok), LOAD_TIMEOUT_S)
                except TimeoutError:  # the thread stays stuck; another load is tried in a second
                    log.error("loading the tokenizer%s from %s took over %g s; retrying",
                              f" of {model}" if model else "", url, LOAD_TIMEOUT_S)
                    continue
                log.info("tokenizer%s from %s: vocab %d, %d bytes", f" of {model}" if model else "", url,
                         tok.vocab_size, len(data))
                return prompt_tokenizer
            except (TimeoutError, aiohttp.ClientError, ValueError, TokenizerError) as e:
                if url not in logged:  # once per replica
                    logged.add(url)
                    log.warning("no tokenizer from %s yet: %s", url, e)
            except Exception:  # anything else is a bug, but must not end the fetch: the model would stay
                # without a tokenizer, silently, for the router's life (the task's exception never read)
                log.exception("fetching the tokenizer%s from %s failed; retrying", f" of {model}" if model else "",
                              url)
        await asyncio.sleep(1.0)
