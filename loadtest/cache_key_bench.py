"""OpenAI's `prompt_cache_key` through kvfleet's router (issue 47): requests that share a key keep to one replica
(the hash ring, bounded by load), where the `kv` policy alone cannot yet see a prefix nobody has computed.

The workload: `--groups` documents of about `--doc-words` words, each asked `--burst` different questions at once
(a team opening the same new document, an agent fanning out over it); groups follow one another. Two runs on the
same two real engines behind one `kv` router, each with its own `cache_salt` (so neither reads the other's cache):
without a key, then with the group's `prompt_cache_key`. Prints each run's fleet prefix-cache hit rate (the
engines' own counters), the prompt tokens the fleet computed, and the ratio.

    python -m loadtest.cache_key_bench --groups 12 --burst 4
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile

import httpx

from kvfleet.workload import words
from loadtest.router_bench import fleet_prefix_counters
from loadtest.router_procs import Proc, start_engine, start_router


def groups(ns) -> list[tuple[str, list[str]]]:
    rng = random.Random(ns.seed)
    return [(words(rng, ns.doc_words), [f"Question {q}: {words(rng, 8)}?" for q in range(ns.burst)])
            for _ in range(ns.groups)]


async def run(url: str, work, salt: str, with_key: bool) -> None:
    async with httpx.AsyncClient(timeout=300) as c:
        for g, (doc, questions) in enumerate(work):
            async def one(q: str, g=g, doc=doc) -> None:
                body = {"model": "smollm2", "max_tokens": 4, "temperature": 0, "cache_salt": salt,
                        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": q}]}
                if with_key:
                    body["prompt_cache_key"] = f"doc-{g}"
                r = await c.post(url + "/v1/chat/completions", json=body)
                r.raise_for_status()
            await asyncio.gather(*(one(q) for q in questions))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=12)
    p.add_argument("--burst", type=int, default=4, help="questions on one document sent at once")
    p.add_argument("--doc-words", type=int, default=300)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--seed", type=int, default=1)
    ns = p.parse_args(argv)
    ns.model, ns.engine_module, ns.engine_arg, ns.threads_per_engine, ns.pin_cores = "smollm2", None, [], 1, True
    log_dir = tempfile.mkdtemp(prefix="cache_key_bench_")
    procs: list[Proc] = []
    try:
        engines = [start_engine(ns, log_dir, f"e{i}", ns.num_blocks, i) for i in range(2)]
        procs += engines
        for e in engines:
            e.wait_ready(300)
        router = start_router(ns, log_dir, [e.url for e in engines], "kv", "smollm2")
        procs.append(router)
        router.wait_ready(120)
        work = groups(ns)
        rates = {}
        for name, with_key in (("kv", False), ("kv + prompt_cache_key", True)):
            q0, h0 = fleet_prefix_counters([e.url for e in engines])
            asyncio.run(run(router.url, work, f"cache-key-bench-{name}", with_key))
            q1, h1 = fleet_prefix_counters([e.url for e in engines])
            rates[name] = (h1 - h0) / max(1.0, q1 - q0)
            print(f"{name:24s} hit rate {rates[name]:.3f}  prompt tokens computed {q1 - q0 - (h1 - h0):,.0f} of "
                  f"{q1 - q0:,.0f}", flush=True)
        print(f"hit rate with the key / without: {rates['kv + prompt_cache_key'] / max(rates['kv'], 1e-9):.2f}")
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
