"""Sampling parameters of one request, validated once at construction (the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.fairness import MAX_FAIRNESS_ID_CHARS
from engine.cache_pin import CachePin
from engine.errors import InvalidRequestError
from engine.lora.request import LoRARequest
from engine.structured.spec import Guide


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; `param` names the field."""


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled token's
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guide: Guide | None = None  # constrained decoding: JSON Schema, JSON object, regex, choice or grammar
    priority: int = 0  # scheduling, not sampling (vLLM's field): lower runs first under --scheduling-policy priority
    lora: LoRARequest | None = None  # not sampling either: the LoRA adapter the request runs under (None: the base)
    fairness_id: str = ""  # scheduling too: whom the waiting queue is fair across (the router's tenant; contract/fairness.py)
    cache_pin: CachePin | None = None  # caching: the cache_control prefix to pin (engine/kv/pins.py); None: none
    tpot_target_s: float | None = None  # scheduling: the time-per-output-token target (x-llm-d-slo-tpot-ms) its steps keep
    ttft_target_s: float | None = None  # scheduling: the time-to-first-token target (x-llm-d-slo-ttft-ms): its deadline
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple((int(k), float(v)) for k, v in self.logit_bias.items()))
        _check(1 <= self.n <= 128, "n", f"n must be between 1 and 128, got {self.n}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _check(0.0 <= self.temperature <= 100.0, "temperature",
               f"temperature must be in [0, 100], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(0.01 <= self.repetition_penalty <= 10.0, "repetition_penalty",
               f"repetition_penalty must be in [0.01, 10], got {self.repetition_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"logprobs must be in [0, 20], got {self.logprobs}")
        _check(isinstance(self.priority, int) and not isinstance(self.priority, bool)
               and -2**31 <= self.priority < 2**31, "priority", f"priority must be a 32-bit integer, got {self.priority!r}")
        _check(isinstance(self.fairness_id, str) and len(self.fairness_id) <= MAX_FAIRNESS_ID_CHARS, "fairness_id",
               f"fairness_id must be a string of at most {MAX_FAIRNESS_ID_CHARS} characters")
        _check(self.tpot_target_s is None or 0 < self.tpot_target_s < float("inf"), "tpot_target_s",
               f"tpot_target_s must be a number of seconds > 0, got {self.tpot_target_s}")
        _check(self.ttft_target_s is None or 0 < self.ttft_target_s < float("inf"), "ttft_target_s",
               f"ttft_target_s must be a number of seconds > 0, got {self.ttft_target_s}")
        _check(all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16, "stop",
               "stop must be at most 16 non-empty strings")
        for tok, bias in self.logit_bias:
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"logit_bias values must be in [-100, 100], got {bias}")
            _check(tok >= 0, "logit_bias", f"logit_bias keys must be token ids >= 0, got {tok}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)
