"""When a sequence stops on its tokens: the engine core's half of the stop conditions.

Interface (used by the engine loop, one StopChecker per sequence):

    checker = StopChecker(seq.params, eos_token_ids, max_model_len)
    seq.append_token(tok)
    res = checker.update(seq)        # StopResult(finish_reason, stop_reason)
    # res.finish_reason: None (go on) | "stop" | "length"; res.stop_reason: the stop token id, or None

`update` looks at the tokens appended since its last call (normally one), in order:
- EOS (any of `eos_token_ids`, unless ignore_eos) → "stop", stop_reason None; a `stop_token_ids` entry →
  "stop", stop_reason = the id. Neither before `min_tokens` outputs (the sampler masks them anyway).
- max_tokens outputs, or max_model_len tokens in all (prompt + output) → "length".
A "stop" always ends on the stopping token, so the front end knows which token's text to leave out.

Stop strings are the front end's (engine/output_text.py): it turns the reported tokens into text and tells
the core to stop a completion whose text reached one (engine/core/messages.py `Abort` with an index), as
vLLM v1's output processor does. Pure logic, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass(frozen=True)
class StopResult:
    finish_reason: str | None = None  # "stop" | "length" | None while the sequence goes on
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS and length)


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: int | Iterable[int] | None, max_model_len: int):
        self.params = params
        eos = () if eos_token_ids is None or params.ignore_eos else (
            (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids))
        self._eos = frozenset(eos)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._max_model_len = max_model_len
        self._num_seen = 0  # output tokens already looked at
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, seq: Sequence) -> StopResult:
        """Account for the tokens appended to `seq` since the last call."""
        if not self.finished:
            start = seq.num_prompt_tokens + self._num_seen
            for pos, tok in enumerate(seq.token_ids[start:], start=start + 1):
                self._num_seen += 1
                if self._step(tok, pos):
                    break
        return StopResult(self.finish_reason, self.stop_reason)

    def _step(self, tok: int, num_tokens: int) -> bool:
        p = self.params
        if self._num_seen >= p.min_tokens and (tok in self._eos or tok in self._stop_ids):
            self.finish_reason = "stop"
            self.stop_reason = None if tok in self._eos else tok
        elif (p.max_tokens is not None and self._num_seen >= p.max_tokens) or num_tokens >= self._max_model_len:
            self.finish_reason = "length"
        return self.finished
