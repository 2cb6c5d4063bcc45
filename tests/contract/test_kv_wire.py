"""The KV event wire codec: what the engine encodes the router decodes to the same values."""

from __future__ import annotations

import json

import pytest

from contract.kv_events import Heartbeat, KVEvent, KVEventKind, Snapshot, follows
from contract.kv_wire import KVLine, KVWireError, decode_line, encode_line

BIG = (1 << 128) - 1  # the largest 128-bit hash
H64 = (1 << 64) + 12345  # past 64 bits: must not be truncated to a JSON number

MESSAGES = [
    Snapshot(7, 16, (1 << 64) - 1, (1, H64, BIG)),
    Snapshot(0, 1, 0, ()),
    Snapshot(3, 16, 0, (1,), (("DISK", (2, BIG)),)),  # what a lower tier holds
    KVEvent(11, KVEventKind.STORED, (7,), None, None, "DISK"),
    KVEvent(12, KVEventKind.REMOVED, (7,), medium="CPU"),
    KVEvent(8, KVEventKind.STORED, (H64, BIG), None),
    KVEvent(9, KVEventKind.STORED, (5,), BIG),
    KVEvent(10, KVEventKind.REMOVED, (BIG, 0)),
    KVEvent(11, KVEventKind.CLEARED),
    Heartbeat(11),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_encode_then_decode_gives_the_same_message(message):
    line = encode_line("engine-a", message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_line(line) == KVLine("engine-a", message)
    assert decode_line(line.decode()) == KVLine("engine-a", message)


def test_the_wire_format_is_the_documented_one():
    assert encode_line("i", KVEvent(3, KVEventKind.STORED, (1, 2), None)) == (
        b'{"type":"stored","instance_id":"i","seq":3,"block_hashes":["00000000000000000000000000000001",'
        b'"00000000000000000000000000000002"],"parent_hash":null}\n')
    assert json.loads(encode_line("i", KVEvent(4, KVEventKind.REMOVED, (BIG,)))) == {
        "type": "removed", "instance_id": "i", "seq": 4, "block_hashes": ["f" * 32]}
    assert json.loads(encode_line("i", KVEvent(5, KVEventKind.CLEARED))) == {
        "type": "cleared", "instance_id": "i", "seq": 5}
    assert json.loads(encode_line("i", Snapshot(2, 16, 9, ()))) == {
        "type": "snapshot", "instance_id": "i", "seq": 2, "block_size": 16, "hash_seed": 9, "block_hashes": []}
    assert json.loads(encode_line("i", Heartbeat(5))) == {"type": "heartbeat", "instance_id": "i", "seq": 5}


@pytest.mark.parametrize("line, says", [
    (b"{not json", "not JSON"),
    (b"\xff\xfe", "not JSON"),
    (b"[1, 2]", "must be a JSON object, got list"),
    (b'{"type": "stored", "seq": 6, "block_hashes": []}', "instance_id must be a string"),
    (b'{"type": "stored", "instance_id": "i", "seq": 6, "block_hashes": "zz"}', "block_hashes must be a list"),
    (b'{"type": "stored", "instance_id": "i", "seq": 6, "block_hashes": ["not-hex"]}', "128-bit hex strings, got 'not-hex'"),
    (b'{"type": "stored", "instance_id": "i", "seq": 6, "block_hashes": [12]}', "128-bit hex strings, got 12"),
    (b'{"type": "stored", "instance_id": "i", "seq": 6, "block_hashes": ["1' + b"0" * 32 + b'"]}', "128-bit"),
    (b'{"type": "stored", "instance_id": "i", "seq": 6, "block_hashes": [], "parent_hash": "-1"}', "parent_hash"),
    (b'{"type": "stored", "instance_id": "i", "seq": "6", "block_hashes": []}', "seq must be an integer >= 0, got '6'"),
    (b'{"type": "heartbeat", "instance_id": "i", "seq": true}', "seq must be an integer"),
    (b'{"type": "exploded", "instance_id": "i", "seq": 6}', "unknown KV event type 'exploded'"),
    (b'{"type": "snapshot", "instance_id": "i", "seq": 1, "block_size": 0, "hash_seed": 0, "block_hashes": []}',
     "block_size must be an integer >= 1, got 0"),
])
def test_a_malformed_line_is_a_clear_error(line, says):
    with pytest.raises(KVWireError) as exc:
        decode_line(line)
    assert says in str(exc.value)


def test_follows_accepts_only_the_next_event_or_a_matching_heartbeat():
    assert follows(5, KVEvent(6, KVEventKind.CLEARED))
    assert not follows(5, KVEvent(7, KVEventKind.CLEARED))  # 6 is missing
    assert not follows(5, KVEvent(5, KVEventKind.CLEARED))
    assert follows(5, Heartbeat(5)) and not follows(5, Heartbeat(6))
    assert follows(5, Snapshot(1, 16, 0, ()))  # a snapshot starts over
