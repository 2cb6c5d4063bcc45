"""router/epp/wire.py: what the picker reads from ext_proc requests and the responses it writes, exactly."""

from __future__ import annotations

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from router.epp import wire
from router.refusal import refuse


def _md(namespace: str, values: dict) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update(values)
    return base_pb2.Metadata(filter_metadata={namespace: s})


def test_headers_are_read_from_raw_value_or_value_and_lower_cased():
    h = ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
        base_pb2.HeaderValue(key="X-LLM-D-Inference-Fairness-Id", value="team-a")]))
    pairs = wire.header_pairs(h)
    assert pairs == [(b":path", b"/v1/chat/completions"), (b"x-llm-d-inference-fairness-id", b"team-a")]
    assert wire.header(pairs, wire.FAIRNESS_ID) == "team-a"
    assert wire.header(pairs, wire.OBJECTIVE) is None


@pytest.mark.parametrize("value, expected", [
    (["10.0.0.1:8000", "10.0.0.2:8000"], ["10.0.0.1:8000", "10.0.0.2:8000"]),
    ("10.0.0.1:8000, 10.0.0.2:8001", ["10.0.0.1:8000", "10.0.0.2:8001"]),
    ([], []),
    ("", []),
])
def test_subset_hint_as_a_list_or_a_comma_separated_string(value, expected):
    assert wire.subset_hint(_md(wire.SUBSET_NAMESPACE, {wire.SUBSET: value})) == expected


def test_no_subset_hint_is_none_not_empty():
    assert wire.subset_hint(base_pb2.Metadata()) is None
    assert wire.subset_hint(_md(wire.SUBSET_NAMESPACE, {"other": "x"})) is None


def test_served_endpoint_from_envoy_lb():
    assert wire.served_endpoint(_md(wire.LB_NAMESPACE, {wire.SERVED: "10.0.0.2:8000"})) == "10.0.0.2:8000"
    assert wire.served_endpoint(base_pb2.Metadata()) is None


def test_endpoints_of_replica_urls():
    assert wire.endpoint_of("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert wire.endpoint_of("http://[fd00::5]:8000") == "[fd00::5]:8000"
    assert wire.urls_by_endpoint(["http://10.0.0.5:8000", "http://10.0.0.5:8001"]) == {
        "10.0.0.5:8000": "http://10.0.0.5:8000", "10.0.0.5:8001": "http://10.0.0.5:8001"}


def test_picked_names_the_same_destination_in_the_header_and_the_metadata():
    r = wire.picked(["10.0.0.1:8000", "10.0.0.2:8000"], {"content-length": "12"}, ["x-kvfleet-kv-pull"])
    common = r.request_headers.response
    assert common.clear_route_cache
    assert wire.destination_of(r) == ("10.0.0.1:8000,10.0.0.2:8000", "10.0.0.1:8000,10.0.0.2:8000")
    assert [(h.header.key, h.header.raw_value) for h in common.header_mutation.set_headers] == [
        (wire.DESTINATION, b"10.0.0.1:8000,10.0.0.2:8000"), ("content-length", b"12")]
    assert list(common.header_mutation.remove_headers) == ["x-kvfleet-kv-pull"]
    with pytest.raises(ValueError):
        wire.picked([])


def test_body_goes_back_in_chunks_of_at_most_62000_bytes_end_of_stream_on_the_last():
    body = bytes(range(256)) * 500  # 128,000 bytes
    chunks = wire.body_chunks(body)
    streamed = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert [len(s.body) for s in streamed] == [62_000, 62_000, 4_000]
    assert [s.end_of_stream for s in streamed] == [False, False, True]
    assert b"".join(s.body for s in streamed) == body
    empty = wire.body_chunks(b"", request=False)
    assert len(empty) == 1 and empty[0].response_body.response.body_mutation.streamed_response.end_of_stream


def test_a_refusal_becomes_an_immediate_response():
    r = wire.immediate(refuse(429, "shed", "shed", None, "overloaded", [(b"retry-after", b"2")]))
    ir = r.immediate_response
    assert ir.status.code == 429
    assert json.loads(ir.body)["error"]["code"] == "overloaded"
    hdrs = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
    assert hdrs == {"content-type": b"application/json", "retry-after": b"2", wire.DROPPED_REASON: b"shed"}
    assert wire.immediate(refuse(503, "none", "no_replica")).immediate_response.status.code == 503
