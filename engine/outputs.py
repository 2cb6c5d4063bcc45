"""What the engine hands back for a request.

Every engine step yields a `RequestDelta` per request that produced something: for each of its
completions only what is new (token ids, text, logprobs) and, once, its finish reason. A consumer that
fell behind merges the deltas that piled up (`RequestDelta.merge`); nothing copies a whole output per
step. The offline API accumulates a request's deltas into one cumulative `RequestOutput` at the end.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class CompletionDelta:
    """What one of a request's n completions produced since the previous delta."""

    index: int
    text: str = ""  # new text (stop strings removed)
    token_ids: list[int] = field(default_factory=list)  # new token ids
    logprobs: list[TokenLogprob] | None = None  # new logprobs, when the request asked for them
    finish_reason: str | None = None  # "stop" | "length" | "abort", in the delta that ends the completion
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    def merge(self, later: CompletionDelta) -> None:
        """Append a later delta of the same completion (in place)."""
        self.text += later.text
        _append_tokens(self, later)


def _append_tokens(target: CompletionDelta | CompletionOutput, later: CompletionDelta) -> None:
    """A later delta's token ids, logprobs and finish onto `target` (its text is the caller's)."""
    target.token_ids.extend(later.token_ids)
    if later.logprobs is not None:
        if target.logprobs is None:
            target.logprobs = []
        target.logprobs.extend(later.logprobs)
    if later.finish_reason is not None:
        target.finish_reason, target.stop_reason = later.finish_reason, later.stop_reason


@dataclass(slots=True)
class RequestDelta:
    """One step's news for a request: the completions that changed."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool  # every completion has finished (or the request was aborted)
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = None
    error: Exception | None = None  # why the engine failed the request (on its last delta, reason "abort")
    cache_creation_tokens: int = 0  # tokens of its cache_control prefix it computed (and pinned) itself
    cached_tokens_by_tier: tuple[int, int, int] = (0, 0, 0)  # num_cached_tokens by origin: (device, lower tier, peer)

    def merge(self, later: RequestDelta) -> None:
        """Fold a later delta of the same request into this one (in place)."""
        mine = {o.index: o for o in self.outputs}
        for o in later.outputs:
            if o.index in mine:
                mine[o.index].merge(o)
            else:
                self.outputs.append(o)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.cache_creation_tokens = later.cache_creation_tokens
        self.cached_tokens_by_tier = later.cached_tokens_by_tier
        self.metrics = later.metrics
        self.error = later.error


@dataclass
class CompletionOutput:
    """One completion, whole."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request, whole: what the offline `LLM` returns."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @classmethod
    def from_deltas(cls, prompt_token_ids: list[int], deltas: Iterable[RequestDelta]) -> RequestOutput:
        """Accumulate a request's deltas, in order (each text piece is joined once, at the end)."""
        texts: dict[int, list[str]] = {}
        comps: dict[int, CompletionOutput] = {}
        last: RequestDelta | None = None
        for d in deltas:
            last = d
            for o in d.outputs:
                c = comps.get(o.index)
                if c is None:
                    c = comps[o.index] = CompletionOutput(o.index)
                    texts[o.index] = []
                texts[o.index].append(o.text)
                _append_tokens(c, o)
        if last is None:
            raise ValueError("a request output needs at least one delta")
        for i, c in comps.items():
            c.text = "".join(texts[i])
        return cls(last.request_id, prompt_token_ids, [comps[i] for i in sorted(comps)], last.finished,
                   last.num_cached_tokens, last.metrics)
