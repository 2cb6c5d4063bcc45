"""`kvfleet bench run --driver guidellm`: the same presets and loads, sent by guidellm (a driven subprocess).

guidellm 0.8.1 (vllm-project/guidellm) is a well-kept load generator: open-loop Poisson and constant rates,
concurrent streams, sweeps, synthetic text with shared prefixes and multi-turn conversations, trace replay,
and a JSON report with every request's timings. We drive its `run` command with a scenario file and read
its JSON report back into kvfleet's request records, so `kvfleet bench report` and the plots treat both
drivers alike. It runs from its own venv ($KVFLEET_GUIDELLM, else $KVFLEET_PEERS_DIR/guidellm-venv, made by
`python -m loadtest.ttft_clients --install`): it co-installs with kvfleet by pip's resolver, but pins
`click~=8.4.0` (downgrading the venv's click) and brings ~30 packages (datasets, pyarrow, pandas, sanic, ...)
that serving images do not need.

Mapping of the presets onto guidellm's `synthetic_text` data: the one-turn presets by their lengths;
multi-turn by `turns`; shared-system and rag by one shared `prefix_tokens` (rag's retrieved chunks become
unique text of the same length: guidellm has no chunk pool); sharegpt by a normal distribution with the
log-normal's mean and standard deviation (guidellm draws normal lengths), clipped to the same bounds.
parallel-n (n > 1) and trace replay stay with the native driver.

Records: a request's TTFT, last-token time, end, prompt and output tokens come from guidellm's timings;
it does not keep every chunk's time, so the run's ITL percentiles are guidellm's own
(`inter_token_latency_ms`), and the records hold only the first and last token times.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from kvfleet.bench.records import RequestRecord
from kvfleet.bench.runner import Load
from kvfleet.bench.scenarios import PRESETS
from kvfleet.peers import peers_dir


def guidellm_exe() -> Path:
    exe = Path(os.environ.get("KVFLEET_GUIDELLM") or peers_dir() / "guidellm-venv" / "bin" / "guidellm")
    if not exe.exists():
        raise SystemExit(f"--driver guidellm: guidellm not found at {exe}; set KVFLEET_GUIDELLM or run "
                         "`python -m loadtest.ttft_clients --install` (makes $KVFLEET_PEERS_DIR/guidellm-venv)")
    return exe


def synthetic_data(preset: str, scale: float) -> dict:
    """guidellm's synthetic_text data for a preset, or SystemExit naming what it cannot express."""
    if preset not in PRESETS:
        raise SystemExit(f"--driver guidellm: --scenario {preset} is not a preset it can express; use --driver native")
    p = PRESETS[preset]
    if p.n > 1:
        raise SystemExit("--driver guidellm: parallel sampling (n > 1) is not in guidellm's synthetic data; "
                         "use --driver native")
    s = lambda x: max(4, round(x * scale))  # noqa: E731
    data = {"kind": "synthetic_text", "prompt_tokens": s(p.prompt), "output_tokens": s(p.output)}
    if p.turns > 1:
        data["turns"] = p.turns
    if p.system:
        data.update(prefix_tokens=s(p.system), prefix_count=1)
    if p.rag:
        template, _, k, chunk = p.rag
        data.update(prefix_tokens=s(template), prefix_count=1, prompt_tokens=k * s(chunk) + s(p.prompt))
    if p.sigma:
        lo, hi, olo, ohi = p.bounds
        for key, mean, sigma, a, b in (("prompt_tokens", p.prompt * scale, p.sigma[0], lo, hi * scale),
                                       ("output_tokens", p.output * scale, p.sigma[1], olo, ohi * scale)):
            data.update({key: round(mean), f"{key}_stdev": round(mean * math.sqrt(math.exp(sigma ** 2) - 1)),
                         f"{key}_min": a, f"{key}_max": max(a, round(b))})
    return data


def scenario(a, preset: str, load: Load, tokenizer: str) -> dict:
    if load.replay:
        raise SystemExit("--driver guidellm: --replay-times stays with --driver native")
    profile = ({"kind": "concurrent", "streams": load.concurrency} if load.concurrency is not None
               else {"kind": "poisson", "rate": load.rate})
    data = synthetic_data(preset, a.scale)
    turns = data.get("turns", 1)
    backend = {"kind": "openai_http", "target": a.target.rstrip("/"), "model": a.model,
               "request_format": "/v1/chat/completions"}
    if a.api_key:
        backend["api_key"] = a.api_key
    return {"spec": {"backend": backend, "profile": profile, "data": [data],
                     "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
                     "constraints": [{"kind": "max_requests", "count": a.num * turns}]}}


def _error(msg: str | None) -> str:
    m = (msg or "").lower()
    if "429" in m:
        return "http_429"
    if "timeout" in m or "timed out" in m:
        return "timeout"
    return "http_5xx" if any(f" {c}" in m for c in ("500", "502", "503", "504")) else "guidellm_error"


def records_from_report(report: dict, scenario_name: str) -> tuple[list[RequestRecord], float, dict]:
    """kvfleet records from guidellm's JSON report (its first benchmark), the wall time, guidellm's ITL."""
    bench = report["benchmarks"][0]
    reqs = bench["requests"]
    t0 = min((r["info"]["timings"]["request_start"] for k in ("successful", "errored")
              for r in reqs.get(k) or [] if r["info"]["timings"].get("request_start")), default=0.0)
    out = []
    for kind in ("successful", "errored", "incomplete"):
        for r in reqs.get(kind) or []:
            t = r["info"]["timings"]
            start = t.get("request_start") or t0
            end = (t.get("request_end") or start) - start
            turn = r["info"].get("turn_index") or 0
            conv = r["info"].get("conversation_id")
            if kind != "successful":
                out.append(RequestRecord(scenario_name, start - t0, (), end,
                                         error="incomplete" if kind == "incomplete" else _error(r["info"].get("error")),
                                         session=conv, turn=turn))
                continue
            n_out = (r.get("output_metrics") or {}).get("text_tokens") or 0
            first, last = t.get("first_token_iteration"), t.get("last_token_iteration")
            chunks = () if first is None else ((first - start,) if n_out < 2 or last is None else
                                                (first - start, last - start))
            out.append(RequestRecord(scenario_name, start - t0, chunks, end,
                                     (r.get("input_metrics") or {}).get("text_tokens") or 0, n_out,
                                     (r.get("input_metrics") or {}).get("cached_tokens") or 0,
                                     "" if chunks else "no_tokens", conv, turn))
    itl = bench["metrics"]["inter_token_latency_ms"]["successful"]
    pct = itl.get("percentiles") or {}
    itl_ms = {"p50": pct.get("p50"), "p95": pct.get("p95"), "p99": pct.get("p99"), "mean": itl.get("mean")}
    return out, float(bench.get("duration") or 0.0), itl_ms


def run_guidellm(a, preset: str, load: Load, metric_urls: list[str]) -> dict:
    import asyncio

    from kvfleet.bench.fleet_metrics import Scraper

    tokenizer = a.guidellm_tokenizer or str(peers_dir() / "smollm2-hf")
    spec = scenario(a, preset, load, tokenizer)
    work = Path(tempfile.mkdtemp(prefix="kvfleet-guidellm-"))
    (work / "scenario.json").write_text(json.dumps(spec))
    argv = [str(guidellm_exe()), "run", "--scenario", str(work / "scenario.json"), "--output",
            f"kind=json,path={work / 'report.json'}"]
    if not a.progress:
        argv.append("--disable-console-interactive")

    async def go():
        async with Scraper(metric_urls, a.metrics_interval) as scraper:
            proc = await asyncio.create_subprocess_exec(*argv, cwd=work, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            rc = await proc.wait()
        return rc, scraper.summary()

    rc, fleet = asyncio.run(go())
    if rc != 0 or not (work / "report.json").exists():
        raise SystemExit(f"guidellm failed (exit {rc}); its files are in {work}")
    records, wall, itl = records_from_report(json.loads((work / "report.json").read_text()), preset)
    return {"records": records, "wall_s": None, "fleet": fleet, "itl_ms": itl, "guidellm_dir": str(work)}
