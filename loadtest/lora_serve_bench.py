"""Served output tokens/s with LoRA adapters: kvfleet's engine beside vLLM-CPU with --enable-lora, same adapters,
same trace, same concurrency.

    python -m loadtest.lora_serve_bench [--concurrency 16] [--adapters 8] [--rank 16] [--targets all|qv]
                                        [--num-requests 64] [--rounds 1] [--repeats 3] [--no-vllm]

Writes `adapters` random adapters in PEFT's format (tests/engine/lora/_adapters.py's recipe), then gives each
server a turn of its own (started with the adapters as `--lora-modules`, `--max-loras` = adapters, one request
per adapter first so every adapter is in; stopped afterwards; rounds alternate kvfleet and vLLM). In a turn the
seeded chat trace of loadtest.http_bench (EOS banned, so both produce the same tokens) runs with every request
on the base model, on the adapters drawn uniformly, and by zipf popularity (s = 1.1), the three in turn
`repeats` times. Prints a table, each mix's median rate over the same server's base model (the issue's target
on CPU: >= 0.8x) and kvfleet over vLLM per mix. vLLM needs the peers venv (../shared/peers;
KVFLEET_PEERS_DIR). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from kvfleet.bench.targets import vllm_cmd
from kvfleet.peers import peers_dir
from kvfleet.workload import generate_trace
from loadtest.http_bench import KVFLEET_CMD, LevelResult, print_table, run_level, turns

TARGETS = {"all": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
           "qv": ("q_proj", "v_proj")}


def write_adapters(root: str, n: int, rank: int, targets: tuple[str, ...]) -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.engine.lora._adapters import write_adapter

    return {f"a{i}": write_adapter(os.path.join(root, f"a{i}"), rank, targets, seed=i) for i in range(n)}


def mixes(adapters: list[str], n: int, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    zipf = [1 / (k + 1) ** 1.1 for k in range(len(adapters))]
    return {"base": ["smollm2"] * n, "uniform": [adapters[i % len(adapters)] for i in range(n)],
            "zipf": rng.choices(adapters, zipf, k=n)}


def commands(paths: dict[str, str], rank: int, peers: Path, with_vllm: bool) -> dict[str, str]:
    modules = " ".join(f"{name}={path}" for name, path in paths.items())
    lora = f"--lora-modules {modules} --max-loras {len(paths)} --max-lora-rank {rank}"
    out = {"kvfleet": f"{KVFLEET_CMD} --max-model-len 2048 {lora}"}
    if with_vllm:
        out["vllm"] = f"{vllm_cmd('bfloat16', '0-1', peers, 2048)} --enable-lora {lora} --max-cpu-loras {len(paths)}"
    return out


async def amain(ns: argparse.Namespace) -> list[LevelResult]:
    paths = write_adapters(tempfile.mkdtemp(prefix="lora-serve-bench-"), ns.adapters, ns.rank, TARGETS[ns.targets])
    trace = generate_trace(ns.num_requests, ns.seed, "single", max_output_tokens=128, min_output_tokens=16)
    by_mix = mixes(list(paths), len(trace), ns.seed)
    starts = commands(paths, ns.rank, Path(ns.peers_dir), not ns.no_vllm)
    urls = {"kvfleet": "http://127.0.0.1:8001", "vllm": "http://127.0.0.1:8200"}
    results = []
    for turn, url in turns({k: urls[k] for k in starts}, starts, ns.rounds, 900, "lora_serve_bench"):
        async with turn:
            await run_level(url, list(paths), trace[:len(paths)], len(paths), "warm", 0.0, 900)  # every adapter in
            for _ in range(ns.repeats):
                for mix, models in by_mix.items():
                    r = await run_level(url, models, trace, ns.concurrency, f"{turn.name.split('#')[0]}:{mix}", 0.0, 900)
                    print_table([r])
                    results.append(r)
    return results


def report(results: list[LevelResult]) -> None:
    rate: dict[str, float] = {}
    for name in dict.fromkeys(r.target for r in results):
        rate[name] = statistics.median(r.output_tok_s for r in results if r.target == name)
    print("\nmedian output tokens/s over the runs, and the ratio to the same server's base model")
    for name, value in rate.items():
        server, mix = name.split(":")
        print(f"  {name:<18} {value:8.1f} tok/s  {value / rate[f'{server}:base']:.2f}x base")
    if any(n.startswith("vllm:") for n in rate):
        print("kvfleet over vLLM-CPU, same mix")
        for mix in ("base", "uniform", "zipf"):
            print(f"  {mix:<8} {rate[f'kvfleet:{mix}'] / rate[f'vllm:{mix}']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.lora_serve_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", choices=tuple(TARGETS), default="all")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="turns per server, alternating kvfleet and vLLM")
    ap.add_argument("--repeats", type=int, default=3, help="times the three mixes run in a turn, in turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true", help="kvfleet only")
    ap.add_argument("--peers-dir", default=str(peers_dir()), help="vLLM's venv and model (env KVFLEET_PEERS_DIR)")
    ns = ap.parse_args(argv)
    report(asyncio.run(amain(ns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
