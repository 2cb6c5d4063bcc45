"""The scheduler's configuration (frozen, validated once) and the validation helpers engine configs share.

Every bad value raises ConfigError, a ValueError whose `field` names the offending setting, so the
CLI and the HTTP edge can point at it.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.errors import ConfigError


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching and the longest sequence (prompt + output) served."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_model_len", self.max_model_len, 1)
        # Chunked prefill lets a prompt longer than the budget run over several steps, but every
        # running sequence must be able to get at least one token per step.
        check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
              f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
              f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")


def check_int(field: str, value: object, minimum: int) -> None:
    check(isinstance(value, int) and not isinstance(value, bool), field,
          f"{field} must be an integer, got {value!r}")
    check(value >= minimum, field, f"{field} must be >= {minimum}, got {value}")


def check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)
