"""What chat and completions share: model check, prompt limits, sampling params, usage, logprobs text.

Every check here raises `APIError` with the offending field, so handlers never reach the engine
with a request the engine would refuse.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from contract.errors import error_body, error_type
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.server.errors import APIError, bad_request
from engine.server.generation import Inflight, engine_error
from engine.server.protocol import _SamplingRequest
from engine.server.streaming import sse


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    internal_token: str | None = None
    drain_timeout: float = 30.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_queued_requests: int | None = None  # beyond max_num_seqs running + this many, new requests get 429

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class ServerState:
    """Mutable per-process state: the engine once loaded, draining flag, in-flight requests."""

    def __init__(self, config: ServerConfig, engine=None):
        self.config = config
        self.engine = engine
        self.load_error: str | None = None
        self.draining = False
        self.closing = False  # set when the process exits: long-lived streams end
        self.inflight = Inflight()
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    @property
    def engine_dead(self) -> bool:
        return self.engine is not None and getattr(self.engine, "dead", None) is not None

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and not self.engine_dead

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.config.served_model_names:
            return self.config.model_name if model is None else model
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"{list(self.config.served_model_names)}", "model", "model_not_found")

    def engine_or_503(self):
        if self.draining:
            raise APIError(503, "server is shutting down; retry on another replica", None, "draining",
                           {"Retry-After": "1", "Connection": "close"})
        if self.engine_dead:
            raise APIError(503, f"the engine is not running: {self.engine.dead}", None, "engine_dead")
        if self.engine is None:
            msg = f"model failed to load: {self.load_error}" if self.load_error else "model is still loading"
            raise APIError(503, msg, None, "not_ready", {"Retry-After": "5"})
        return self.engine

    def admit(self, engine, num_requests: int = 1) -> None:
        """429 when the replica already holds as many requests as it runs plus --max-queued-requests."""
        limit = self.config.max_queued_requests
        if limit is None:
            return
        capacity = int(getattr(getattr(engine, "args", None), "max_num_seqs", 0)) + limit
        if len(self.inflight) + num_requests > capacity:
            raise APIError(429, f"this replica is at capacity ({len(self.inflight)} requests in flight, at most "
                                f"{capacity}); retry shortly or on another replica", None, "engine_overloaded",
                           {"Retry-After": "1"})

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text


def logit_bias(req: _SamplingRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise bad_request(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {bias}", "logit_bias")
        out.append((tok, float(bias)))
    return tuple(out)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)


def kv_capacity(engine) -> int:
    """Tokens the whole KV cache holds (a single request can never use more)."""
    stats = engine.stats()
    return int(getattr(stats, "num_total_blocks", 0)) * int(getattr(stats, "block_size", 0))


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int, kv_tokens: int, param: str,
                   prompt_param: str) -> int:
    """The output budget: the requested one, or all that is left of the context (and of the KV cache);
    400 naming the field when the request could never fit."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", prompt_param)
    left = max_model_len - prompt_len
    if left < 1:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                          f"{prompt_len} tokens (no room for output). Shorten the prompt.",
                          prompt_param, "context_length_exceeded")
    kv_left = kv_tokens - prompt_len if kv_tokens else left
    if requested is not None and requested > left:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                          f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                          f"completion). Reduce the prompt or {param}.", param, "context_length_exceeded")
    budget = min(left, kv_left) if requested is None else requested
    if budget > kv_left or budget < 1:
        raise bad_request(f"the request needs {prompt_len + max(budget, 1)} tokens of KV cache but this replica "
                          f"holds only {kv_tokens}; reduce the prompt or {param}",
                          param if requested is not None else prompt_param, "context_length_exceeded")
    return budget


def build_params(req: _SamplingRequest, max_tokens: int, logprobs: int | None, vocab_size: int) -> SamplingParams:
    if req.stop_token_ids:
        check_token_ids(req.stop_token_ids, vocab_size, "stop_token_ids")
    try:
        return req.sampling_params(max_tokens, logprobs, logit_bias(req, vocab_size))
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from None


def completed(out: RequestOutput | None) -> bool:
    """Finished on its own (stop/length), not aborted by a drain deadline or shutdown."""
    return out is not None and out.finished and all(o.finish_reason != "abort" for o in out.outputs)


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(state: ServerState, lps: list[TokenLogprob]) -> list[dict]:
    out = []
    for lp in lps:
        tok = state.token_text(lp.token_id)
        out.append({"token": tok, "logprob": _finite(lp.logprob), "bytes": list(tok.encode()),
                    "top_logprobs": [{"token": (t := state.token_text(i)), "logprob": _finite(v),
                                      "bytes": list(t.encode())} for i, v in lp.top]})
    return out


def completion_logprobs(state: ServerState, lps: list[TokenLogprob], text_offset: int) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok = state.token_text(lp.token_id)
        tokens.append(tok)
        token_lps.append(_finite(lp.logprob))
        top = {state.token_text(i): _finite(v) for i, v in lp.top} or {tok: _finite(lp.logprob)}
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _finite(x: float) -> float:
    """JSON has no -inf: clamp like vLLM does."""
    return max(float(x), -9999.0)


def stream_error(e: BaseException) -> str:
    """The SSE error event that ends a stream the engine failed."""
    err = engine_error(e)
    return sse(error_body(err.message, error_type(err.status), err.param, err.code))


def stream_end(base: dict, finals: list[RequestOutput | None], include_usage: bool) -> str | None:
    """The last event before [DONE]: an 'aborted' error if a completion was cut short, else the usage chunk."""
    if not all(completed(f) for f in finals):
        return sse(error_body("the request was aborted before it finished", error_type(503), None, "aborted"))
    if include_usage:
        return sse({**base, "choices": [], "usage": usage(finals)})
    return None
