"""Connection limits that kvfleet's two HTTP servers (router and engine) share: uvicorn has none of them.

- `--header-timeout`: a connection must send a request's complete headers within this many seconds of
  opening (or of its first byte, on a kept-alive connection); otherwise it is closed (408 if it had started).
  Without it, a client that connects and sends nothing holds a socket and a file descriptor for ever.
- `--body-timeout`: a request's body must arrive within this many seconds of its headers; otherwise 408 and
  the connection is closed (the handler sees a disconnect). Without it, a client that trickles a body holds
  the handler, and on the router the prompt's budget reservation, for ever.
- `--max-connections`: open connections beyond this are closed as soon as they are accepted (before any byte
  is read), so that descriptors and memory stay bounded whatever clients do. Idle ones age out by the
  timeouts above and uvicorn's keep-alive timeout.

The limits are enforced by a subclass of uvicorn's httptools protocol, passed as `uvicorn.Config(http=...)`.
Body *size* limits stay where they were (`--max-body-bytes` on each server), since they answer in the API's
error format.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from contract.errors import ConfigError

logger = logging.getLogger("kvfleet.http")

_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s")


@dataclass(frozen=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096

    def __post_init__(self) -> None:
        for name, flag in (("header_timeout_s", "--header-timeout"), ("body_timeout_s", "--body-timeout")):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                raise ConfigError(flag, f"{flag} must be a number of seconds > 0, got {value}")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ConfigError("--max-connections", f"--max-connections must be an integer >= 1, "
                                                   f"got {self.max_connections}")


def add_cli_args(group: argparse._ActionsContainer) -> None:
    d = HttpLimits()
    group.add_argument("--header-timeout", type=float, default=d.header_timeout_s, metavar="SECONDS",
                       help="a connection that has not sent a request's complete headers this long after opening "
                       f"(or after its first byte) is closed (default {d.header_timeout_s:g})")
    group.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="SECONDS",
                       help="a request whose body has not fully arrived this long after its headers gets 408 and "
                       f"its connection is closed (default {d.body_timeout_s:g})")
    group.add_argument("--max-connections", type=int, default=d.max_connections,
                       help="open connections beyond this are closed when accepted, before anything is read "
                       f"(default {d.max_connections})")


def from_cli(ns: argparse.Namespace) -> HttpLimits:
    return HttpLimits(header_timeout_s=ns.header_timeout, body_timeout_s=ns.body_timeout,
                      max_connections=ns.max_connections)


def protocol_class(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `limits` enforced; pass it as `uvicorn.Config(http=...)`."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: HttpLimits = HttpLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._limit_timer: asyncio.TimerHandle | None = None
        self._in_headers = False

    # -- connection ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            logger.warning("connection refused: %d open, --max-connections %d", len(self.connections) - 1,
                           self.limits.max_connections)
            transport.abort()
            return
        self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- parser callbacks ----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        if self._limit_timer is None:  # a kept-alive connection's next request
            self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s, self._body_timed_out)  # disarmed by on_message_complete

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # -- timers --------------------------------------------------------------------------------------------
    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._limit_timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if self._limit_timer is not None:
            self._limit_timer.cancel()
            self._limit_timer = None

    def _header_timed_out(self) -> None:
        self._limit_timer = None
        if self.transport.is_closing():
            return
        if self._in_headers:  # a request had begun: say why it ends
            self._reply_408(f"request headers not received within {self.limits.header_timeout_s:g} s")
        self.transport.close()

    def _body_timed_out(self) -> None:
        self._limit_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        started = cycle is not None and cycle.response_started
        if cycle is not None:  # the handler sees a disconnect; whatever it sends now is dropped
            cycle.disconnected = True
            cycle.message_event.set()
        if not started:
            self._reply_408(f"request body not received within {self.limits.body_timeout_s:g} s")
        self.transport.close()

    def _reply_408(self, message: str) -> None:
        body = (b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":"request_timeout"}}'
                % message.encode())
        self.transport.write(_408 % (len(body), body))
