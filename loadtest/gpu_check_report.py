"""The summary of loadtest/gpu_check.sh: gpu_check.json (every result) and gpu_check.md (tables and pass marks).

    python -m loadtest.gpu_check_report RESULTS_DIR GPU_NAME TESTS_STATUS BENCH_STATUS ENGINE_STATUS [COMPILE_STATUS]
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET


def load(res: str, name: str) -> dict | None:
    try:
        with open(os.path.join(res, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def junit_counts(path: str) -> dict | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}
    counts["incomplete"] = any(p.get("name") == "incomplete" and p.get("value") == "true" for p in root.iter("property"))
    return counts


def bench_md(name: str, b: dict) -> list[str]:
    a = b["args"]
    out = [f"### paged decode, {name} (Hq={a['heads']} Hkv={a['kv_heads']} D={a['head_dim']}, {a['dtype']}, "
           f"block {a['block_size']}); copy bandwidth {b['copy_gbs']:.0f} GB/s", "",
           "paged us: the step's kernels replayed from a CUDA graph (timed `graph`), or the whole eager call where "
           "capture failed (`eager`); eager us: the whole eager call, Python planning and launches included.", "",
           "| batch | context | splits | paged us | timed | GB/s | % copy | SDPA us | paged/SDPA time | eager us |",
           "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in b["rows"]:
        if "paged_ms" not in r:
            out.append(f"| {r['batch']} | {r['context']} | skipped: {r.get('skipped')} | | | | | | | |")
            continue
        sd = (f"{r['sdpa_ms'] * 1e3:.1f} | {r['paged_vs_sdpa_time']:.2f}" if "sdpa_ms" in r else "- | -")
        eager = f"{r['eager_ms'] * 1e3:.1f}" if "eager_ms" in r else "-"
        out.append(f"| {r['batch']} | {r['context']} | {r['num_splits']} | {r['paged_ms'] * 1e3:.1f} | "
                   f"{r.get('paged_timed', 'eager')} | {r['paged_gbs']:.0f} | {100 * r['paged_frac_copy']:.0f}% | {sd} "
                   f"| {eager} |")
        if "graph_error" in r:
            out.append(f"| | | graph capture failed: {r['graph_error']} | | | | | | | |")
    t = b["targets"]
    out += ["", f"pass mark (context >= 2K, batch >= 16): min {_num(t['min_frac_copy'])} of copy bandwidth "
                f"(>= 0.85: **{t['frac_copy_ok']}**); max paged/SDPA time {_num(t['max_time_vs_sdpa'])} "
                f"(<= 1.10: **{t['vs_sdpa_ok']}**)", ""]
    return out


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def engine_md(e: dict) -> list[str]:
    out = [f"### engine, {e['shape']['name']}-shaped random model ({e['layers']} layers, bf16), prompt "
           f"{e['prompt_len']} + output {e['output_len']} tokens per request", "",
           "| mode | batch | output tok/s | decode steps | host ms/step | GPU ms/step | engine step ms |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for mode, m in e["modes"].items():
        for b, r in m["batches"].items():
            ms = [_num(r.get(k)) for k in ("decode_host_ms_median", "decode_gpu_ms_median", "engine_step_wall_ms_median")]
            out.append(f"| {mode} | {b} | {r['output_tokens_per_s']:.1f} | {r['decode_steps']} | " + " | ".join(ms) + " |")
        out.append(f"| {mode} | load + warm-up | {m['load_and_warmup_s']:.1f} s | | | | |")
    if "greedy_equal" in e:
        out += ["", f"greedy tokens equal, eager vs CUDA graphs: {e['greedy_equal']} (all: **{e['greedy_equal_all']}**)"]
        for b, d in e.get("divergence", {}).items():
            if d["identical"] < d["sequences"]:
                gaps = ", ".join("not in top 20" if g is None else f"{g:.3f}" for g in d["logprob_gaps"])
                out.append(f"- batch {b}: {d['identical']}/{d['sequences']} sequences identical; first differences at "
                           f"tokens {d['first_difference_at']}; the two tokens' logprob gap there: {gaps}")
    return out + [""]


def compile_md(res: str, c: dict) -> list[str]:
    """The variant table loadtest.gpu_compile wrote for this device, and the failures it named."""
    rows = c.get("rows", [])
    out = [f"## Every engine Triton variant, compiled for this device ({len(rows)} variants, "
           f"{len(c.get('failures', []))} failing)", ""]
    out += [f"- FAIL {line}" for line in c.get("failures", [])]
    try:
        with open(os.path.join(res, "gpu_compile.md")) as f:
            out += ["", f.read()]
    except OSError:
        pass
    return out + [""]


def main(argv: list[str]) -> int:
    res, gpu, tests, bench, engine = argv[:5]
    compiled = argv[5] if len(argv) > 5 else "not run"
    table = load(res, "gpu_compile.json")
    junit = junit_counts(os.path.join(res, "kernel_tests.xml"))
    benches = {n: load(res, f"bench_{n}.json") for n in ("llama3-8b", "qwen2.5-7b")}
    eng = load(res, "engine.json")
    summary = {"gpu": gpu, "kernel_tests": tests, "kernel_tests_junit": junit, "bench": bench, "engine": engine,
               "paged_decode": benches, "engine_results": eng, "compile_table": compiled,
               "compile_failures": (table or {}).get("failures")}
    with open(os.path.join(res, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=2)
    md = [f"# gpu_check on {gpu}", "",
          f"- kernel tests (compiled, slow included): **{tests}** {junit or ''}",
          f"- paged decode benchmark: **{bench}**", f"- engine run: **{engine}**",
          f"- variant compile table: **{compiled}**", ""]
    for name, b in benches.items():
        if b:
            md += bench_md(name, b)
    if eng:
        md += engine_md(eng)
    if table:
        md += compile_md(res, table)
    with open(os.path.join(res, "gpu_check.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
