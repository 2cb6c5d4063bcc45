"""Speculative decoding (`ngram`, `suffix`, `draft_model`) against none, served over HTTP (issue 45): real engines
of the bundled model at their default flags (4,096 KV blocks), one without and one per method with
`--speculative-config`, all started once and measured in turn for `--rounds` rounds (without first in odd rounds,
last in even ones), so that each ratio compares runs a few seconds apart on a long-running server.

- copy, c=1: prompts whose answers copy spans of the prompt (code to repeat with one change, a list to reformat,
  a passage to quote), one at a time, greedy, `--copy-max-tokens` out; new prompts each round (a header line of
  its own), so that every round prefills them as a user's new request would; output tokens/s over the set, and
  whether every answer is the same text with and without speculation (greedy: it must be);
- chat, c=16: 16 concurrent streams of short seeded chats (`ignore_eos`, `--chat-max-tokens` out) for
  `--chat-requests` requests; output tokens/s.

Each round's copy set follows the chats of the round before (the warm-up's in round 1: one short copy request
and one wave of 16 chats, not measured): mixed traffic, where a lone request follows a burst of chats.

Prints per round and pooled: tokens/s without and with, their ratio, identical answers, and the engine's own
acceptance (vllm:spec_decode_num_accepted_tokens / num_draft_tokens) and tokens per verifying step.

    python -m loadtest.spec_bench --rounds 4 --methods ngram,suffix
    python -m loadtest.spec_bench --rounds 2 --methods draft_model --draft-model smollm2   # the model drafts for itself

`draft_model` drafts with `--draft-model` (default: the bundled model's first 8 layers, cut into the log directory
by loadtest/layer_draft.py; no smaller model shares its tokenizer). Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time

import httpx

from kvfleet.workload import words
from loadtest.layer_draft import write_layer_draft
from loadtest.router_procs import Proc, start_engine

SPECS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
         "suffix": {"method": "suffix", "num_speculative_tokens": 8},  # suffix_decoding_*: vLLM's defaults
         "draft_model": {"method": "draft_model", "num_speculative_tokens": 4}}  # "model": --draft-model

CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''


def copy_prompts(round_: int = 0) -> list[str]:
    """The copy set; round_ > 0 heads each prompt with a line of that round's own (new prompts, same tasks)."""
    rng = random.Random(45)
    items = [words(rng, 6) for _ in range(12)]
    passage = words(rng, 120)
    head = f"Task {words(random.Random(round_), 3)}.\n" if round_ else ""
    return [head + p for p in [
        f"Rewrite this Python function, renaming the parameter `values` to `xs`. Output only the code.\n\n{CODE}",
        f"Repeat this Python function exactly, adding a docstring line at the top. Output only the code.\n\n{CODE}",
        "Turn this list into a numbered list, one item per line, keeping each item's words:\n"
        + "\n".join(f"- {x}" for x in items),
        f"Quote the following passage verbatim, then stop.\n\n{passage}",
        "Convert these lines to upper case, keeping their order:\n" + "\n".join(items),
    ]]


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def copy_set(url: str, prompts: list[str], max_tokens: int) -> tuple[float, list[str]]:
    """(output tokens/s over the set, each answer's text), one request at a time."""
    texts, tokens, busy = [], 0, 0.0
    async with httpx.AsyncClient(timeout=600) as c:
        for p in prompts:
            body = {"model": "smollm2", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                    "temperature": 0}
            t = time.perf_counter()
            r = await c.post(url + "/v1/chat/completions", json=body)
            busy += time.perf_counter() - t
            r.raise_for_status()
            j = r.json()
            texts.append(j["choices"][0]["message"]["content"])
            tokens += j["usage"]["completion_tokens"]
    return tokens / busy, texts


async def chat(url: str, n: int, concurrency: int, max_tokens: int, seed: int = 7) -> float:
    rng = random.Random(seed)
    prompts = [f"{words(rng, 30)}? Answer briefly." for _ in range(n)]
    queue = list(prompts)
    tokens = 0

    async def worker(c: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            p = queue.pop()
            body = {"model": "smollm2", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0}
            r = await c.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as c:
        t = time.perf_counter()
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        return tokens / (time.perf_counter() - t)


def start(ns, log_dir: str, method: str | None) -> Proc:
    """An engine without speculation (method None) or with the method's config, ready and warmed up."""
    spec = dict(SPECS[method], **({"model": ns.draft_model} if method == "draft_model" else {})) if method else None
    ns.engine_arg = ["--speculative-config", json.dumps(spec)] if spec else []
    e: Proc = start_engine(ns, log_dir, method or "plain", 4096)
    e.wait_ready(300)
    asyncio.run(copy_set(e.url, copy_prompts()[:1], 16))  # warm-up, and of the batch shapes a server has run
    asyncio.run(chat(e.url, 16, 16, ns.chat_max_tokens))  # for a while (a first chat run is ~20% slower)
    return e


def measure(ns, e: Proc, round_: int) -> dict:
    copy_tps, texts = asyncio.run(copy_set(e.url, copy_prompts(round_), ns.copy_max_tokens))
    chat_tps = asyncio.run(chat(e.url, ns.chat_requests, 16, ns.chat_max_tokens, 7 + round_))
    return {"copy_tps": copy_tps, "chat_tps": chat_tps, "texts": texts}


def spec_counts(e: Proc) -> dict:
    """The engine's speculation counters since start: acceptance, tokens per verifying step, the gate."""
    m = httpx.get(e.url + "/metrics").text
    drafts = metric(m, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric(m, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric(m, "vllm:spec_decode_num_accepted_tokens_total")
    return {"acceptance": accepted / draft_tokens if draft_tokens else None,
            "tokens_per_verify": (accepted + drafts) / drafts if drafts else None,
            "gate": f"gate open {metric(m, 'kvfleet:spec_decode_gate_open'):.0f}, closed steps "
                    f"{metric(m, 'kvfleet:spec_decode_gate_closed_steps_total'):.0f}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--copy-max-tokens", type=int, default=200)
    ap.add_argument("--chat-requests", type=int, default=64)
    ap.add_argument("--chat-max-tokens", type=int, default=64)
    ap.add_argument("--methods", default="ngram",
                    help="comma-separated: ngram, suffix, draft_model (each against none, per round)")
    ap.add_argument("--draft-model", default=None, metavar="PATH",
                    help="draft_model's checkpoint (default: the bundled model's first 8 layers)")
    ns = ap.parse_args(argv)
    methods = [m for m in ns.methods.split(",") if m]
    for m in methods:
        if m not in SPECS:
            ap.error(f"--methods: unknown method {m!r} (one of {', '.join(SPECS)})")
    ns.model, ns.engine_module, ns.threads_per_engine, ns.pin_cores = "smollm2", None, None, False
    log_dir = tempfile.mkdtemp(prefix="spec_bench_")
    if "draft_model" in methods and ns.draft_model is None:
        ns.draft_model = write_layer_draft("smollm2", 8, f"{log_dir}/draft8")
    if "draft_model" in methods:
        print(f"draft model: {ns.draft_model}", flush=True)
    pooled: dict[tuple[str, str], list[float]] = {(m, k): [] for m in methods for k in ("copy", "chat")}
    same_all = True
    engines: dict[str | None, Proc] = {}
    try:
        for method in [None, *methods]:
            engines[method] = start(ns, log_dir, method)
        for rnd in range(1, ns.rounds + 1):
            # without first in odd rounds, last in even ones: this machine's drift does not favour one side
            order = [None, *methods] if rnd % 2 else [*methods, None]
            got = {method: measure(ns, engines[method], rnd) for method in order}
            plain = got[None]
            for method in methods:
                spec, counts = got[method], spec_counts(engines[method])
                same = plain["texts"] == spec["texts"]
                same_all &= same
                rc, rt = spec["copy_tps"] / plain["copy_tps"], spec["chat_tps"] / plain["chat_tps"]
                pooled[method, "copy"].append(rc)
                pooled[method, "chat"].append(rt)
                acc, tpv = counts["acceptance"], counts["tokens_per_verify"]
                print(f"round {rnd}, {method}: copy c=1 {plain['copy_tps']:.1f} -> {spec['copy_tps']:.1f} tok/s = "
                      f"x{rc:.2f} (answers identical: {same}); chat c=16 {plain['chat_tps']:.1f} -> "
                      f"{spec['chat_tps']:.1f} tok/s = x{rt:.2f}; since start: drafts kept "
                      f"{acc if acc is None else f'{acc:.2f}'}, tokens per verifying step {tpv and round(tpv, 2)}, "
                      f"{counts['gate']}", flush=True)
    finally:
        for e in engines.values():
            e.stop()
    for method in methods:
        gm = {k: math.prod(pooled[method, k]) ** (1 / ns.rounds) for k in ("copy", "chat")}
        print(f"pooled {method} (geometric mean of rounds): copy c=1 x{gm['copy']:.2f} (target >= 1.8), chat c=16 "
              f"x{gm['chat']:.2f} (target >= 1.0)")
    print(f"greedy answers identical in every round: {same_all}; logs {log_dir}")
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
