"""The scheduler's configuration (frozen, validated once) and the validation helpers engine configs share.

Every bad value raises ConfigError, a ValueError whose `field` names the offending setting, so the
CLI and the HTTP edge can point at it.
"""

from __future__ import annotations

from dataclasses import dataclass

from contract.errors import ConfigError

SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values
DEFAULT_MAX_STEP_MS = 150.0  # under contention, prompt chunks shrink so a step is predicted to take at most this
MAX_STEP_MS_LIMIT = 60_000.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of continuous batching, the longest sequence (prompt + output) served, and the order of
    the waiting queue (engine/scheduler.py)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int = 2048
    policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    priority_aging_s: float = 30.0  # under "priority": a waiting request's priority improves by 1 per this long
    max_loras: int = 1  # distinct LoRA adapters among the running sequences (the model's adapter slots)
    max_step_ms: float = DEFAULT_MAX_STEP_MS  # the step-time target under contention (engine/step_time.py); 0: off

    def __post_init__(self) -> None:
        check(self.policy in SCHEDULING_POLICIES, "scheduling_policy",
              f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.policy!r}")
        check(isinstance(self.priority_aging_s, (int, float)) and self.priority_aging_s > 0, "priority_aging",
              f"priority aging must be > 0 seconds, got {self.priority_aging_s!r}")
        check_max_step_ms("max_step_ms", self.max_step_ms)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_model_len", self.max_model_len, 1)
        # Chunked prefill lets a prompt longer than the budget run over several steps, but every
        # running sequence must be able to get at least one token per step.
        check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
              f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
              f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode each step")


def check_max_step_ms(field: str, value: object) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= MAX_STEP_MS_LIMIT, field,
          f"{field} must be a number of milliseconds in [0, {MAX_STEP_MS_LIMIT:.0f}] (0: steps are not bounded "
          f"by time), got {value!r}")


def check_int(field: str, value: object, minimum: int) -> None:
    check(isinstance(value, int) and not isinstance(value, bool), field,
          f"{field} must be an integer, got {value!r}")
    check(value >= minimum, field, f"{field} must be >= {minimum}, got {value}")


def check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)
