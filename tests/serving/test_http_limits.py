"""serving/http_limits.py against hostile sockets: a real uvicorn server on loopback, raw TCP clients."""

from __future__ import annotations

import argparse
import socket
import threading
import time

import pytest
import uvicorn

from contract.errors import ConfigError
from deploy.ports import free_port
from serving import http_limits
from serving.http_limits import HttpLimits

LIMITS = HttpLimits(header_timeout_s=0.5, body_timeout_s=0.5, max_connections=3)


class EchoApp:
    """Answers with the body's length; records whether a handler saw its client disconnect."""

    def __init__(self):
        self.disconnects = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                self.disconnects += 1
                return
            size += len(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = str(size).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class RefuseBigApp(EchoApp):
    """Like the engine's body limit: a 413 with `connection: close` for an announced body over 1 MB, unread."""

    async def __call__(self, scope, receive, send):
        length = int(dict(scope.get("headers") or []).get(b"content-length", b"0"))
        if scope["type"] != "http" or length <= 1 << 20:
            await super().__call__(scope, receive, send)
            return
        body = b'{"error":{"code":"request_too_large"}}'
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def server():
    app, port = RefuseBigApp(), free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off",
                                        http=http_limits.protocol_class(LIMITS)))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    yield app, port
    srv.should_exit = True
    thread.join(10)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def _read_all(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset counts as closed)."""
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _request(port: int, body: bytes = b"x" * 10) -> bytes:
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                  % (len(body), body))
        return _read_all(s)


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(server):
    _, port = server
    with _connect(port) as s:
        t0 = time.monotonic()
        assert _read_all(s) == b""  # closed without a reply: nothing had begun
        assert 0.4 < time.monotonic() - t0 < 3.0


def test_headers_trickled_get_408_after_the_header_timeout(server):
    _, port = server
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
        reply = _read_all(s)
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b'"code":"request_timeout"' in reply


def test_a_body_that_never_completes_gets_408_and_the_handler_sees_a_disconnect(server):
    app, port = server
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"y" * 10)
        t0 = time.monotonic()
        reply = _read_all(s)
        assert time.monotonic() - t0 < 3.0
    assert reply.startswith(b"HTTP/1.1 408 ")
    deadline = time.monotonic() + 2
    while app.disconnects == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert app.disconnects == 1


def test_connections_beyond_the_cap_are_closed_at_once_and_the_cap_frees_up(server):
    _, port = server
    idle = [_connect(port) for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    with _connect(port) as extra:
        t0 = time.monotonic()
        assert _read_all(extra) == b""
        assert time.monotonic() - t0 < 0.3  # refused, not timed out
    for s in idle:
        s.close()
    time.sleep(0.1)
    assert _request(port).endswith(b"\r\n\r\n10")


def test_a_refused_body_still_sending_gets_its_413_not_a_reset(server):
    """The server answers 413 before reading a 32 MB body; the client keeps sending, then reads. Without the
    lingering close the server's close with unread bytes resets the connection and the 413 is lost."""
    _, port = server
    for _ in range(3):
        with _connect(port) as s:
            s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (32 << 20))
            time.sleep(0.1)  # the 413 and the server's close come now, while the body is still to be sent
            sent = 0
            try:
                while sent < 32 << 20:
                    s.sendall(b"x" * (1 << 20))
                    sent += 1 << 20
            except (BrokenPipeError, ConnectionResetError) as e:
                pytest.fail(f"the server reset the connection after {sent >> 20} MB: {e!r}")
            reply = _read_all(s)
        assert reply.startswith(b"HTTP/1.1 413 ") and reply.endswith(b'"request_too_large"}}'), reply[:200]


def test_a_refused_body_lingers_no_longer_than_linger_s(server, monkeypatch):
    """A client that keeps trickling after the 413 is cut off after LINGER_S."""
    monkeypatch.setattr(http_limits, "LINGER_S", 0.5)
    _, port = server
    with _connect(port) as s:
        s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (32 << 20))
        t0 = time.monotonic()
        assert s.recv(65536).startswith(b"HTTP/1.1 413 ")
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while time.monotonic() - t0 < 5:
                s.sendall(b"x" * 1024)
                time.sleep(0.05)
        assert 0.4 < time.monotonic() - t0 < 2.0


def test_well_behaved_requests_pass_including_keep_alive(server):
    _, port = server
    with _connect(port) as s:
        for _ in range(2):
            s.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc")
            reply = s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200 ") and reply.endswith(b"\r\n\r\n3")
            time.sleep(0.3)  # idle between requests, under the keep-alive timeout


def test_limits_name_the_flag():
    with pytest.raises(ConfigError) as e:
        HttpLimits(header_timeout_s=0)
    assert e.value.field == "--header-timeout"
    with pytest.raises(ConfigError) as e:
        HttpLimits(max_connections=0)
    assert e.value.field == "--max-connections"
    p = argparse.ArgumentParser()
    http_limits.add_cli_args(p)
    assert http_limits.from_cli(p.parse_args(["--body-timeout", "7"])) == HttpLimits(body_timeout_s=7.0)


def test_both_servers_take_the_flags():
    from router.main import build_parser, config_from_args

    ns = build_parser().parse_args(["--replicas", "http://127.0.0.1:1", "--max-connections", "9",
                                    "--max-body-bytes", "2048"])
    assert http_limits.from_cli(ns).max_connections == 9
    assert config_from_args(ns).max_body_bytes == 2048
    from engine.args import EngineArgs
    from engine.server.main import add_server_args

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    add_server_args(p)
    assert http_limits.from_cli(p.parse_args(["--header-timeout", "3"])).header_timeout_s == 3.0
