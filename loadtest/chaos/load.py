"""Background load for the scenarios that break something while clients keep sending: `workers` loops, each
sending short chat requests (streamed or not) through the routers by the failover client, until stopped."""

from __future__ import annotations

import asyncio
import random

from loadtest.chaos.clients import Result, Tally, chat_body, failover, prompt
from loadtest.chaos.common import client
from loadtest.chaos.fleet import KEYS


class Load:
    def __init__(self, urls: list[str], workers: int = 6, key: str = KEYS["alpha"], max_tokens: int = 24,
                 seed: int = 0, failover_tries: int = 1, timeout: float = 120.0):
        self.urls, self.workers, self.key, self.max_tokens = urls, workers, key, max_tokens
        self.seed, self.tries, self.timeout = seed, failover_tries, timeout
        self.tally = Tally()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._client = None

    async def _worker(self, w: int) -> None:
        rng = random.Random(f"{self.seed}-{w}")
        i = w
        while not self._stop.is_set():
            body = chat_body(prompt(rng, rng.randint(10, 120)), rng.randint(4, self.max_tokens), rng.random() < 0.6)
            res: Result = await failover(self._client, self.urls, i % len(self.urls), body, self.key,
                                         timeout=self.timeout, tries=self.tries)
            self.tally.add(res)
            i += 1

    async def start(self) -> Load:
        self._client = client(self.workers * 2)
        self._tasks = [asyncio.ensure_future(self._worker(w)) for w in range(self.workers)]
        return self

    async def stop(self) -> Tally:
        """Let every request in flight finish (each has its own timeout), then stop."""
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()
        return self.tally
