"""A model's chat template rendered as Hugging Face transformers renders it, without importing transformers.

Chat templates are Jinja programs from the model's files. transformers (5.x, `utils/chat_template_utils.py`) runs
them in an immutable sandbox with `trim_blocks` and `lstrip_blocks`, the loop controls extension, a `generation`
block tag (used by training code to mark assistant text; it renders its body), and these names: `tojson` (JSON
without HTML escaping, ensure_ascii off, with indent / separators / sort_keys), `raise_exception(message)`,
`strftime_now(format)`, a `dict` constructor and a `namespace` that refuses underscore names. The template sees
`messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's special tokens by name (`bos_token`,
`eos_token`, ...). Messages lose their keys whose value is None (`content: null` is no key at all), and a message's
reasoning is also given as `reasoning_content` and `thinking`.

Importing transformers costs seconds of CPU (it imports torch); a router renders every chat request and needs
neither. tests/engine/test_chat_template.py renders the same conversations through transformers and here and
requires the same text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (transformers tracks where; nothing here does)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore-prefixed names (CPython internals stay out of reach)."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick, so that namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_Namespace)
    return env.from_string(source)


def _plain(value):
    """JSON types only, rebuilt (the sandbox sees no caller's objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


_REASONING = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning goes by


def _with_reasoning_aliases(m: dict) -> dict:
    """A message's reasoning under `reasoning_content` and `thinking` too, whichever name it came under."""
    reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
    return m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning}


def render(source: str, messages: Sequence[Mapping], *, add_generation_prompt: bool,
           tools: Sequence[Mapping] | None = None, special_tokens: Mapping[str, str] | None = None) -> str:
    """The template applied to the messages (each already a plain dict: contract/messages.py), as text. Raises
    jinja2's errors (a template's raise_exception among them)."""
    chat = [_with_reasoning_aliases({k: v for k, v in _plain(dict(m)).items() if v is not None}) for m in messages]
    return compile_template(source).render(messages=chat, tools=_plain(list(tools)) if tools is not None else None,
                                           documents=None, add_generation_prompt=add_generation_prompt,
                                           **_plain(dict(special_tokens or {})))
