"""What one benchmark request leaves behind, and how it is read off a recorded SSE stream.

A `RequestRecord` holds times only as offsets (seconds): when the request was sent, relative to the run's
start, and when each content chunk and the end arrived, relative to the send. Everything the reports show
is computed from these records (kvfleet/bench/metrics.py), so a recorded stream gives exact figures.
With parallel sampling (n > 1) every choice's chunks count: TPOT and ITL are then over the interleaved
streams of all choices (the request's token rate), not one choice's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from itertools import pairwise


@dataclass(frozen=True)
class RequestRecord:
    scenario: str
    start_s: float  # when it was sent, seconds after the run started
    chunk_s: tuple[float, ...]  # when each chunk with generated text arrived, seconds after the send
    end_s: float  # when the response ended, seconds after the send
    prompt_tokens: int = 0
    output_tokens: int = 0  # from `usage` when the server sends it, else one per content chunk and choice
    cached_tokens: int = 0
    error: str = ""  # error type ("" = success): http_429, http_5xx, timeout, connection, stream_error, ...
    session: str | None = None
    turn: int = 0
    text: str = field(default="", compare=False)  # the first choice's reply (multi-turn resends it)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] if self.chunk_s else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last chunk - first chunk) / (output tokens - 1)."""
        if len(self.chunk_s) < 2 or self.output_tokens < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-chunk gaps (one chunk is one token for the engines here: the inter-token latency)."""
        return [b - a for a, b in pairwise(self.chunk_s)]

    def to_json(self, with_text: bool = False) -> dict:
        d = asdict(self)
        d["chunk_s"] = [round(x, 6) for x in self.chunk_s]
        if not with_text:
            d.pop("text")
        return d

    @classmethod
    def from_json(cls, d: dict) -> RequestRecord:
        return cls(**{**d, "chunk_s": tuple(d["chunk_s"])})


def error_type(status: int) -> str:
    if status == 429:
        return "http_429"
    return f"http_{status // 100}xx" if status >= 500 else f"http_{status}"


def record_from_sse(lines: list[tuple[float, str]], *, scenario: str, start_s: float, end_s: float,
                    session: str | None = None, turn: int = 0) -> RequestRecord:
    """A record from the SSE lines of one streamed chat or completion response, each with the time it
    arrived (seconds after the send). Chunks that carry text (delta.content or text) count; role-only
    chunks, keep-alive comments and the usage chunk do not. An `error` event makes the record an error."""
    chunks: list[float] = []
    parts: list[str] = []
    n_content = 0
    usage: dict = {}
    for t, line in lines:
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            msg = json.loads(data)
        except json.JSONDecodeError:
            return _failed(scenario, start_s, end_s, "bad_json", session, turn, chunks)
        if "error" in msg:
            return _failed(scenario, start_s, end_s, "stream_error", session, turn, chunks)
        if msg.get("usage"):
            usage = msg["usage"]
        has_text = False
        for ch in msg.get("choices") or []:
            piece = (ch.get("delta") or {}).get("content") or ch.get("text") or ""
            if piece:
                has_text = True
                n_content += 1
                if ch.get("index", 0) == 0:
                    parts.append(piece)
        if has_text:
            chunks.append(t)
    if not chunks:
        return _failed(scenario, start_s, end_s, "no_tokens", session, turn, chunks)
    details = usage.get("prompt_tokens_details") or {}
    return RequestRecord(scenario, start_s, tuple(chunks), end_s, int(usage.get("prompt_tokens", 0)),
                         int(usage.get("completion_tokens", n_content)), int(details.get("cached_tokens") or 0),
                         "", session, turn, "".join(parts))


def _failed(scenario, start_s, end_s, err, session, turn, chunks) -> RequestRecord:
    return RequestRecord(scenario, start_s, tuple(chunks), end_s, error=err, session=session, turn=turn)
