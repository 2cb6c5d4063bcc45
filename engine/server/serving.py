"""What chat and completions share: model check, sampling params, and `respond` (add the requests
through the engine's one admission edge, then stream or collect their deltas through the formatter).

Field checks here raise `APIError` naming the field; whatever the engine refuses comes back as a typed
error that `engine_error` maps (one table, engine/server/errors.py), before any byte is sent.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from contract.errors import ConfigError
from contract.fairness import FAIRNESS_HEADER, MAX_FAIRNESS_ID_CHARS
from contract.kv_transfer import PULL_HEADER
from contract.request import RequestError
from contract.slo import LatencyTargets, latency_targets
from engine.client import EngineClient
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.server.errors import APIError, bad_request, engine_error
from engine.server.formatter import Format, Reply
from engine.server.generation import ClosingBody, Inflight, Tracked, close_all, merge, start
from engine.server.protocol import _SamplingRequest
from engine.server.streaming import ClientGone, sse_response, watch_disconnect
from engine.usage_book import UsageBook

MAX_ROUTER_ID_CHARS = 200  # a router's x-request-id longer than this is not remembered in the usage book


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    internal_token: str | None = None
    require_internal_token: bool = False  # on every endpoint but /health and /ready, not only /v1/kv/events
    drain_timeout: float = 30.0
    max_body_bytes: int = 4 * 1024 * 1024
    sse_keepalive: float = 10.0  # seconds a stream may go without a byte before a `: keep-alive` comment; 0: none
    kv_pull_timeout: float = 5.0  # seconds a request may spend pulling its prefix from a peer (0: pulls off)
    kv_pull_max_bytes: int = 2 * 1024 ** 3  # the most KV payload one pull takes

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ConfigError("--served-model-name", "--served-model-name must hold at least one non-empty name")
        if self.require_internal_token and not self.internal_token:
            raise ConfigError("--require-internal-token", "--require-internal-token needs --internal-token "
                                                          "(or env KVFLEET_INTERNAL_TOKEN)")
        if self.drain_timeout < 0:
            raise ConfigError("--drain-timeout", f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.max_body_bytes < 1024:
            raise ConfigError("--max-body-bytes", f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.kv_pull_timeout < float("inf"):
            raise ConfigError("--kv-pull-timeout", f"--kv-pull-timeout must be a number of seconds >= 0 (0: pulls "
                                                   f"off), got {self.kv_pull_timeout}")
        if self.kv_pull_max_bytes < 1:
            raise ConfigError("--kv-pull-max-bytes", f"--kv-pull-max-bytes must be >= 1, got {self.kv_pull_max_bytes}")
        if not self.sse_keepalive >= 0 or self.sse_keepalive == float("inf"):
            raise ConfigError("--sse-keepalive", f"--sse-keepalive must be a number of seconds >= 0 (0: off), "
                                                 f"got {self.sse_keepalive}")

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]


class ServerState:
    """Mutable per-process state: the engine once loaded, draining flag, in-flight requests."""

    def __init__(self, config: ServerConfig, engine: EngineClient | None = None):
        self.config = config
        self.engine = engine
        self.lora = None  # engine/server/lora.py's LoRARegistry when LoRA adapters are enabled
        self.kv_puller = None  # engine/server/kv_transfer.py's KVPuller, unless pulls are off
        self.load_error: str | None = None
        self.draining = False
        self.closing = False  # set when the process exits: long-lived streams end
        self.inflight = Inflight()
        self.usage = UsageBook()  # what each request used, by its router's x-request-id (POST /v1/kvfleet/usage/lookup)
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    @property
    def engine_dead(self) -> bool:
        return self.engine is not None and self.engine.dead is not None

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and not self.engine_dead

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.config.served_model_names:
            return self.config.model_name if model is None else model
        if self.lora is not None and model in self.lora.adapters:
            return model
        adapters = list(self.lora.adapters) if self.lora is not None else []
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"{list(self.config.served_model_names) + adapters}", "model", "model_not_found")

    def engine_or_503(self) -> EngineClient:
        if self.draining:
            raise APIError(503, "server is shutting down; retry on another replica", None, "draining",
                           {"Retry-After": "1", "Connection": "close"})
        if self.engine_dead:
            raise APIError(503, f"the engine is not running: {self.engine.dead}", None, "engine_dead")
        if self.engine is None:
            msg = f"model failed to load: {self.load_error}" if self.load_error else "model is still loading"
            raise APIError(503, msg, None, "not_ready", {"Retry-After": "5"})
        return self.engine

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return text


def logit_bias(req: _SamplingRequest) -> tuple[tuple[int, float], ...]:
    """The wire's {"token id": bias} as pairs (ranges are checked by SamplingParams and admission)."""
    out = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            out.append((int(key), float(bias)))
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return tuple(out)


def fairness_of(request: Request) -> str:
    """The request's fairness id (contract/fairness.py): the router's tenant, or a gateway's; "" without one."""
    value = request.headers.get(FAIRNESS_HEADER, "").strip()
    if len(value) > MAX_FAIRNESS_ID_CHARS:
        raise bad_request(f"the {FAIRNESS_HEADER} header must be at most {MAX_FAIRNESS_ID_CHARS} characters",
                          FAIRNESS_HEADER)
    return value


def targets_of(request: Request) -> LatencyTargets:
    """The request's x-llm-d-slo-ttft-ms and x-llm-d-slo-tpot-ms (contract/slo.py) in seconds; a bad value is the
    request's 400."""
    try:
        return latency_targets(request.headers)
    except RequestError as e:
        raise bad_request(str(e), e.param) from None


def build_params(req: _SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs, logit_bias(req))
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from None


async def respond(state: ServerState, request: Request, req: _SamplingRequest, fmt: Format, model: str, rid: str,
                  prompts: list[list[int]], params: list[SamplingParams], wire: Mapping[str, str], arrival: float,
                  echo: Callable[[], list[str]] | None = None) -> Response:
    """Add one request per prompt (all or none: a refused one closes those already added, before any byte
    is sent), then stream their deltas as SSE or answer with the whole body. echo: the prompts' texts,
    asked for once the engine has admitted them (so only valid token ids are decoded). A stream's status
    line goes out with its first chunk or keep-alive, so a failure before then still gets its HTTP status."""
    engine = state.engine_or_503()
    metrics = request.app.state.metrics
    lora = state.lora.get(model) if state.lora is not None else None
    if lora is not None:  # the adapter rides with the request's params to the engine core
        params = [dataclasses.replace(p, lora=lora) for p in params]
    fairness_id = fairness_of(request)
    if fairness_id:  # the tenant the router named: the scheduler's queue is fair across them (engine/fair_share.py)
        params = [dataclasses.replace(p, fairness_id=fairness_id) for p in params]
    targets = targets_of(request)
    if targets.tpot_s is not None:  # its steps are kept under it (engine/scheduler.py step_target_s)
        params = [dataclasses.replace(p, tpot_target_s=targets.tpot_s) for p in params]
    if targets.ttft_s is not None:  # its deadline orders the waiting queue (engine/scheduler.py Scheduler.deadline)
        params = [dataclasses.replace(p, ttft_target_s=targets.ttft_s) for p in params]
    if state.kv_puller is not None:  # a pull the router asked for, or one in flight for the same prefix
        hint = request.headers.get(PULL_HEADER) if state.kv_puller.allowed(request) else None
        for ids, sp in zip(prompts, params, strict=True):  # before the requests are added: they find the blocks
            await state.kv_puller.pull(hint or None, ids, req.cache_salt, sp.lora.name if sp.lora is not None else None)
    streams: list[Tracked] = []
    router_id = request.headers.get("x-request-id", "")[:MAX_ROUTER_ID_CHARS + 1]
    try:
        for k, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
            names = wire if len(prompts) == 1 else {**wire, "prompt": f"prompt[{k}]"}
            try:
                streams.append(start(engine, ids, sp, rid if len(prompts) == 1 else f"{rid}-{k}", req.cache_salt,
                                     metrics, state.inflight, arrival))
            except Exception as e:
                raise engine_error(e, names) from None
            if router_id and len(router_id) <= MAX_ROUTER_ID_CHARS:  # before any await: no delta came yet
                state.usage.expect(streams[-1].request_id, router_id)
    except BaseException:
        await close_all(streams)
        raise
    reply = Reply(fmt, rid, model, int(time.time()), req.n, params[0].logprobs is not None, echo and echo(),
                  prompts if req.return_token_ids else None, cache_control=params[0].cache_pin is not None)
    headers = {"X-Request-Id": rid}
    if req.stream:
        continuous = req.include_usage() and req.stream_options.continuous_usage_stats
        body = reply.stream(merge(streams), len(prompts), req.include_usage(), continuous)
        return sse_response(ClosingBody(body, streams), headers, state.config.sse_keepalive)
    try:
        return JSONResponse(await watch_disconnect(request, reply.collect(merge(streams), len(prompts))),
                            headers=headers)
    except ClientGone:
        return Response(status_code=499)
    except APIError:
        raise
    except Exception as e:  # the engine died or failed the request
        raise engine_error(e) from None
    finally:
        await close_all(streams)
