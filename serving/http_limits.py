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
- Lingering close: a response sent before the request's body was read (a 413 for an announced 100 MB body,
  a 408) used to be followed by a plain close while the client was still sending, so the kernel answered the
  unread bytes with a reset, which also discards the response the client had not read yet: the client saw
  "connection reset" instead of the 413. Now the server half-closes (its response and a FIN go out), reads and
  drops what the client still sends for up to LINGER_S seconds (or until the client closes), then closes, as
  nginx's `lingering_close` does.

The limits are enforced by a subclass of uvicorn's httptools protocol, passed as `uvicorn.Config(http=...)`.
Body *size* limits stay where they were (`--max-body-bytes` on each server), since they answer in the API's
error format.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from contract.errors import ConfigError, error_body, error_type

logger = logging.getLogger("kvfleet.http")

LINGER_S = 5.0  # how long a closing connection still reads (and drops) a request body it did not want

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


class _LingeringTransport:
    """The connection's transport as the request cycles see it: close() lingers while a body is unread."""

    def __init__(self, transport: asyncio.Transport, protocol: LimitedHttpToolsProtocol):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def close(self) -> None:
        self._protocol.close_connection()


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: HttpLimits = HttpLimits()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._limit_timer: asyncio.TimerHandle | None = None
        self._in_headers = False
        self._body_unread = False  # a request's headers arrived and the rest of its body has not
        self._lingering = False

    # -- connection ----------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = _LingeringTransport(transport, self)  # type: ignore[assignment]
        if len(self.connections) > self.limits.max_connections:
            logger.warning("connection refused: %d open, --max-connections %d", len(self.connections) - 1,
                           self.limits.max_connections)
            transport.abort()
            return
        self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def close_connection(self) -> None:
        """Close; while the client may still be sending a body, half-close and drop what comes first."""
        transport: asyncio.Transport = self.transport._transport  # type: ignore[attr-defined]
        if self._lingering or transport.is_closing():
            return
        if not self._body_unread or not transport.can_write_eof():
            transport.close()
            return
        self._lingering = True
        self.pipeline.clear()  # no request after this one is answered
        self._arm(LINGER_S, transport.close)
        transport.write_eof()  # the response is out; a FIN follows it
        transport.resume_reading()  # uvicorn pauses reading when a body piles up: the rest must drain

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a body nobody will read
            return
        super().data_received(data)

    def eof_received(self) -> None:
        if self._lingering:  # the client has sent all it will
            self._disarm()
            self.transport._transport.close()  # type: ignore[attr-defined]
            return
        super().eof_received()

    # -- parser callbacks ----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        if self._limit_timer is None:  # a kept-alive connection's next request
            self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._body_unread = True
        self._disarm()
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s, self._body_timed_out)  # disarmed by on_message_complete

    def on_message_complete(self) -> None:
        self._body_unread = False
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
        body = json.dumps(error_body(message, error_type(408), None, "request_timeout"), separators=(",", ":")).encode()
        self.transport.write(_408 % (len(body), body))
