"""When a sequence stops, and which of its text a client may see so far.

Interface (used by the engine loop, one StopChecker per sequence):

    checker = StopChecker(seq.params, eos_token_ids, max_model_len, detokenizer)   # detokenizer may be None
    seq.append_token(tok)
    res = checker.update(seq)        # StopResult(text, finish_reason, stop_reason)
    # res.text: new text safe to stream now; checker.text: all of it so far (joined on demand)
    # res.finish_reason: None (go on) | "stop" | "length"; res.stop_reason: the stop string or token id

`update` looks at the tokens appended since its last call (normally one), in order:
- EOS (any of `eos_token_ids`, unless ignore_eos) → "stop", stop_reason None; a `stop_token_ids` entry →
  "stop", stop_reason = the id. Neither before `min_tokens` outputs (the sampler masks them anyway).
  The stopping token's text is not emitted unless include_stop_str_in_output.
- Stop strings → "stop", stop_reason = the string; checked from `min_tokens` on, also when the string spans
  tokens. The text is cut where the (earliest) stop string begins, or after it if include_stop_str_in_output.
  While streaming, the longest tail of the text that could still begin a stop string is held back, so a
  client never sees text that a later token would retract. Held text is released as soon as it cannot be
  a stop string any more, and at the end of the sequence.
- max_tokens outputs, or max_model_len tokens in all (prompt + output) → "length".
When the sequence finishes, held-back text (a partial stop string, a character cut off by the end) is
emitted, so `checker.text` is the full decode minus what stop handling removes. Pure logic, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@dataclass(frozen=True)
class StopResult:
    text: str  # new text the client may see now
    finish_reason: str | None = None  # "stop" | "length" | None while the sequence goes on
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: int | Iterable[int] | None, max_model_len: int,
                 detokenizer: IncrementalDetokenizer | None = None):
        self.params = params
        eos = () if eos_token_ids is None or params.ignore_eos else (
            (eos_token_ids,) if isinstance(eos_token_ids, int) else tuple(eos_token_ids))
        self._eos = frozenset(eos)
        self._stop_ids = frozenset(params.stop_token_ids)
        self._max_model_len = max_model_len
        self._detok = detokenizer
        self._stops = params.stop if detokenizer is not None else ()
        self._num_seen = 0  # output tokens already looked at
        self._held = ""  # text produced but not yet shown: it could be the start of a stop string
        self._shown: list[str] = []  # every piece of text shown so far
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """Everything shown so far (joined on demand: the engine loop only uses each step's new text)."""
        return "".join(self._shown)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, seq: Sequence) -> StopResult:
        """Account for the tokens appended to `seq` since the last call."""
        if self.finished:
            return StopResult("", self.finish_reason, self.stop_reason)
        start = seq.num_prompt_tokens + self._num_seen
        shown = []
        for pos, tok in enumerate(seq.token_ids[start:], start=start + 1):
            self._num_seen += 1
            done = self._step(tok, pos)
            if done is not None:
                shown.append(done)
                break
            shown.append(self._release())
        new = "".join(shown)
        self._shown.append(new)
        return StopResult(new, self.finish_reason, self.stop_reason)

    def _step(self, tok: int, num_tokens: int) -> str | None:
        """Process one output token; returns the final text if it ends the sequence, else None."""
        p = self.params
        may_stop = self._num_seen >= p.min_tokens
        if may_stop and (tok in self._eos or tok in self._stop_ids):
            self.finish_reason = "stop"
            self.stop_reason = None if tok in self._eos else tok
            tail = self._add_text(tok) if p.include_stop_str_in_output else ""
            return self._take_held() + tail + self._flush_text()
        before = len(self._held)
        self._held += self._add_text(tok)
        if may_stop and self._stops:
            hit = _find_stop(self._held, before, self._stops)
            if hit is not None:
                at, stop = hit
                self.finish_reason, self.stop_reason = "stop", stop
                end = at + len(stop) if p.include_stop_str_in_output else at
                text = self._held[:end]
                self._held = ""
                return text
        if (p.max_tokens is not None and self._num_seen >= p.max_tokens) or num_tokens >= self._max_model_len:
            self.finish_reason = "length"
            self._held += self._flush_text()
            return self._take_held()
        return None

    def _release(self) -> str:
        """Show the held text except the longest tail that could still begin a stop string."""
        keep = _partial_stop_len(self._held, self._stops)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def _take_held(self) -> str:
        out, self._held = self._held, ""
        return out

    def _add_text(self, tok: int) -> str:
        return self._detok.add([tok]) if self._detok is not None else ""

    def _flush_text(self) -> str:
        return self._detok.flush() if self._detok is not None else ""


def _find_stop(text: str, old_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends beyond `old_len` (the part already searched)."""
    best: tuple[int, str] | None = None
    for s in stops:
        at = text.find(s, max(0, old_len - len(s) + 1))
        if at >= 0 and (best is None or at < best[0]):
            best = (at, s)
    return best


def _partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        start = max(len(text) - len(s) + 1, 0)  # a proper prefix is shorter than s
        at = text.find(s[0], start)
        while at >= 0 and len(text) - at > best:
            if s.startswith(text[at:]):
                best = len(text) - at
                break
            at = text.find(s[0], at + 1)
    return best
