"""What an engine tells routers about its prefix cache, as values: events, the snapshot, the heartbeat.

Every event carries the engine's next sequence number (strictly increasing from 1). A subscriber first gets
a `Snapshot` (every cached block hash as of `seq`), then the events numbered seq+1, seq+2, ...; a
`Heartbeat` repeats the newest number sent. `follows` says whether a message may come next; when it may
not, events were missed and the subscriber needs a new snapshot. kv_wire.py encodes these as NDJSON lines.
An engine with a lower tier (host memory or disk, engine/kv/tier.py) announces the blocks it keeps there with
their `medium`: a hit there costs a reload, not a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class KVEventKind(str, Enum):
    STORED = "stored"  # full blocks entered the prefix cache
    REMOVED = "removed"  # blocks were evicted from it
    CLEARED = "cleared"  # the whole prefix cache was reset


@dataclass(frozen=True)
class KVEvent:
    seq: int
    kind: KVEventKind
    block_hashes: tuple[int, ...] = ()
    parent_hash: int | None = None  # for STORED: the hash the first stored block chains on (None: block 0)
    lora_name: str | None = None  # for STORED: the LoRA adapter the blocks were computed under (None: the base)
    medium: str | None = None  # where the blocks are: None the engine's KV cache; "CPU" / "DISK" its lower tier


@dataclass(frozen=True)
class Snapshot:
    seq: int  # the newest event the snapshot includes
    block_size: int
    hash_seed: int
    block_hashes: tuple[int, ...]
    tiers: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (medium, hashes) the engine's lower tier holds


@dataclass(frozen=True)
class Heartbeat:
    seq: int  # the newest event sent so far


KVMessage = Snapshot | KVEvent | Heartbeat


def follows(last_seq: int, message: KVMessage) -> bool:
    """Whether message may come after the event numbered last_seq without anything missed in between."""
    if isinstance(message, Snapshot):
        return True
    if isinstance(message, Heartbeat):
        return message.seq == last_seq
    return message.seq == last_seq + 1
