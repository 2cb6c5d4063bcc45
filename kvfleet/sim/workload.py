"""What the fleet simulator replays: sessions of turns, each turn a prompt's length, its output length and the
chained hashes of its cacheable prompt blocks.

- `mooncake()`: the Mooncake conversation trace (one-turn sessions at the trace's arrival times; its
  `hash_ids` are the block hashes, 512 tokens each); located by `--trace` or KVFLEET_MOONCAKE_TRACE.
- `multi_turn()`: generated chat sessions from kvfleet/workload.py's seeded generator (the same shape as
  loadtest/router_bench.py's and vllm_fleet.py's: a few shared system prompts, user turns, stand-in replies),
  turned into token ids (one per word, role markers around each message) and hashed with the engines' own
  chained block hash (contract/hashing.py). Turn k+1 is sent `think_s` after turn k's last token.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from contract.cacheable import cacheable_blocks
from contract.hashing import hash_blocks
from kvfleet.peers import mooncake_trace
from kvfleet.workload import generate_trace, words

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the blocks a prefix hit could cover
    num_blocks: int  # blocks the block hit rate counts for this prompt


@dataclass(frozen=True)
class Session:
    key: str | None  # the session key the router sees (None: none)
    start_s: float
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class SimWorkload:
    sessions: tuple[Session, ...]
    block_size: int
    think_s: float = 0.0  # between a turn's last token and the next turn's arrival
    concurrency: int | None = None  # closed loop: this many sessions at a time, each started when one ends

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)


def mooncake(path: str | Path | None = None, limit: int | None = None, time_scale: float = 1.0) -> SimWorkload:
    """The Mooncake trace as one-turn sessions; arrival offsets multiplied by time_scale."""
    sessions = []
    with open(path or mooncake_trace(), encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            rec = json.loads(line)
            ids = tuple(rec["hash_ids"])
            n = rec["input_length"]
            turn = Turn(n, rec["output_length"], ids[:cacheable_blocks(n, MOONCAKE_BLOCK_TOKENS)], len(ids))
            sessions.append(Session(None, rec["timestamp"] / 1000.0 * time_scale, (turn,)))
    return SimWorkload(tuple(sessions), MOONCAKE_BLOCK_TOKENS)


class _Vocab:
    """Token ids for words: one id per distinct word, in order of first use (deterministic)."""

    ROLES = {"system": 1, "user": 2, "assistant": 3}
    END, GEN = 4, 5

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, messages: Iterable[dict]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out.append(self.ROLES.get(m["role"], 0))
            out.extend(self.ids.setdefault(w, 16 + len(self.ids)) for w in m["content"].split())
            out.append(self.END)
        out.append(self.GEN)  # the generation prompt
        return out


def multi_turn(num_sessions: int, seed: int = 0, *, turns: int = 4, mean_user_tokens: float = 200,
               reply_tokens: int = 80, output_tokens: int = 80, system_prompts: int = 2, system_tokens: int = 200,
               session_rate: float | None = None, concurrency: int | None = None, think_s: float = 0.5,
               block_size: int = 32, sigma: float = 0.6, max_user_tokens: int = 1024) -> SimWorkload:
    """Seeded multi-turn sessions: each opens with one of `system_prompts` shared system prompts; turn k resends
    the whole conversation. Sessions start as a Poisson process at `session_rate` per second, or closed loop
    with `concurrency` sessions at a time. User turns are log-normal (`sigma`) around `mean_user_tokens`, at most
    `max_user_tokens`."""
    if (session_rate is None) == (concurrency is None):
        raise ValueError("give exactly one of session_rate and concurrency")
    trace = generate_trace(num_sessions * turns, seed=seed, mode="multi_turn", turns_per_session=turns,
                           mean_prompt_tokens=mean_user_tokens, min_output_tokens=output_tokens,
                           max_output_tokens=output_tokens, reply_tokens=reply_tokens, sigma=sigma,
                           max_prompt_tokens=max_user_tokens)
    systems = [words(random.Random(f"{seed}-sys-{k}"), system_tokens) for k in range(system_prompts)]
    vocab = _Vocab()
    rng = random.Random(f"{seed}-arrivals")
    by_session: dict[str, list[Turn]] = {}
    for req in trace:
        if req.session_id is None:  # multi_turn traces give every request its session
            raise ValueError(f"request {req.request_id} has no session id")
        k = random.Random(f"{seed}-{req.session_id}").randrange(system_prompts)
        ids = vocab.encode([{"role": "system", "content": systems[k]}, *req.messages])
        n_hashed = cacheable_blocks(len(ids), block_size)
        hashes = hash_blocks(ids[:n_hashed * block_size], block_size)
        by_session.setdefault(req.session_id, []).append(
            Turn(len(ids), req.max_tokens, tuple(hashes), len(ids) // block_size))
    sessions, t = [], 0.0
    for key, ts in by_session.items():
        if session_rate:
            t += rng.expovariate(session_rate)
        sessions.append(Session(key, t, tuple(ts)))
    return SimWorkload(tuple(sessions), block_size, think_s, concurrency)


PROFILE_MAX_TURNS = 16


def from_profile(profile: dict, num_requests: int, request_rate: float, seed: int = 0,
                 block_size: int = 32) -> SimWorkload:
    """Generated sessions (multi_turn) shaped like a `kvfleet profile --json` workload: turns per session from the
    follow-up share f (a session of T turns has T-1 follow-ups: T = 1 / (1 - f), at most PROFILE_MAX_TURNS), the
    output's mean tokens (the replies later turns resend), user turns sized so the mean prompt matches, and
    sessions arriving as a Poisson process at request_rate / T; user turns log-normal with the spread of the profile's
    prompts (mean over median), up to its longest prompt. A shared-prefix share of at least half gives two
    shared system prompts of a quarter of the median prompt (capped at 2,048 tokens); below it, each session its own
    (the profile gives the share, not the prefix's length: that quarter is this generator's assumption)."""
    try:
        prompt, output = profile["prompt_tokens"], profile["output_tokens"]
        follow_up, shared = float(profile["follow_up_share"]), float(profile["shared_prefix_share"])
        mean_prompt, median_prompt, mean_output = float(prompt["mean"]), float(prompt["p50"]), float(output["mean"])
        max_prompt = int(prompt["max"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"not a `kvfleet profile --json` file (missing or bad {e})") from e
    if not (median_prompt >= 1 and mean_output >= 1 and 0 <= follow_up <= 1 and 0 <= shared <= 1):
        raise ValueError("the profile's prompt and output means must be >= 1 and its shares within [0, 1]")
    turns = max(1, min(PROFILE_MAX_TURNS, round(1 / (1 - follow_up)) if follow_up < 1 else PROFILE_MAX_TURNS))
    out_tokens = max(1, round(mean_output))
    sessions = max(1, round(num_requests / turns))
    system_prompts = 2 if shared >= 0.5 else sessions
    system_tokens = max(1, min(2048, round(median_prompt / 4))) if shared >= 0.5 else 8
    # mean prompt over turns k = 1..T: system + k user turns + (k - 1) replies (plus a few role tokens each)
    user = (mean_prompt - system_tokens - out_tokens * (turns - 1) / 2) / ((turns + 1) / 2)
    # log-normal: mean / median = exp(sigma^2 / 2), the prompt's spread given to the user turns
    sigma = min(1.5, max(0.1, math.sqrt(2 * math.log(max(mean_prompt / median_prompt, 1.0)))))
    return multi_turn(sessions, seed, turns=turns, mean_user_tokens=max(4.0, user), reply_tokens=out_tokens,
                      output_tokens=out_tokens, system_prompts=system_prompts, system_tokens=system_tokens,
                      session_rate=request_rate / turns, block_size=block_size, sigma=sigma,
                      max_user_tokens=max(max_prompt, 4))
