"""contract/usage_lookup.py: an engine's answer, each entry checked; `written_tokens` optional (older engines)."""

from __future__ import annotations

from contract.usage_lookup import RUNNING, UNKNOWN, parse_answer

OLD = {"prompt_tokens": 12, "cached_tokens": 4, "completion_tokens": 3, "outcome": "stop", "finished_at": 1.0}


def test_answers_with_and_without_written_tokens_are_read_and_malformed_ones_unknown():
    new = {**OLD, "written_tokens": 8}
    got = parse_answer({"data": {"a": OLD, "b": new, "c": {**OLD, "written_tokens": -1}, "d": "running",
                                 "e": {**OLD, "cached_tokens": 13}, "f": {**OLD, "written_tokens": True}}})
    assert got == {"a": OLD, "b": new, "c": UNKNOWN, "d": RUNNING, "e": UNKNOWN, "f": UNKNOWN}
    assert parse_answer(None) == {} and parse_answer({"data": []}) == {}
