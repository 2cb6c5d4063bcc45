r"""The stress matrix: every preset (kvfleet/bench/scenarios.py) against kvfleet's local fleet (`kvfleet up`: a
KV-aware router + 2 engines, one core each), one kvfleet engine (all cores), and vLLM-CPU (the peer venv,
kvfleet/peers.py) where the preset fits its context; one table, one row per scenario.

    kvfleet bench matrix --small                                 # a quick proof: kvfleet rows, tiny sizes
    kvfleet bench matrix --targets fleet,single,vllm --num 16 --scale 0.5 --concurrency 4 --out-dir matrix/

Targets run one after the other (each started for its turn and stopped after it), so they never share the
CPUs; every target gets the same seeded workload. Results: one `kvfleet bench` JSON per target and scenario,
`matrix.json`, and `matrix.md` (the table, then the long side-by-side report).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

import httpx

from deploy.ports import free_port
from kvfleet.bench import cli
from kvfleet.bench.report import load_result, markdown
from kvfleet.bench.scenarios import MATRIX, PRESETS, build
from kvfleet.bench.targets import Turn, vllm_cmd
from kvfleet.peers import peers_dir

TARGETS = ("fleet", "single", "vllm")
SMALL = {"num": 3, "scale": 0.125, "concurrency": 2, "targets": "fleet,single"}
TEMPLATE_TOKENS = 12  # chat-template tokens per message, a generous bound for SmolLM2's template


def longest_context(preset: str, num: int, seed: int, scale: float) -> int:
    """The longest prompt + output (in words ~ tokens) any request of the preset's workload needs."""
    worst = 0
    for c in build(preset, num, seed, scale):
        ctx = sum(len(m["content"].split()) + TEMPLATE_TOKENS for m in c.prefix)
        for t in c.turns:
            ctx += len(t.user.split()) + TEMPLATE_TOKENS
            worst = max(worst, ctx + t.max_tokens)
            ctx += t.max_tokens + TEMPLATE_TOKENS
    return worst


def target_cmd(name: str, port: int, a: argparse.Namespace) -> tuple[str, str]:
    """(start command, base URL) of a target on `port`."""
    py = sys.executable
    if name == "fleet":
        engine_port = free_port()
        while engine_port + 1 == port or engine_port == port:
            engine_port = free_port()
        extra = f" -- --max-model-len {a.max_model_len}"
        return (f"{py} -m kvfleet up --replicas {a.replicas} --port {port} --engine-port {engine_port}{extra}",
                f"http://127.0.0.1:{port}")
    if name == "single":
        return (f"{py} -m kvfleet engine --model smollm2 --host 127.0.0.1 --port {port} --max-model-len "
                f"{a.max_model_len} --log-level warning", f"http://127.0.0.1:{port}")
    return (vllm_cmd("bfloat16", "0-1", Path(a.peers_dir), a.max_model_len).replace("--port 8200", f"--port {port}"),
            f"http://127.0.0.1:{port}")


def run_target(name: str, a: argparse.Namespace, scenarios: list[str], out_dir: Path) -> dict[str, str]:
    """Start the target, bench every scenario that fits, stop it; {scenario: result path or why not}."""
    port = free_port()
    cmd, url = target_cmd(name, port, a)
    log = str(out_dir / f"{name}.log")
    done: dict[str, str] = {}
    fits = [s for s in scenarios if longest_context(s, a.num, a.seed, a.scale) <= a.max_model_len]
    for s in scenarios:
        if s not in fits:
            done[s] = f"n/a: longer than --max-model-len {a.max_model_len}"
    if name == "vllm" and not (Path(a.peers_dir) / "vllm-venv" / "bin" / "python").exists():
        return {s: f"n/a: no vLLM venv under {a.peers_dir}" for s in scenarios}

    async def up():
        turn = Turn(name, cmd, url, a.start_timeout, log)
        await turn.__aenter__()
        if name == "fleet":  # the router is ready with one engine; wait for all of them
            async with httpx.AsyncClient() as client:
                for _ in range(int(a.start_timeout)):
                    if (await client.get(url + "/ready")).json().get("ready_replicas") == a.replicas:
                        break
                    await asyncio.sleep(1.0)
        async with httpx.AsyncClient(timeout=600) as client:  # warm-up: first-request costs stay out of the rows
            for i in range(a.replicas if name == "fleet" else 1):
                await client.post(url + "/v1/chat/completions", json={
                    "model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": f"warm up {i}"}]})
        return turn

    print(f"== {name}: {cmd}", flush=True)
    turn = asyncio.run(up())
    try:
        for s in fits:
            path = out_dir / f"{name}-{s}.json"
            argv = ["run", "--target", url, "--name", name, "--scenario", s, "--num", str(a.num), "--scale",
                    str(a.scale), "--concurrency", str(a.concurrency), "--seed", str(a.seed), "--out", str(path)]
            if a.slo_ttft_ms:
                argv += ["--slo-ttft-ms", str(a.slo_ttft_ms)]
            if a.slo_tpot_ms:
                argv += ["--slo-tpot-ms", str(a.slo_tpot_ms)]
            if not a.progress:
                argv.append("--no-progress")
            cli.main(argv)
            done[s] = str(path)
    finally:
        asyncio.run(turn.__aexit__())
    return done


def _cell(res: dict | None, key: str) -> str:
    if res is None:
        return "n/a"
    s, fleet = res["runs"][0]["summary"], res["runs"][0].get("fleet") or {}
    if key == "hit":
        v = fleet.get("prefix_hit_rate")
        return "-" if v is None else f"{v:.0%}"
    if key == "ok":
        return f"{s['completed']}/{s['requests']}"
    v = s["ttft_ms"]["p50"] if key == "ttft" else s["e2e_ms"]["p99"] if key == "e2e99" else s["output_tok_s"]
    return "-" if v != v else (f"{v:.0f}" if key != "tok" else f"{v:.1f}")


def table(results: dict[str, dict[str, dict | None]], targets: list[str], scenarios: list[str]) -> str:
    cols = ["scenario", "shape"]
    for label in ("TTFT p50 ms", "E2E p99 ms", "out tok/s", "prefix hit"):
        cols += [f"{t} {label}" for t in targets]
    ratio = "fleet" in targets and "single" in targets
    if ratio:
        cols.append("fleet/single out tok/s")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for s in scenarios:
        row = [s, PRESETS[s].description]
        for key in ("ttft", "e2e99", "tok", "hit"):
            row += [_cell(results[t].get(s), key) for t in targets]
        if ratio:
            f, g = results["fleet"].get(s), results["single"].get(s)
            fr = f and f["runs"][0]["summary"]["output_tok_s"]
            gr = g and g["runs"][0]["summary"]["output_tok_s"]
            row.append(f"x{fr / gr:.2f}" if fr and gr else "n/a")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfleet bench matrix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true",
                    help=f"a quick proof run: {SMALL} (explicit flags still win)")
    ap.add_argument("--targets", default=None, help=f"comma-separated, of {','.join(TARGETS)} (default: all three)")
    ap.add_argument("--scenarios", default=",".join(MATRIX), help="comma-separated presets")
    ap.add_argument("--num", type=int, default=None, help="conversations per scenario (default 16)")
    ap.add_argument("--scale", type=float, default=None, help="multiply preset lengths (default 0.5)")
    ap.add_argument("--concurrency", type=int, default=None, help="closed-loop workers (default 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=2, help="engines behind the fleet's router")
    ap.add_argument("--max-model-len", type=int, default=2048,
                    help="every target's context limit; longer scenarios are n/a (vLLM-CPU's default here)")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--peers-dir", default=str(peers_dir()), help="vLLM's venv and model (env KVFLEET_PEERS_DIR)")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    ap.add_argument("--out-dir", default=None, help="results go here (default: a new temporary folder)")
    a = ap.parse_args(argv)
    defaults = SMALL if a.small else {"num": 16, "scale": 0.5, "concurrency": 4, "targets": ",".join(TARGETS)}
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    targets = [t.strip() for t in a.targets.split(",") if t.strip()]
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    if bad := [t for t in targets if t not in TARGETS]:
        ap.error(f"--targets: unknown {bad}; choose from {list(TARGETS)}")
    if bad := [s for s in scenarios if s not in PRESETS]:
        ap.error(f"--scenarios: unknown {bad}; choose from {list(MATRIX)}")
    for flag, v in (("--num", a.num), ("--scale", a.scale), ("--concurrency", a.concurrency)):
        if v <= 0:
            ap.error(f"{flag} must be positive, got {v}")
    out_dir = Path(a.out_dir or tempfile.mkdtemp(prefix="kvfleet-matrix-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"stress matrix: targets {targets}, {len(scenarios)} scenarios, {a.num} conversations each, scale "
          f"{a.scale:g}, concurrency {a.concurrency}; results in {out_dir}", flush=True)
    paths = {t: run_target(t, a, scenarios, out_dir) for t in targets}
    results = {t: {s: (load_result(p) if p.endswith(".json") and os.path.exists(p) else None)
                   for s, p in paths[t].items()} for t in targets}
    settings = {"targets": targets, "scenarios": scenarios, "num": a.num, "scale": a.scale,
                "concurrency": a.concurrency, "seed": a.seed, "replicas": a.replicas, "max_model_len": a.max_model_len}
    head = (f"# Stress matrix\n\n`kvfleet bench matrix {' '.join(argv if argv is not None else sys.argv[1:])}`: "
            f"{a.num} conversations per scenario, lengths x{a.scale:g}, closed loop at concurrency {a.concurrency}, "
            f"seed {a.seed}. fleet = `kvfleet up` (router + {a.replicas} engines, one core slice each); single = one "
            f"kvfleet engine on all cores; vllm = vLLM-CPU (bf16). n/a: not run (reason in matrix.json).\n\n")
    every = [r for t in targets for r in results[t].values() if r is not None]
    text = head + table(results, targets, scenarios) + "\n## Every run\n\n" + markdown(every) if every else head
    (out_dir / "matrix.md").write_text(text)
    (out_dir / "matrix.json").write_text(json.dumps({"settings": settings, "runs": paths}, indent=1))
    print(text)
    print(f"wrote {out_dir / 'matrix.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
