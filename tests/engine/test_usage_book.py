"""engine/usage_book.py: what each request used, by the router's request id, bounded in size and time."""

import pytest

from engine.outputs import CompletionDelta, RequestDelta
from engine.usage_book import RUNNING, UNKNOWN, RequestUsage, UsageBook


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def delta(rid, tokens=(), finish=None, index=0, prompt=10, cached=4, finished=False, error=None, outs=None,
          written=0, tiers=(0, 0, 0)):
    outputs = outs if outs is not None else [CompletionDelta(index, token_ids=list(tokens), finish_reason=finish)]
    return RequestDelta(rid, outputs, finished, prompt, cached, error=error, cache_creation_tokens=written,
                        cached_tokens_by_tier=tiers)


def test_a_request_sums_its_deltas_and_finishes_with_its_reason():
    clock = Clock()
    book = UsageBook(clock=clock)
    book.expect("chatcmpl-1", "req_a")
    assert book.lookup(["req_a", "req_b"]) == {"req_a": RUNNING, "req_b": UNKNOWN}
    book.observe(delta("chatcmpl-1", [5]))
    book.observe(delta("chatcmpl-1", [6, 7]))
    book.observe(delta("chatcmpl-1", [8], "length", finished=True))
    assert book.lookup(["req_a"]) == {"req_a": RequestUsage(10, 4, 4, "length", 1000.0)}


def test_an_abort_counts_every_token_the_core_sampled_and_no_prompt_before_the_first_token():
    book = UsageBook(clock=Clock())
    book.expect("e1", "req_a")
    book.observe(delta("e1", [1, 2, 3]))
    book.observe(delta("e1", [4]))  # sampled after the client went away: the engine counted it
    book.observe(delta("e1", [], "abort", finished=True))
    book.expect("e2", "req_b")
    book.observe(delta("e2", [], "abort", finished=True))  # aborted while waiting: no prompt counted
    got = book.lookup(["req_a", "req_b"])
    assert got["req_a"] == RequestUsage(10, 4, 4, "aborted", 1000.0)
    assert got["req_b"] == RequestUsage(0, 0, 0, "aborted", 1000.0)


def test_deltas_of_ids_never_expected_are_ignored():
    book = UsageBook(clock=Clock())
    book.observe(delta("other", [1], "stop", finished=True))
    assert len(book) == 0 and book.lookup(["other"]) == {"other": UNKNOWN}


def test_the_parts_of_a_batch_sum_under_the_router_id_and_finish_with_the_last():
    book = UsageBook(clock=Clock())
    book.expect("cmpl-1-0", "req_a")
    book.expect("cmpl-1-1", "req_a")
    book.observe(delta("cmpl-1-0", [1, 2], "stop", prompt=7, cached=0, finished=True))
    assert book.lookup(["req_a"]) == {"req_a": RUNNING}
    book.observe(delta("cmpl-1-1", [1, 2, 3], "length", prompt=9, cached=5, finished=True))
    assert book.lookup(["req_a"])["req_a"] == RequestUsage(16, 5, 5, "stop", 1000.0)


def test_n_completions_count_all_their_tokens_and_an_error_is_the_outcome():
    book = UsageBook(clock=Clock())
    book.expect("e1", "req_a")
    book.observe(delta("e1", outs=[CompletionDelta(0, token_ids=[1]), CompletionDelta(1, token_ids=[2])]))
    book.observe(delta("e1", [], "abort", finished=True, error=RuntimeError("oom")))
    assert book.lookup(["req_a"])["req_a"] == RequestUsage(10, 4, 2, "error", 1000.0)


def test_a_stop_string_seen_by_the_server_ends_the_request():
    book = UsageBook(clock=Clock())
    book.expect("e1", "req_a")
    book.observe(delta("e1", [1, 2]))
    book.end("e1", "stop")
    book.end("e1", "stop")  # once
    assert book.lookup(["req_a"])["req_a"] == RequestUsage(10, 4, 2, "stop", 1000.0)


def test_a_retry_on_the_same_engine_adds_to_the_first_attempt():
    book = UsageBook(clock=Clock())
    for eid in ("e1", "e2"):
        book.expect(eid, "req_a")
        book.observe(delta(eid, [1], "stop", finished=True))
    assert book.lookup(["req_a"])["req_a"] == RequestUsage(20, 8, 2, "stop", 1000.0)


def test_entries_are_forgotten_after_the_ttl_and_beyond_max_entries_oldest_first():
    clock = Clock()
    book = UsageBook(max_entries=2, ttl_s=60, clock=clock)
    for i in range(3):
        book.expect(f"e{i}", f"req_{i}")
        book.observe(delta(f"e{i}", [1], "stop", finished=True))
        clock.t += 10
    assert [k for k, v in book.lookup(["req_0", "req_1", "req_2"]).items() if v == UNKNOWN] == ["req_0"]
    clock.t = 1000.0 + 10 + 60  # req_1 finished at 1010: exactly ttl_s ago
    assert book.lookup(["req_1", "req_2"]) == {"req_1": UNKNOWN,
                                                "req_2": RequestUsage(10, 4, 1, "stop", 1020.0)}
    assert len(book) == 1


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError):
        UsageBook(max_entries=0)
    with pytest.raises(ValueError):
        UsageBook(ttl_s=0)


def test_written_tokens_are_remembered_summed_over_parts_and_retries_and_answered():
    book = UsageBook(clock=Clock())
    book.expect("cmpl-1-0", "req_a")
    book.expect("cmpl-1-1", "req_a")
    book.observe(delta("cmpl-1-0", [], written=6))  # before the first token: the prompt is not counted yet
    book.observe(delta("cmpl-1-0", [1], "stop", prompt=9, cached=0, written=6, finished=True))
    book.observe(delta("cmpl-1-1", [1, 2], "stop", prompt=9, cached=4, written=3, finished=True))
    got = book.lookup(["req_a"])["req_a"]
    assert got == RequestUsage(18, 4, 3, "stop", 1000.0, 9)
    assert got.to_dict() == {"prompt_tokens": 18, "cached_tokens": 4, "completion_tokens": 3, "written_tokens": 9,
                             "cached_tokens_by_tier": {"device": 0, "lower_tier": 0, "peer": 0},
                             "outcome": "stop", "finished_at": 1000.0}
    book.expect("e2", "req_a")  # a retry on the same engine: both count
    book.observe(delta("e2", [1], "stop", prompt=9, cached=9, written=0, finished=True))
    assert book.lookup(["req_a"])["req_a"] == RequestUsage(27, 13, 4, "stop", 1000.0, 9)
    book.expect("e3", "req_b")
    book.observe(delta("e3", [], "abort", written=5, finished=True))  # aborted while waiting: nothing written
    assert book.lookup(["req_b"])["req_b"] == RequestUsage(0, 0, 0, "aborted", 1000.0, 0)


def test_cached_tokens_by_tier_are_remembered_summed_over_parts_and_retries_and_answered():
    book = UsageBook(clock=Clock())
    book.expect("cmpl-1-0", "req_a")
    book.expect("cmpl-1-1", "req_a")
    book.observe(delta("cmpl-1-0", [], cached=0, tiers=(9, 9, 9)))  # before the first token: not counted yet
    book.observe(delta("cmpl-1-0", [1], "stop", prompt=40, cached=32, tiers=(16, 0, 16), finished=True))
    book.observe(delta("cmpl-1-1", [1], "stop", prompt=40, cached=16, tiers=(0, 16, 0), finished=True))
    got = book.lookup(["req_a"])["req_a"]
    assert got.cached_by_tier == (16, 16, 16) and got.cached_tokens == 48
    assert got.to_dict()["cached_tokens_by_tier"] == {"device": 16, "lower_tier": 16, "peer": 16}
    book.expect("e2", "req_a")  # a retry on the same engine: both count
    book.observe(delta("e2", [1], "stop", prompt=40, cached=40, tiers=(40, 0, 0), finished=True))
    assert book.lookup(["req_a"])["req_a"].cached_by_tier == (56, 16, 16)
