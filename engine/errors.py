"""Every error the engine raises at its edges, typed, so that one table (engine/server/errors.py) maps
each to an HTTP status and an OpenAI error type, and the CLI can name the flag.

    InvalidRequestError    a request can never run; `param` names the request field to blame, `code` is
      RequestTooLongError  OpenAI's error code ("context_length_exceeded" for a request too long)
      SamplingParamsError  (engine/sampling_params.py: a sampling parameter is out of range)
      LoRAError            a LoRA adapter cannot be served (engine/lora/adapter.py)
    QueueFullError         the replica already holds all the requests it takes; retry shortly or elsewhere
    PinLimitError          a cache_control prefix would pin more KV blocks than the engine or the tenant may
    EngineDeadError        the engine loop is not running (not started, shut down or crashed)
    RequestOutOfMemoryError  the engine gave up on a running request that kept running out of memory

A bad setting raises contract.errors.ConfigError, the same in engine, server and router. Pure: imports nothing.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request can never run as asked. `param` is the engine-level field ("prompt", "max_tokens",
    "n", "logit_bias", ...); the HTTP edge renames it to the wire field where they differ."""

    code = "invalid_value"

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole across the engine core's process boundary
        return type(self), (self.param, str(self))


class LoRAError(InvalidRequestError):
    """The adapter cannot be served; `param` names what is wrong (lora_path, r, target_modules, ...)."""

    code = "invalid_lora_adapter"


class RequestTooLongError(InvalidRequestError):
    """Prompt + output do not fit max_model_len or the whole KV cache."""

    code = "context_length_exceeded"


class QueueFullError(RuntimeError):
    """The replica holds as many requests as it runs plus its queue limit."""


class PinLimitError(RuntimeError):
    """Pinning the request's cache_control prefix would exceed the engine's or its tenant's pinned-block limit
    (engine/kv/pins.py); nothing of it was taken."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down or crashed) or never started; no request can run."""


class RequestOutOfMemoryError(RuntimeError):
    """The model ran out of memory in several steps in a row that ran this request alone
    (engine/oom_backoff.py); the engine freed it and serves the others."""
