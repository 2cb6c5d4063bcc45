#!/usr/bin/env bash
# One-command GPU check of the attention kernels (issue 5), unattended, well under 10 minutes on an H100/H200:
#   1. device copy bandwidth, then paged decode at batch 1/16/64/256 x context 512/2K/8K (do_bench median):
#      GB/s, fraction of copy bandwidth, next to torch SDPA on contiguous K/V; a decode launch-shape sweep;
#   2. the kernel tests and the engine greedy test, compiled (TRITON_INTERPRET=0) on the GPU;
#   3. the engine's offline throughput on SmolLM2 with the triton backend (loadtest/offline_throughput.py).
# Prints one short table last; full numbers go to $OUT/gpu_check/ (or ./results/gpu_check/).
# Without a CUDA GPU: says so, runs the kernel tests in Triton's interpreter, exits with their status (0 = pass).
#
# usage: loadtest/gpu_check.sh [--full]     --full also runs the slow full test matrix (adds a few minutes)
# env:   PYTHON=/path/to/python (default: the first of .venv/bin/python, python3, python that sees a CUDA GPU)
set -uo pipefail  # not -e: every step runs and reports; the exit status is the worst step's

cd "$(dirname "$0")/.."
FULL=0
for arg in "$@"; do
  case "$arg" in
    --full) FULL=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$arg' (try --help)" >&2; exit 2 ;;
  esac
done

RESULTS="${OUT:-./results}/gpu_check"
mkdir -p "$RESULTS"
LOG="$RESULTS/log.txt"
: > "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/kvfleet_triton_cache}"  # not under $OUT
export HF_HUB_OFFLINE=1
say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

has_cuda() { timeout 60 "$1" -c 'import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
has_mod() { timeout 60 "$1" -c "import $2" >/dev/null 2>&1; }

PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
  [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
  if has_cuda "$cand"; then PY="$cand"; break; fi
done

# ---- no GPU: interpreter tests only --------------------------------------------------------------
if [ -z "$PY" ]; then
  say "no CUDA GPU visible to any python with torch+triton ($(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | head -1 || echo 'no nvidia-smi'))"
  IPY=""
  for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    if has_mod "$cand" "torch, triton, pytest"; then IPY="$cand"; break; fi
  done
  if [ -z "$IPY" ]; then
    say "no python with torch, triton and pytest found: nothing to run (make install first)"; exit 1
  fi
  say "running the kernel tests in Triton's interpreter on the CPU ($IPY)"
  TRITON_INTERPRET=1 timeout 900 "$IPY" -m pytest tests/engine/test_triton_kernels.py tests/engine/test_triton_engine.py \
      -q -p no:cacheprovider 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  echo "{\"gpu\": false, \"interpreter_tests_rc\": $rc}" > "$RESULTS/gpu_check.json"
  say "no GPU: interpreter tests $([ "$rc" = 0 ] && echo passed || echo "FAILED (rc=$rc)"); results in $RESULTS"
  exit "$rc"
fi

# ---- GPU ------------------------------------------------------------------------------------------
GPU_NAME="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)"
say "GPU: $GPU_NAME; python $PY ($("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
STATUS_TESTS="not run"; STATUS_BENCH="not run"; STATUS_THROUGHPUT="not run"; WORST=0
note_rc() { [ "$1" -gt "$WORST" ] && WORST="$1"; }

# 1. paged decode benchmark
say "step 1: copy bandwidth + paged decode benchmark + launch-shape sweep (limit 220s)"
timeout 220 "$PY" -m loadtest.bench_paged_decode --batches 1,16,64,256 --contexts 512,2048,8192 --sweep 64,2048 \
    --json "$RESULTS/bench_paged_decode.json" 2>&1 | tee "$RESULTS/bench_paged_decode.txt" | tee -a "$LOG"
rc=${PIPESTATUS[0]}
case "$rc" in 0) STATUS_BENCH="done" ;; 124) STATUS_BENCH="TIMED OUT after 220s" ;; *) STATUS_BENCH="FAILED (rc=$rc)" ;; esac
note_rc "$rc"

# 2. kernel tests, compiled
if has_mod "$PY" pytest; then
  MARK="not slow"; TLIMIT=200
  if [ "$FULL" = 1 ]; then MARK="slow or not slow"; TLIMIT=420; fi
  say "step 2: kernel tests compiled on the GPU (-m '$MARK', limit ${TLIMIT}s)"
  TRITON_INTERPRET=0 timeout "$TLIMIT" "$PY" -m pytest tests/engine/test_triton_kernels.py tests/engine/test_triton_engine.py \
      -q -p no:cacheprovider \
      -m "$MARK" -o addopts="" --junitxml="$RESULTS/kernel_tests.xml" 2>&1 | tail -25 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case "$rc" in 0) STATUS_TESTS="passed" ;; 124) STATUS_TESTS="TIMED OUT after ${TLIMIT}s" ;; *) STATUS_TESTS="FAILED (rc=$rc)" ;; esac
  note_rc "$rc"
else
  STATUS_TESTS="skipped: pytest is not installed for $PY"; say "step 2: $STATUS_TESTS"
fi

# 3. engine offline throughput on SmolLM2 with the triton backend. loadtest/offline_throughput.py (MODEL part) is
#    used when it takes --device and --attention-backend; otherwise a short inline run of the same engine
#    (triton, then torch for comparison, bf16, greedy, EOS ignored) measures it.
THR_JSON="$RESULTS/offline_throughput.json"
THR_HELP=""
if [ -f loadtest/offline_throughput.py ]; then
  THR_HELP="$(timeout 30 "$PY" -m loadtest.offline_throughput --help 2>/dev/null || true)"
fi
if grep -q -- "--attention-backend" <<< "$THR_HELP" && grep -q -- "--device" <<< "$THR_HELP"; then
  say "step 3: loadtest/offline_throughput.py on SmolLM2, triton backend (limit 110s)"
  JSON_FLAG=()
  if grep -q -- "--json" <<< "$THR_HELP"; then JSON_FLAG=(--json "$THR_JSON"); fi
  timeout 110 "$PY" -m loadtest.offline_throughput --model smollm2 --attention-backend triton --device cuda --skip-hf \
      --num-requests 64 ${JSON_FLAG[@]+"${JSON_FLAG[@]}"} 2>&1 | tail -15 | tee "$RESULTS/offline_throughput.txt" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
else
  say "step 3: engine offline throughput on SmolLM2 (inline: offline_throughput.py has no --device/--attention-backend; limit 110s)"
  timeout 110 "$PY" - "$THR_JSON" 64 <<'PYEOF' 2>&1 | grep -v -i warn | tail -15 | tee "$RESULTS/offline_throughput.txt" | tee -a "$LOG"
import json, sys, time
import torch
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from loadtest.workload import generate_trace
path, n = sys.argv[1], int(sys.argv[2])
res, tokens = {"source": "gpu_check inline run of engine.llm.LLM", "model": "smollm2", "dtype": "bfloat16"}, {}
for backend in ("triton", "torch"):
    t0 = time.perf_counter()
    llm = LLM("smollm2", device="cuda", attention_backend=backend, dtype="bfloat16", max_num_seqs=64,
              kv_cache_memory=4.0)
    load_s = time.perf_counter() - t0
    reqs = generate_trace(n, seed=0, mode="single", min_output_tokens=64, max_output_tokens=128)
    prompts = [llm.tokenizer.apply_chat_template(list(r.messages)) for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:4], params[:4])  # warm-up (kernel compilation)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    tokens[backend] = [list(o.outputs[0].token_ids) for o in outs]
    out_toks = sum(len(x) for x in tokens[backend])
    res[backend] = {"requests": n, "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": out_toks,
                    "seconds": dt, "output_tokens_per_s": out_toks / dt, "load_seconds": load_s}
    print(f"{backend}: {n} requests, {out_toks} output tokens in {dt:.2f} s = {out_toks / dt:.1f} tok/s", flush=True)
    del llm
    torch.cuda.empty_cache()
res["output_tokens_per_s"] = res["triton"]["output_tokens_per_s"]
res["triton_vs_torch"] = res["triton"]["output_tokens_per_s"] / res["torch"]["output_tokens_per_s"]
res["same_greedy_tokens_fraction"] = sum(a == b for a, b in zip(tokens["triton"], tokens["torch"])) / n
print(f"triton/torch throughput {res['triton_vs_torch']:.2f}x; identical greedy outputs "
      f"{res['same_greedy_tokens_fraction']:.0%} (bf16: small differences may flip late tokens)")
with open(path, "w") as f:
    json.dump(res, f, indent=2)
PYEOF
  rc=${PIPESTATUS[0]}
fi
case "$rc" in 0) STATUS_THROUGHPUT="done" ;; 124) STATUS_THROUGHPUT="TIMED OUT after 110s" ;; *) STATUS_THROUGHPUT="FAILED (rc=$rc)" ;; esac
note_rc "$rc"

# summary: one JSON with everything, one short table last
"$PY" - "$RESULTS" "$GPU_NAME" "$STATUS_TESTS" "$STATUS_BENCH" "$STATUS_THROUGHPUT" <<'PYEOF' | tee -a "$LOG"
import json, os, sys
res, gpu, tests, bench, thr = sys.argv[1:6]
def load(name):
    try:
        with open(os.path.join(res, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
b, t = load("bench_paged_decode.json"), load("offline_throughput.json")
summary = {"gpu": gpu, "kernel_tests": tests, "bench": bench, "offline_throughput": thr,
           "paged_decode": b, "engine_throughput": t}
with open(os.path.join(res, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
print(f"\n=== gpu_check on {gpu} ===")
print(f"kernel tests (compiled): {tests}")
if b:
    print(f"copy bandwidth: {b['copy_gbs']:.0f} GB/s   paged decode ({b['args']['dtype']}, Hq={b['args']['heads']}"
          f" Hkv={b['args']['kv_heads']} D={b['args']['head_dim']}, block {b['args']['block_size']}):")
    print(f"{'batch':>5} {'ctx':>5} {'paged us':>9} {'GB/s':>6} {'%copy':>6} {'sdpa us':>8} {'paged/sdpa':>10}")
    for r in b["rows"]:
        if "paged_ms" not in r:
            print(f"{r['batch']:>5} {r['context']:>5}  skipped"); continue
        sd = f"{r['sdpa_ms']*1e3:>8.1f} {r['paged_vs_sdpa_time']:>10.2f}" if "sdpa_ms" in r else f"{'-':>8} {'-':>10}"
        print(f"{r['batch']:>5} {r['context']:>5} {r['paged_ms']*1e3:>9.1f} {r['paged_gbs']:>6.0f} "
              f"{100*r['paged_frac_copy']:>5.0f}% {sd}")
    tg = b["targets"]
    print(f"targets (ctx>=2K, batch>=16): min %copy {tg['min_frac_copy']} (>=0.70: {tg['frac_copy_ok']}); "
          f"max paged/sdpa time {tg['max_time_vs_sdpa']} (<=1.10: {tg['vs_sdpa_ok']})")
    best = next((r for r in b.get("sweep", []) if "paged_ms" in r), None)
    if best:
        print(f"best decode launch at batch/ctx {b['args']['sweep']}: block_n {best['block_n']} warps "
              f"{best['num_warps']} stages {best['num_stages']} ({100*best['paged_frac_copy']:.0f}% of copy)")
else:
    print(f"paged decode benchmark: {bench}")
if t:
    keys = [k for k in ("output_tokens_per_s", "triton_vs_torch", "same_greedy_tokens_fraction") if k in t]
    print("engine offline throughput (SmolLM2, triton): "
          + (", ".join(f"{k}={t[k]:.2f}" for k in keys) if keys else json.dumps(t)[:300]))
else:
    print(f"engine offline throughput: {thr}")
print(f"full results: {os.path.join(res, 'gpu_check.json')}")
PYEOF
exit "$WORST"
