"""Free loopback ports for the processes that tests, benchmarks and local runs start.

A port the kernel hands out for `bind(0)` comes from the ephemeral range, the same range it picks the source
ports of outgoing connections from: between choosing such a port and the server binding it, any client
connection (the test's own HTTP calls) can take it ("address already in use"). Ports below the ephemeral
range are never handed to outgoing connections, so one that is free when checked stays free until a
process of ours binds it (barring another picker choosing the same one: they are drawn at random).

Two pickers in parallel (pytest-xdist workers, which say so in PYTEST_XDIST_WORKER / _COUNT) draw from disjoint
residue classes, and one picker never hands out the same port twice within a minute, so a port chosen but not
yet bound by the process it was chosen for is never chosen again meanwhile.
"""

from __future__ import annotations

import os
import random
import socket
import time

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HOLD_S = 60.0
_HANDED: dict[int, float] = {}  # port -> when this process handed it out


def _worker() -> tuple[int, int]:
    """(this picker's index, how many pick in parallel): from pytest-xdist's variables, else (0, 1)."""
    try:
        count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    except ValueError:
        return 0, 1
    return (index % count, count) if count > 0 else (0, 1)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on, below the ephemeral range where there is room."""
    low, high = 10000, _ephemeral_start()
    if high - low < 1000:  # an unusual range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    worker, workers = _worker()
    now = time.monotonic()
    for old in [p for p, t in _HANDED.items() if now - t > _HOLD_S]:
        del _HANDED[old]
    for _ in range(200):
        port = random.randrange(low, high)
        port -= (port - worker) % workers  # this picker's residue class
        if port < low or port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _HANDED[port] = now
            return port
    raise OSError(f"no free port on {host} in {low}..{high}")
