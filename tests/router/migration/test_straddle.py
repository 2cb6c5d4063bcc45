"""A stop string across the break, exactly: what the router shows, holds and cuts."""

from __future__ import annotations

from router.migration.straddle import Straddle, held_text


def test_held_text_is_what_the_replica_decoded_past_what_it_showed():
    assert held_text("Hello wor", "Hello ") == "wor"
    assert held_text("Hello", "Hello") == ""
    assert held_text("caf\ufffd", "ca") == "f"  # a character split over tokens: the continuation completes it
    assert held_text("other", "Hello") == ""


def test_a_stop_string_that_began_before_the_break_is_found_and_cut():
    s = Straddle("EN", ("END",), include_stop=False)
    assert s.feed("D and more") == ("", "END")


def test_its_text_is_held_while_it_may_still_complete():
    s = Straddle("E", ("END",), include_stop=False)
    assert s.feed("N") == ("", None)
    assert s.feed("X and on") == ("ENX and on", None)
    assert s.done
    assert s.feed(" more") == (" more", None)


def test_include_stop_str_in_output_keeps_it():
    s = Straddle("x EN", ("END",), include_stop=True)
    assert s.feed("D tail") == ("x END", "END")


def test_the_earliest_start_wins():
    s = Straddle("abc", ("bcd", "abcq"), include_stop=False)
    assert s.feed("d") == ("a", "bcd")


def test_a_stop_string_the_continuation_cut_may_complete_an_earlier_one():
    # held "ab", stops "abX" and "X": the continuation's engine stops on "X" (text "" and stop_reason "X");
    # the uninterrupted engine would have found "abX", which begins earlier
    s = Straddle("ab", ("abX", "X"), include_stop=False)
    assert s.feed("") == ("", None)
    assert s.finish("X") == ("", "abX")


def test_at_the_end_what_is_held_goes_out():
    s = Straddle("EN", ("END",), include_stop=False)
    assert s.feed("") == ("", None)
    assert s.finish(None) == ("EN", None)


def test_no_stop_strings_pass_everything():
    s = Straddle("", (), include_stop=False)
    assert s.feed("abc") == ("abc", None)
