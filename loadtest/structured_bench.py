r"""Structured outputs under load: what JSON-Schema constraints cost kvfleet, and the same workload on vLLM-CPU.

For each server (one at a time, alone on the machine), with grammars already cached (every schema is sent
once before measuring):
- throughput at concurrency C with 0%, 50% and 100% of the requests constrained by a JSON Schema (chat,
  streamed, the same prompts; output tokens from the usage chunk): output tokens/s, requests/s and the median
  time per output token after the first (TPOT). JSON answers are shorter than free ones, so tokens/s mixes
  in more prefill per token; the decode rate (1 / TPOT at the same concurrency) is the like-for-like figure:
  the constrained mixes' over the unconstrained one (target: >= 0.90 at 100%, i.e. <= 10% cost);
- time to first token for a schema the server has never seen (its grammar is compiled before the first
  token) against the same schema sent again (cached), median over R new schemas;
- every constrained answer is checked against its schema (valid / constrained answers).

    python -m loadtest.structured_bench                       # kvfleet and vLLM-CPU (peer venv, ~2 min to start)
    python -m loadtest.structured_bench --servers kvfleet --quick     # a smoke run: a few requests, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass

import httpx
import jsonschema

from kvfleet.peers import peers_dir
from loadtest.router_procs import Proc
from loadtest.ttft_clients import start_server

PROMPTS = ["Describe a fictional person as JSON.", "Give me a product record in JSON.",
           "Write a short JSON object about a city.", "Return a JSON record of a book."]
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["name", "age", "email"], "additionalProperties": False},
    {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                      "price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "tags": {"type": "array", "items": {"enum": ["new", "sale", "eco"]},
                                               "maxItems": 3}},
     "required": ["sku", "price", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "country": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
                                      "capital": {"type": "boolean"}},
     "required": ["city", "country", "population", "capital"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                      "author": {"type": "object", "properties": {
                                          "first": {"type": "string", "maxLength": 12},
                                          "last": {"type": "string", "maxLength": 12}},
                                          "required": ["first", "last"], "additionalProperties": False},
                                      "year": {"type": "integer", "minimum": 1450, "maximum": 2030}},
     "required": ["title", "author", "year"], "additionalProperties": False},
]


@dataclass
class Result:
    ttft: float
    e2e: float
    tokens: int
    text: str
    schema: dict | None


def body(i: int, constrained: bool, max_tokens: int, schema: dict | None = None) -> dict:
    b = {"model": "smollm2", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
         "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stream": True,
         "stream_options": {"include_usage": True}}
    if constrained:
        schema = schema or SCHEMAS[i % len(SCHEMAS)]
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return b


async def one(client: httpx.AsyncClient, url: str, b: dict) -> Result:
    t0 = time.perf_counter()
    ttft, tokens, pieces = None, 0, []
    async with client.stream("POST", url + "/v1/chat/completions", json=b) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", []):
                text = c["delta"].get("content")
                if text:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    pieces.append(text)
    schema = b.get("response_format", {}).get("json_schema", {}).get("schema")
    e2e = time.perf_counter() - t0
    return Result(ttft if ttft is not None else e2e, e2e, tokens, "".join(pieces), schema)


async def run_mix(url: str, fraction: float, n: int, concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    k = round(1 / fraction) if fraction else 0

    async def task(client, i):
        async with sem:
            return await one(client, url, body(i, bool(k) and i % k == 0, max_tokens))

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(task(client, i) for i in range(n)))
        wall = time.perf_counter() - t0
    constrained = [r for r in results if r.schema is not None]
    valid = sum(_valid(r) for r in constrained)
    return {"fraction": fraction, "requests": n, "wall_s": wall, "tok_s": sum(r.tokens for r in results) / wall,
            "req_s": n / wall, "ttft_p50": statistics.median(r.ttft for r in results),
            "tpot_p50": statistics.median((r.e2e - r.ttft) / (r.tokens - 1) for r in results if r.tokens > 1),
            "constrained": len(constrained), "valid": valid}


def _valid(r: Result) -> bool:
    try:
        jsonschema.validate(json.loads(r.text), r.schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


async def compile_ttft(url: str, repeats: int, max_tokens: int) -> tuple[float, float]:
    """Median TTFT of a never-seen schema, and of the same schema sent again right after."""
    new, cached = [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for i in range(repeats):
            schema = json.loads(json.dumps(SCHEMAS[i % len(SCHEMAS)]))
            schema["properties"][f"f_{uuid.uuid4().hex[:10]}"] = {"type": "integer", "minimum": 0, "maximum": 9}
            new.append((await one(client, url, body(i, True, max_tokens, schema))).ttft)
            cached.append((await one(client, url, body(i, True, max_tokens, schema))).ttft)
    return statistics.median(new), statistics.median(cached)


async def measure(url: str, ns) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:  # warm up: every schema compiled, the model hot
        await asyncio.gather(*(one(client, url, body(i, True, ns.max_tokens)) for i in range(len(SCHEMAS))))
        await one(client, url, body(0, False, ns.max_tokens))
    mixes = [await run_mix(url, f, ns.requests, ns.concurrency, ns.max_tokens) for f in (0.0, 0.5, 1.0)]
    new, cached = await compile_ttft(url, ns.repeats, ns.max_tokens)
    return {"mixes": mixes, "ttft_new_schema": new, "ttft_cached_schema": cached}


def report(name: str, m: dict) -> None:
    base = m["mixes"][0]
    print(f"== {name}")
    for x in m["mixes"]:
        print(f"  {int(x['fraction'] * 100):3d}% JSON Schema: {x['tok_s']:7.1f} out tok/s  {x['req_s']:5.2f} req/s  "
              f"TTFT p50 {x['ttft_p50'] * 1000:6.0f} ms  TPOT p50 {x['tpot_p50'] * 1000:5.1f} ms  "
              f"valid {x['valid']}/{x['constrained']}  vs unconstrained: tok/s x{x['tok_s'] / base['tok_s']:.2f}, "
              f"decode rate x{base['tpot_p50'] / x['tpot_p50']:.2f}")
    print(f"  TTFT new schema {m['ttft_new_schema'] * 1000:.0f} ms vs cached {m['ttft_cached_schema'] * 1000:.0f} ms "
          f"(compile adds {(m['ttft_new_schema'] - m['ttft_cached_schema']) * 1000:.0f} ms)")
    full = base["tpot_p50"] / m["mixes"][-1]["tpot_p50"]
    print(f"  100% constrained over unconstrained, decode rate: x{full:.2f} "
          f"(target >= x0.90: {'met' if full >= 0.9 else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="kvfleet,vllm", help="comma list of kvfleet, vllm")
    p.add_argument("--requests", type=int, default=64, help="requests per mix")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=5, help="new schemas for the compile TTFT")
    p.add_argument("--url", help="measure a server already running here instead of starting one")
    p.add_argument("--quick", action="store_true", help="a smoke run: 8 requests per mix at concurrency 4")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.requests, ns.concurrency, ns.repeats, ns.max_tokens = 8, 4, 2, 64
    if min(ns.requests, ns.concurrency, ns.repeats, ns.max_tokens) < 1:
        p.error("--requests, --concurrency, --repeats and --max-tokens must be >= 1")
    results = {}
    if ns.url:
        results["server"] = asyncio.run(measure(ns.url.rstrip("/"), ns))
    else:
        for name in ns.servers.split(","):
            if name not in ("kvfleet", "vllm"):
                p.error(f"--servers: unknown server {name!r}")
            with tempfile.TemporaryDirectory() as logs:
                proc: Proc = start_server(name, peers_dir(), logs)
                try:
                    proc.wait_ready(timeout=900, path="/health" if name == "vllm" else "/ready")
                    results[name] = asyncio.run(measure(proc.url, ns))
                finally:
                    proc.stop()
    for name, m in results.items():
        report(name, m)
    if "kvfleet" in results and "vllm" in results:
        for k, f in enumerate((0.0, 0.5, 1.0)):
            a, b = results["kvfleet"]["mixes"][k]["tok_s"], results["vllm"]["mixes"][k]["tok_s"]
            print(f"  {int(f * 100):3d}% JSON Schema: kvfleet {a:.1f} vs vLLM {b:.1f} out tok/s = x{a / b:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
