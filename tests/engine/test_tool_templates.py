"""Tools through the chat template: SmolLM2's (no tools: the inline Hermes convention) and a template that
renders tools itself (a Qwen2.5-style template, given as text: no other model is installed)."""

from __future__ import annotations

import copy

import pytest

from engine.tokenizer import Tokenizer, load_tokenizer

pytestmark = pytest.mark.model

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
HISTORY = [{"role": "user", "content": "Weather in Oslo?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "3 C"}]
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_smollm2_gets_the_inline_convention():
    text = load_tokenizer("smollm2").render_chat(HISTORY, True, TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n<tool_response>\n3 C\n</tool_response><|im_end|>" in text


def test_a_template_with_tools_renders_them_itself():
    hf = copy.deepcopy(load_tokenizer("smollm2").hf)
    hf.chat_template = QWEN_STYLE
    text = Tokenizer(hf).render_chat(HISTORY, True, TOOLS)
    assert text.startswith('<|im_start|>system\n# Tools\n<tools>{"type": "function", "function": {"name": "get_weather"')
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text  # an object
    assert "<|im_start|>user\n<tool_response>\n3 C\n</tool_response>" in text
