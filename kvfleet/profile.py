r"""`kvfleet profile TRACE`: the shape of a workload from a JSONL trace, to bench and plan capacity with.

    kvfleet profile my_trace.jsonl
    kvfleet profile --mooncake --json > profile.json      # then: kvfleet capacity ... --profile profile.json

Traces: kvfleet's format (one request per line: `timestamp` or `arrival_s` in seconds; `messages` or
`prompt_tokens`; `output_tokens` (what was generated) or `max_tokens`; optional `session_id`, `stream`) or
Mooncake's (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

Figures:
- prompt and output tokens: p50/p95/p99 and mean. Text prompts are counted with --tokenizer (a model name or
  directory, through the engine's chat template), else approximately (words + 4 per message).
- follow-up share: requests that continue an earlier conversation (kvfleet: a session seen before, or a history
  with an assistant turn; Mooncake: the request's hash_ids start with all but the last (possibly partial)
  block of an earlier request's, at least 2 blocks, so more than a shared first block).
  multi-turn session share: conversations with more than one request, among all conversations.
- shared-prefix share: requests whose leading system prompt (kvfleet) or first 512-token block (Mooncake) is
  also the start of another conversation's request (a shared system prompt or template).
- streaming share: requests with `stream: true` (null when the trace does not say).
- arrivals: mean rate, and burstiness as the coefficient of variation of inter-arrival gaps (1 for Poisson,
  above 1 for bursty), and the busiest second's request count.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvfleet.bench.metrics import percentile
from kvfleet.peers import mooncake_trace


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float | None
    prompt_tokens: int
    output_tokens: int
    conversation: str
    follow_up: bool
    prefix_key: str | None  # what identifies a shared leading prefix
    stream: bool | None


def _approx_tokens(messages: list[dict]) -> int:
    return sum(len(str(m.get("content", "")).split()) + 4 for m in messages)


def read_requests(path: str | Path, tokenizer=None) -> list[TraceRequest]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace {path} does not exist")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"trace {path} is empty")
    return _mooncake(rows) if "hash_ids" in rows[0] else _ours(rows, path, tokenizer)


def _mooncake(rows: list[dict]) -> list[TraceRequest]:
    seen: dict[tuple, str] = {}  # an earlier request's hash_ids but the last (maybe partial) block -> conversation
    out = []
    for i, r in enumerate(rows):
        ids = tuple(r.get("hash_ids", []))
        conv = None
        for k in range(len(ids), 1, -1):
            conv = seen.get(ids[:k])
            if conv is not None:
                break
        follow = conv is not None
        conv = conv or f"m{i}"
        if len(ids) >= 3:
            seen.setdefault(ids[:-1], conv)
        out.append(TraceRequest(r["timestamp"] / 1000.0, int(r["input_length"]), int(r["output_length"]), conv,
                                follow, str(ids[0]) if ids else None, None))
    return out


def _ours(rows: list[dict], path: Path, tokenizer) -> list[TraceRequest]:
    out = []
    sessions: set[str] = set()
    for i, r in enumerate(rows):
        msgs = r.get("messages") or []
        if isinstance(r.get("prompt_tokens"), int):
            n_prompt = r["prompt_tokens"]
        elif msgs:
            n_prompt = len(tokenizer.apply_chat_template(msgs)) if tokenizer else _approx_tokens(msgs)
        else:
            raise ValueError(f"{path}:{i + 1}: needs messages or prompt_tokens")
        n_out = r.get("output_tokens", r.get("max_tokens"))
        if not isinstance(n_out, int):
            raise ValueError(f"{path}:{i + 1}: needs output_tokens or max_tokens")
        sid = r.get("session_id")
        follow = (sid is not None and sid in sessions) or any(m.get("role") == "assistant" for m in msgs)
        if sid is not None:
            sessions.add(sid)
        key = msgs[0]["content"] if msgs and msgs[0].get("role") == "system" else None
        arrival = r.get("arrival_s", r.get("timestamp"))
        out.append(TraceRequest(None if arrival is None else float(arrival), n_prompt, n_out,
                                sid if sid is not None else f"r{i}", follow, key,
                                None if "stream" not in r else bool(r["stream"])))
    return out


def _dist(xs: list[float]) -> dict:
    return {"p50": percentile(xs, 50), "p95": percentile(xs, 95), "p99": percentile(xs, 99),
            "mean": sum(xs) / len(xs), "max": max(xs)}


def profile(reqs: list[TraceRequest]) -> dict:
    n = len(reqs)
    convs = Counter(r.conversation for r in reqs)
    key_convs: dict[str, set] = {}
    for r in reqs:
        if r.prefix_key is not None:
            key_convs.setdefault(r.prefix_key, set()).add(r.conversation)
    shared = sum(1 for r in reqs if r.prefix_key is not None and len(key_convs[r.prefix_key]) > 1)
    streams = [r.stream for r in reqs if r.stream is not None]
    out = {"requests": n, "prompt_tokens": _dist([r.prompt_tokens for r in reqs]),
           "output_tokens": _dist([r.output_tokens for r in reqs]),
           "conversations": len(convs), "follow_up_share": sum(r.follow_up for r in reqs) / n,
           "multi_turn_session_share": sum(1 for c in convs.values() if c > 1) / len(convs),
           "shared_prefix_share": shared / n,
           "streaming_share": sum(streams) / len(streams) if streams else None}
    times = sorted(r.arrival_s for r in reqs if r.arrival_s is not None)
    if len(times) >= 3:
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
        duration = times[-1] - times[0]
        per_second = Counter(int(t - times[0]) for t in times)
        out["arrivals"] = {"duration_s": duration, "rate_per_s": (len(times) - 1) / duration if duration else None,
                           "interarrival_mean_s": mean, "interarrival_cv": std / mean if mean else None,
                           "peak_requests_in_1s": max(per_second.values())}
    else:
        out["arrivals"] = None
    return out


def print_profile(p: dict, name: str) -> None:
    print(f"trace {name}: {p['requests']} requests in {p['conversations']} conversations")
    for k in ("prompt_tokens", "output_tokens"):
        d = p[k]
        print(f"  {k.replace('_', ' ')}: p50 {d['p50']:.0f}  p95 {d['p95']:.0f}  p99 {d['p99']:.0f}  "
              f"mean {d['mean']:.1f}  max {d['max']:.0f}")
    print(f"  follow-up requests {p['follow_up_share']:.1%}; multi-turn conversations "
          f"{p['multi_turn_session_share']:.1%}; shared system prompt / template {p['shared_prefix_share']:.1%}; "
          f"streaming " + ("unknown" if p["streaming_share"] is None else f"{p['streaming_share']:.1%}"))
    a = p["arrivals"]
    if a:
        print(f"  arrivals: {a['rate_per_s']:.3f} req/s over {a['duration_s']:.1f} s, inter-arrival CV "
              f"{a['interarrival_cv']:.2f} (1 = Poisson), busiest second {a['peak_requests_in_1s']} requests")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfleet profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=None, help="JSONL trace (kvfleet's or Mooncake's format)")
    ap.add_argument("--mooncake", action="store_true",
                    help="the Mooncake trace (env KVFLEET_MOONCAKE_TRACE, or under KVFLEET_SHARED_DIR)")
    ap.add_argument("--tokenizer", default=None, help="count text prompts with this model's tokenizer (e.g. smollm2)")
    ap.add_argument("--json", action="store_true", help="print JSON (input for `kvfleet capacity --profile`)")
    a = ap.parse_args(argv)
    if bool(a.trace) == a.mooncake:
        ap.error("give a TRACE path or --mooncake (one of them)")
    path = Path(a.trace) if a.trace else mooncake_trace()
    tok = None
    if a.tokenizer:
        from engine.tokenizer import load_tokenizer
        tok = load_tokenizer(a.tokenizer)
    try:
        p = profile(read_requests(path, tok))
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        print(f"kvfleet profile: error: TRACE {path}: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"trace": str(path), **p}, indent=1))
    else:
        print_profile(p, str(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
