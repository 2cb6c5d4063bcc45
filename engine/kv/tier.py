"""The lower KV tier: blocks evicted from the engine's KV cache kept in a larger, slower store, by hash.

    tier = KVTier(capacity_bytes, path=None)     # host memory; with a path: files in that directory
    dropped = tier.put(h, tokens, lora, payload)  # the hashes it let go (least recently used) to make room
    entry = tier.get(h)                           # (tokens, lora, payload) or None; refreshes its recency

A GPU machine keeps them in host memory ("CPU"), a CPU machine on local disk ("DISK": one file per block, written
through the page cache). The directory is emptied when the tier opens: blocks of an earlier run may have been
computed by other weights. engine/kv/offload.py moves blocks between the cache and the tier.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class TierEntry:
    tokens: tuple[int, ...]
    lora: str | None
    nbytes: int


class KVTier:
    def __init__(self, capacity_bytes: int, path: str | None = None):
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.path = path
        self.medium = "CPU" if path is None else "DISK"
        self._entries: OrderedDict[int, TierEntry] = OrderedDict()
        self._memory: dict[int, bytes] = {}
        self.used_bytes = 0
        if path is not None:
            if os.path.isdir(path):
                shutil.rmtree(path)
            os.makedirs(path)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[int]:
        return list(self._entries)

    def put(self, block_hash: int, tokens: tuple[int, ...], lora: str | None, payload: bytes) -> list[int]:
        """Keep a block (replacing an older copy); returns the hashes dropped to make room (not this one, unless it
        is larger than the whole tier)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return []
        if len(payload) > self.capacity_bytes:
            return []
        dropped: list[int] = []
        while self.used_bytes + len(payload) > self.capacity_bytes:
            old, entry = self._entries.popitem(last=False)
            self._delete(old)
            self.used_bytes -= entry.nbytes
            dropped.append(old)
        if self.path is None:
            self._memory[block_hash] = payload
        else:
            with open(self._file(block_hash), "wb") as f:
                f.write(payload)
        self._entries[block_hash] = TierEntry(tokens, lora, len(payload))
        self.used_bytes += len(payload)
        return dropped

    def get(self, block_hash: int) -> tuple[TierEntry, bytes] | None:
        entry = self._entries.get(block_hash)
        if entry is None:
            return None
        self._entries.move_to_end(block_hash)
        if self.path is None:
            return entry, self._memory[block_hash]
        with open(self._file(block_hash), "rb") as f:
            return entry, f.read()

    def adapter_hashes(self, lora: str) -> list[int]:
        return [h for h, e in self._entries.items() if e.lora == lora]

    def drop(self, block_hash: int) -> bool:
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        self._delete(block_hash)
        self.used_bytes -= entry.nbytes
        return True

    def clear(self) -> list[int]:
        gone = list(self._entries)
        for h in gone:
            self._delete(h)
        self._entries.clear()
        self.used_bytes = 0
        return gone

    def _delete(self, block_hash: int) -> None:
        if self.path is None:
            self._memory.pop(block_hash, None)
        else:
            try:
                os.unlink(self._file(block_hash))
            except FileNotFoundError:
                pass

    def _file(self, block_hash: int) -> str:
        assert self.path is not None
        return os.path.join(self.path, f"{block_hash:032x}.kv")
