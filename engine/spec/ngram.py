"""Prompt lookup (`"method": "ngram"`): draft tokens copied from the sequence's own context. Pure, no state.

`propose(tokens, k, min_n, max_n)` looks for the last n tokens of `tokens` (prompt + output so far) earlier in
`tokens`, n from `max_n` down to `min_n`: the longest n that occurs earlier wins, and of its occurrences the latest
(the one nearest the end). The drafts are the k tokens that followed that occurrence; an occurrence so near the
end that fewer than k tokens follow it continues into the tokens it proposes (a copy that overlaps itself, as in
LZ77), so a repeating tail such as `a b a b` proposes k tokens (`a b a b ...`). No occurrence: no drafts.

vLLM's proposer also takes the longest n-gram in [min, max], but of equal lengths the earliest occurrence, and stops
at the end of the context instead of continuing a periodic tail.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for what follows `tokens` (empty when no n-gram of the tail recurs)."""
    length = len(tokens)
    if k <= 0 or length <= min_n:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # where an earlier occurrence could end: the last token again
    if ends.size == 0:
        return []
    matched = np.ones(ends.size, dtype=np.int64)  # tail tokens each candidate matches, up to max_n
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(max_n, length - 1)):
        pos = ends - j
        ok = alive & (pos >= 0)
        ok[ok] = arr[pos[ok]] == arr[length - 1 - j]
        alive = ok
        if not alive.any():
            break
        matched += alive
    best = int(matched.max())
    if best < min_n:
        return []
    end = int(ends[np.flatnonzero(matched == best)[-1]])  # the latest occurrence of the longest n-gram
    ext = list(tokens[end + 1:end + 1 + k])
    while len(ext) < k:  # the copy reached the end of the context: it goes on over what it copied
        ext.append(ext[len(ext) - (length - end - 1)])
    return ext
