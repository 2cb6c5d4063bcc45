"""The Gateway API Inference Extension's endpoint picker protocol over Envoy ext_proc, as pure functions: what
the picker reads from a ProcessingRequest and the ProcessingResponses it writes. The types are Envoy's own
generated protos (PyPI `xds-protos`); nothing here does I/O.

  request headers / body chunks  -> pick -> HeadersResponse (clear_route_cache, x-gateway-destination-endpoint
                                            = primary[,fallback...]; the same value in dynamic metadata
                                            envoy.lb) + the body back as streamed mutations (<= 62,000 bytes each)
  subset hint   metadata_context.filter_metadata["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]
  served        metadata_context.filter_metadata["envoy.lb"]["x-gateway-destination-endpoint-served"]
  refused       ImmediateResponse (503: nothing eligible; 429: shed)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from router.refusal import Refusal

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
DROPPED_REASON = "x-llm-d-request-dropped-reason"
# request headers llm-d's picker reads
OBJECTIVE = "x-llm-d-inference-objective"
FAIRNESS_ID = "x-llm-d-inference-fairness-id"
MODEL_REWRITE = "x-llm-d-model-name-rewrite"
MAX_BODY_CHUNK = 62_000  # bytes per streamed body mutation (Envoy's limit on one ext_proc message, with room)


# -- reading -------------------------------------------------------------------------------------------------
def header_pairs(headers: ep.HttpHeaders) -> list[tuple[bytes, bytes]]:
    """The request's headers as (name, value) byte pairs, names lower-case (Envoy sends raw_value; value where an
    older one sends that)."""
    out = []
    for h in headers.headers.headers:
        value = h.raw_value if h.raw_value else h.value.encode("latin-1")
        out.append((h.key.lower().encode("latin-1"), value))
    return out


def header(pairs: Iterable[tuple[bytes, bytes]], name: str) -> str | None:
    key = name.encode("latin-1")
    return next((v.decode("latin-1") for k, v in pairs if k == key), None)


def _metadata_value(md: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    if namespace not in md.filter_metadata:
        return None
    fields = md.filter_metadata[namespace].fields
    return fields[key] if key in fields else None


def subset_hint(md: base_pb2.Metadata) -> list[str] | None:
    """The endpoints the gateway allows for this request (None: no hint, any of the pool's). A list of strings, or
    one comma-separated string; an empty one is an empty subset (nothing is eligible)."""
    v = _metadata_value(md, SUBSET_NAMESPACE, SUBSET)
    if v is None:
        return None
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        items = [x.string_value for x in v.list_value.values if x.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = v.string_value.split(",")
    else:
        items = []
    return [s.strip() for s in items if s.strip()]


def served_endpoint(md: base_pb2.Metadata) -> str | None:
    """The endpoint that served the request, as the gateway reports it on the response."""
    v = _metadata_value(md, LB_NAMESPACE, SERVED)
    if v is None or v.WhichOneof("kind") != "string_value":
        return None
    return v.string_value.split(",")[0].strip() or None


def status_code(headers: ep.HttpHeaders) -> int | None:
    raw = header(header_pairs(headers), ":status")
    return int(raw) if raw is not None and raw.isdigit() else None


# -- endpoints and replica URLs --------------------------------------------------------------------------------
def endpoint_of(url: str) -> str:
    """http://10.0.0.5:8000 -> 10.0.0.5:8000 (http://[fd00::5]:8000 -> [fd00::5]:8000): what the gateway's
    ORIGINAL_DST cluster connects to."""
    return urlsplit(url).netloc


def urls_by_endpoint(urls: Iterable[str]) -> dict[str, str]:
    return {endpoint_of(u): u for u in urls}


# -- writing ---------------------------------------------------------------------------------------------------
def _header_option(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode("latin-1")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def destination_value(endpoints: Sequence[str]) -> str:
    """primary[,fallback...]: what both the header and the metadata carry (they must never differ)."""
    if not endpoints:
        raise ValueError("a destination names at least one endpoint")
    return ",".join(endpoints)


def picked(endpoints: Sequence[str], set_headers: Mapping[str, str] = {},
           remove_headers: Sequence[str] = ()) -> ep.ProcessingResponse:
    """The request headers' answer once an endpoint is picked: route cache cleared, the destination in the
    header and in dynamic metadata envoy.lb (one value), and the edge's other header changes."""
    value = destination_value(endpoints)
    mutation = ep.HeaderMutation(set_headers=[_header_option(DESTINATION, value)]
                                 + [_header_option(k, v) for k, v in set_headers.items()],
                                 remove_headers=list(remove_headers))
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DESTINATION: value}})
    return ep.ProcessingResponse(
        request_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation,
                                                                       clear_route_cache=True)),
        dynamic_metadata=md)


def destination_of(resp: ep.ProcessingResponse) -> tuple[str | None, str | None]:
    """The destination a picked() response names in its header and in its metadata (for checks and tests)."""
    hv = next((h.header.raw_value.decode("latin-1") or h.header.value
               for h in resp.request_headers.response.header_mutation.set_headers if h.header.key == DESTINATION),
              None)
    md = resp.dynamic_metadata.fields
    mv = md[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value \
        if LB_NAMESPACE in md and DESTINATION in md[LB_NAMESPACE].struct_value.fields else None
    return hv, mv


def body_chunks(body: bytes, end_of_stream: bool = True, *, request: bool = True) -> list[ep.ProcessingResponse]:
    """`body` as streamed body mutations of at most MAX_BODY_CHUNK bytes, end of stream on the last (when
    `end_of_stream`); an empty body is one empty chunk."""
    parts = [body[i:i + MAX_BODY_CHUNK] for i in range(0, len(body), MAX_BODY_CHUNK)] or [b""]
    out = []
    for i, part in enumerate(parts):
        streamed = ep.StreamedBodyResponse(body=part, end_of_stream=end_of_stream and i == len(parts) - 1)
        common = ep.CommonResponse(body_mutation=ep.BodyMutation(streamed_response=streamed))
        out.append(ep.ProcessingResponse(request_body=ep.BodyResponse(response=common)) if request
                   else ep.ProcessingResponse(response_body=ep.BodyResponse(response=common)))
    return out


def response_headers(set_headers: Mapping[str, str] = {}) -> ep.ProcessingResponse:
    mutation = ep.HeaderMutation(set_headers=[_header_option(k, v) for k, v in set_headers.items()])
    return ep.ProcessingResponse(response_headers=ep.HeadersResponse(
        response=ep.CommonResponse(header_mutation=mutation)))


def trailers(request: bool) -> ep.ProcessingResponse:
    return (ep.ProcessingResponse(request_trailers=ep.TrailersResponse()) if request
            else ep.ProcessingResponse(response_trailers=ep.TrailersResponse()))


def immediate(refusal: Refusal) -> ep.ProcessingResponse:
    """The gateway answers the client itself: the refusal's status, OpenAI error body and headers."""
    hdrs = [_header_option("content-type", "application/json")]
    hdrs += [_header_option(k.decode("latin-1"), v.decode("latin-1")) for k, v in refusal.headers]
    if refusal.status == 429:
        hdrs.append(_header_option(DROPPED_REASON, refusal.outcome))
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=refusal.status), headers=ep.HeaderMutation(set_headers=hdrs),
        body=json.dumps(refusal.body).encode(), details=refusal.outcome))
