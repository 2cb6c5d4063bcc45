"""Suffix decoding's proposer (engine/spec/suffix.py) against a reference suffix tree of the same depth, with exact
drafts on hand-made streams; the shared index of finished requests. Pure."""

from __future__ import annotations

import random

import numpy as np

from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec.config import SpeculativeConfig
from engine.spec.decoder import SpecDecoder
from engine.spec.suffix import SEP, SuffixCache, propose


def arr(*streams) -> np.ndarray:
    out: list[int] = []
    for s in streams:
        out += [*s, SEP]
    return np.array(out[:-1], dtype=np.int64)


def test_the_most_frequent_continuation_of_the_longest_followed_match():
    a = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 9, 1, 2]
    # "9 1 2" never continued; "1 2" occurred 4 times, 3 followed by 3 (p 3/4), then "1 2 3" by 4 twice of 3 (p 1/2)
    d = propose(np.array(a), a, 8, 24, 1.0, 0.1)
    assert (d.tokens, d.score, d.match_len) == ([3, 4], 1.25, 2)  # at most spec_factor x 2 drafts
    d = propose(np.array(a), a, 8, 24, 4.0, 0.1)  # "1 2 3 4" then 1 or 9 (a tie: the lower id), p 1/4 from there on
    assert d.tokens == [3, 4, 1, 2, 3, 5, 1, 2] and d.score == 0.75 + 0.5 + 0.25 * 6
    assert propose(np.array(a), a, 8, 24, 4.0, 0.3).tokens == [3, 4]  # the product fell under min_prob
    assert propose(np.array(a), a, 8, 4, 4.0, 0.1).tokens == [3, 4]  # runs of at most 4 tokens: "1 2 3 4"
    assert propose(np.array(a), a, 1, 24, 4.0, 0.1).tokens == [3]


def test_streams_do_not_run_into_each_other_and_no_match_gives_nothing():
    streams = arr([5, 6, 7], [8, 6])
    assert propose(streams, [1, 6], 4, 24, 4.0, 0.0).tokens == [7]  # "6" then SEP in the 2nd stream continues nothing
    assert propose(streams, [1, 7], 4, 24, 4.0, 0.0).tokens == []  # "7" ends its stream
    assert propose(streams, [42], 4, 24, 4.0, 0.0).tokens == []


def reference(streams: list[list[int]], tail: list[int], k: int, depth: int, factor: float, min_prob: float):
    """A suffix tree of `depth` built node by node: the count of every run of at most `depth` tokens."""
    counts: dict[tuple, int] = {}
    for s in streams:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] = counts.get(tuple(s[i:j]), 0) + 1

    def children(run):
        return {run[-1]: c for run2, c in counts.items() for run in [run2]
                if len(run2) == len(prefix) + 1 and run2[:-1] == prefix} if (prefix := run) is not None else {}

    match = None
    for m in range(min(depth - 1, len(tail)), 0, -1):
        run = tuple(tail[-m:])
        if run in counts and children(run):
            match = run
            break
    if match is None:
        return []
    out, p, run = [], 1.0, match
    limit = min(k, max(1, int(factor * len(match) + 1e-9)), depth - len(match))
    while len(out) < limit:
        ch = children(run)
        if not ch:
            break
        tok = min(ch, key=lambda t: (-ch[t], t))
        p *= ch[tok] / counts[run]
        if p < min_prob:
            break
        out.append(tok)
        run = run + (tok,)
    return out


def test_random_streams_match_the_reference_tree():
    rng = random.Random(7)
    for _ in range(300):
        vocab = rng.randint(2, 5)
        streams = [[rng.randrange(vocab) for _ in range(rng.randint(1, 25))] for _ in range(rng.randint(1, 3))]
        tail = streams[-1]
        k, depth = rng.randint(1, 6), rng.randint(2, 8)
        factor, min_prob = rng.choice([0.5, 1.0, 2.0, 8.0]), rng.choice([0.0, 0.1, 0.3])
        got = propose(arr(*streams), tail, k, depth, factor, min_prob).tokens
        assert got == reference(streams, tail, k, depth, factor, min_prob), (streams, k, depth, factor, min_prob)


def test_the_shared_index_keeps_the_last_finished_outputs():
    cache = SuffixCache(2)
    for out in ([1, 2, 3], [4], [5, 6, 7], [8, 9, 10]):
        cache.add(out)
    assert cache.num_requests == 2 and cache.array().tolist() == [5, 6, 7, SEP, 8, 9, 10]  # [4]: too short to hold a run
    assert SuffixCache(0).array().size == 0


def test_a_sequence_takes_drafts_from_finished_requests_when_they_score_higher():
    cfg = SpeculativeConfig("suffix", 4, suffix_decoding_max_spec_factor=4.0, suffix_decoding_max_cached_requests=8)
    spec = SpecDecoder(cfg, max_model_len=64, gated=False)
    done = Sequence("old", [1], SamplingParams())
    for t in (20, 21, 22, 23, 24):
        done.append_token(t)
    spec.finished(done, aborted=False)
    aborted = Sequence("gone", [1], SamplingParams())
    for t in (20, 30):
        aborted.append_token(t)
    spec.finished(aborted, aborted=True)  # not cached
    seq = Sequence("new", [7, 8, 20], SamplingParams())
    seq.append_token(21)
    assert spec.propose(seq, 1) == [22, 23, 24]  # "20 21" went on so in the finished request
    short = SpecDecoder(cfg, max_model_len=64, gated=False)
    short.cache.add([20, 21, 22])
    own = Sequence("own", [20, 21, 40, 20], SamplingParams())
    own.append_token(21)
    assert short.propose(own, 1) == [40, 20, 21]  # its own "20 21 ..." scores 1.5 against the cache's [22]: 1.0
