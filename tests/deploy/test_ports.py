"""deploy.ports.free_port: free, below the ephemeral range, never twice in a row, disjoint across xdist workers."""

from __future__ import annotations

import socket

from deploy import ports


def test_ports_are_free_distinct_and_in_this_workers_class(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    monkeypatch.setattr(ports, "_HANDED", {})
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == 300  # none handed out twice while it may still be waiting to be bound
    assert all(p % 3 == 1 and 10000 <= p < ports._ephemeral_start() for p in got)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[-1]))  # and it is free


def test_a_bound_port_is_not_handed_out(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    monkeypatch.setattr(ports, "_HANDED", {})
    real = ports.random.randrange
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        held = s.getsockname()[1]
        draws: list[int] = []

        def draw(lo: int, hi: int) -> int:  # the held port twice, then real draws (any fixed port may be taken)
            draws.append(held if len(draws) < 2 else real(lo, hi))
            return draws[-1]

        monkeypatch.setattr(ports.random, "randrange", draw)
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: max(held + 1, 20000))
        got = ports.free_port()
        assert draws[:2] == [held, held] and len(draws) >= 3  # the held port was drawn and passed over
        assert got != held and got == draws[-1]
