"""The four drivers of the placement core decide alike: the HTTP router's Fleet (its state driven directly,
without HTTP, as test_lease.py does), the Ray request router's RoutingState (its KV events through its real
subscriptions, over in-memory streams in the engine's wire format), the simulator's router
(kvfleet/sim/router.py) and the endpoint picker (router/epp/: each request a whole ext_proc exchange through its
PickStream - headers, body, the picked destination, response headers naming the served endpoint, the body's end -
in memory, admission included) get the same sequence - KV snapshots, stored / removed / cleared blocks, load
scrapes, requests, finishes - and must return the same decision (replica, reason, predicted cached tokens, cost)
for every request, under each policy.

The sequence respects what all three can see: no first tokens (Serve reports none: a request is pending until
it finishes), and no request within 0.2 s before a scrape (the HTTP router and the simulator take requests
sent in the last 0.2 s before a scrape as not counted by it; Ray's stats carry no send time).
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from contract.hashing import DEFAULT_HASH_SEED
from contract.kv_events import KVEvent, KVEventKind, KVMessage, Snapshot
from contract.kv_wire import encode_line
from deploy.ray.route_hint import RouteHint
from deploy.ray.routing_state import RoutingState
from kvfleet.sim.router import SimRouter
from router.config import RouterConfig, ScoringConfig
from router.epp import wire
from router.epp.stream import PickerSettings, PickStream
from router.metrics import RouterMetrics
from router.requests.core import RouterCore
from router.requests.flow import Flow
from router.routing.fleet import DEFAULT_POOL, Fleet
from router.routing.kv_events import EventApplier
from router.routing.placement import HashedPrompt
from router.routing.policies import Decision
from router.routing.prepare import PreparedRequest
from router.routing.replicas import EngineLoad
from router.states import KVEventsState

BS, SEED = 16, DEFAULT_HASH_SEED
URLS = ["http://a:1", "http://b:1", "http://c:1"]


@dataclass(frozen=True)
class Scrape:
    url: str
    load: EngineLoad


@dataclass(frozen=True)
class Request:
    rid: str
    prep: PreparedRequest


# -- the three drivers, behind one small interface ------------------------------------------------------------
class FleetDriver:
    def __init__(self, policy: str):
        self.now = 0.0
        cfg = RouterConfig(replicas=tuple(URLS), policy=policy, scoring=ScoringConfig())
        self.fleet = Fleet(cfg, RouterMetrics(cfg.policy), lambda: self.now)
        self.leases: dict = {}
        self.appliers: dict[str, EventApplier] = {}

    async def join(self, t: float, snapshots: dict[str, Snapshot]) -> None:
        self.now = t
        p = self.fleet.placement  # what set_replicas and the first /ready checks do, without the I/O
        p.set_members(DEFAULT_POOL, URLS)
        for url in URLS:
            p.on_health(url, True, t)
        for url, snap in snapshots.items():
            await self.kv(url, snap)

    async def kv(self, url: str, message: KVMessage) -> None:
        if not self.fleet.policy.needs.kv_events:
            return  # no subscription
        applier = self.appliers.setdefault(url, EventApplier(url, self.fleet.index))  # as KVEventSubscriber
        assert applier.apply(message)
        if isinstance(message, Snapshot):
            self.fleet.placement.on_kv_events(url, KVEventsState.LIVE)

    def scrape(self, t: float, s: Scrape) -> None:
        self.now = t
        self.fleet.placement.on_load(s.url, s.load, t, t)  # as _scrape_loop, answered at once

    def request(self, t: float, r: Request) -> Decision:
        self.now = t
        lease = self.leases[r.rid] = self.fleet.lease(r.prep)
        return lease.decision

    def finish(self, t: float, rid: str) -> None:
        self.now = t
        lease = self.leases.pop(rid)
        lease.succeeded()
        lease.release()


class RayDriver:
    def __init__(self, policy: str):
        self.now = 0.0
        self.state = RoutingState(policy, stats_stale_s=3.0, heartbeat_timeout_s=60.0, clock=lambda: self.now)
        self.queues: dict[str, asyncio.Queue] = {}
        self.asked: dict[str, int] = {}  # per replica: lines its subscription has asked for
        self.sent: dict[str, int] = {}

    def open_stream(self, key: str):
        q = self.queues[key] = asyncio.Queue()
        self.asked[key] = self.sent[key] = 0

        async def gen():
            while True:
                self.asked[key] += 1
                yield await q.get()

        return gen()

    async def join(self, t: float, snapshots: dict[str, Snapshot]) -> None:
        self.now = t
        self.state.set_replicas(URLS, self.open_stream)
        for url, snap in snapshots.items():
            await self.kv(url, snap)

    async def kv(self, url: str, message: KVMessage) -> None:
        if url not in self.state.subscriptions:
            return  # the policy needs no KV events: no subscription
        await self._until(lambda: url in self.queues)  # the subscription's task has opened its stream
        self.queues[url].put_nowait(encode_line(url, message))
        self.sent[url] += 1
        await self._until(lambda: self.asked[url] > self.sent[url])  # it asks for the next line: this one is applied

    @staticmethod
    async def _until(cond) -> None:
        for _ in range(1000):
            if cond():
                return
            await asyncio.sleep(0)
        raise AssertionError("the KV subscription did not take its event")

    def scrape(self, t: float, s: Scrape) -> None:
        self.now = t
        ld = s.load
        self.state.on_stats(s.url, {"kv_usage": ld.kv_usage, "kv_tokens": ld.kv_tokens, "running": ld.running,
                                    "waiting": ld.waiting, "kv_capacity_tokens": ld.kv_capacity_tokens})

    def request(self, t: float, r: Request) -> Decision:
        self.now = t
        hint = RouteHint.of(r.prep, BS, SEED)
        d = self.state.choose(URLS, hint)
        self.state.on_routed(d.url, r.rid, hint, d.predicted_cached_tokens)  # Serve sends it where it was told
        return d

    def finish(self, t: float, rid: str) -> None:
        self.now = t
        self.state.on_completed(self.state.sent[rid][0], rid)


class SimDriver:
    def __init__(self, policy: str):
        self.router = SimRouter(policy, ScoringConfig(), BS, SEED)
        self.tickets: dict = {}

    async def join(self, t: float, snapshots: dict[str, Snapshot]) -> None:
        for url in URLS:
            snap = snapshots[url]
            self.router.join(url, t, snap.seq, snap.block_hashes)

    async def kv(self, url: str, message: KVMessage) -> None:
        if not isinstance(message, Snapshot):
            assert self.router.on_kv_events(url, [message])

    def scrape(self, t: float, s: Scrape) -> None:
        self.router.on_scrape(s.url, s.load, t)

    def request(self, t: float, r: Request) -> Decision:
        p = r.prep
        d, ticket = self.router.route(HashedPrompt(p.num_prompt_tokens, p.session_key, BS, SEED,
                                                   tuple(p.block_hashes(BS, SEED))), t)
        self.tickets[r.rid] = (d.url, ticket)
        return d

    def finish(self, t: float, rid: str) -> None:
        self.router.on_done(*self.tickets.pop(rid))


class _Requests:
    """The gateway's side of one ext_proc stream, in memory: an async iterator fed by put()."""

    def __init__(self):
        self.q: asyncio.Queue = asyncio.Queue()

    def put(self, msg) -> None:
        self.q.put_nowait(msg)

    def __aiter__(self):
        return self

    async def __anext__(self):
        msg = await self.q.get()
        if msg is None:
            raise StopAsyncIteration
        return msg


def _http_headers(pairs: dict[str, str], end_of_stream: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]), end_of_stream=end_of_stream)


class EppDriver:
    """The endpoint picker: its RouterCore's fleet fed as the Fleet driver's, each request one PickStream."""

    def __init__(self, policy: str):
        self.now = 0.0
        cfg = RouterConfig(replicas=tuple(URLS), policy=policy, scoring=ScoringConfig(), model=None,
                           default_model="m")
        self.core = RouterCore(cfg)
        self.core.fleet.clock = lambda: self.now
        self.core.need_tokens = True  # a picker with a tokenizer; the sequence's prompts are token ids
        self.flow = Flow(self.core)
        self.streams: dict[str, tuple[PickStream, _Requests, object]] = {}
        self.appliers: dict[str, EventApplier] = {}

    async def join(self, t: float, snapshots: dict[str, Snapshot]) -> None:
        self.now = t
        fleet = self.core.fleet
        p = fleet.placement

        async def set_replicas(urls, pool=DEFAULT_POOL):  # what Fleet.set_replicas does, without the checks' I/O
            p.set_members(pool, urls)

        fleet.set_replicas = set_replicas
        await self.core.pools.start()  # the pools' discovery (static) sets the members
        await asyncio.sleep(0)
        for url in URLS:
            p.on_health(url, True, t)
            p.on_models(url, frozenset({"m"}))  # as the health loop learns from /v1/models ...
        for listener in fleet.listeners:  # ... and tells the pools' catalog
            listener()
        for url, snap in snapshots.items():
            await self.kv(url, snap)

    async def close(self) -> None:
        await self.core.pools.stop()

    async def kv(self, url: str, message: KVMessage) -> None:
        fleet = self.core.fleet
        if not fleet.policy.needs.kv_events:
            return
        applier = self.appliers.setdefault(url, EventApplier(url, fleet.index))
        assert applier.apply(message)
        if isinstance(message, Snapshot):
            fleet.placement.on_kv_events(url, KVEventsState.LIVE)

    def scrape(self, t: float, s: Scrape) -> None:
        self.now = t
        self.core.fleet.placement.on_load(s.url, s.load, t, t)

    async def request(self, t: float, r: Request) -> Decision:
        self.now = t
        body = {"model": "m", "prompt": r.prep.token_ids, "max_tokens": 1, "stream": True}
        if r.prep.session_key is not None:
            body["user"] = r.prep.session_key
        raw = json.dumps(body).encode()
        stream, requests = PickStream(self.core, self.flow, PickerSettings()), _Requests()
        responses = stream.run(requests)
        requests.put(ep.ProcessingRequest(request_headers=_http_headers({":method": "POST", ":path": "/v1/completions"})))
        requests.put(ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=True)))
        picked = await responses.__anext__()
        header, metadata = wire.destination_of(picked)
        assert header == metadata and header is not None, picked
        echoed = await responses.__anext__()
        assert echoed.request_body.response.body_mutation.streamed_response.end_of_stream
        assert stream.lease is not None and header.split(",")[0] == wire.endpoint_of(stream.lease.url)
        self.streams[r.rid] = (stream, requests, responses)
        return stream.lease.decision

    async def finish(self, t: float, rid: str) -> None:
        self.now = t
        stream, requests, responses = self.streams.pop(rid)
        served = struct_pb2.Struct()
        served.update({wire.SERVED: wire.endpoint_of(stream.lease.url)})
        requests.put(ep.ProcessingRequest(response_headers=_http_headers({":status": "200"}),
                                          metadata_context=base_pb2.Metadata(filter_metadata={wire.LB_NAMESPACE: served})))
        await responses.__anext__()
        requests.put(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"", end_of_stream=True)))
        await responses.__anext__()
        requests.put(None)
        async for _ in responses:
            pass


async def _call(result):
    return await result if asyncio.iscoroutine(result) else result


# -- one sequence, fed to all four in lockstep -----------------------------------------------------------
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def _replay(policy: str, seed: int) -> list[Decision]:
    drivers = [FleetDriver(policy), RayDriver(policy), SimDriver(policy), EppDriver(policy)]
    rng = random.Random(seed)
    systems = [_tokens(rng, 3 * BS) for _ in range(2)]
    # A holds system prompt 0 from the start, C the first 2 blocks of system prompt 1, B nothing
    snapshots = {
        URLS[0]: Snapshot(3, BS, SEED, tuple(PreparedRequest(systems[0] + [1], None, None, False).block_hashes(BS, SEED))),
        URLS[1]: Snapshot(0, BS, SEED, ()),
        URLS[2]: Snapshot(7, BS, SEED, tuple(PreparedRequest(systems[1] + [1], None, None, False).block_hashes(BS, SEED)[:2])),
    }
    seq = {url: s.seq for url, s in snapshots.items()}
    held: dict[str, set[int]] = {url: set(s.block_hashes) for url, s in snapshots.items()}
    t = 100.0
    for d in drivers:
        await d.join(t, snapshots)
    sessions: dict[int, list[int]] = {}
    inflight: list[tuple[str, str, PreparedRequest]] = []  # (request id, replica, request)
    decisions: list[Decision] = []

    async def kv(url: str, kind: KVEventKind, hashes: tuple[int, ...] = ()) -> None:
        seq[url] += 1
        for d in drivers:
            await d.kv(url, KVEvent(seq[url], kind, hashes))

    for step in range(90):
        t += 0.5
        if step % 3 == 0:  # scrapes, 0.25 s after the last request and before the next one
            for url in URLS:
                if rng.random() < 0.85:  # sometimes a scrape fails to come: its load goes stale
                    s = Scrape(url, EngineLoad(kv_usage=round(rng.random() * 0.9, 2), running=rng.randrange(6),
                                               waiting=rng.choice((0, 0, 1, 3, 9)), kv_capacity_tokens=4096.0))
                    for d in drivers:
                        d.scrape(t - 0.25, s)
        for _ in range(rng.randrange(3)):  # finishes; the replica caches the prompt's blocks (most of the time)
            if inflight:
                rid, url, prep = inflight.pop(rng.randrange(len(inflight)))
                for d in drivers:
                    await _call(d.finish(t, rid))
                new = tuple(h for h in prep.block_hashes(BS, SEED) if h not in held[url])
                if new and rng.random() < 0.8:
                    held[url].update(new)
                    await kv(url, KVEventKind.STORED, new)
        if rng.random() < 0.15:  # evictions
            url = rng.choice(URLS)
            gone = tuple(sorted(held[url]))[: rng.randrange(1, 4)]
            if gone:
                held[url].difference_update(gone)
                await kv(url, KVEventKind.REMOVED, gone)
        if rng.random() < 0.02:
            url = rng.choice(URLS)
            held[url].clear()
            await kv(url, KVEventKind.CLEARED)
        # a request: a session's next turn (its history plus a new message), or a one-off on a system prompt
        if rng.random() < 0.2:  # a prompt nobody has seen: no replica holds any of it, nor has it on the way
            prep = PreparedRequest(_tokens(rng, rng.randrange(20, 60)), None, f"user-{step % 4}", True)
        elif rng.random() < 0.7:
            sid = rng.randrange(6)
            history = sessions.get(sid) or list(systems[sid % 2])
            tokens = sessions[sid] = history + _tokens(rng, rng.randrange(5, 40))
            prep = PreparedRequest(tokens, None, f"user-{sid}" if sid < 4 else None, True)
        else:
            prep = PreparedRequest(systems[rng.randrange(2)] + _tokens(rng, rng.randrange(1, 30)), None, None, True)
        rid = f"r{step}"
        got = [await _call(d.request(t, Request(rid, prep))) for d in drivers]
        assert got[0] == got[1] == got[2] == got[3], (policy, step, got)
        decisions.append(got[0])
        inflight.append((rid, got[0].url, prep))
    drivers[1].state.close()
    await drivers[3].close()
    return decisions


@pytest.mark.parametrize("policy", ["kv", "approx-prefix", "session", "least-load", "round-robin"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_four_drivers_make_the_same_decisions(policy, seed):
    decisions = asyncio.run(_replay(policy, seed))
    reasons = {d.reason for d in decisions}
    # the sequence reaches the policy's rules: cache hits and misses, session keys, load
    if policy in ("kv", "approx-prefix"):
        assert "cache" in reasons and reasons & {"session", "least-load"}, reasons
        assert sum(d.predicted_cached_tokens > 0 for d in decisions) >= 60
    else:
        assert reasons == {"session": {"session", "least-load"}}.get(policy, {policy}), reasons
    assert len({d.url for d in decisions}) >= 2
