"""The KV event wire format (GET /v1/kv/events): one JSON object per line, hashes as 32-char lowercase hex.

    {"type":"snapshot","instance_id":I,"seq":S,"block_size":B,"hash_seed":H,"block_hashes":[...][,"tiers":{M:[...]}]}
    {"type":"stored","instance_id":I,"seq":S,"block_hashes":[...],"parent_hash":hex|null[,"lora_name":str][,"medium":M]}
    {"type":"removed","instance_id":I,"seq":S,"block_hashes":[...][,"medium":M]}

`medium` (absent: the engine's KV cache) names a lower tier ("CPU", "DISK"); a snapshot's `tiers` lists what
each lower tier holds.
    {"type":"cleared","instance_id":I,"seq":S}
    {"type":"heartbeat","instance_id":I,"seq":S}

The engine encodes with `encode_line`, routers decode with `decode_line`; a malformed line raises
KVWireError saying what is wrong with it.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from contract.kv_events import Heartbeat, KVEvent, KVEventKind, KVMessage, Snapshot

_HASH_LIMIT = 1 << 128


class KVWireError(ValueError):
    """A KV event line that does not follow the wire format."""


class KVLine(NamedTuple):
    instance_id: str
    message: KVMessage


def encode_line(instance_id: str, message: KVMessage) -> bytes:
    """One NDJSON line (newline included)."""
    if isinstance(message, Snapshot):
        obj = {"type": "snapshot", "instance_id": instance_id, "seq": message.seq,
               "block_size": message.block_size, "hash_seed": message.hash_seed,
               "block_hashes": _hex_list(message.block_hashes)}
        if message.tiers:
            obj["tiers"] = {medium: _hex_list(hashes) for medium, hashes in message.tiers}
    elif isinstance(message, Heartbeat):
        obj = {"type": "heartbeat", "instance_id": instance_id, "seq": message.seq}
    else:
        obj = {"type": message.kind.value, "instance_id": instance_id, "seq": message.seq}
        if message.kind is not KVEventKind.CLEARED:
            obj["block_hashes"] = _hex_list(message.block_hashes)
        if message.kind is KVEventKind.STORED:
            obj["parent_hash"] = None if message.parent_hash is None else _hex(message.parent_hash)
            if message.lora_name is not None:  # blocks of a LoRA adapter (vLLM's BlockStored.lora_name)
                obj["lora_name"] = message.lora_name
        if message.medium is not None:
            obj["medium"] = message.medium
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def decode_line(line: str | bytes) -> KVLine:
    try:
        obj = json.loads(line)
    except (UnicodeDecodeError, ValueError) as e:
        raise KVWireError(f"KV event line is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise KVWireError(f"a KV event line must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("type")
    instance_id = obj.get("instance_id")
    if not isinstance(instance_id, str):
        raise KVWireError(f"{kind} event: instance_id must be a string, got {instance_id!r}")
    seq = _int(obj, "seq", 0)
    if kind == "snapshot":
        message: KVMessage = Snapshot(seq, _int(obj, "block_size", 1), _int(obj, "hash_seed", 0), _hashes(obj),
                                      _tiers(obj))
    elif kind == "heartbeat":
        message = Heartbeat(seq)
    elif kind == "stored":
        parent = obj.get("parent_hash")
        lora_name = obj.get("lora_name")
        if lora_name is not None and not isinstance(lora_name, str):
            raise KVWireError(f"stored event: lora_name must be a string or absent, got {lora_name!r}")
        message = KVEvent(seq, KVEventKind.STORED, _hashes(obj),
                          None if parent is None else _parse_hash(obj, "parent_hash", parent), lora_name, _medium(obj))
    elif kind == "removed":
        message = KVEvent(seq, KVEventKind.REMOVED, _hashes(obj), medium=_medium(obj))
    elif kind == "cleared":
        message = KVEvent(seq, KVEventKind.CLEARED)
    else:
        raise KVWireError(f"unknown KV event type {kind!r}")
    return KVLine(instance_id, message)


def _medium(obj: dict) -> str | None:
    medium = obj.get("medium")
    if medium is not None and (not isinstance(medium, str) or not medium):
        raise KVWireError(f"{obj.get('type')} event: medium must be a non-empty string or absent, got {medium!r}")
    return medium


def _tiers(obj: dict) -> tuple[tuple[str, tuple[int, ...]], ...]:
    raw = obj.get("tiers", {})
    if not isinstance(raw, dict):
        raise KVWireError(f"snapshot: tiers must be an object of medium -> hashes, got {raw!r}")
    out = []
    for medium, hashes in raw.items():
        if not isinstance(hashes, list):
            raise KVWireError(f"snapshot: tiers.{medium} must be a list, got {hashes!r}")
        out.append((medium, tuple(_parse_hash(obj, f"tiers.{medium}", h) for h in hashes)))
    return tuple(out)


def _hex(h: int) -> str:
    return f"{h:032x}"


def _hex_list(hashes: tuple[int, ...]) -> list[str]:
    return [f"{h:032x}" for h in hashes]


def _int(obj: dict, field: str, minimum: int) -> int:
    value = obj.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise KVWireError(f"{obj.get('type')} event: {field} must be an integer >= {minimum}, got {value!r}")
    return value


def _hashes(obj: dict) -> tuple[int, ...]:
    raw = obj.get("block_hashes")
    if not isinstance(raw, list):
        raise KVWireError(f"{obj.get('type')} event: block_hashes must be a list, got {raw!r}")
    return tuple(_parse_hash(obj, "block_hashes", h) for h in raw)


def _parse_hash(obj: dict, field: str, raw: object) -> int:
    try:
        if not isinstance(raw, str):
            raise ValueError
        value = int(raw, 16)
        if not 0 <= value < _HASH_LIMIT:
            raise ValueError
    except ValueError:
        raise KVWireError(f"{obj.get('type')} event: {field} must hold 128-bit hex strings, got {raw!r}") from None
    return value
