"""vLLM's KV event wire format, decoded: pure, no I/O (the subscriber is router/routing/vllm_kv_events.py).

SGLang publishes the same format (sglang/srt/disaggregation/kv_events.py, "the same encoding vLLM uses"), one
BlockStored per page, with its own optional fields: `cache_salt` on every block of a salted request, a
`session_id`, and token pairs instead of ids for EAGLE's bigram keys. This decoder takes both engines.

vLLM (vllm/distributed/kv_events.py, ZmqEventPublisher) publishes each scheduler step's cache changes as the
multipart message (topic, 8-byte big-endian seq, payload). The payload is msgspec msgpack of an array-like
[ts, events, data_parallel_rank] (trailing defaults may be omitted); each event a map tagged by "type":
BlockStored (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, and, when not
default, extra_keys, group_idx, ...), BlockRemoved (block_hashes, medium, ...), AllBlocksCleared. Hashes are
vLLM's ExternalBlockHash: 64-bit ints by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), sha256 bytes otherwise.
The replay socket answers (b"", topic, seq, payload) per buffered batch, then (b"", b"", END_SEQ, b"").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

VllmHash = int | bytes  # kept as given: a hashable key
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay socket's end-of-replay marker


class VllmEventError(ValueError):
    """A frame that is not a vLLM KV event batch."""


@dataclass(frozen=True)
class Stored:
    block_hashes: tuple[VllmHash, ...]
    parent_block_hash: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    cache_salt: str | None = None
    medium: str | None = None
    lora_name: str | None = None
    # the blocks' vLLM hashes also cover inputs kvfleet's hash does not see (multimodal items, prompt embeds)
    foreign_inputs: bool = False


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    pass


VllmEvent = Stored | Removed | Cleared


@dataclass(frozen=True)
class VllmBatch:
    seq: int
    events: tuple[VllmEvent, ...]
    unknown: int = 0  # events of a type this decoder does not know, ignored


def decode_batch(seq_bytes: bytes, payload: bytes) -> VllmBatch:
    """One published batch: its 8-byte big-endian sequence number and msgpack payload."""
    if len(seq_bytes) != 8:
        raise VllmEventError(f"seq: expected 8 bytes, got {len(seq_bytes)}")
    try:
        batch = msgpack.unpackb(payload, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise VllmEventError(f"payload: not msgpack ({e})") from e
    if not isinstance(batch, list) or len(batch) not in (2, 3):
        raise VllmEventError("payload: expected the array [ts, events, dp_rank]")
    if not isinstance(batch[1], list):
        raise VllmEventError("events: expected an array")
    events: list[VllmEvent] = []
    unknown = 0
    for i, raw in enumerate(batch[1]):
        if not isinstance(raw, dict):
            raise VllmEventError(f"events[{i}]: expected a map")
        kind = raw.get("type")
        if kind == "BlockStored":
            events.append(_stored(raw, f"events[{i}]"))
        elif kind == "BlockRemoved":
            events.append(Removed(_hashes(raw, f"events[{i}]"), _opt(raw, "medium", str, f"events[{i}]")))
        elif kind == "AllBlocksCleared":
            events.append(Cleared())
        else:
            unknown += 1
    return VllmBatch(int.from_bytes(seq_bytes, "big"), tuple(events), unknown)


def _is_hash(v: Any) -> bool:
    return isinstance(v, bytes) or (isinstance(v, int) and not isinstance(v, bool))


def _hashes(raw: dict, where: str) -> tuple[VllmHash, ...]:
    hashes = raw.get("block_hashes")
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes):
        raise VllmEventError(f"{where}.block_hashes: expected an array of ints or bytes")
    return tuple(hashes)


def _opt(raw: dict, key: str, typ: type, where: str) -> Any:
    v = raw.get(key)
    if v is not None and not isinstance(v, typ):
        raise VllmEventError(f"{where}.{key}: expected {typ.__name__} or nil, got {type(v).__name__}")
    return v


def _stored(raw: dict, where: str) -> Stored:
    hashes = _hashes(raw, where)
    parent = raw.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise VllmEventError(f"{where}.parent_block_hash: expected an int, bytes or nil")
    tokens = raw.get("token_ids")
    if not isinstance(tokens, list):
        raise VllmEventError(f"{where}.token_ids: expected an array of ints")
    bigram = bool(tokens) and all(_is_pair(t) for t in tokens)  # SGLang's EAGLE keys: not token ids we can hash
    if not bigram and not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise VllmEventError(f"{where}.token_ids: expected an array of ints")
    block_size = raw.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise VllmEventError(f"{where}.block_size: expected a positive int")
    lora_name = _opt(raw, "lora_name", str, where)
    salt, foreign = _extra_keys(_opt(raw, "extra_keys", list, where), lora_name, parent is None, where)
    salt = _opt(raw, "cache_salt", str, where) or salt  # SGLang names it; vLLM puts it in extra_keys
    if bigram:
        return Stored(hashes, parent, (), block_size, salt, _opt(raw, "medium", str, where), lora_name, True)
    return Stored(hashes, parent, tuple(tokens), block_size, salt, _opt(raw, "medium", str, where), lora_name,
                  foreign)


def _is_pair(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def _extra_keys(extra: list | None, lora_name: str | None, first_is_block_0: bool,
                where: str) -> tuple[str | None, bool]:
    """(cache_salt, foreign_inputs) from the per-block extra_keys.

    vLLM publishes them untagged, per block, in its hashing order: the LoRA name (every block, when the request
    has an adapter), (mm_identifier, offset) pairs, the cache_salt (block 0 of a request only) and prompt-embeds
    digests (bytes). So the salt is the str left in block 0's keys once the LoRA name is taken off."""
    salt, foreign = None, False
    for i, keys in enumerate(extra or ()):
        if keys is None:
            continue
        if not isinstance(keys, list):
            raise VllmEventError(f"{where}.extra_keys[{i}]: expected an array or nil")
        rest = keys[1:] if lora_name is not None and keys[:1] == [lora_name] else keys
        strs = [k for k in rest if isinstance(k, str)]
        foreign = foreign or len(strs) != len(rest)
        if strs and i == 0 and first_is_block_0 and len(strs) == 1:
            salt = strs[0]
        elif strs:
            foreign = True
    return salt, foreign
