"""The tokenizer without transformers (engine/tokenizer_snapshot.py, engine/chat_template.py) against transformers
itself: the same token ids, text, token strings and facts, and the same rendered chat for every template feature
transformers gives templates; a snapshot from another transformers version is not trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jinja2
import pytest

from contract.messages import chat_messages
from contract.tool_prompt import tool_messages
from engine import chat_template, tokenizer_snapshot
from engine.tokenizer import Tokenizer, load_tokenizer, load_tokenizer_archive, tokenizer_archive

pytestmark = pytest.mark.model

TEXTS = ["Hello world", "", " ", "  leading and trailing  ", "tabs\tand\nnew\n\nlines\r\n", "naïve café — “quotes”",
         "日本語のテキストと emoji 🚀🎉👩‍👩‍👧", "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> in the middle",
         "x" * 300, "def f(x):\n    return x ** 2  # squares\n", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "\u200b\u00a0zero width",
         "mixed <|im_end|><|im_start|> specials"]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Tomorrow? 🌧"}],
    [{"role": "user", "content": "A <|im_end|> inside"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "Weather in Oslo?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "3 C"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# every name and extension transformers gives a template, and its environment's options
FEATURES = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- for m in messages -%}{%- if m.role == 'skip' %}{% continue %}{% endif -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "{% generation %}[{{ m.role }}|{{ m.content | default('NONE') }}]{% endgeneration %}\n"
    "    {% if loop.index > 5 %}{% break %}{% endif %}\n"
    "{%- endfor -%}"
    "n={{ ns.n }} {{ dict(a=1, b='é<') | tojson }} {{ {'k': [1, 2]} | tojson(indent=2) }}"
    "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }} {{ bos_token }}{{ eos_token }}{{ pad_token }}"
    "{{ strftime_now('%Y') | length }}{% if add_generation_prompt %}<gen>{% endif %}"
    "{%- if messages | length > 6 %}{{ raise_exception('too many: ' ~ messages | length) }}{% endif %}")


@pytest.fixture(scope="module")
def hf():
    return load_tokenizer("smollm2").hf


@pytest.fixture(scope="module")
def lean(hf, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("snapshot"))
    hf.save_pretrained(directory)
    assert tokenizer_snapshot.write(hf, directory)
    snap = tokenizer_snapshot.read(directory)
    assert snap is not None
    return Tokenizer.from_snapshot(snap, directory)


def test_token_ids_text_and_token_strings_are_transformers(hf, lean):
    for text in TEXTS:
        for special in (False, True):
            ids = lean.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), text
        ids = hf.encode(text, add_special_tokens=False)
        for skip in (False, True):
            assert lean.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text
        assert lean.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids), text
    every = list(range(0, lean.vocab_size, 97)) + [0, 1, 2, lean.vocab_size - 1]
    assert lean.decode(every) == hf.decode(every)
    assert lean.convert_ids_to_tokens(every) == hf.convert_ids_to_tokens(every)


def test_facts_are_transformers(hf, lean):
    assert (lean.eos_token_id, lean.bos_token_id, lean.vocab_size) == (hf.eos_token_id, hf.bos_token_id, len(hf))
    assert lean.all_special_ids == frozenset(hf.all_special_ids)
    assert lean.special_tokens == hf.special_tokens_map and lean.chat_template == hf.chat_template
    added = {i: (t.content, t.lstrip, t.rstrip, t.single_word, t.special) for i, t in lean.added_tokens.items()}
    assert added == {i: (t.content, t.lstrip, t.rstrip, t.single_word, t.special)
                     for i, t in hf.added_tokens_decoder.items()} and len(added) > 10


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_the_models_template_renders_as_transformers_renders_it(hf, lean, generation_prompt):
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):  # as the engine gives them: normalized, tools inline (SmolLM2 renders none)
            msgs = tool_messages(chat_messages(messages), tools, False)
            want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
            assert lean.render_chat(messages, generation_prompt, tools) == want


@pytest.mark.parametrize("n", [1, 4, 7])
def test_every_template_feature_renders_as_transformers_renders_it(hf, lean, n):
    messages = [{"role": "skip" if i == 1 else "user", "content": None if i == 2 else f"m{i} <é>"} for i in range(n)]
    if n > 6:  # raise_exception: the same error from both
        with pytest.raises(jinja2.exceptions.TemplateError, match="too many: 7"):
            hf.apply_chat_template(messages, tokenize=False, chat_template=FEATURES, tools=TOOLS)
        with pytest.raises(jinja2.exceptions.TemplateError, match="too many: 7"):
            chat_template.render(FEATURES, messages, add_generation_prompt=True, tools=TOOLS,
                                 special_tokens=lean.special_tokens)
        return
    for tools, prompt in ((TOOLS, True), (None, False)):
        want = hf.apply_chat_template(messages, tokenize=False, chat_template=FEATURES, tools=tools,
                                      add_generation_prompt=prompt)
        got = chat_template.render(FEATURES, messages, add_generation_prompt=prompt, tools=tools,
                                   special_tokens=lean.special_tokens)
        assert got == want


def test_the_sandbox_refuses_what_transformers_refuses(hf):
    messages = [{"role": "user", "content": "x"}]
    for source in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}",
                   "{% set ns = namespace(_x=1) %}{{ ns._x }}", "{% set ns = namespace() %}{% set ns._y = 1 %}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            hf.apply_chat_template(messages, tokenize=False, chat_template=source)
        with pytest.raises(jinja2.exceptions.SecurityError):
            chat_template.render(source, messages, add_generation_prompt=False)


def test_a_snapshot_of_another_version_or_damaged_is_not_used(hf, tmp_path):
    directory = str(tmp_path)
    assert tokenizer_snapshot.write(hf, directory)
    meta_path = os.path.join(directory, tokenizer_snapshot.META)
    meta = json.loads(open(meta_path).read())
    json.dump({**meta, "transformers": "0.0.1"}, open(meta_path, "w"))
    assert tokenizer_snapshot.read(directory) is None
    json.dump(meta, open(meta_path, "w"))
    assert tokenizer_snapshot.read(directory) is not None
    open(os.path.join(directory, tokenizer_snapshot.BACKEND), "w").write("{not json")
    assert tokenizer_snapshot.read(directory) is None
    assert tokenizer_snapshot.read(str(tmp_path / "missing")) is None


def test_an_archive_round_trip_keeps_the_snapshot(lean, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path))
    back = load_tokenizer_archive(tokenizer_archive(lean))
    assert back._backend is not None  # from its snapshot, transformers not needed
    assert back.apply_chat_template(CONVERSATIONS[1]) == lean.apply_chat_template(CONVERSATIONS[1])
    assert back.eos_token_ids == lean.eos_token_ids


def test_a_second_process_loads_without_transformers(tmp_path):
    """The first load writes the cache and its snapshot; the next process reads them and never imports
    transformers or torch, and encodes a chat as the first did."""
    code = ("import sys, json; from engine.tokenizer import load_tokenizer; t = load_tokenizer('smollm2'); "
            "print(json.dumps([t.apply_chat_template([{'role': 'user', 'content': 'hi there'}]), "
            "'transformers' in sys.modules, 'torch' in sys.modules]))")
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for _ in range(2)]
    assert runs[0][0] == runs[1][0] and runs[0][1] is True  # the first through transformers
    assert runs[1][1:] == [False, False]
