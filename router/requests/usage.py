"""What a request really used, read from the engine's answer, for settling its token reservation.

A streamed request is sent upstream with `stream_options: {include_usage: true, continuous_usage_stats:
true}`, so every chunk carries the usage so far and a stream cancelled at any point is charged what it
generated. What the client did not ask for is taken out again on the way back (`StreamUsage.feed`):
without `continuous_usage_stats` the chunks' `usage` becomes null (with `include_usage`) or goes away, and
without `include_usage` the final usage-only chunk is dropped, so the client sees what OpenAI would send.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class UsageWanted:
    """What the client's own `stream_options` asked for."""

    include_usage: bool = False
    continuous: bool = False

    @property
    def everything(self) -> bool:
        return self.include_usage and self.continuous


def ask_for_usage(stream_options, continuous: bool = True) -> tuple[UsageWanted, dict]:
    """A streamed request's `stream_options` with usage turned on: in every chunk, or (continuous=False) in a
    final chunk only; with what the client's own options asked for."""
    opts = stream_options if isinstance(stream_options, dict) else {}
    wanted = UsageWanted(opts.get("include_usage") is True, opts.get("continuous_usage_stats") is True)
    return wanted, {**opts, "include_usage": True, "continuous_usage_stats": continuous or wanted.continuous}


def output_tokens(usage) -> int:
    """The completion tokens a usage object reports (0 where it reports none)."""
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def total_tokens(usage) -> int | None:
    if not isinstance(usage, dict):
        return None
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool) and total >= 0:
        return total
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt + completion
    return None


class StreamUsage:
    """Follows one response: `feed` each streamed chunk (it returns the bytes to send on), or `body` a whole
    JSON response; `used` is the last total_tokens seen (None if none was), `last` the last usage object."""

    def __init__(self, wanted: UsageWanted | None = None):
        self.wanted = wanted or UsageWanted(True, True)
        self.used: int | None = None
        self.last: dict | None = None
        self._pending = b""

    def body(self, data: bytes) -> None:
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if isinstance(obj, dict):
            self._seen(obj.get("usage"))

    def feed(self, chunk: bytes) -> bytes:
        """The chunk as the client should get it: whole SSE events only (a partial one waits for its end)."""
        data = self._pending + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2:]
        return b"".join(self._event(ev) for ev in data[:end + 2].split(b"\n\n")[:-1])

    def flush(self) -> bytes:
        """Whatever partial event is left when the stream ends."""
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return event + b"\n\n"
        fast = self._usage_last(event)
        if fast is not None:
            return fast
        try:
            obj = json.loads(event[6:])
        except ValueError:
            return event + b"\n\n"
        usage = obj.get("usage")
        self._seen(usage)
        if self.wanted.everything or usage is None:
            return event + b"\n\n"
        if not obj.get("choices"):  # the final usage-only chunk
            return event + b"\n\n" if self.wanted.include_usage else b""
        if self.wanted.continuous:
            return event + b"\n\n"
        if self.wanted.include_usage:
            obj["usage"] = None
        else:
            del obj["usage"]
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    def _usage_last(self, event: bytes) -> bytes | None:
        """The common layout, `{..."choices":[...non-empty],"usage":{...}}` (usage last, as kvfleet's engine
        and vLLM write it), handled without parsing the chunk: the usage object is decoded alone and cut
        out or nulled. None where the event looks otherwise (the caller parses it whole)."""
        at = event.rfind(b',"usage":')
        if at < 0 or b'"choices":[]' in event:
            return None
        start = at + len(b',"usage":')
        try:
            tail = event[start:].decode()
            usage, end = _DECODER.raw_decode(tail)
        except (ValueError, UnicodeDecodeError):
            return None
        if tail[end:] != "}":
            return None
        self._seen(usage)
        if self.wanted.continuous or usage is None:
            return event + b"\n\n"
        if self.wanted.include_usage:
            return event[:start] + b"null}\n\n"
        return event[:at] + b"}\n\n"

    def _seen(self, usage) -> None:
        total = total_tokens(usage)
        if total is not None:
            self.used = total
            self.last = usage
