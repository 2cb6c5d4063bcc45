"""uvicorn, but the first SIGTERM/SIGINT drains before the server exits and a second one exits at once:
`kvfleet engine` and `kvfleet router` both stop this way (running requests finish, new ones go elsewhere)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import uvicorn

logger = logging.getLogger("serving.draining")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]):
        """drain(): stop taking requests and wait (bounded) for the running ones; the server exits after it."""
        super().__init__(config)
        self.drain = drain
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining or self.loop is None:
            self.should_exit = True
            self.force_exit = self.force_exit or self.draining
            return
        self.draining = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.drain()
        finally:
            self.should_exit = True

    def fail(self, message: str) -> None:
        logger.error("exiting: %s", message)
        self.exit_code = 1
        self.should_exit = True
