"""The transfer arena (engine/core/arena.py): exact first-fit bookkeeping, and memory two processes share."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from engine.core.arena import ALIGN, Arena, Regions


def test_first_fit_aligns_and_merges_neighbours_on_free():
    r = Regions(10 * ALIGN)
    a = r.alloc(1)
    b = r.alloc(2 * ALIGN)
    c = r.alloc(3 * ALIGN - 5)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and r.used_bytes == 6 * ALIGN
    assert r.alloc(5 * ALIGN) is None  # 4 left
    r.free(b)
    assert r.alloc(3 * ALIGN) == 6 * ALIGN  # the hole of 2 is too small: first fit after c
    assert r.alloc(2 * ALIGN) == ALIGN  # b's hole, exactly
    r.free(a)
    r.free(ALIGN)
    r.free(c)  # 0..6 one free run again (6..9 still lent, 9..10 free)
    assert r.alloc(7 * ALIGN) is None and r.alloc(6 * ALIGN) == 0
    r.free(0)
    r.free(6 * ALIGN)
    assert r.alloc(10 * ALIGN) == 0 and r.used_bytes == 10 * ALIGN


def test_a_bad_request_or_free_is_an_error():
    r = Regions(ALIGN)
    with pytest.raises(ValueError):
        r.alloc(0)
    with pytest.raises(KeyError):
        r.free(0)


def _child(arena: Arena, q) -> None:
    view = arena.view(ALIGN, 4)
    q.put(bytes(view))
    view[:] = b"back"


def test_a_spawned_process_maps_the_same_memory():
    arena = Arena(1 << 20)
    try:
        arena.view(ALIGN, 4)[:] = b"sent"
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=_child, args=(arena, q))
        p.start()
        assert q.get(timeout=60) == b"sent"
        p.join(60)
        assert p.exitcode == 0 and bytes(arena.view(ALIGN, 4)) == b"back"
        with pytest.raises(ValueError, match="outside"):
            arena.view((1 << 20) - 2, 4)
    finally:
        arena.close()


def test_without_memfd_an_unlinked_file_serves(monkeypatch):
    monkeypatch.delattr("os.memfd_create")
    arena = Arena(1 << 16)
    try:
        arena.view(0, 3)[:] = b"abc"
        assert bytes(arena.view(0, 3)) == b"abc"
    finally:
        arena.close()
