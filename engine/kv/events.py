"""The KV event log: what the prefix cache stored and dropped, in order, for routers to mirror.

Every event gets the next sequence number (strictly increasing, starting at 1). The engine drains
the log after each step and publishes the events; a subscriber pairs `snapshot()` of the cache with
`last_seq` and then applies events with larger numbers. If nobody drains for a long time the
oldest pending events are dropped: the numbers they had are skipped, so a subscriber sees a gap
and asks for a new snapshot.
"""

from __future__ import annotations

from collections import deque

from contract.kv_events import KVEvent, KVEventKind


class KVEventLog:
    def __init__(self, max_pending: int = 65536):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self._pending: deque[KVEvent] = deque()
        self._max_pending = max_pending
        self.last_seq = 0  # number of the newest event recorded (drained or not)
        self.num_dropped = 0

    def stored(self, block_hashes: list[int], parent_hash: int | None, lora_name: str | None = None,
               medium: str | None = None) -> None:
        if block_hashes:
            self._record(KVEventKind.STORED, block_hashes, parent_hash, lora_name, medium)

    def removed(self, block_hashes: list[int], medium: str | None = None) -> None:
        if block_hashes:
            self._record(KVEventKind.REMOVED, block_hashes, None, None, medium)

    def cleared(self) -> None:
        self._record(KVEventKind.CLEARED, [], None)

    def drain_events(self) -> list[KVEvent]:
        """Every pending event, oldest first; the log is empty afterwards."""
        events = list(self._pending)
        self._pending.clear()
        return events

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def _record(self, kind: KVEventKind, block_hashes: list[int], parent_hash: int | None,
                lora_name: str | None = None, medium: str | None = None) -> None:
        self.last_seq += 1
        self._pending.append(KVEvent(self.last_seq, kind, tuple(block_hashes), parent_hash, lora_name, medium))
        if len(self._pending) > self._max_pending:
            self._pending.popleft()
            self.num_dropped += 1
