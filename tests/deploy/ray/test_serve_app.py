"""The Serve application end to end on a local Ray instance with 2 CPU replicas of the bundled model (slow:
Ray, two model loads and three deployments take minutes on 2 cores):

- the official `openai` client through the ingress, plain and streamed, and the engine's own error body;
- KV events reach the request router over Ray: prompts extending one cached prefix, sent WITHOUT a session
  key, all go to the replica that holds it (without the exact index they would be spread by load);
- the multi-turn workload of loadtest/ray_fleet.py: the fleet's hit rate (the engines' own prefix-cache
  counters, read from each replica's /metrics by pinned calls) >= 0.95 of one replica holding the whole cache,
  neither replica taking more than 75% of the requests.
"""

import os
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from deploy.ports import free_port
from loadtest.ray_fleet import app_args, measure
from loadtest.ray_serve import deploy, ray_serve, undeploy
from loadtest.router_bench import build_sessions

pytestmark = [pytest.mark.slow, pytest.mark.model]


def workload() -> SimpleNamespace:
    # 4 sessions in flight: the first turns, routed before any cache holds their system prompt, are placed by
    # the session ring with bounded load, so both replicas get system prompts to be affine to (at 2 in flight
    # one replica could take them all and, with the prefix cached, keep every session). A system prompt those
    # concurrent first turns prefill on both replicas is the fleet's loss against one replica: 2 prompts and
    # 4 turns keep it small against the history the follow-ups reuse.
    return SimpleNamespace(sessions=12, turns=4, system_prompts=2, system_tokens=160, mean_user_tokens=50,
                           reply_tokens=20, max_tokens=6, concurrency=4, seed=3, model="smollm2", api="chat",
                           port=0, num_blocks=1024)


def test_serve_app_end_to_end():
    ns = workload()
    ns.port = free_port()
    cpus = os.cpu_count() or 1
    sessions = build_sessions(ns)
    with ray_serve(ns.port) as url:
        deploy(app_args(ns, "kv", 2, ns.num_blocks, max(1, cpus // 2)), url)
        kv = measure(url, sessions, ns, "e2e-kv")  # first: the engines' counters then hold this workload only
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi"}],
                                           max_tokens=6, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens >= 1
        chunks = list(client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Count to three"}], max_tokens=6, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and chunks[-1].usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError, match="messages"):
            client.chat.completions.create(model="smollm2", messages=[], max_tokens=4)

        base = [{"role": "system", "content": "You answer questions about ships. " * 30}]
        served = []
        for i in range(6):  # no session key: only the exact index (KV events over Ray) keeps them together
            body = {"model": "smollm2", "max_tokens": 2, "temperature": 0,
                    "messages": base + [{"role": "user", "content": f"Question {i}: what is a hull?"}]}
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
            assert resp.status_code == 200, resp.text
            served.append(resp.headers["x-kvfleet-replica"])
            if i == 0:
                time.sleep(1.0)  # the first request's blocks reach the router as KV events
        assert len(set(served[1:])) == 1 and served[1] == served[0], served

        undeploy()
        deploy(app_args(ns, "round-robin", 1, 2 * ns.num_blocks, cpus), url)
        single = measure(url, sessions, ns, "e2e-one")
        undeploy()
    print(f"kv: hit {kv['hit_rate']:.3f} (usage {kv['usage_hit_rate']:.3f}) split {kv['by_replica']}; "
          f"single: hit {single['hit_rate']:.3f} (usage {single['usage_hit_rate']:.3f})")
    assert kv["errors"] == 0 and single["errors"] == 0
    assert len(kv["by_replica"]) == 2 and kv["largest_share"] <= 0.75, kv["by_replica"]
    assert kv["hit_rate"] >= 0.95 * single["hit_rate"], (kv["hit_rate"], single["hit_rate"])
