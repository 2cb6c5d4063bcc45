"""Chat message normalisation shared by the engine and the router."""

import pytest

from contract.messages import MessageError, chat_messages


def test_messages_keep_role_text_content_and_a_non_empty_name():
    assert chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": None, "refusal": None, "tool_calls": None},
                          {"role": "user", "content": "c", "name": "bob"},
                          {"role": "user", "content": "d", "name": ""}]) == [
        {"role": "user", "content": "ab"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "c", "name": "bob"}, {"role": "user", "content": "d"}]


def test_normalising_twice_changes_nothing():
    once = chat_messages([{"role": "user", "content": [{"type": "text", "text": "x"}], "name": "n"}])
    assert chat_messages(once) == once


@pytest.mark.parametrize("messages, says", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"content": "no role"}], "messages[0] must be an object with a string 'role'"),
    ([{"role": "user", "content": "ok"}, "x"], "messages[1] must be an object"),
    ([{"role": "user", "content": 5}], "messages[0].content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0] must be a text part"),
    ([{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0] must be a text part"),
    ([{"role": "user", "content": "x", "name": 3}], "messages[0].name must be a string"),
])
def test_bad_messages_name_the_field(messages, says):
    with pytest.raises(MessageError) as exc:
        chat_messages(messages)
    assert says in str(exc.value)
