"""What each request really used on this engine, remembered for a while under the id its router gave it. Pure:
no I/O (engine/server/usage.py answers lookups; the server feeds it every delta the core reports).

A router meters a request from the usage the engine reports in its response. When the router dies before it
could read that (or settle it), the router that reconciles its pending ledger record asks this engine
(`POST /v1/kvfleet/usage/lookup`, contract/usage_lookup.py) what the request used, by the router's request id
(the `x-request-id` header the router sends).

The counts follow the engine's own counters (`vllm:prompt_tokens`, `vllm:generation_tokens`), so a ledger built
from them sums to what the engines' /metrics say:
- prompt tokens count once a request's first token was sampled (a request aborted before that used none);
- cached prompt tokens: as the engine reports them in its usage (`prompt_tokens_details.cached_tokens`);
- written prompt tokens: those of its cache_control prefix it computed and pinned, as the engine reports them
  (`cache_creation_input_tokens`), so a router prices them at the cache-write price;
- the cached tokens by where their blocks came from (device memory, the lower tier, a peer), as the engine reports
  them (`cached_tokens_by_tier`), so a record closed from the book carries the same split as one settled live;
- output tokens: every token the core sampled for the request, those sampled after its client went away (in
  the step that was running when the abort arrived) included.

A router request may be several engine requests (a batch of completion prompts): they sum under its id, which
is `finished` when the last of them ended. The outcome is `aborted` if any was aborted (its client went away:
e.g. the router died mid-stream), else `error` if the engine failed one, else the first one's finish reason
(`stop`, `length`). Finished entries are kept for `ttl_s` seconds, at most `max_entries` of them (the oldest
go first); running ones as long as they run.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from contract.usage_lookup import TIERS

DEFAULT_MAX_ENTRIES = 200_000  # ~150 bytes each: ~30 MB at most
DEFAULT_TTL_S = 7200.0  # twice the router's default --usage-reconcile-after (3600 s)
RUNNING = "running"
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class RequestUsage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    outcome: str  # "stop" | "length" | "aborted" | "error"
    finished_at: float  # Unix seconds
    written_tokens: int = 0  # of the computed prompt tokens, written to cache_control breakpoints
    cached_by_tier: tuple[int, int, int] = (0, 0, 0)  # cached_tokens by origin: (device, lower tier, peer)

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "written_tokens": self.written_tokens,
                "cached_tokens_by_tier": dict(zip(TIERS, self.cached_by_tier, strict=True)),
                "outcome": self.outcome, "finished_at": self.finished_at}


class _Part:
    """One engine request of a router request, while it runs."""

    __slots__ = ("key", "prompt", "cached", "written", "output", "outcome", "tiers")

    def __init__(self, key: str):
        self.key = key
        self.prompt = self.cached = self.written = self.output = 0
        self.outcome: str | None = None
        self.tiers = (0, 0, 0)


class _Open:
    __slots__ = ("parts", "prompt", "cached", "written", "output", "outcomes", "tiers")

    def __init__(self) -> None:
        self.parts = 0
        self.prompt = self.cached = self.written = self.output = 0
        self.outcomes: list[str] = []
        self.tiers = (0, 0, 0)


def _add(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _outcome(outcomes: list[str]) -> str:
    for worst in ("aborted", "error"):
        if worst in outcomes:
            return worst
    return outcomes[0] if outcomes else "stop"


class UsageBook:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time):
        if max_entries < 1 or not ttl_s > 0:
            raise ValueError(f"a usage book needs max_entries >= 1 and ttl_s > 0, got {max_entries}, {ttl_s}")
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._parts: dict[str, _Part] = {}  # engine request id -> its running part
        self._open: dict[str, _Open] = {}  # router request id -> what its parts used so far
        self._done: OrderedDict[str, RequestUsage] = OrderedDict()  # router request id -> usage, oldest first

    def __len__(self) -> int:
        return len(self._done)

    def expect(self, engine_id: str, key: str) -> None:
        """Engine request `engine_id` (just added) belongs to the router's request `key`."""
        if engine_id in self._parts:
            return
        self._parts[engine_id] = _Part(key)
        self._open.setdefault(key, _Open()).parts += 1

    def observe(self, delta) -> None:
        """A delta the core reported (engine/outputs.py RequestDelta), before the server formats it."""
        part = self._parts.get(delta.request_id)
        if part is None:
            return
        new = sum(len(o.token_ids) for o in delta.outputs)
        if new and not part.prompt:  # the engine counts the prompt at the request's first sampled token
            part.prompt = delta.num_prompt_tokens
        part.output += new
        if part.prompt:
            part.cached = delta.num_cached_tokens
            part.written = delta.cache_creation_tokens
            part.tiers = tuple(delta.cached_tokens_by_tier)
        if delta.error is not None:
            part.outcome = "error"
        for o in delta.outputs:
            if o.finish_reason == "abort" and part.outcome is None:
                part.outcome = "aborted"
            elif o.index == 0 and o.finish_reason is not None and part.outcome is None:
                part.outcome = o.finish_reason
        if delta.finished:
            self.end(delta.request_id)

    def end(self, engine_id: str, outcome: str | None = None) -> None:
        """The engine request ended (its last delta, an error, or a stop string the server saw)."""
        part = self._parts.pop(engine_id, None)
        if part is None:
            return
        acc = self._open[part.key]
        acc.parts -= 1
        acc.prompt += part.prompt
        acc.cached += part.cached
        acc.written += part.written
        acc.output += part.output
        acc.tiers = _add(acc.tiers, part.tiers)
        acc.outcomes.append(part.outcome or outcome or "stop")
        if acc.parts:
            return
        del self._open[part.key]
        now = self.clock()
        usage = RequestUsage(acc.prompt, acc.cached, acc.output, _outcome(acc.outcomes), now, acc.written, acc.tiers)
        earlier = self._done.pop(part.key, None)
        if earlier is not None:  # the same router request again on this engine (a retry): both count
            usage = RequestUsage(earlier.prompt_tokens + usage.prompt_tokens,
                                 earlier.cached_tokens + usage.cached_tokens,
                                 earlier.completion_tokens + usage.completion_tokens,
                                 _outcome([earlier.outcome, usage.outcome]), now,
                                 earlier.written_tokens + usage.written_tokens,
                                 _add(earlier.cached_by_tier, usage.cached_by_tier))
        self._done[part.key] = usage
        self._prune(now)

    def lookup(self, keys: Iterable[str]) -> dict[str, RequestUsage | str]:
        """Per router request id: its usage once finished, `running`, or `unknown` (never seen here, or forgotten)."""
        self._prune(self.clock())
        out: dict[str, RequestUsage | str] = {}
        for k in keys:
            got = self._done.get(k)
            out[k] = got if got is not None else RUNNING if k in self._open else UNKNOWN
        return out

    def _prune(self, now: float) -> None:
        done = self._done
        while done and (len(done) > self.max_entries or next(iter(done.values())).finished_at <= now - self.ttl_s):
            done.popitem(last=False)
