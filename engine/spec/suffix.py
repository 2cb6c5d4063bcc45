"""Suffix decoding (`"method": "suffix"`; SuffixDecoding, Oliaro et al. 2024, vLLM's `suffix`): draft tokens from how
the sequence's latest tokens continued before, most frequent continuation first. Pure.

    propose(streams, tail, k, depth, spec_factor, min_prob) -> Draft(tokens, score, match_len)

`streams` is one int64 array of token streams separated by SEP (a sequence's own prompt and output, or the finished
requests a SuffixCache holds), `tail` the context whose continuation is wanted. The match: the longest tail of at
most depth - 1 tokens that occurs in the streams followed by a token (the index counts runs of at most `depth`
tokens, as a suffix tree of that depth does). From there the drafts go one token at a time: of the occurrences still
matching, the token that most often comes next (the lowest id of equal counts), its probability estimated as its
count over the occurrences of the run so far (an occurrence at the very end of a stream, with nothing after it,
counts in the run and for no token); drafting stops when the product of those probabilities drops under
`min_prob`, at k tokens, at `spec_factor` x the match length, or when the run would pass `depth` tokens. The score
is the sum of the drafts' probabilities (the tokens expected to be kept): a caller with two indexes takes the draft
with the higher score.

The counting is done over the arrays with numpy at each proposal (no tree to hold: 8 bytes a token), in time
linear in the streams' length for each matched token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SEP = -1  # between two streams of one index: no run crosses it


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    score: float  # the sum of the drafts' estimated probabilities
    match_len: int


NONE = Draft([], 0.0, 0)


def propose(streams: np.ndarray, tail: Sequence[int], k: int, depth: int, spec_factor: float,
            min_prob: float) -> Draft:
    """Drafts for what follows `tail`, from the runs of `streams` (see the module's doc)."""
    if k <= 0 or depth < 2 or len(streams) < 2 or not len(tail):
        return NONE
    arr = streams
    tail_arr = np.asarray(tail[-(depth - 1):], dtype=np.int64)
    # ends: positions where an occurrence of the tail's last m tokens ends, for the m matched so far
    ends = np.flatnonzero(arr == tail_arr[-1])
    m = 1
    best_ends, best_m = (ends, 1) if _followed(arr, ends) else (None, 0)
    while m < tail_arr.size and ends.size:
        pos = ends - m
        ok = pos >= 0
        ok[ok] = arr[pos[ok]] == tail_arr[-1 - m]
        ends = ends[ok]
        m += 1
        if _followed(arr, ends):
            best_ends, best_m = ends, m
    if best_ends is None:
        return NONE
    return _walk(arr, best_ends, best_m, k, depth, spec_factor, min_prob)


def _next(arr: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(which occurrences are followed by a token of their own stream, the positions after each occurrence)."""
    nxt = ends + 1
    ok = nxt < len(arr)
    ok[ok] = arr[nxt[ok]] != SEP
    return ok, nxt


def _followed(arr: np.ndarray, ends: np.ndarray) -> bool:
    return bool(ends.size) and bool(_next(arr, ends)[0].any())


def _walk(arr: np.ndarray, ends: np.ndarray, m: int, k: int, depth: int, spec_factor: float,
          min_prob: float) -> Draft:
    """`ends`: every occurrence of the matched run (those with nothing after them count in the denominator)."""
    limit = min(k, max(1, int(spec_factor * m + 1e-9)), depth - m)
    tokens: list[int] = []
    score, p = 0.0, 1.0
    while len(tokens) < limit:
        ok, nxt = _next(arr, ends)
        if not ok.any():
            break
        following = arr[nxt[ok]]
        values, counts = np.unique(following, return_counts=True)
        i = int(np.argmax(counts))  # np.unique sorts: the lowest id wins a tie
        p *= int(counts[i]) / ends.size
        if p < min_prob:
            break
        tok = int(values[i])
        tokens.append(tok)
        score += p
        ends = nxt[ok][following == tok]
    return Draft(tokens, score, m)


class SuffixCache:
    """The prompts and outputs of the last `max_requests` finished requests, as one array of streams (oldest dropped
    first). The array is rebuilt when a request enters or leaves: O(tokens held) per finished request."""

    def __init__(self, max_requests: int):
        self.max_requests = max_requests
        self._streams: deque[np.ndarray] = deque()
        self._array: np.ndarray | None = None

    def add(self, tokens: Sequence[int]) -> None:
        if self.max_requests <= 0 or len(tokens) < 2:
            return
        self._streams.append(np.asarray(tokens, dtype=np.int64))
        while len(self._streams) > self.max_requests:
            self._streams.popleft()
        self._array = None

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def array(self) -> np.ndarray:
        if self._array is None:
            sep = np.array([SEP], dtype=np.int64)
            parts = [p for s in self._streams for p in (s, sep)][:-1]
            self._array = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._array
