"""Stop conditions (the core's token checks, engine/stop.py) and the front end's text with its stop strings and
hold-back (engine/output_text.py), run together as the server runs them: exact per-step text on a piece-table
tokenizer, then SmolLM2."""

import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.output_text import CompletionText, RequestText
from engine.outputs import CompletionDelta, RequestDelta, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.stop import StopChecker, StopResult

os.environ.setdefault("HF_HUB_OFFLINE", "1")

EOS, STOP_TOK = 0, 1


class PieceTokenizer:
    """Token id i decodes to PIECES[i]; ids 0 and 1 are special (skipped when asked)."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in (EOS, STOP_TOK)))

    def ids(self, *pieces):
        return [self.pieces.index(p) for p in pieces]


TOK = PieceTokenizer(["</s>", "<stop>", "He", "llo", " wor", "ld", "!", " ", "o", "x", "ab", "c", "END", "\n"])


@dataclass(frozen=True)
class Shown:
    """What a client sees after one token: new text, and the finish."""

    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None


def pipeline(seq, eos, max_model_len, tok, token_ids):
    """The core's StopChecker, then the front end's CompletionText, one token per step as the engine runs them;
    stops at the finish (the front end's, or the core's)."""
    core = StopChecker(seq.params, eos, max_model_len)
    text = CompletionText(seq.params, seq.token_ids, tok)
    results = []
    for t in token_ids:
        seq.append_token(t)
        res = core.update(seq)
        d, _ = text.apply(CompletionDelta(0, "", [t], None, res.finish_reason, res.stop_reason))
        results.append(Shown(d.text, d.finish_reason, d.stop_reason))
        if d.finish_reason:
            break
    return results, text


def run(pieces_or_ids, max_model_len=10_000, prompt=(9,), eos=EOS, tok=TOK, **params):
    """Feed tokens one by one; return (per-step results, the completion's text)."""
    ids = [t if isinstance(t, int) else tok.pieces.index(t) for t in pieces_or_ids]
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=params.pop("max_tokens", 1000), **params))
    return pipeline(seq, eos, max_model_len, tok, ids)


def texts(results):
    return [r.text for r in results]


def test_stop_string_spanning_tokens_is_held_back_and_never_emitted():
    results, checker = run(["He", "llo", " wor", "ld"], stop=["o wo"])
    assert texts(results) == ["He", "ll", ""]
    assert results[-1] == Shown("", "stop", "o wo")
    assert checker.text == "Hell" and checker.finished


def test_include_stop_str_in_output_keeps_it_and_cuts_after_it():
    results, checker = run(["He", "llo", " wor", "ld"], stop=["o wo"], include_stop_str_in_output=True)
    assert texts(results) == ["He", "ll", "o wo"]
    assert checker.text == "Hello wo" and checker.stop_reason == "o wo"


def test_held_text_is_released_once_it_cannot_start_a_stop_string():
    results, checker = run(["He", "llo", "x", " wor", "ld", "!"], stop=["o wo"], max_tokens=6)
    assert texts(results) == ["He", "ll", "ox", " wor", "ld", "!"]
    assert results[-1].finish_reason == "length" and results[-1].stop_reason is None
    assert checker.text == "Hellox world!"


def test_partial_stop_string_at_the_end_is_emitted_when_the_length_runs_out():
    results, checker = run(["He", "llo", " wor"], stop=["world peace"], max_tokens=3)
    assert texts(results) == ["He", "llo", " wor"]
    assert checker.text == "Hello wor" and checker.finish_reason == "length"


def test_earliest_stop_string_wins_within_one_token():
    results, checker = run(["He", "llo", " wor", "ld"], stop=["ld", "llo w", "wor"])
    assert checker.text == "He" and checker.stop_reason == "llo w"


def test_stop_string_inside_a_single_token_cuts_it():
    results, checker = run(["ab", "c", "ab"], stop=["b"])
    assert texts(results) == ["a"] and checker.stop_reason == "b"


def test_repeated_prefix_characters_hold_back_the_longest_candidate():
    results, checker = run(["ab", "ab", "ab", "c"], stop=["ababc"])
    assert texts(results) == ["", "", "ab", ""]
    assert checker.text == "ab" and checker.stop_reason == "ababc"


def test_eos_stops_without_its_text():
    results, checker = run(["He", "</s>"], skip_special_tokens=False)
    assert results[-1] == Shown("", "stop", None) and checker.text == "He"
    results, checker = run(["He", "</s>"], skip_special_tokens=False, include_stop_str_in_output=True)
    assert checker.text == "He</s>"


def test_several_eos_ids_and_no_eos():
    assert run(["He", "END", "!"], eos=[EOS, TOK.pieces.index("END")])[1].text == "He"
    results, checker = run(["He", "</s>", "!"], eos=None, max_tokens=3)
    assert checker.finish_reason == "length"


def test_ignore_eos_keeps_going():
    results, checker = run(["He", "</s>", "llo"], ignore_eos=True, max_tokens=3)
    assert checker.finish_reason == "length" and checker.text == "Hello"


def test_stop_token_ids_report_the_token_and_drop_its_text():
    end = TOK.pieces.index("END")
    results, checker = run(["He", "llo", "END", "!"], stop_token_ids=[end])
    assert results[-1] == Shown("", "stop", end)
    assert checker.text == "Hello"
    results, checker = run(["He", "END"], stop_token_ids=[end], include_stop_str_in_output=True)
    assert checker.text == "HeEND"


def test_stop_token_releases_a_held_partial_stop_string():
    end = TOK.pieces.index("END")
    results, checker = run(["He", "llo", "END"], stop=["o wo"], stop_token_ids=[end])
    assert texts(results) == ["He", "ll", "o"] and checker.text == "Hello"


def test_min_tokens_delays_every_stop_condition():
    end = TOK.pieces.index("END")
    results, checker = run(["He", "</s>", "END", "llo", " wor", "ld", "</s>"], stop=["He"], stop_token_ids=[end],
                           min_tokens=4)
    assert checker.text == "HeENDllo world" and checker.finish_reason == "stop" and checker.stop_reason is None
    assert len(results) == 7
    # a stop string completed by the min_tokens-th token counts
    results, checker = run(["He", "llo", " wor"], stop=["lo w"], min_tokens=3)
    assert checker.text == "Hel" and checker.stop_reason == "lo w"


def test_max_tokens_and_max_model_len():
    results, checker = run(["He", "llo", " wor", "ld"], max_tokens=2)
    assert len(results) == 2 and results[-1] == Shown("llo", "length", None)
    results, checker = run(["He", "llo", " wor", "ld"], prompt=(9, 9, 9), max_model_len=6)
    assert len(results) == 3 and checker.finish_reason == "length" and checker.text == "Hello wor"


def test_stop_string_beats_length_on_the_same_token():
    results, checker = run(["He", "llo"], stop=["ll"], max_tokens=2)
    assert checker.finish_reason == "stop" and checker.text == "He"


def test_after_the_finish_the_core_reports_the_same_and_the_front_end_nothing():
    seq = Sequence("r", [9], SamplingParams(max_tokens=1))
    core, text = StopChecker(seq.params, EOS, 100), CompletionText(seq.params, [9], TOK)
    seq.append_token(2)
    assert core.update(seq) == StopResult("length")
    d, stopped = text.apply(CompletionDelta(0, "", [2], None, "length"))
    assert (d.text, d.finish_reason, stopped) == ("He", "length", False)
    seq.append_token(3)
    assert core.update(seq) == StopResult("length")
    assert text.apply(CompletionDelta(0, "", [3])) == (None, False)
    assert text.text == "He"


def test_the_core_ignores_stop_strings():
    seq = Sequence("r", [9], SamplingParams(stop=["He"], max_tokens=5))
    checker = StopChecker(seq.params, EOS, 100)
    for t in (2, 3):
        seq.append_token(t)
        assert checker.update(seq) == StopResult()
    seq.append_token(EOS)
    assert checker.update(seq) == StopResult("stop", None)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streamed_text_is_always_a_prefix_of_the_final_text(data):
    """Whatever the tokens and stop strings, nothing shown is ever retracted, and the result is exact."""
    alphabet = "ab c"
    pieces = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=3), min_size=1, max_size=12))
    stops = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=4), max_size=3))
    include = data.draw(st.booleans())
    min_tokens = data.draw(st.integers(0, len(pieces)))
    tok = PieceTokenizer(["</s>", "<stop>"] + pieces)
    results, checker = run(list(range(2, 2 + len(pieces))) + [EOS], tok=tok, prompt=(), stop=stops,
                           include_stop_str_in_output=include, min_tokens=min_tokens)
    shown = ""
    for r in results:
        shown += r.text
        assert checker.text.startswith(shown)
    assert shown == checker.text
    full = "".join(pieces)
    # reference: the first token (from the min_tokens-th on) that completes a stop string; within it,
    # the earliest-starting one
    ends = [len("".join(pieces[:i + 1])) for i in range(len(pieces))]
    hits = [(next(i for i, e in enumerate(ends) if at + len(s) <= e), at, j)
            for j, s in enumerate(stops) for at in range(len(full)) if full.startswith(s, at)]
    hits = [h for h in hits if h[0] + 1 >= min_tokens]
    if hits:
        _, at, j = min(hits)
        s = stops[j]
        assert checker.finish_reason == "stop" and checker.stop_reason == s
        assert checker.text == (full[:at + len(s)] if include else full[:at])
    else:  # the EOS after the last piece releases whatever was held back
        assert checker.stop_reason is None and len(results) == len(pieces) + 1
        assert checker.text == full


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import load_tokenizer
    return load_tokenizer("smollm2")


def run_real(tok, text, **params):
    seq = Sequence("r", tok.encode("Q: "), SamplingParams(max_tokens=params.pop("max_tokens", 1000), **params))
    return pipeline(seq, tok.eos_token_id, 10_000, tok, tok.encode(text))


@pytest.mark.parametrize("text,stop,expected", [
    ("Hello 世界 and more text", "世界", "Hello "),
    ("The answer is 42.\nUser: next question", "\nUser:", "The answer is 42."),
    ("emoji 🎉🎉 party", "🎉 p", "emoji 🎉"),
    ("no stop here at all", "zzz", "no stop here at all"),
    ("combining e\u0301 mark", "\u0301 m", "combining e"),
])
def test_real_tokenizer_stop_strings(tok, text, stop, expected):
    results, checker = run_real(tok, text, stop=[stop], max_tokens=len(tok.encode(text)))
    assert checker.text == expected
    assert "".join(r.text for r in results) == expected
    assert not any("\ufffd" in r.text for r in results)
    shown = ""
    for r in results:  # no prefix of the stop string is ever shown before the stop is known
        shown += r.text
        assert expected.startswith(shown)
    if stop in text:
        assert checker.stop_reason == stop


def test_real_tokenizer_eos_in_chat_output(tok):
    results, checker = run_real(tok, "Sure! 👍<|im_end|>ignored", skip_special_tokens=False)
    assert checker.text == "Sure! 👍" and checker.finish_reason == "stop" and checker.stop_reason is None


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_real_tokenizer_random_text_and_stop_strings(tok, data):
    """Unicode text through SmolLM2's tokens: nothing shown is retracted, no stop string survives, the cut is right."""
    alphabet = st.sampled_from(list("ab .\n") + ["é", "世", "界", "🎉", "e\u0301"])
    text = "".join(data.draw(st.lists(alphabet, max_size=30)))
    stops = data.draw(st.lists(st.one_of(
        st.builds(lambda s, i, n: s[i:i + n], st.just(text), st.integers(0, 30), st.integers(1, 4)),
        st.text(st.sampled_from(list("ab .é世🎉")), min_size=1, max_size=3)), max_size=3))
    stops = [s for s in stops if s]
    include = data.draw(st.booleans())
    ids = tok.encode(text)
    results, checker = run_real(tok, text, stop=stops, include_stop_str_in_output=include,
                                max_tokens=max(1, len(ids)))
    shown = ""
    for r in results:
        shown += r.text
        assert checker.text.startswith(shown)
        assert "\ufffd" not in r.text
    assert shown == checker.text
    full = tok.decode(ids)
    if checker.stop_reason is not None:
        s = checker.stop_reason
        body = checker.text[:-len(s)] if include else checker.text
        assert full.startswith(body + s) and (not include or checker.text.endswith(s))
        assert not any(t in body for t in stops)
    elif ids:
        assert checker.finish_reason == "length"
        assert checker.text == full and not any(s in full for s in stops)


def test_a_delta_of_several_tokens_is_cut_after_the_one_that_completes_a_stop_string():
    """The core ran on before it heard of the stop: its later tokens and logprobs never reach the client."""
    text = CompletionText(SamplingParams(stop=["o wo"], max_tokens=100), [9], TOK)
    d, stopped = text.apply(CompletionDelta(0, "", TOK.ids("He", "llo")))
    assert (d.text, d.finish_reason, stopped) == ("Hell", None, False)
    ids = TOK.ids(" wor", "ld", "!")
    d, stopped = text.apply(CompletionDelta(0, "", ids, [TokenLogprob(t, -1.0) for t in ids]))
    assert (d.text, d.token_ids, d.finish_reason, d.stop_reason, stopped) == ("", ids[:1], "stop", "o wo", True)
    assert [lp.token_id for lp in d.logprobs] == ids[:1]
    assert text.text == "Hell"


def test_a_stop_string_on_the_cores_last_token_wins_but_needs_no_stop_sent():
    text = CompletionText(SamplingParams(stop=["llo"], max_tokens=2), [9], TOK)
    text.apply(CompletionDelta(0, "", TOK.ids("He")))
    d, stopped = text.apply(CompletionDelta(0, "", TOK.ids("llo"), None, "length"))
    assert (d.text, d.finish_reason, d.stop_reason, stopped) == ("", "stop", "llo", False)


def test_a_request_ends_when_its_last_completion_meets_a_stop_string():
    req = RequestText(SamplingParams(n=2, stop=["ld"], max_tokens=100), [9], TOK)

    def step(*per_completion):
        return req.apply(RequestDelta("r", [CompletionDelta(i, "", TOK.ids(p)) for i, p in per_completion], False, 1))

    d, stopped = step((0, "He"), (1, "He"))
    assert [o.text for o in d.outputs] == ["He", "He"] and stopped == [] and not d.finished
    d, stopped = step((0, "ld"), (1, "llo"))  # completion 0 ends: the core is told to stop it alone
    assert [(o.index, o.text, o.finish_reason) for o in d.outputs] == [(0, "", "stop"), (1, "llo", None)]
    assert stopped == [0] and not d.finished
    d, stopped = step((0, "!"), (1, "ld"))  # a token of 0 the core made before it heard: dropped
    assert [(o.index, o.finish_reason, o.stop_reason) for o in d.outputs] == [(1, "stop", "ld")]
    assert stopped == [None] and d.finished and req.finished  # its last completion: the core stops the request
    assert step((1, "!")) == (None, [])
    assert req.completions[0].text == "He" and req.completions[1].text == "Hello"


def test_an_abort_or_an_error_from_the_core_passes_through():
    req = RequestText(SamplingParams(max_tokens=10), [9], TOK)
    req.apply(RequestDelta("r", [CompletionDelta(0, "", TOK.ids("He"))], False, 1))
    d, _ = req.apply(RequestDelta("r", [CompletionDelta(0, finish_reason="abort")], True, 1))
    assert d.finished and [(o.text, o.finish_reason) for o in d.outputs] == [("", "abort")]
    err = RequestDelta("r", [], True, 1, error=RuntimeError("boom"))
    assert RequestText(SamplingParams(), [9], TOK).apply(err) == (err, [])
