"""The request router's state and decisions (deploy/ray/routing_state.py) with kvfleet's policy objects: the
exact index fed by KV event streams in the engine's wire format (the transport over Ray is replaced by
in-memory streams here; tests/deploy/ray/test_serve_app.py runs the real one), route hints built from the
HTTP router's own request preparation, round-robin, and load from routing stats."""

import asyncio

import pytest

from contract.hashing import DEFAULT_HASH_SEED
from contract.kv_events import Heartbeat, KVEvent, KVEventKind, Snapshot
from contract.kv_wire import encode_line
from deploy.ray.route_hint import RouteHint
from deploy.ray.routing_state import RoutingState, close_all
from router.routing.prepare import PreparedRequest
from router.states import KVEventsState

BS = 16


def hint(tokens: list[int], session: str | None = None) -> RouteHint:
    return RouteHint.of(PreparedRequest(tokens, None, session, False), BS, DEFAULT_HASH_SEED)


def streams(held: dict[str, tuple[int, ...]], later: dict[str, tuple[int, ...]] | None = None):
    """Each replica's stream: a snapshot of `held`, then (optionally) one `stored` event, then heartbeats."""

    def open_stream(key: str):
        async def gen():
            yield encode_line(key, Snapshot(5, BS, DEFAULT_HASH_SEED, held.get(key, ())))
            seq = 5
            if later and key in later:
                await asyncio.sleep(0.05)
                seq += 1
                yield encode_line(key, KVEvent(seq, KVEventKind.STORED, later[key]))
            while True:
                await asyncio.sleep(0.05)
                yield encode_line(key, Heartbeat(seq))

        return gen()

    return open_stream


async def until(cond, what: str, timeout_s: float = 5.0) -> None:
    """Poll `cond` until it holds (a loaded 2-core machine may take longer than a fixed sleep)."""
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def live(state: RoutingState, keys) -> None:
    for _ in range(200):
        if all(state.replicas[k].kv_events is KVEventsState.LIVE for k in keys):
            return
        await asyncio.sleep(0.01)
    raise AssertionError({k: state.replicas[k].kv_events for k in keys})


def test_kv_policy_sends_a_prompt_to_the_replica_holding_its_prefix():
    prompt = list(range(1000, 1000 + 5 * BS + 3))  # 5 full blocks + a partial one
    h = hint(prompt)
    assert len(h.block_hashes) == 5

    async def main():
        state = RoutingState("kv")
        later_prompt = hint(list(range(7000, 7000 + 3 * BS)))
        state.set_replicas(["a", "b"], streams({"b": h.block_hashes[:4]}, {"a": later_prompt.block_hashes}))
        for k in ("a", "b"):
            state.on_stats(k, {"kv_usage": 0.1, "running": 0, "waiting": 0})
        await live(state, ["a", "b"])
        assert state.predict_cached(h, ["a", "b"]) == {"a": 0, "b": 4 * BS}
        for _ in range(3):  # every time, not by rotation
            d = state.choose(["a", "b"], h)
            assert (d.url, d.predicted_cached_tokens, d.reason) == ("b", 4 * BS, "cache")
        await until(lambda: state.predict_cached(later_prompt, ["a", "b"]).get("a", 0) > 0,
                    "a's live `stored` event arrived")
        assert state.choose(["a", "b"], later_prompt).url == "a"
        # a prompt nobody holds, with a session key: the session's ring replica, the same one each time
        other = hint(list(range(5000, 5000 + 3 * BS)), session="s1")
        first = state.choose(["a", "b"], other)
        assert first.reason == "session" and state.choose(["a", "b"], other).url == first.url
        # the replica leaves: its subscription stops and its blocks leave the index
        state.set_replicas(["a"], streams({}))
        await until(lambda: not state.index.has("b") and "b" not in state.subscriptions, "b's subscription stopped")
        assert state.choose(["a", "b"], h).url == "a"
        task = state.subscriptions["a"][1]
        close_all()  # what the ingress does when Serve shuts it down
        await until(lambda: task.done(), "a's subscription task ended")
        assert task.cancelled() and not state.subscriptions and not state.index.has("a")

    asyncio.run(main())


def test_a_gap_in_the_event_stream_resyncs_from_a_new_snapshot():
    async def main():
        opened = []

        def open_stream(key):
            async def gen():
                opened.append(key)
                yield encode_line(key, Snapshot(5, BS, DEFAULT_HASH_SEED, (1, 2)))
                yield encode_line(key, KVEvent(7, KVEventKind.STORED, (3,)))  # 6 is missing
                await asyncio.sleep(10)

            return gen()

        state = RoutingState("kv")
        state.set_replicas(["a"], open_stream)
        for _ in range(100):
            if len(opened) >= 2:
                break
            await asyncio.sleep(0.02)
        assert len(opened) >= 2 and state.subscriptions["a"][0].resyncs >= 1
        state.close()

    asyncio.run(main())


def test_round_robin_alternates_and_tracks_in_flight_requests():
    async def main():
        state = RoutingState("round-robin")
        state.set_replicas(["a", "b"], streams({}))
        assert not state.subscriptions  # round-robin needs no KV events
        urls = [state.choose(["a", "b"], hint([1] * 40)).url for _ in range(4)]
        assert sorted(urls) == ["a", "a", "b", "b"] and urls[0] != urls[1]
        state.on_routed("a", "q", hint([1] * 40), 0)
        v = state.replicas["a"].view(state.clock(), state.stats_stale_s)
        assert (v.inflight, v.new_tokens, v.pending_tokens) == (1, 40, 40)  # pending prefill until it completes
        state.on_completed("a", "q")
        assert not state.sent and state.replicas["a"].inflight == 0

    asyncio.run(main())


def test_least_load_reads_routing_stats_and_what_this_router_sent_since():
    t = [100.0]
    state = RoutingState("least-load", stats_stale_s=30, clock=lambda: t[0])

    async def main():
        state.set_replicas(["a", "b"], streams({}))

    asyncio.run(main())
    state.on_stats("a", {"kv_usage": 0.5, "running": 6, "waiting": 4})
    state.on_stats("b", {"kv_usage": 0.1, "running": 1, "waiting": 0})
    assert state.choose(["a", "b"], None).url == "b"
    t[0] += 1
    for i in range(12):  # sent to b since its last report: b now looks busier than a
        state.on_routed("b", f"r{i}", hint([1] * 40), 0)
    assert state.choose(["a", "b"], None).url == "a"
    t[0] += 60  # the reports went stale: load unknown, only in-flight counts
    assert not state.replicas["a"].view(t[0], state.stats_stale_s).load_known


def test_unknown_policy_names_the_field():
    with pytest.raises(ValueError, match="request_router_kwargs.policy"):
        RoutingState("nope")
