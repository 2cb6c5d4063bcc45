"""The campaign's results: a verdict table for the terminal and docs/reliability.md (with the soak's plot)."""

from __future__ import annotations

import os
import platform
import sys
import traceback

from loadtest.chaos.verdict import Verdict, fmt

FINDINGS = """## What the campaign found, and what was fixed

- **Connections that never send a request were never closed, and nothing capped them** (router and engine:
  uvicorn has no header or body read timeout and no connection cap; one idle connection costs a descriptor
  for ever, so enough of them exhaust the process's descriptors). Fixed by `serving/http_limits.py`, shared
  by both servers: `--header-timeout` (default 10 s), `--body-timeout` (60 s, then 408) and
  `--max-connections` (4096, excess closed on accept). Regression tests: `tests/kvfleet/test_http_limits.py`
  (raw sockets against a uvicorn server with the limits) and `tests/kvfleet/test_http_limits_servers.py`
  (the real `kvfleet router` and `kvfleet engine` processes). The hostile-clients scenario below shows the
  500 idle connections on each server closed by the header timeout.
- The router's body limit existed in its configuration but had no flag: `kvfleet router --max-body-bytes`.
- **Engine memory grew with every new batch size** (the soak: engine RSS rising ~16 MB/min through the run,
  routers and Redis flat, no block leaked). Not a Python leak (tracemalloc: under 1 MB of Python allocations
  over 6 minutes of load; object counts flat) and not the allocator (jemalloc grew the same; glibc with 2
  arenas too): oneDNN, which runs torch's CPU bf16 matmuls and our pre-packed projections, keeps a primitive
  for every input shape in two caches of 1,024 entries each (ideep's `LRU_CACHE_CAPACITY`, oneDNN's
  `ONEDNN_PRIMITIVE_CACHE_CAPACITY`), 0.6-1.5 MB each at SmolLM2's sizes, and an engine batches a different
  number of tokens at almost every step: SmolLM2's four projections at 1,000 row counts grew a process from
  0.25 to 3.0 GB. Fixed by `engine/onednn_caches.py`: the engine bounds both caches to 256 entries before it
  loads a model (a user's own setting wins). Regression test: `tests/engine/test_onednn_caches.py` (80 new
  row counts grow an unbounded process by more than 40 MB and a bounded one by under 12 MB).
- **A client still sending a refused body could read a connection reset instead of its 413.** The engine
  answers an announced oversized body at once (`connection: close`) and uvicorn then closed the socket with
  the body unread, so the kernel reset the connection and the client lost the response it had not read yet
  (the full run of 2026-11-30 23:49 UTC: 2 of the engine's 3 announced 100 MB bodies ended in a reset after
  3 MB; an earlier run had passed by timing). Fixed by a lingering close in `serving/http_limits.py` (both
  servers): after such a response the server half-closes, drops what the client still sends for up to 5 s,
  then closes. Regression tests: `tests/kvfleet/test_http_limits.py` (a 32 MB body refused unread: the 413
  arrives, no reset; a client that keeps trickling is cut off after the linger time). The hostile-clients
  scenario rerun after the fix passed 7/7, every 100 MB body answered 413:
  [`reliability-hostile-rerun.md`](reliability-hostile-rerun.md).
- **Router RSS rose slowly through the soak** (30-minute run: router-0 355 -> 377 MB, router-1 331 -> 360 MB;
  fitted rise over the second half 10.6 and 12 MB, under the 16 MB bound, so the check passed). Traced after
  the run with tracemalloc on a router under the soak's load: the growing Python allocations were all the
  router's piece -> token-ids cache (`router/routing/tokens.py`), which is bounded at 64 Mi characters but was filling
  with the soak's never-repeating prompts at about 8.8 bytes per cached character (tuples of Python ints), so
  about 560 MB at its bound. Its ids are now 4-byte arrays: under 3 bytes per character (test:
  `tests/router/routing/test_tokens.py`), about 130 MB at the bound. Not rerun through a 30-minute soak since.
- **Alternating routers seemed to hit the cache less than one router** (2.6-8.1% lower in four runs); the
  scenario compared two different workloads (two seeds), whose hit rates differ on their own. Run on the same
  conversations (salted per run so none hits another's cache), three pairs gave one router 0.598 / 0.613 /
  0.601 and alternating 0.601 / 0.600 / 0.599. The scenario now does that, in the order one, alternating,
  alternating, one.
- The leak check needs to see the block pool: engines now export `kvfleet:num_free_kv_blocks` and
  `kvfleet:num_cached_kv_blocks` (test: `tests/engine/server/test_metrics.py`, every block free at idle).
"""


def table(verdicts: list[Verdict]) -> str:
    rows = [("scenario", "verdict", "checks", "seconds")]
    rows += [(v.scenario, "PASS" if v.passed else "FAIL", f"{sum(c.passed for c in v.checks)}/{len(v.checks)}",
              f"{v.seconds:.0f}") for v in verdicts]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _cell(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_cell(x) for x in value) + ")"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in value.items())
    return fmt(value).replace("|", "\\|")


def plot_soak(v: Verdict, path: str) -> bool:
    series = v.figures.get("_series")
    if not series or len(series.get("t", [])) < 2:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [x / 60 for x in series["t"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    for k, ys in series.items():
        if k.startswith("rss "):
            a.plot(t, ys, label=k[4:])
        elif k.startswith("free "):
            b.plot(t, ys, label=k[5:])
    a.set(title="RSS (MB)", xlabel="minutes")
    b.set(title="free KV blocks", xlabel="minutes")
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def markdown(verdicts: list[Verdict], docs: dict[str, str], command: str, started: str, wall_s: float,
             notes: list[str], plot: str | None) -> str:
    ok = all(v.passed for v in verdicts)
    out = ["# Reliability and security campaign", "",
           f"Results of one run of `{command}`, started {started}, {wall_s / 60:.0f} minutes: "
           f"**{'every scenario passed' if ok else 'some scenarios FAILED'}**. Regenerate with `make chaos` "
           "(the scenarios live in `loadtest/chaos/`; `make chaos-quick` is a smaller smoke run that writes no report).", "",
           f"Machine: {len(os.sched_getaffinity(0))} CPUs ({cpu_model() or platform.machine()}), Python "
           f"{sys.version.split()[0]}, shared with other jobs while this ran, so latencies are noisy; this is a "
           "correctness campaign, not a benchmark. The fleet: Redis, 2 engines of the bundled SmolLM2-135M on "
           "the CPU (one thread each, 256 KV blocks of 16 tokens each, internal token required), 2 routers "
           "(kv policy, tenants file, budgets in Redis), all on loopback, every process at its default log level.",
           ""]
    out += [f"- {n}" for n in notes]
    out += ["", "| scenario | verdict | checks passed | seconds |", "|---|---|---|---|"]
    out += [f"| [{v.scenario}](#{v.scenario.lower().replace(' ', '-')}) | {'PASS' if v.passed else '**FAIL**'} | "
            f"{sum(c.passed for c in v.checks)}/{len(v.checks)} | {v.seconds:.0f} |" for v in verdicts]
    out += ["", FINDINGS.strip()]
    for v in verdicts:
        out += ["", f"## {v.scenario}", "", docs.get(v.scenario, "").strip(), "", "| check | result | detail |",
                "|---|---|---|"]
        out += [f"| {c.name} | {'pass' if c.passed else '**FAIL**'} | {c.detail.replace('|', '/')} |" for c in v.checks]
        out += ["", "| figure | value |", "|---|---|"]
        out += [f"| {k} | {_cell(x)} |" for k, x in v.figures.items() if not k.startswith("_")]
        out += [f"\n{n}" for n in v.notes]
        if v.scenario == "soak" and plot:
            out += ["", f"![soak: RSS and free blocks over time]({plot})"]
    return "\n".join(out) + "\n"


def write(out: str, verdicts: list[Verdict], docs: dict[str, str], command: str, started: str, wall_s: float,
          notes: list[str]) -> None:
    """The report at `out` (its folder made if missing), with the soak's plot beside it when there is one."""
    folder = os.path.dirname(out) or "."
    os.makedirs(folder, exist_ok=True)
    plot = None
    soak = next((v for v in verdicts if v.scenario == "soak"), None)
    if soak is not None:
        try:
            if plot_soak(soak, os.path.join(folder, "reliability-soak.png")):
                plot = "reliability-soak.png"
        except Exception:  # a plot must never cost the report
            traceback.print_exc()
    with open(out, "w") as f:
        f.write(markdown(verdicts, docs, command, started, wall_s, notes, plot))
