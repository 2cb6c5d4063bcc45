"""Seeded chat workloads shared by `kvfleet bench` and every benchmark (offline, HTTP, router, fleet simulator).

A trace is a list of `ChatRequest`s: OpenAI chat messages, an output length, a session id and an
arrival offset. The same seed always gives the same trace, so kvfleet and its peers see identical
work. Modes:

- `single`: independent one-turn chats; prompt lengths log-normal around ~60 tokens.
- `shared_system`: every request starts with one of a few long system prompts (RAG/agent style),
  so a prefix cache can serve most of the prompt.
- `multi_turn`: sessions of several turns; turn k repeats the whole conversation so far (with a
  deterministic stand-in for the assistant's earlier replies, `reply_tokens` words each, by default
  half the turn's output length), so turn k's prompt extends turn k-1's.

`read_mooncake` turns the Mooncake conversation trace (lengths, arrival times and prefix-block ids,
no text) into chat requests whose texts share exactly the prefixes the trace says they share.

Text is built from common English words that the SmolLM2/Llama tokenizers encode as about one
token each (with the leading space), so `approx_tokens` words are about that many tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.peers import mooncake_trace

MODES = ("single", "shared_system", "multi_turn")

_WORDS = (
    "the of and to in is was for on are as with his they at be this from have or by one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first been "
    "its who now people my made over did down only way find use may water long little very after words "
    "called just where most know get through back much before go good new write our used me man too any "
    "day same right look think also around another came come work three word must because does part even "
    "place well such here take why things help put years different away again off went old number great "
    "tell men say small every found still between name should home big give air line set own under read "
    "last never us left end along while might next sound below saw something thought both few those always "
    "looked show large often together asked house world going want school important until form food keep "
    "children feet land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let night following "
    "picture being study second eyes soon times story boys since white days ever paper hard near sentence "
    "better best across during today others however sure means knew try told young miles sun ways thing whole "
    "hear example heard several change answer room sea against top turned learn point city play toward five "
    "using himself usually money seen car morning given body family later order book river stop plan ask"
).split()

_QUESTIONS = (
    "Explain this in simple terms.", "Summarize the main points.", "What should I do next?",
    "Can you give me an example?", "Write a short answer.", "What is the most important part?",
    "How would you improve this?", "List three key ideas.",
)


@dataclass(frozen=True)
class ChatRequest:
    request_id: str
    messages: tuple[dict, ...]
    max_tokens: int
    session_id: str | None = None
    turn: int = 0
    arrival_s: float = 0.0  # offset from the start of the run; 0 for closed-loop runs
    approx_prompt_tokens: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def body(self, model: str, **overrides) -> dict:
        """The OpenAI /v1/chat/completions request body for this request."""
        out = {"model": model, "messages": [dict(m) for m in self.messages], "max_tokens": self.max_tokens}
        out.update(overrides)
        return out


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, n)))


def lognormal_length(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal length with the given mean (not median), clipped to [lo, hi]."""
    mu = math.log(mean) - sigma * sigma / 2
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))))


def generate_trace(num_requests: int, seed: int = 0, mode: str = "single", *, mean_prompt_tokens: float = 60,
                   sigma: float = 0.6, max_prompt_tokens: int = 1024, min_output_tokens: int = 16,
                   max_output_tokens: int = 128, num_system_prompts: int = 4, system_prompt_tokens: int = 256,
                   turns_per_session: int = 4, request_rate: float | None = None,
                   reply_tokens: int | None = None) -> list[ChatRequest]:
    """A seeded list of chat requests. request_rate (req/s) adds Poisson arrival offsets; reply_tokens sets the
    length in words of multi_turn's stand-in assistant replies (default: half the turn's max_tokens)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if num_requests < 0 or min_output_tokens < 1 or max_output_tokens < min_output_tokens:
        raise ValueError("need num_requests >= 0 and 1 <= min_output_tokens <= max_output_tokens")
    if reply_tokens is not None and reply_tokens < 1:
        raise ValueError(f"reply_tokens must be >= 1, got {reply_tokens}")
    rng = random.Random(seed)
    systems = [words(random.Random(f"{seed}-system-{i}"), system_prompt_tokens) for i in range(num_system_prompts)]
    out: list[ChatRequest] = []
    sessions: dict[int, list[dict]] = {}
    t = 0.0
    for i in range(num_requests):
        if request_rate:
            t += rng.expovariate(request_rate)
        n_prompt = lognormal_length(rng, mean_prompt_tokens, sigma, 4, max_prompt_tokens)
        n_out = rng.randint(min_output_tokens, max_output_tokens)
        user = {"role": "user", "content": f"{words(rng, n_prompt - 8)} {rng.choice(_QUESTIONS)}"}
        session, turn = None, 0
        if mode == "single":
            msgs = [user]
        elif mode == "shared_system":
            k = rng.randrange(num_system_prompts)
            msgs = [{"role": "system", "content": systems[k]}, user]
            session = f"system-{k}"
        else:  # multi_turn: sessions of turns_per_session turns, interleaved
            sid = i // turns_per_session
            turn = i % turns_per_session
            history = sessions.setdefault(sid, [])
            msgs = [*history, user]
            # a deterministic stand-in for the assistant's reply, so the next turn's prefix is known
            reply = {"role": "assistant", "content": words(rng, n_out // 2 if reply_tokens is None else reply_tokens)}
            sessions[sid] = [*msgs, reply]
            session = f"session-{sid}"
        approx = sum(len(m["content"].split()) + 4 for m in msgs)
        out.append(ChatRequest(f"req-{seed}-{i}", tuple(msgs), n_out, session, turn, t, approx))
    return out


def read_mooncake(path: str | Path | None = None, limit: int | None = None, *, token_scale: float = 1 / 16,
                  block_tokens: int = 512, max_prompt_tokens: int = 1536, max_output_tokens: int = 256,
                  time_scale: float = 1.0, seed: int = 0) -> list[ChatRequest]:
    """Chat requests from the Mooncake trace: arrival times (ms) scaled by time_scale, lengths by
    token_scale (SmolLM2-sized). Equal `hash_ids` at the same position become identical text, so the
    trace's prefix reuse carries over; each request's text after its last block id is unique."""
    out: list[ChatRequest] = []
    words_per_block = max(1, round(block_tokens * token_scale))
    with open(path or mooncake_trace(), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            rec = json.loads(line)
            ids = rec.get("hash_ids", [])
            n_prompt = max(4, min(max_prompt_tokens, round(rec["input_length"] * token_scale)))
            n_blocks = min(len(ids), n_prompt // words_per_block)
            parts = [words(random.Random(f"{seed}-block-{h}"), words_per_block) for h in ids[:n_blocks]]
            tail = n_prompt - n_blocks * words_per_block
            if tail > 0 or not parts:
                parts.append(words(random.Random(f"{seed}-tail-{i}"), max(1, tail)))
            n_out = max(1, min(max_output_tokens, round(rec["output_length"] * token_scale)))
            msgs = ({"role": "user", "content": " ".join(parts)},)
            out.append(ChatRequest(f"mooncake-{i}", msgs, n_out, None, 0,
                                   rec["timestamp"] / 1000.0 * time_scale, n_prompt,
                                   {"hash_ids": ids[:n_blocks]}))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Print a seeded chat trace as JSON lines.")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", choices=(*MODES, "mooncake"), default="single")
    ap.add_argument("--mooncake-path", default=str(mooncake_trace()),
                    help="the Mooncake trace (env KVFLEET_MOONCAKE_TRACE; default: ../shared/traces/...)")
    a = ap.parse_args(argv)
    if a.mode == "mooncake":
        trace = read_mooncake(a.mooncake_path, a.num_requests, seed=a.seed)
    else:
        trace = generate_trace(a.num_requests, a.seed, a.mode)
    for r in trace:
        print(json.dumps({"request_id": r.request_id, "session_id": r.session_id, "turn": r.turn,
                          "arrival_s": round(r.arrival_s, 3), "max_tokens": r.max_tokens,
                          "approx_prompt_tokens": r.approx_prompt_tokens, "messages": list(r.messages)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
