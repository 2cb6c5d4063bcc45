#!/usr/bin/env bash
# One-command GPU check of the engine's CUDA path (issues 5, 19 and 50), unattended, at most 8 minutes in the worst
# case (every step has its own timeout; the limits below add up to <= 480 s and are checked before anything runs).
# Needs no checkpoint and no bundled model: random-weight models of real shapes are built on the device.
#   1. kernel tests compiled on the GPU (TRITON_INTERPRET=0), in parallel (pytest -n 8 when pytest-xdist is
#      there), the full matrix plus bf16 at Llama-3-8B / Qwen2.5-7B shapes (head_dim 128, GQA 4 and 7) against
#      SDPA and float32 references, and the engine on a tiny model with the triton backend (greedy tokens against
#      the torch backend; speculation with a draft model: its own runner and the k+1 verifying rows per sequence);
#      JUnit XML rewritten after every test, so it exists even after a timeout;
#   2. paged decode vs measured copy bandwidth and contiguous SDPA, batch 1/16/64/256 x context 512/2K/8K, at
#      both shapes (pass mark at context >= 2K, batch >= 16: >= 85% of copy bandwidth, <= 1.10x SDPA's time);
#   3. the engine on the Llama-3-8B-shaped model (all 32 layers, bf16): offline throughput at batch
#      1/16/64/256 with and without CUDA graphs, greedy tokens compared, host time per decode step beside GPU time;
#   4. every Triton variant the engine compiles (python -m loadtest.gpu_compile --device), compiled for this device:
#      registers, spills, shared memory, occupancy, tensor-core use and expected time per call, the same table
#      `make gpu-compile` prints for sm_90 / sm_100 on a CPU machine, so the two can be compared.
# Results: $OUT/gpu_check/ (or ./results/gpu_check/): gpu_check.json, gpu_check.md, and every step's whole log.
# Without a CUDA GPU: says so, runs the interpreter subset (kernel, layer and decode-input tests; an engine smoke
# run on a tiny shape) under its own limits, and exits with the tests' status.
#
# usage: loadtest/gpu_check.sh        env: PYTHON=/path/to/python (default: the first of .venv/bin/python,
#                                          python3, python that sees a CUDA GPU)
set -uo pipefail  # not -e: every step runs and reports; the exit status is the worst step's

cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help) sed -n '2,20p' "$0"; exit 0 ;; "") ;; *) echo "gpu_check: no arguments (try --help)" >&2; exit 2 ;; esac

# ---- time budget (seconds). Worst case = sum of the limits of the steps that run + a kill grace per step ----
KILL_GRACE=5           # timeout -k: a step that ignores SIGINT/SIGTERM is killed this much later
LIMIT_PROBE=30         # find a python that sees CUDA (all candidates together)
LIMIT_TESTS=130        # GPU: compiled kernel tests
LIMIT_BENCH=100        # GPU: paged decode benchmark, two shapes
LIMIT_ENGINE=130       # GPU: engine on the 8B-shaped model, eager and CUDA graphs
LIMIT_COMPILE=40       # GPU: the variant table for this device (~117 variants, 8 compile processes)
LIMIT_REPORT=15        # summary JSON + Markdown
LIMIT_ITESTS=300       # no GPU: interpreter tests
LIMIT_ISMOKE=90        # no GPU: engine smoke run (tiny shape, interpreter)
GPU_WORST=$((LIMIT_PROBE + LIMIT_TESTS + LIMIT_BENCH + LIMIT_ENGINE + LIMIT_COMPILE + LIMIT_REPORT + 6 * KILL_GRACE))  # 475
CPU_WORST=$((LIMIT_PROBE + LIMIT_ITESTS + LIMIT_ISMOKE + LIMIT_REPORT + 4 * KILL_GRACE))                # 455
if [ "$GPU_WORST" -gt 480 ] || [ "$CPU_WORST" -gt 480 ]; then
  echo "gpu_check: step limits add up to ${GPU_WORST}s (GPU) / ${CPU_WORST}s (no GPU), over 480s" >&2; exit 2
fi

RESULTS="${OUT:-./results}/gpu_check"
mkdir -p "$RESULTS"
LOG="$RESULTS/log.txt"
: > "$LOG"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/kvfleet_triton_cache}"  # not under $OUT
export HF_HUB_OFFLINE=1
T0=$(date +%s)
say() { echo "[gpu_check $(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
status_of() { case "$1" in 0) echo "passed" ;; 124|130|137) echo "TIMED OUT after ${2}s" ;; *) echo "FAILED (rc=$1)" ;; esac; }
WORST=0
note_rc() { [ "$1" -gt "$WORST" ] && WORST="$1"; }
# run_step NAME LIMIT CMD...: whole output to $RESULTS/NAME.log and the console; SIGINT at the limit, SIGKILL
# KILL_GRACE later. pytest steps write JUnit XML after every test (loadtest/junit_live.py), so a stopped run
# leaves the tests finished so far
run_step() {
  local name="$1" limit="$2"; shift 2
  timeout -s INT -k "$KILL_GRACE" "$limit" "$@" > >(tee "$RESULTS/$name.log" | tee -a "$LOG") 2>&1
  local rc=$?
  wait  # the tee of the process substitution
  return "$rc"
}
# junit_or_stub FILE STEP STATUS: make sure a JUnit file exists (a step killed before pytest wrote one gets a stub)
junit_or_stub() {
  [ -s "$1" ] && return 0
  cat > "$1" <<EOF
<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="$2" tests="1" errors="1" failures="0" skipped="0"><testcase classname="gpu_check" name="$2"><error message="$3">pytest wrote no JUnit report: $3 (see $2.log)</error></testcase></testsuite></testsuites>
EOF
}

say "time budget: GPU run ${GPU_WORST}s worst case (probe ${LIMIT_PROBE} + tests ${LIMIT_TESTS} + bench ${LIMIT_BENCH} + engine ${LIMIT_ENGINE} + compile table ${LIMIT_COMPILE} + report ${LIMIT_REPORT} + 6 x ${KILL_GRACE} kill grace); no-GPU run ${CPU_WORST}s"

# ---- step 0: a python that sees CUDA (one limit for all candidates) ------------------------------------------
export PROBE='import torch, triton, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
PY="$(timeout -k "$KILL_GRACE" "$LIMIT_PROBE" bash -c '
  for cand in "$@"; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    if "$cand" -c "$PROBE" >/dev/null 2>&1; then echo "$cand"; exit 0; fi
  done' _ "${PYTHON:-}" .venv/bin/python python3 python)" || true

has_mod() { timeout 20 "$1" -c "import $2" >/dev/null 2>&1; }
XDIST=()

# ---- no GPU: the interpreter subset ----------------------------------------------------------------------------
if [ -z "$PY" ]; then
  say "NO GPU: no CUDA GPU visible to any python with torch+triton ($(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | head -1 || echo 'no nvidia-smi')); running the interpreter subset"
  IPY=""
  for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$cand" ] && command -v "$cand" >/dev/null 2>&1 || continue
    if has_mod "$cand" "torch, triton, pytest"; then IPY="$cand"; break; fi
  done
  if [ -z "$IPY" ]; then
    say "no python with torch, triton and pytest found: nothing to run (make install first)"
    echo '{"gpu": false, "error": "no python with torch, triton and pytest"}' > "$RESULTS/gpu_check.json"; exit 1
  fi
  if has_mod "$IPY" xdist; then XDIST=(-n 2); fi
  say "step 1 (no GPU): kernel, layer and decode-input tests in Triton's interpreter ($IPY, limit ${LIMIT_ITESTS}s)"
  run_step interpreter_tests "$LIMIT_ITESTS" env TRITON_INTERPRET=1 "$IPY" -m pytest \
      tests/engine/kernels/test_triton_kernels.py tests/engine/kernels/test_triton_layers.py tests/engine/test_decode_inputs.py \
      tests/engine/kernels/test_triton_lora.py tests/engine/test_triton_engine.py -k "not test_engine_greedy_tokens_equal_with_persistent" \
      -q -p no:cacheprovider ${XDIST[@]+"${XDIST[@]}"} -p loadtest.junit_live --junit-live "$RESULTS/interpreter_tests.xml"
  rc=$?; S_TESTS="$(status_of "$rc" "$LIMIT_ITESTS")"; note_rc "$rc"
  junit_or_stub "$RESULTS/interpreter_tests.xml" interpreter_tests "$S_TESTS"
  say "step 2 (no GPU): engine smoke run, tiny random model, triton backend in the interpreter (limit ${LIMIT_ISMOKE}s)"
  run_step engine_smoke "$LIMIT_ISMOKE" env TRITON_INTERPRET=1 "$IPY" -m loadtest.gpu_engine_bench --shape tiny --device cpu \
      --batches 1,4 --prompt-len 16 --output-len 4 --json "$RESULTS/engine_smoke.json"
  rc=$?; S_SMOKE="$(status_of "$rc" "$LIMIT_ISMOKE")"
  timeout -k "$KILL_GRACE" "$LIMIT_REPORT" "$IPY" - "$RESULTS" "$S_TESTS" "$S_SMOKE" <<'PYEOF' | tee -a "$LOG"
import json, os, sys
res, tests, smoke = sys.argv[1:4]
summary = {"gpu": False, "interpreter_tests": tests, "engine_smoke": smoke,
           "note": "no CUDA GPU: kernels ran in Triton's interpreter on the CPU; no timing here is a measurement"}
with open(os.path.join(res, "gpu_check.json"), "w") as f:
    json.dump(summary, f, indent=2)
md = ["# gpu_check: NO GPU", "", "No CUDA GPU was visible: only the interpreter subset ran.", "",
      f"- interpreter tests (kernels, layer kernels, decode inputs, engine with the triton backend): **{tests}**",
      f"- engine smoke run (tiny random model, interpreter): **{smoke}**", ""]
with open(os.path.join(res, "gpu_check.md"), "w") as f:
    f.write("\n".join(md))
print("\n".join(md))
PYEOF
  say "NO GPU: interpreter tests ${S_TESTS}, engine smoke ${S_SMOKE}; results in $RESULTS (total $(( $(date +%s) - T0 ))s)"
  exit "$WORST"
fi

# ---- GPU ----------------------------------------------------------------------------------------------------------
GPU_NAME="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null)"
say "GPU: $GPU_NAME; python $PY ($("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1))"
if has_mod "$PY" xdist; then XDIST=(-n 8); else say "pytest-xdist missing: the tests run serially"; fi
PTIMEOUT=()
if has_mod "$PY" pytest_timeout; then PTIMEOUT=(--timeout 100); fi

# 1. kernel tests, compiled: everything in the kernel, layer and real-shape files, slow ones included
S_TESTS="skipped: pytest is not installed for $PY"
if has_mod "$PY" pytest; then
  say "step 1: kernel tests compiled on the GPU, slow included (limit ${LIMIT_TESTS}s)"
  run_step kernel_tests "$LIMIT_TESTS" env TRITON_INTERPRET=0 "$PY" -m pytest \
      tests/engine/kernels/test_triton_kernels.py tests/engine/kernels/test_triton_layers.py tests/engine/kernels/test_triton_real_shapes.py \
      tests/engine/kernels/test_triton_lora.py tests/engine/lora/test_lora_triton_engine.py \
      tests/engine/test_triton_engine.py -m "slow or not slow" -o addopts="" -q -p no:cacheprovider -rfE \
      ${XDIST[@]+"${XDIST[@]}"} ${PTIMEOUT[@]+"${PTIMEOUT[@]}"} -p loadtest.junit_live --junit-live "$RESULTS/kernel_tests.xml"
  rc=$?; S_TESTS="$(status_of "$rc" "$LIMIT_TESTS")"; note_rc "$rc"
  junit_or_stub "$RESULTS/kernel_tests.xml" kernel_tests "$S_TESTS"
fi

# 2. paged decode benchmark at both shapes
say "step 2: copy bandwidth + paged decode vs SDPA, Llama-3-8B then Qwen2.5-7B attention shapes (limit ${LIMIT_BENCH}s)"
run_step bench_paged_decode "$LIMIT_BENCH" bash -c '
  "$1" -m loadtest.bench_paged_decode --heads 32 --kv-heads 8 --head-dim 128 --batches 1,16,64,256 \
      --contexts 512,2048,8192 --json "$2/bench_llama3-8b.json" || exit $?
  "$1" -m loadtest.bench_paged_decode --heads 28 --kv-heads 4 --head-dim 128 --batches 1,16,64,256 \
      --contexts 512,2048,8192 --copy-gib 1 --json "$2/bench_qwen2.5-7b.json"' _ "$PY" "$RESULTS"
rc=$?; S_BENCH="$(status_of "$rc" "$LIMIT_BENCH")"; note_rc "$rc"

# 3. engine on the 8B-shaped model, eager then CUDA graphs
say "step 3: engine on a random Llama-3-8B-shaped model (32 layers, bf16), eager and CUDA graphs (limit ${LIMIT_ENGINE}s)"
run_step engine "$LIMIT_ENGINE" "$PY" -m loadtest.gpu_engine_bench --shape llama3-8b --batches 1,16,64,256 \
    --prompt-len 128 --output-len 64 --modes eager,graphs --json "$RESULTS/engine.json"
rc=$?; S_ENGINE="$(status_of "$rc" "$LIMIT_ENGINE")"; note_rc "$rc"

# 4. the compile table of every engine variant, for this device's architecture and SM count
say "step 4: every engine Triton variant compiled for this device: registers, spills, smem, occupancy, tensor cores (limit ${LIMIT_COMPILE}s)"
run_step gpu_compile "$LIMIT_COMPILE" "$PY" -m loadtest.gpu_compile --device --jobs 8 --json "$RESULTS/gpu_compile.json" \
    --markdown "$RESULTS/gpu_compile.md"
rc=$?; S_COMPILE="$(status_of "$rc" "$LIMIT_COMPILE")"; note_rc "$rc"

# summary: gpu_check.json (everything) and gpu_check.md (the tables)
timeout -k "$KILL_GRACE" "$LIMIT_REPORT" "$PY" -m loadtest.gpu_check_report "$RESULTS" "$GPU_NAME" "$S_TESTS" "$S_BENCH" \
    "$S_ENGINE" "$S_COMPILE" 2>&1 | tee -a "$LOG"
say "done in $(( $(date +%s) - T0 ))s (worst case allowed ${GPU_WORST}s); results in $RESULTS"
exit "$WORST"
