"""One long stream at concurrency 1: does per-token time stay flat as the context grows?

Each target gets the same chat request (greedy, EOS ignored, `--tokens` output tokens, default 3,072),
streamed with continuous usage stats so every chunk says how many tokens it completes; the time of token k
is when the chunk holding it arrived. It prints the mean time per token over an early window (tokens
64-1,087 by default) and over the last 1,024 tokens, their ratio (the slow-down over the stream), and the
ratios between targets. Targets alternate over `--rounds` (A B A B) so a slow spell of the machine hits
each, each server started only for its own turn:

    python -m loadtest.long_stream --with-kvfleet --with-vllm --rounds 2
    python -m loadtest.long_stream --target mine=http://127.0.0.1:8001

Reading the longer KV cache costs more per token as the stream grows; `--kv-bytes-per-token` and
`--read-gbps` print what that alone accounts for, as a floor next to the measured growth.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass

import aiohttp

from loadtest.http_bench import add_target_args, resolve_targets, turns

PROMPT = "Tell me a very long story about a lighthouse keeper, the sea, the ships and the town."


@dataclass(frozen=True)
class StreamResult:
    target: str
    tokens: int
    early_ms: float  # mean ms per token over the early window
    late_ms: float  # mean ms per token over the last `late` tokens
    ttft_ms: float

    @property
    def growth(self) -> float:
        return self.late_ms / self.early_ms


async def stream_times(url: str, model: str, tokens: int, timeout: float) -> tuple[float, list[float]]:
    """(TTFT s, arrival time of each output token in s from the request's start)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    times: list[float] = []
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    raise RuntimeError(f"{url}: {msg['error']}")
                done = (msg.get("usage") or {}).get("completion_tokens")
                if done is not None and done > len(times):
                    now = time.perf_counter() - t0
                    times.extend([now] * (done - len(times)))
    if len(times) != tokens:
        raise RuntimeError(f"{url}: got {len(times)} tokens, asked for {tokens}")
    return times[0], times


def summarize(target: str, ttft: float, times: list[float], early: tuple[int, int], late: int) -> StreamResult:
    a, b = early
    n = len(times)
    early_ms = (times[b] - times[a]) / (b - a) * 1000
    late_ms = (times[n - 1] - times[n - 1 - late]) / late * 1000
    return StreamResult(target, n, early_ms, late_ms, ttft * 1000)


def print_results(results: list[StreamResult], early: tuple[int, int], late: int) -> None:
    print(f"{'target':<12} {'tokens':>6} {'TTFT ms':>8} {f'ms/tok {early[0]}-{early[1]}':>18} "
          f"{f'ms/tok last {late}':>16} {'growth':>7}")
    for r in results:
        print(f"{r.target:<12} {r.tokens:>6} {r.ttft_ms:>8.1f} {r.early_ms:>18.2f} {r.late_ms:>16.2f} "
              f"{r.growth:>6.2f}x")


def pooled(results: list[StreamResult]) -> dict[str, StreamResult]:
    """Per target (the name before '#'), mean early and late times over its rounds."""
    out: dict[str, list[StreamResult]] = {}
    for r in results:
        out.setdefault(r.target.split("#")[0], []).append(r)
    return {name: StreamResult(name, rs[0].tokens, sum(r.early_ms for r in rs) / len(rs),
                               sum(r.late_ms for r in rs) / len(rs), sum(r.ttft_ms for r in rs) / len(rs))
            for name, rs in out.items()}


async def amain(a: argparse.Namespace) -> list[StreamResult]:
    targets, starts = resolve_targets(a, a.tokens + 256)
    early = (a.early_start, a.early_start + a.window)
    results = []
    for turn, url in turns(targets, starts, a.rounds, a.start_timeout, "long_stream"):
        async with turn:
            await stream_times(url, a.model, 16, a.request_timeout)  # warm-up
            ttft, times = await stream_times(url, a.model, a.tokens, a.request_timeout)
            results.append(summarize(turn.name, ttft, times, early, a.window))
            print_results(results[-1:], early, a.window)
            sys.stdout.flush()
    print()
    print_results(results, early, a.window)
    if a.rounds > 1:
        print("\npooled over rounds:")
        print_results(list(pooled(results).values()), early, a.window)
    per = pooled(results)
    names = list(per)
    for other in names[1:]:
        x, y = per[names[0]], per[other]
        print(f"{names[0]}/{other} ms per token: early {x.early_ms / y.early_ms:.2f}x, late {x.late_ms / y.late_ms:.2f}x")
    if a.kv_bytes_per_token and a.read_gbps:
        extra = (a.tokens - a.window / 2 - (early[0] + early[1]) / 2) * a.kv_bytes_per_token / (a.read_gbps * 1e9) * 1000
        print(f"reading the longer KV cache at {a.read_gbps} GB/s accounts for {extra:.2f} ms per token of growth")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_args(ap)
    ap.add_argument("--tokens", type=int, default=3072, help="output tokens of the stream")
    ap.add_argument("--early-start", type=int, default=64, help="first token of the early window")
    ap.add_argument("--window", type=int, default=1024, help="tokens in the early and the late window")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the targets this many times (A B A B)")
    ap.add_argument("--kv-bytes-per-token", type=float, default=0.0,
                    help="KV bytes per token of context (SmolLM2-135M bf16: 23040) to print the bandwidth floor")
    ap.add_argument("--read-gbps", type=float, default=0.0, help="the machine's measured read bandwidth, GB/s")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if a.window < 1 or a.early_start < 0 or a.early_start + a.window >= a.tokens - a.window:
        ap.error(f"--early-start + --window must end before the last --window tokens of --tokens ({a.tokens})")
    asyncio.run(amain(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
