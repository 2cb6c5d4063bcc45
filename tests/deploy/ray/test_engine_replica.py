"""The engine deployment's replica class outside Serve, running the fake engine's app (no model): requests
come back as a Head naming the replica then the body, and kv_events yields the engine's NDJSON event stream
(decoded by the contract's codec) - what the ingress and the request routers read over Ray."""

import asyncio
import json

from contract.kv_events import KVEvent, Snapshot
from contract.kv_wire import decode_line
from deploy.ray.asgi_call import Head
from deploy.ray.engine_replica import REPLICA_HEADER, EngineReplica


def test_generate_and_kv_events_through_the_replica_class():
    async def main():
        rep = EngineReplica.__new__(EngineReplica)
        await rep.__init__(app_factory="loadtest.fake_engine:make_app", app_options={"chunks": 3, "block_size": 16})
        events = rep.kv_events()
        first = decode_line((await events.__anext__()).split(b"\n")[0])
        assert first.instance_id == rep.id and isinstance(first.message, Snapshot) and not first.message.block_hashes

        body = json.dumps({"model": "smollm2", "prompt": list(range(40)), "max_tokens": 3, "stream": True}).encode()
        head, *chunks = [x async for x in rep.generate("POST", "/v1/completions", body,
                                                      {"content-type": "application/json"})]
        assert isinstance(head, Head) and head.status == 200 and head.header(REPLICA_HEADER) == rep.id
        assert b"".join(chunks).rstrip().endswith(b"data: [DONE]")

        line = b""
        while b"stored" not in line:  # the prompt's 2 full blocks entered the fake engine's cache
            line = await asyncio.wait_for(events.__anext__(), 5)
        stored = decode_line(line.split(b"\n")[0]).message
        assert isinstance(stored, KVEvent) and len(stored.block_hashes) == 2
        await events.aclose()
        assert await rep.record_routing_stats() == {}  # no engine stats from the fake: load unknown
        await rep.__del__()

    asyncio.run(main())
