"""Streaming load against OpenAI-compatible endpoints: output tokens/s, TTFT and TPOT, side by side.

    python -m loadtest.http_bench --target kvfleet=http://127.0.0.1:8001 --concurrency 1 16 64
    python -m loadtest.http_bench --with-kvfleet --with-vllm --concurrency 1 16 64 --num-requests 64
    python -m loadtest.http_bench --with-kvfleet --with-vllm --rounds 2   # alternate A B A B on a noisy machine
    python -m loadtest.http_bench --with-kvfleet --with-llamacpp --concurrency 1 --rounds 2

Every target gets the same seeded chat trace (`kvfleet.workload`) at every concurrency level
(closed loop: C workers, each sends its next request when the previous one ends). EOS is banned
(`logit_bias {2: -100}` plus `ignore_eos`) so each request produces exactly its `max_tokens`,
whichever server answers. Targets run one after the other; `--start NAME=CMD` (or --with-kvfleet /
--with-vllm / --with-llamacpp) launches a server for its turn only and stops it afterwards, so two servers never
share the CPUs. With two or more targets the first is compared against the others as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from kvfleet.bench.metrics import percentile as bench_percentile
from kvfleet.bench.records import record_from_sse
from kvfleet.bench.targets import Turn, llamacpp_cmd, vllm_cmd
from kvfleet.peers import peers_dir
from kvfleet.workload import MODES, ChatRequest, generate_trace

VLLM_DTYPES = ("float32", "bfloat16")
KVFLEET_CMD = f"{sys.executable} -m kvfleet engine --model smollm2 --host 127.0.0.1 --port 8001"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    tpot: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""


@dataclass
class LevelResult:
    target: str
    concurrency: int
    num_requests: int
    failed: int
    wall_s: float
    output_tokens: int
    output_tok_s: float
    req_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    errors: list[str] = field(default_factory=list)


def percentile(xs: list[float], q: float) -> float:
    """q in 0..1 (kvfleet.bench.metrics.percentile takes 0..100: one interpolation rule for both)."""
    return bench_percentile(xs, q * 100)


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> RequestResult:
    """One streamed request; its SSE lines are read by kvfleet.bench.records (one parser for both benches)."""
    t0 = time.perf_counter()
    lines: list[tuple[float, str]] = []
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                return RequestResult(False, error=f"HTTP {resp.status}: {text}")
            async for raw in resp.content:  # one SSE line per iteration
                lines.append((time.perf_counter() - t0, raw.decode("utf-8", "replace")))
    except (TimeoutError, aiohttp.ClientError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}"[:200])
    rec = record_from_sse(lines, scenario="", start_s=0.0, end_s=time.perf_counter() - t0)
    if not rec.ok:
        return RequestResult(False, error="no tokens received" if rec.error == "no_tokens" else rec.error)
    return RequestResult(True, rec.ttft_s or 0.0, rec.tpot_s or 0.0, rec.end_s, rec.output_tokens)


async def run_level(url: str, model: str | list[str], trace: list[ChatRequest], concurrency: int, name: str,
                    temperature: float, timeout: float) -> LevelResult:
    """model: one for every request, or one per request of the trace (the warm-up takes the first)."""
    models = [model] * len(trace) if isinstance(model, str) else model
    extra = {"stream": True, "stream_options": {"include_usage": True}, "temperature": temperature,
             "logit_bias": {"2": -100}, "ignore_eos": True}
    # a connection per request, as every server gets it: llama.cpp's server drops a kept-alive connection that the
    # client then writes its next request to (half of a run's requests failed that way)
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await one_request(session, url, trace[0].body(models[0], **{**extra, "max_tokens": 4}))  # warm-up
        queue = list(reversed(list(zip(trace, models, strict=True))))
        results: list[RequestResult] = []

        async def worker() -> None:
            while queue:
                r, m = queue.pop()
                results.append(await one_request(session, url, r.body(m, **extra)))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    return LevelResult(name, concurrency, len(results), len(results) - len(ok), wall, out_tokens,
                       out_tokens / wall, len(ok) / wall,
                       percentile([r.ttft for r in ok], 0.5), percentile([r.ttft for r in ok], 0.99),
                       percentile([r.tpot for r in ok], 0.5), percentile([r.tpot for r in ok], 0.99),
                       sorted({r.error for r in results if not r.ok})[:5])


def print_table(results: list[LevelResult]) -> None:
    print(f"{'target':<10} {'conc':>4} {'reqs':>5} {'fail':>4} {'out tok/s':>10} {'req/s':>7} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    for r in results:
        print(f"{r.target:<10} {r.concurrency:>4} {r.num_requests:>5} {r.failed:>4} {r.output_tok_s:>10.1f} "
              f"{r.req_s:>7.2f} {r.ttft_p50 * 1e3:>7.0f}ms {r.ttft_p99 * 1e3:>7.0f}ms "
              f"{r.tpot_p50 * 1e3:>7.1f}ms {r.tpot_p99 * 1e3:>7.1f}ms")
        for e in r.errors:
            print(f"    error: {e}")


def print_ratios(results: list[LevelResult], names: list[str]) -> None:
    base = names[0]
    by = {(r.target, r.concurrency): r for r in results}
    for other in names[1:]:
        print(f"\n{base} vs {other} (throughput: >1 is {base} ahead; latency: <1 is {base} ahead)")
        for c in sorted({r.concurrency for r in results}):
            a, b = by.get((base, c)), by.get((other, c))
            if a and b and b.output_tok_s > 0:
                print(f"  c={c:<3} out tok/s x{a.output_tok_s / b.output_tok_s:.2f}   "
                      f"TTFT p50 x{a.ttft_p50 / b.ttft_p50:.2f}   TPOT p50 x{a.tpot_p50 / b.tpot_p50:.2f}")


def print_pooled_ratios(results: list[LevelResult], names: list[str]) -> None:
    """Over all rounds: output tokens / wall time summed per target, and the median of per-round ratios."""
    base = names[0]
    for other in names[1:]:
        print(f"\n{base} vs {other}, all rounds pooled (tokens over total time; per-round ratios in brackets)")
        for c in sorted({r.concurrency for r in results}):
            mine = [r for r in results if r.target.split("#")[0] == base and r.concurrency == c]
            theirs = [r for r in results if r.target.split("#")[0] == other and r.concurrency == c]
            if not mine or not theirs:
                continue
            rate = lambda rs: sum(r.output_tokens for r in rs) / sum(r.wall_s for r in rs)  # noqa: E731
            per_round = [m.output_tok_s / t.output_tok_s for m, t in zip(mine, theirs, strict=False)
                         if t.output_tok_s > 0]
            print(f"  c={c:<3} out tok/s {rate(mine):.1f} vs {rate(theirs):.1f} = x{rate(mine) / rate(theirs):.2f}   "
                  f"[{', '.join(f'x{x:.2f}' for x in per_round)}]")


def add_target_args(ap: argparse.ArgumentParser) -> None:
    """The flags that say which servers to measure (shared by the HTTP benchmarks)."""
    ap.add_argument("--target", action="append", default=[], metavar="NAME=URL")
    ap.add_argument("--start", action="append", default=[], metavar="NAME=CMD",
                    help="shell command that starts NAME's server for its turn (stopped afterwards)")
    ap.add_argument("--with-kvfleet", action="store_true", help="start `kvfleet engine` on :8001 for its turn")
    ap.add_argument("--kvfleet-args", default="", help="extra flags for the started kvfleet engine")
    ap.add_argument("--with-vllm", action="store_true", help="start vLLM-CPU (peers README) on :8200 for its turn")
    ap.add_argument("--vllm-dtype", choices=VLLM_DTYPES, default="bfloat16")
    ap.add_argument("--vllm-threads-bind", default="0-1",
                    help="VLLM_CPU_OMP_THREADS_BIND for the started vLLM ('' = its default: one core)")
    ap.add_argument("--with-llamacpp", action="store_true",
                    help="start llama.cpp's llama-server (../shared/peers/setup_llamacpp.sh) on :8300 for its turn, "
                         "serving the bundled GGUF")
    ap.add_argument("--llamacpp-bin", default=None,
                    help="the llama-server binary (default: <peers-dir>/llamacpp/llama-server)")
    ap.add_argument("--peers-dir", default=str(peers_dir()),
                    help="where vLLM's venv and the converted model are (env KVFLEET_PEERS_DIR; default: .peers/)")
    ap.add_argument("--model", default="smollm2")


def turns(targets: dict[str, str], starts: dict[str, str], rounds: int, timeout: float,
          log_prefix: str) -> list[tuple[Turn, str]]:
    """Every target's turns, alternating (A B A B ...) so a slow spell of the machine hits each one."""
    return [(Turn(name if rounds == 1 else f"{name}#{rnd}", starts.get(name), url, timeout,
                  os.path.join(tempfile.gettempdir(), f"{log_prefix}_{name}.log")), url)
            for rnd in range(1, rounds + 1) for name, url in targets.items()]


def resolve_targets(a: argparse.Namespace, max_model_len: int = 2048) -> tuple[dict[str, str], dict[str, str]]:
    """(name -> URL, name -> command starting it for its turn) from add_target_args' flags."""
    targets = dict(t.split("=", 1) for t in a.target)
    starts = dict(s.split("=", 1) for s in a.start)
    if a.with_kvfleet:
        targets.setdefault("kvfleet", "http://127.0.0.1:8001")
        starts.setdefault("kvfleet", f"{KVFLEET_CMD} --max-model-len {max_model_len}"
                                     + (" " + a.kvfleet_args if a.kvfleet_args else ""))
    if a.with_vllm:
        targets.setdefault("vllm", "http://127.0.0.1:8200")
        starts.setdefault("vllm", vllm_cmd(a.vllm_dtype, a.vllm_threads_bind or None, Path(a.peers_dir), max_model_len))
    if a.with_llamacpp:
        binary = Path(a.llamacpp_bin) if a.llamacpp_bin else Path(a.peers_dir) / "llamacpp" / "llama-server"
        if not binary.exists():
            raise SystemExit(f"--with-llamacpp: no llama-server at {binary}; build it with DIR={binary.parent} bash "
                             "../shared/peers/setup_llamacpp.sh, or name it with --llamacpp-bin")
        targets.setdefault("llamacpp", "http://127.0.0.1:8300")
        starts.setdefault("llamacpp", llamacpp_cmd(binary))
    if not targets:
        raise SystemExit("give at least one --target NAME=URL (or --with-kvfleet / --with-vllm / --with-llamacpp)")
    return targets, starts


async def amain(a: argparse.Namespace) -> list[LevelResult]:
    targets, starts = resolve_targets(a)
    sizes = {c: max(a.num_requests, a.min_waves * c) for c in a.concurrency}
    trace = generate_trace(max(sizes.values()), a.seed, a.mode, max_output_tokens=a.max_output_tokens,
                           min_output_tokens=min(a.min_output_tokens, a.max_output_tokens))
    print(f"trace: mode {a.mode}, seed {a.seed}; requests per level "
          f"{', '.join(f'c={c}: {n}' for c, n in sizes.items())} (the first n of one trace)", flush=True)
    results = []
    for turn, url in turns(targets, starts, a.rounds, a.start_timeout, "http_bench"):
        async with turn:
            for c in a.concurrency:
                r = await run_level(url, a.model, trace[:sizes[c]], c, turn.name, a.temperature, a.request_timeout)
                results.append(r)
                print_table([r])
                sys.stdout.flush()
    print()
    print_table(results)
    if a.rounds == 1:
        print_ratios(results, list(targets))
    else:
        for rnd in range(1, a.rounds + 1):
            print_ratios(results, [f"{n}#{rnd}" for n in targets])
        print_pooled_ratios(results, list(targets))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_args(ap)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--num-requests", type=int, default=64, help="requests per concurrency level (at least)")
    ap.add_argument("--min-waves", type=int, default=2,
                    help="at least this many requests per worker at each level (steadier figures at high concurrency)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=MODES, default="single")
    ap.add_argument("--min-output-tokens", type=int, default=16)
    ap.add_argument("--max-output-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the targets this many times, alternating (A B A B): a noisy machine's slow spells "
                         "then hit every target; prints per-round and pooled ratios")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    results = asyncio.run(amain(a))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0 if all(r.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
