"""Free loopback ports for the processes that tests, benchmarks and local runs start.

A port the kernel hands out for `bind(0)` comes from the ephemeral range, the same range it picks the source
ports of outgoing connections from: between choosing such a port and the server binding it, any client
connection (the test's own HTTP calls) can take it ("address already in use"). Ports below the ephemeral
range are never handed to outgoing connections, so one that is free when checked stays free until a
process of ours binds it (barring another picker choosing the same one: they are drawn at random).
"""

from __future__ import annotations

import random
import socket

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_start() -> int:
    try:
        with open(_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nothing listens on, below the ephemeral range where there is room."""
    low, high = 10000, _ephemeral_start()
    if high - low < 1000:  # an unusual range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    for _ in range(200):
        port = random.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} in {low}..{high}")
