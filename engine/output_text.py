"""The text of a request's completions, made in the front end from the token ids the engine core reports.

As in vLLM v1's output processor, the core deals in tokens only (engine/stop.py: EOS, stop token ids,
lengths) and the process that serves HTTP detokenizes and applies stop strings, so that work never holds
up a step. Interface (the server's engine/async_engine.py and the offline engine/llm.py):

    text = RequestText(params, prompt_token_ids, tokenizer)
    delta, stops = text.apply(core_delta)   # core_delta: a RequestDelta of token ids (text "")
    # delta: the client's RequestDelta (text filled in; None when nothing in it is news to the client)
    # stops: what the core must stop: indexes of completions a stop string ended in this delta, or [None] when
    #        that ended the request's last one (delta.finished before the core's): the whole request

Per completion (CompletionText), token by token:
- Stop strings → "stop", stop_reason = the string; checked from `min_tokens` outputs on, also when the string
  spans tokens. The text is cut where the (earliest) stop string begins, or after it if
  include_stop_str_in_output; the token that completed it is the completion's last (the tokens and logprobs
  the core made after it, before it heard of the stop, are dropped).
- While streaming, the longest tail of the text that could still begin a stop string is held back, so a
  client never sees text that a later token would retract; held text is released as soon as it cannot be a
  stop string any more, and when the completion ends.
- The core's own finish: "stop" ends on a stop token (EOS or a stop_token_ids entry), whose text is left out
  unless include_stop_str_in_output; "length" releases everything; a stop string completed by that same last
  token still wins (it comes first in the text). "abort" ends the completion with nothing more.
`CompletionText.text` is then the full decode minus what stop handling removes. Pure logic, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from engine.detokenizer import Decoder, IncrementalDetokenizer
from engine.outputs import CompletionDelta, RequestDelta
from engine.sampling_params import SamplingParams


class CompletionText:
    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], tokenizer: Decoder):
        self.params = params
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops = tuple(params.stop)
        self._num_seen = 0  # output tokens turned into text
        self._held = ""  # text produced but not yet shown: it could be the start of a stop string
        self._shown: list[str] = []  # every piece of text shown so far
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def text(self) -> str:
        """Everything shown so far (joined on demand)."""
        return "".join(self._shown)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, d: CompletionDelta) -> tuple[CompletionDelta | None, bool]:
        """(d with its text, cut after a stop string; whether a stop string ended it here and the core must be
        told). None when the completion had ended already: tokens the core made before it heard of the stop."""
        if self.finished:
            return None, False
        shown: list[str] = []
        kept = len(d.token_ids)
        last = kept - 1
        for i, tok in enumerate(d.token_ids):
            self._num_seen += 1
            if i == last and d.finish_reason == "stop":  # the core stopped on this token (EOS, stop_token_ids)
                tail = self._detok.add([tok]) if self.params.include_stop_str_in_output else ""
                shown.append(self._take_held() + tail + self._detok.flush())
                break
            before = len(self._held)
            self._held += self._detok.add([tok])
            hit = _find_stop(self._held, before, self._stops) if self._num_seen >= self.params.min_tokens else None
            if hit is not None:
                at, stop = hit
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                shown.append(self._held[:end])
                self._held = ""
                self.finish_reason, self.stop_reason = "stop", stop
                kept = i + 1
                break
            if i == last and d.finish_reason == "length":
                self._held += self._detok.flush()
                shown.append(self._take_held())
            else:
                shown.append(self._release())
        stopped_here = self.finished and d.finish_reason is None  # else the core ended it already
        if not self.finished:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        new = "".join(shown)
        self._shown.append(new)
        logprobs = d.logprobs if d.logprobs is None or kept == len(d.token_ids) else d.logprobs[:kept]
        return CompletionDelta(d.index, new, d.token_ids[:kept], logprobs, self.finish_reason,
                               self.stop_reason), stopped_here

    def _release(self) -> str:
        """Show the held text except the longest tail that could still begin a stop string."""
        keep = _partial_stop_len(self._held, self._stops)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def _take_held(self) -> str:
        out, self._held = self._held, ""
        return out


class RequestText:
    """The n completions of one request."""

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], tokenizer: Decoder):
        self._params = params
        self._prompt = prompt_token_ids
        self._tokenizer = tokenizer
        self.completions: dict[int, CompletionText] = {}

    @property
    def finished(self) -> bool:
        """Every completion ended (as far as the front end knows)."""
        return len(self.completions) == self._params.n and all(c.finished for c in self.completions.values())

    def apply(self, delta: RequestDelta) -> tuple[RequestDelta | None, list[int | None]]:
        if delta.error is not None:
            return delta, []
        was_finished = self.finished
        outputs: list[CompletionDelta] = []
        stopped: list[int | None] = []
        for d in delta.outputs:
            comp = self.completions.get(d.index)
            if comp is None:
                comp = self.completions[d.index] = CompletionText(self._params, self._prompt, self._tokenizer)
            out, stopped_here = comp.apply(d)
            if out is not None:
                outputs.append(out)
            if stopped_here:
                stopped.append(d.index)
        if was_finished or (not outputs and not delta.finished):
            return None, stopped
        if self.finished and not delta.finished:  # a stop string ended its last completion: stop it all
            stopped = [None]
        return dataclasses.replace(delta, outputs=outputs, finished=delta.finished or self.finished), stopped


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
