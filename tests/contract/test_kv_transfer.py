"""KV transfer wire format: frames survive any split of the byte stream, pull requests are validated naming the
field, and `verify` takes exactly the leading blocks that are the prompt's and refuses the first that is not."""

from __future__ import annotations

import dataclasses

import pytest

from contract.errors import ConfigError
from contract.hashing import hash_blocks
from contract.kv_transfer import (
    BlockFrame,
    FrameError,
    FrameReader,
    Layout,
    PullRequest,
    Refusal,
    end_frame,
    verify,
)

LAYOUT = Layout("smollm2", 4, "bfloat16", 2, 1, 2, 7)  # block_bytes = 2 * 2 * 4 * 1 * 2 * 2 = 64
PROMPT = list(range(100, 113))  # 3 full blocks of 4
HASHES = hash_blocks(PROMPT[:12], 4, None, 7)


def frame(first: int, n: int, **over) -> BlockFrame:
    f = BlockFrame(tuple(HASHES[first:first + n]), tuple(tuple(PROMPT[i * 4:(i + 1) * 4])
                                                           for i in range(first, first + n)),
                   None, bytes(range(64)) * n)
    return dataclasses.replace(f, **over)


def test_frames_decode_whatever_the_chunking():
    data = frame(0, 2).encode() + frame(2, 1).encode() + end_frame(3)
    for size in (1, 7, 64, len(data)):
        reader, got = FrameReader(), []
        for i in range(0, len(data), size):
            got += reader.feed(data[i:i + size])
        assert [f.hashes for f in got] == [tuple(HASHES[:2]), tuple(HASHES[2:])]
        assert got[0].payload == bytes(range(64)) * 2 and got[1].payload == bytes(range(64))
        assert reader.ended and reader.end_blocks == 3


def test_a_garbled_stream_is_a_frame_error():
    with pytest.raises(FrameError):
        FrameReader().feed(b"\x05\x00\x00\x00nope!")
    with pytest.raises(FrameError):
        FrameReader().feed(b"\xff\xff\xff\xff")  # a 4 GiB meta: refused before buffering it
    with pytest.raises(FrameError):
        FrameReader().feed(b"\x02\x00\x00\x00[]")  # JSON, but not an object with nbytes


def test_pull_request_round_trips_and_names_the_bad_field():
    req = PullRequest(tuple(HASHES), LAYOUT, 1 << 20, 2.5)
    assert PullRequest.from_json(req.to_json()) == req
    for body, field in ((b"[]", "body"), (b'{"hashes": [1]}', "hashes"), (b'{"hashes": ["zz"]}', "hashes"),
                        (b'{"hashes": [], "max_bytes": 0}', "max_bytes"),
                        (b'{"hashes": [], "max_bytes": 1, "wait_s": -1}', "wait_s"),
                        (b'{"hashes": [], "max_bytes": 1, "layout": {"model": "m"}}', "layout")):
        with pytest.raises(ConfigError) as e:
            PullRequest.from_json(body)
        assert e.value.field == field


def test_layout_mismatch_names_the_first_field_that_differs():
    assert LAYOUT.mismatch(LAYOUT) is None
    assert LAYOUT.mismatch(dataclasses.replace(LAYOUT, dtype="float32")) == "dtype"
    assert LAYOUT.mismatch(dataclasses.replace(LAYOUT, block_size=16, model="x")) == "model"
    assert LAYOUT.block_bytes == 64


def test_verify_takes_the_prompts_blocks_and_refuses_the_first_that_is_not():
    assert verify(frame(0, 3), LAYOUT, HASHES, PROMPT, 0, None, None, None) == (3, None)
    assert verify(frame(1, 2), LAYOUT, HASHES, PROMPT, 1, HASHES[0], None, None) == (2, None)
    bad_tokens = frame(0, 3, tokens=(tuple(PROMPT[0:4]), (1, 2, 3, 4), tuple(PROMPT[8:12])))
    assert verify(bad_tokens, LAYOUT, HASHES, PROMPT, 0, None, None, None) == (1, Refusal.TOKENS)
    other = hash_blocks([9, 9, 9, 9], 4, None, 7)[0]
    assert verify(frame(0, 2, hashes=(HASHES[0], other)), LAYOUT, HASHES, PROMPT, 0, None, None,
                  None) == (1, Refusal.HASH)
    # the right hashes over other tokens: the tokens are checked against the prompt first
    forged = frame(0, 1, tokens=((5, 5, 5, 5),))
    assert verify(forged, LAYOUT, HASHES, PROMPT, 0, None, None, None) == (0, Refusal.TOKENS)
    # a salted request's chain differs from the unsalted one the source holds
    salted = hash_blocks(PROMPT[:12], 4, "tenant", 7)
    assert verify(frame(0, 1), LAYOUT, salted, PROMPT, 0, None, "tenant", None) == (0, Refusal.HASH)
    assert verify(frame(0, 2, payload=b"x" * 100), LAYOUT, HASHES, PROMPT, 0, None, None, None) == (0, Refusal.SIZE)
    assert verify(frame(0, 1, lora="sql"), LAYOUT, HASHES, PROMPT, 0, None, None, None) == (0, Refusal.ADAPTER)
    assert verify(frame(2, 1), LAYOUT, HASHES, PROMPT, 0, None, None, None) == (0, Refusal.HASH)  # out of place
