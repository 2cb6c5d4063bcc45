"""A gateway in miniature: it speaks ext_proc to the endpoint picker exactly as the Inference Extension's Envoy
configuration does (request and response headers SEND, bodies FULL_DUPLEX_STREAMED, trailers SEND; an
ORIGINAL_DST upstream keyed on x-gateway-destination-endpoint), over a real gRPC channel, then sends the request
to the endpoint it was given - the next one of the list when one cannot be reached, as Envoy's retries do - and
streams the answer back through the picker, reporting the endpoint that served in envoy.lb.

    gw = Gateway("127.0.0.1:9002")
    got = gw.send("/v1/chat/completions", {...}, subset=["127.0.0.1:8001"])
    got.status, got.body, got.endpoints, got.served, got.headers
"""

from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass, field

import grpc
import httpx
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

DESTINATION = "x-gateway-destination-endpoint"
TIMEOUT_S = 120.0


@dataclass
class Result:
    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    endpoints: list[str] = field(default_factory=list)  # what the picker named: primary, then fallbacks
    served: str | None = None  # the endpoint that answered
    upstream_body: bytes = b""  # what the picker sent on as the request body
    metadata_destination: str | None = None
    header_destination: str | None = None
    chunks: int = 0  # streamed body mutations the request body came back in

    def json(self):
        return json.loads(self.body)


def _headers(pairs: dict[str, str], end_of_stream: bool) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]), end_of_stream=end_of_stream)


def _metadata(namespace: str, values: dict) -> base_pb2.Metadata:
    s = struct_pb2.Struct()
    s.update(values)
    return base_pb2.Metadata(filter_metadata={namespace: s})


class _Stream:
    """One Process stream: requests go in through a queue, responses are read by a thread into another."""

    def __init__(self, stub):
        self.outbox: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.call = stub.Process(iter(self.outbox.get, None), timeout=TIMEOUT_S)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for r in self.call:
                self.inbox.put(r)
        except grpc.RpcError as e:
            self.inbox.put(e)
        self.inbox.put(None)

    def put(self, msg: ep.ProcessingRequest) -> None:
        self.outbox.put(msg)

    def get(self) -> ep.ProcessingResponse:
        r = self.inbox.get(timeout=TIMEOUT_S)
        if r is None or isinstance(r, grpc.RpcError):
            raise AssertionError(f"the picker's stream ended: {r}")
        return r

    def close(self) -> None:
        self.outbox.put(None)
        self.reader.join(timeout=10)


class Gateway:
    def __init__(self, address: str, chunk_bytes: int = 700):
        self.channel = grpc.insecure_channel(address)
        self.stub = ep_grpc.ExternalProcessorStub(self.channel)
        self.chunk_bytes = chunk_bytes  # the client's body reaches the picker in pieces this big

    def close(self) -> None:
        self.channel.close()

    def send(self, path: str, body: dict | bytes, headers: dict[str, str] | None = None,
             subset: list[str] | str | None = None, method: str = "POST") -> Result:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        stream = _Stream(self.stub)
        try:
            return self._exchange(stream, path, raw, headers or {}, subset, method)
        finally:
            stream.close()

    def _exchange(self, s: _Stream, path: str, raw: bytes, headers: dict[str, str], subset, method: str) -> Result:
        req_headers = {":method": method, ":path": path, ":authority": "gateway", ":scheme": "http",
                       "content-type": "application/json", "content-length": str(len(raw)), **headers}
        md = _metadata("envoy.lb.subset_hint", {"x-gateway-destination-endpoint-subset": subset}) \
            if subset is not None else base_pb2.Metadata()
        s.put(ep.ProcessingRequest(request_headers=_headers(req_headers, end_of_stream=not raw), metadata_context=md))
        parts = [raw[i:i + self.chunk_bytes] for i in range(0, len(raw), self.chunk_bytes)]
        for i, part in enumerate(parts):
            s.put(ep.ProcessingRequest(request_body=ep.HttpBody(body=part, end_of_stream=i == len(parts) - 1)))
        first = s.get()
        if first.HasField("immediate_response"):
            ir = first.immediate_response
            return Result(int(ir.status.code), bytes(ir.body),
                          {h.header.key: h.header.raw_value.decode() for h in ir.headers.set_headers})
        if not first.HasField("request_headers"):
            raise AssertionError(f"the picker answered the request headers with {first.WhichOneof('response')}")
        common = first.request_headers.response
        assert common.clear_route_cache, "the picker must clear the route cache"
        mutated = dict(req_headers)
        # Envoy's ext_proc applies remove_headers first, then set_headers (MutationUtils::applyHeaderMutations)
        for k in common.header_mutation.remove_headers:
            mutated.pop(k, None)
        for h in common.header_mutation.set_headers:
            mutated[h.header.key] = h.header.raw_value.decode() or h.header.value
        header_value = mutated.get(DESTINATION)
        lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
        md_value = lb[DESTINATION].string_value if DESTINATION in lb else None
        upstream, chunks = b"", 0
        if raw:
            while True:  # the body comes back as streamed mutations, end of stream on the last
                r = s.get()
                streamed = r.request_body.response.body_mutation.streamed_response
                upstream += streamed.body
                chunks += 1
                if streamed.end_of_stream:
                    break
        endpoints = header_value.split(",") if header_value else []
        result = Result(0, b"", endpoints=endpoints, upstream_body=upstream, metadata_destination=md_value,
                        header_destination=header_value, chunks=chunks)
        send_headers = {k: v for k, v in mutated.items() if not k.startswith(":") and k != DESTINATION
                        and k != "content-length"}
        with httpx.Client(timeout=TIMEOUT_S) as client:
            for endpoint in endpoints:  # ORIGINAL_DST with retries: down the list until one answers
                try:
                    with client.stream(method, f"http://{endpoint}{path}", content=upstream,
                                       headers=send_headers) as resp:
                        result.served = endpoint
                        self._respond(s, resp, endpoint, result)
                        return result
                except httpx.ConnectError:
                    continue
        # no endpoint took it: the gateway answers 503 itself
        result.status, result.body = 503, b"no healthy upstream"
        return result

    def _respond(self, s: _Stream, resp: httpx.Response, endpoint: str, result: Result) -> None:
        pairs = {":status": str(resp.status_code), **{k: v for k, v in resp.headers.items()}}
        s.put(ep.ProcessingRequest(response_headers=_headers(pairs, end_of_stream=False),
                                   metadata_context=_metadata("envoy.lb", {
                                       "x-gateway-destination-endpoint-served": endpoint})))
        r = s.get()
        assert r.HasField("response_headers"), r
        headers = dict(resp.headers)
        for h in r.response_headers.response.header_mutation.set_headers:
            headers[h.header.key] = h.header.raw_value.decode() or h.header.value
        body = b""
        sent = 0
        for chunk in resp.iter_raw():
            s.put(ep.ProcessingRequest(response_body=ep.HttpBody(body=chunk, end_of_stream=False)))
            sent += 1
        s.put(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)))
        while True:
            r = s.get()
            streamed = r.response_body.response.body_mutation.streamed_response
            body += streamed.body
            if streamed.end_of_stream:
                break
        result.status, result.body, result.headers = resp.status_code, body, headers


def health(address: str, service: str = "readiness", timeout: float = 2.0) -> str:
    """The picker's gRPC health for `service`: SERVING, NOT_SERVING, ... (UNAVAILABLE when it does not answer)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(got.status)


def wait_serving(address: str, proc=None, timeout: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.popen.poll() is not None:
            raise RuntimeError(f"the picker exited with {proc.popen.returncode}:\n{proc.tail()}")
        if health(address) == "SERVING":
            return
        time.sleep(0.1)
    raise TimeoutError(f"the picker at {address} is not SERVING after {timeout}s" +
                       (f":\n{proc.tail()}" if proc is not None else ""))
