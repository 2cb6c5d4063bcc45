"""`kvfleet router` and `kvfleet engine` enforce --header-timeout and --max-connections (real processes on
loopback: a connection that sends nothing used to stay open for ever, and nothing capped their number)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from deploy.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(argv: list[str], port: int, tmp_path, name: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "kvfleet", *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:  # /health answers as soon as the server is up (an engine's model may still be loading)
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)


def _eof_after(port: int) -> float:
    """Seconds until the server closes a connection that sends nothing."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass
        return time.monotonic() - t0


def _check_limits(port: int) -> None:
    assert 0.4 < _eof_after(port) < 5.0  # --header-timeout 0.5
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]  # --max-connections 3
    try:
        time.sleep(0.1)
        assert _eof_after(port) < 0.3  # the 4th is closed at once, not after the header timeout
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


@pytest.mark.parametrize("kind", ["router", "engine"])
def test_server_enforces_connection_limits(kind, tmp_path):
    port = free_port()
    limits = ["--header-timeout", "0.5", "--max-connections", "3"]
    if kind == "router":
        argv = ["router", "--port", str(port), "--policy", "round-robin", "--replicas", "http://127.0.0.1:9",
                "--log-level", "warning", *limits]
    else:
        argv = ["engine", "--model", "smollm2", "--port", str(port), "--num-blocks", "64", "--log-level", "warning",
                *limits]
    proc = _start(argv, port, tmp_path, kind)
    try:
        _check_limits(port)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
