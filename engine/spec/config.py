"""`--speculative-config`: vLLM's JSON object, validated once at the edge.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
     "disable_by_batch_size": 16}

    {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
     "suffix_decoding_max_spec_factor": 1.0, "suffix_decoding_min_token_prob": 0.1,
     "suffix_decoding_max_cached_requests": 64}

    {"method": "draft_model", "model": "/models/smollm2-draft", "num_speculative_tokens": 4}

As in vLLM: `num_speculative_tokens` is required; `prompt_lookup_min` / `prompt_lookup_max` (ngram) default to 5
when both are absent and to each other when one is; the `suffix_decoding_*` fields (suffix, engine/spec/suffix.py)
take vLLM's defaults except `suffix_decoding_max_cached_requests`: 64 finished requests here (vLLM: 10,000), since
each proposal scans the cached outputs. `model` (draft_model only, required there) names a smaller checkpoint of
the same vocabulary, as the engine's own `--model` does (engine/spec/draft_model.py). `disable_by_batch_size`
(vLLM's name) is kvfleet's back-off: a step with more running sequences than this proposes nothing
(engine/spec/decoder.py). Every error is a ConfigError naming `--speculative-config` and the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from contract.errors import ConfigError

FLAG = "--speculative-config"
METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given
DEFAULT_DISABLE_BY_BATCH_SIZE = 16  # not measured yet (issue 45): verifying k drafts costs k rows per sequence
DEFAULT_TREE_DEPTH = 24  # vLLM's suffix_decoding_* defaults, but the cached requests
DEFAULT_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1
DEFAULT_CACHED_REQUESTS = 64
MAX_TREE_DEPTH = 256
_SUFFIX = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
           "suffix_decoding_max_cached_requests")
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
           *_SUFFIX, "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    suffix_decoding_max_tree_depth: int = DEFAULT_TREE_DEPTH
    suffix_decoding_max_spec_factor: float = DEFAULT_SPEC_FACTOR
    suffix_decoding_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    suffix_decoding_max_cached_requests: int = DEFAULT_CACHED_REQUESTS
    model: str | None = None  # draft_model: the draft checkpoint (a path or a bundled model's name)

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model":
            _check(isinstance(self.model, str) and bool(self.model.strip()), "model",
                   f"is required with method draft_model (the draft checkpoint's path), got {self.model!r}")
        else:
            _check(self.model is None, "model", f"applies only to method draft_model, not {self.method}")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int("prompt_lookup_min", self.prompt_lookup_min, 1)
        _int("prompt_lookup_max", self.prompt_lookup_max, 1)
        _check(self.prompt_lookup_min <= self.prompt_lookup_max, "prompt_lookup_min",
               f"must be <= prompt_lookup_max ({self.prompt_lookup_max}), got {self.prompt_lookup_min}")
        _int("disable_by_batch_size", self.disable_by_batch_size, 1)
        _int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 2, MAX_TREE_DEPTH)
        _number("suffix_decoding_max_spec_factor", self.suffix_decoding_max_spec_factor, 0.0, None)
        _number("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob, 0.0, 1.0)
        _int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0)

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """From the flag's JSON text, a dict, or a SpeculativeConfig; None (or an empty string) is off."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(FLAG, f"{FLAG}: must be a JSON object, e.g. '{{\"method\": \"ngram\", "
                                        f"\"num_speculative_tokens\": 4}}' ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(FLAG, f"{FLAG}: must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_FIELDS))
        _check(not unknown, None,
               f"unknown field(s) {', '.join(map(repr, unknown))}; kvfleet takes {', '.join(_FIELDS)}")
        _check("method" in value, "method", "is required (\"ngram\", \"suffix\" or \"draft_model\")")
        _check("num_speculative_tokens" in value, "num_speculative_tokens", "is required (the drafts per step, k)")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None:  # vLLM's defaults: 5 and 5 when neither is given, else each the other's
            lo = DEFAULT_LOOKUP if hi is None else hi
        if hi is None:
            hi = lo
        method = value["method"]
        if method == "[ngram]":  # vLLM's legacy spelling
            method = "ngram"
        disable = value.get("disable_by_batch_size")
        suffix = {f: value[f] for f in _SUFFIX if value.get(f) is not None}
        return cls(method, value["num_speculative_tokens"], lo, hi,
                   DEFAULT_DISABLE_BY_BATCH_SIZE if disable is None else disable, **suffix, model=value.get("model"))

    def to_json(self) -> str:
        return json.dumps({f: getattr(self, f) for f in _FIELDS if f != "model" or self.model is not None})


def _int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    ok = (isinstance(value, int) and not isinstance(value, bool) and value >= minimum
          and (maximum is None or value <= maximum))
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    _check(ok, name, f"must be an integer {bound}, got {value!r}")


def _number(name: str, value: object, minimum: float, maximum: float | None) -> None:
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and value >= minimum
          and (value <= maximum if maximum is not None else value != float("inf")))
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    _check(ok, name, f"must be a number {bound}, got {value!r}")


def _check(ok: bool, name: str | None, message: str) -> None:
    if not ok:
        where = f"{FLAG}: {name}" if name else FLAG
        raise ConfigError(FLAG, f"{where} {message}" if name else f"{where}: {message}")
