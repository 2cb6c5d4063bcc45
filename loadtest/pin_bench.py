"""cache_control pins on one real engine (in process, the bundled model): a pinned prefix through a flood.

    python -m loadtest.pin_bench [--num-blocks 128] [--rounds 5] [--prefix-words 120] [--flood 8]

Two prefixes of the same length are read once, A with a cache_control pin (CachePin, as the server derives it from
the mark), B without. Then `--rounds` times: a flood of `--flood` distinct prompts, more blocks than the cache has
unpinned, evicts every unpinned prefix; then A and B are read again. The hit rate of a prefix is the share of its
whole blocks' tokens found cached over those reads (A must be 1.0; B, the same prefix without a pin, is measured).
Finally the engine's pin clock (LLMEngine.clock, a testing hook) is moved past the TTL: the next step drops the pins,
and one more flood evicts A like any other block.
"""

from __future__ import annotations

import argparse
import itertools
import time

from engine.args import EngineArgs
from engine.cache_pin import CachePin
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

TTL_S = 300.0
_ids = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i % 7} item {i}." for i in range(n))


def read(engine: LLMEngine, ids: list[int], pin: CachePin | None = None) -> int:
    """Run one request to its end (1 token); its prompt tokens served from the cache."""
    rid = f"r{next(_ids)}"
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0, cache_pin=pin))
    cached = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.request_id == rid:
                cached = d.num_cached_tokens
    return cached


def flood(engine: LLMEngine, n: int, round_: int, prompt_words: int) -> None:
    for k in range(n):
        read(engine, engine.tokenizer.encode(words(f"flood{round_}x{k}", prompt_words)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix-words", type=int, default=40)
    ap.add_argument("--flood", type=int, default=8, help="distinct prompts per flood")
    ap.add_argument("--flood-words", type=int, default=30)
    ns = ap.parse_args()
    engine = LLMEngine(EngineArgs(model="smollm2", dtype="float32", num_blocks=ns.num_blocks, max_model_len=1024,
                                  engine_core="thread", kv_pin_fraction=0.25, kv_pin_tenant_fraction=0.25))
    clock = Clock()
    engine.clock = clock
    bs, kv = engine.block_size, engine.kv
    tok = engine.tokenizer
    a = tok.encode(words("alpha", ns.prefix_words))
    b = tok.encode(words("bravo", ns.prefix_words))
    n = min(len(a), len(b)) // bs * bs  # whole blocks of the prefix: what a hit can cover
    a, b = a[:n], b[:n]
    pin = CachePin(n, TTL_S)
    flood_blocks = ns.flood * (len(tok.encode(words("flood0x0", ns.flood_words))) // bs + 1)
    print(f"engine: {ns.num_blocks} KV blocks of {bs} tokens, at most {kv.pins.max_blocks} pinned; prefix A (pinned) "
          f"and B (not): {n} tokens = {n // bs} blocks each; each flood: {ns.flood} distinct prompts, ~{flood_blocks} "
          f"blocks = {flood_blocks / (ns.num_blocks - n // bs):.1f}x the unpinned cache")
    read(engine, a + tok.encode(" first question"), pin)
    read(engine, b + tok.encode(" first question"))
    print(f"pinned blocks after A's first read: {kv.pins.num_pinned}")
    hits_a = hits_b = 0
    t0 = time.perf_counter()
    for r in range(ns.rounds):
        flood(engine, ns.flood, r, ns.flood_words)
        hits_a += min(read(engine, a + tok.encode(f" question {r}"), pin), n)
        hits_b += min(read(engine, b + tok.encode(f" question {r}")), n)
    total = ns.rounds * n
    rate_a, rate_b = hits_a / total, hits_b / total
    print(f"{ns.rounds} floods ({time.perf_counter() - t0:.1f} s), {kv.evictions} evictions in all")
    print(f"hit rate of pinned prefix A through the floods:   {rate_a:.3f} ({hits_a}/{total} tokens)")
    print(f"hit rate of the same-length prefix B, no pin:      {rate_b:.3f} ({hits_b}/{total} tokens)")
    print(f"A / B: {'inf' if rate_b == 0 else f'{rate_a / rate_b:.1f}x'}; tokens A did not recompute: "
          f"{hits_a - hits_b} of {total}")
    before = kv.pins.num_pinned
    clock.offset += TTL_S + 1  # the pin's TTL passes (no read refreshed it since the last round)
    flood(engine, ns.flood, ns.rounds, ns.flood_words)  # its first step drops the pins; the flood evicts A
    after_hit = read(engine, a + tok.encode(" after the ttl"))
    print(f"after the TTL: pinned blocks {before} -> {kv.pins.num_pinned}; A's hit after one more flood: "
          f"{min(after_hit, n)}/{n} tokens (evictable again: {after_hit < n})")


if __name__ == "__main__":
    main()
