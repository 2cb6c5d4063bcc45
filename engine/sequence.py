"""A sequence being generated: its tokens, how many of them the KV cache holds, and its blocks.

State lives here; the scheduler and the KV cache manager are helpers around it. One request with
n > 1 becomes n sequences that share the prompt's blocks (fork after prefill).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Sequence as Seq

from engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams | None = None,
                 cache_salt: str | None = None, index: int = 0, arrival_time: float | None = None):
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.params = params or SamplingParams()
        self.cache_salt = cache_salt
        self.lora = self.params.lora  # the LoRARequest (engine/lora/request.py) it runs under; None: the base model
        self.fairness_id = self.params.fairness_id  # whom the waiting queue is fair across (engine/fair_share.py)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.cached_by_tier = (0, 0, 0)  # of them: (device, lower tier, peer): where their blocks came from
        self.pinned = False  # its cache_control prefix (params.cache_pin) was pinned (engine/kv/pins.py)
        self.num_cache_created_tokens = 0  # tokens of that prefix it computed itself (not cache hits)
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks seen so far
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.matcher = None  # the grammar matcher of a constrained request (engine/structured/), advanced per token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_prefill_done(self) -> bool:
        """True once every known token except possibly the newest sampled one has K/V cached."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})")
