"""Memory the front end and the engine core share, for the payloads of KV transfers between engines.

    arena = Arena(ARENA_BYTES)          # the front end's (or the core thread's) side: an anonymous memory file
    # pickled into the spawned core process, it maps the same pages there (the file descriptor is passed)
    regions = Regions(arena.size)       # the front end's bookkeeping of which parts are in use
    off = regions.alloc(n)              # None while no free run of n bytes exists
    arena.view(off, n)                  # a writable memoryview both processes see
    regions.free(off)

Why: a pull moves tens of megabytes per frame of blocks. Pickled down multiprocessing's pipes (64 KiB per
write, one wake-up of the reader for each) they crossed at 400-500 MB/s, twice per pull (the source's core to
its server, the puller's server to its core), and were copied four more times on the way. Here the core
gathers the blocks straight into the region the front end gave it, and scatters imported blocks straight out
of one: the pipes carry only the (offset, size) of the region.

The memory is a memfd (Linux; elsewhere an unlinked temporary file): not a file in /dev/shm, so neither its
size limit (64 MiB in a default container) nor a process killed at the wrong moment can leave it behind. Its
pages are allocated when first written and then kept, so the arena's size is only an upper bound and its memory
the most that transfers in flight at once have used (tens of megabytes for a few concurrent pulls of SmolLM2's
11.5 MB frames). Pure bookkeeping in `Regions` (first fit over a sorted free list, tested with exact expectations).
"""

from __future__ import annotations

import bisect
import mmap
import os
import tempfile

ARENA_BYTES = 1 << 30  # address space, not memory: pages exist only while some transfer wrote them
ALIGN = 64


class Arena:
    def __init__(self, size: int, fd: int | None = None):
        """A new arena of `size` bytes, or (fd given) the mapping of an existing one in this process."""
        self.size = size
        if fd is None:
            fd = _anonymous_file()
            os.ftruncate(fd, size)
        self._fd = fd
        self._map = mmap.mmap(fd, size)
        self._view = memoryview(self._map)

    def view(self, offset: int, size: int) -> memoryview:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"region [{offset}, {offset + size}) is outside the arena of {self.size} bytes")
        return self._view[offset:offset + size]

    def close(self) -> None:
        try:
            self._view.release()
            self._map.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with that, or the process
            pass
        os.close(self._fd)

    def __reduce__(self):
        """Pickled for a spawned process: the descriptor travels with it (multiprocessing passes it on)."""
        from multiprocessing.reduction import DupFd

        return _attach, (DupFd(self._fd), self.size)


def _anonymous_file() -> int:
    """A memfd; where there is none (not Linux), an unlinked temporary file, shared the same way."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("kvfleet-kv-arena", os.MFD_CLOEXEC)
    fd, path = tempfile.mkstemp(prefix="kvfleet-kv-arena-")
    os.unlink(path)
    return fd


def _attach(dup, size: int) -> Arena:
    return Arena(size, dup.detach())


class Regions:
    """Which bytes of an arena are lent out: first fit, neighbours merged on free."""

    def __init__(self, size: int):
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, size), sorted by offset, never adjacent
        self._used: dict[int, int] = {}  # offset -> size

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def alloc(self, size: int) -> int | None:
        """The offset of `size` free bytes (rounded up to ALIGN), or None while no free run is that long."""
        if size <= 0:
            raise ValueError(f"a region needs at least one byte, not {size}")
        size = -(-size // ALIGN) * ALIGN
        for i, (off, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, length - size)
                self._used[off] = size
                return off
        return None

    def free(self, offset: int) -> None:
        size = self._used.pop(offset)
        i = bisect.bisect_left(self._free, (offset, 0))
        start, end = offset, offset + size
        if i < len(self._free) and self._free[i][0] == end:  # merge with the run after
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:  # and the one before
            start = self._free[i - 1][0]
            self._free[i - 1] = (start, end - start)
        else:
            self._free.insert(i, (start, end - start))
