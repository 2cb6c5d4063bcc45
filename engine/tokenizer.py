"""The one tokenizer path, shared by the engine, the server and the router.

`load_tokenizer(model)` resolves the model like the engine does (`engine.model.registry`), loads the
Hugging Face tokenizer (from a model directory, or from a GGUF file through transformers) and wraps it
in a small, plain-list interface. Reading a tokenizer out of a GGUF file parses the whole file (seconds),
so the extracted tokenizer is cached on disk (KVFLEET_CACHE_DIR, default ~/.cache/kvfleet), keyed by
the file's path, size and mtime; loading from the cache takes a fraction of a second.

`tokenizer_facts(model)` gives what an engine core needs before any request: the end-of-sequence ids and the
vocabulary size, kept on disk beside the cache the first time the tokenizer loads, so that a core process reads
them from a small file instead of importing transformers (~1.3 s of CPU per engine start here); it
loads the tokenizer itself only on first use (a structured-output grammar, the offline API's text).

`tokenizer_archive(tok)` packs a loaded tokenizer (its Hugging Face files and kvfleet's extra eos ids) into a
tar, which an engine serves to routers (`GET /v1/kvfleet/tokenizer`), and `load_tokenizer_archive(data)`
loads one: a router needs neither the model's weights nor a reader for its format.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import tempfile
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from contract.messages import MessageError, chat_messages
from contract.tool_prompt import template_renders_tools, tool_messages
from engine.model.registry import ModelSource, resolve_model

_lock = threading.Lock()
_loaded: dict[str, Tokenizer] = {}


class TokenizerError(ValueError):
    """The tokenizer could not be loaded or could not render the input; the message says why."""


class Tokenizer:
    """Plain-list wrapper around a Hugging Face (fast) tokenizer."""

    def __init__(self, hf_tokenizer, source: ModelSource | None = None,
                 extra_eos_token_ids: Iterable[int] = ()):
        self.hf = hf_tokenizer
        self.source = source
        eos = hf_tokenizer.eos_token_id
        if eos is None:
            raise TokenizerError(f"tokenizer of {source.path if source else 'model'} has no eos_token_id")
        self.eos_token_id: int = int(eos)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_token_id, *map(int, extra_eos_token_ids)]))
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.vocab_size: int = len(hf_tokenizer)
        self.all_special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)
        self.chat_template: str | None = getattr(hf_tokenizer, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"prompt must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def render_chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping] | None = None) -> str:
        """The chat template applied to messages (and tools: contract/tool_prompt.py), as text."""
        if not self.chat_template:
            raise TokenizerError("this model's tokenizer has no chat template; use a completion prompt instead")
        try:
            msgs = chat_messages(messages)
        except MessageError as e:
            raise TokenizerError(str(e)) from None
        native = template_renders_tools(self.chat_template)
        msgs = tool_messages(msgs, tools, native)
        extra = {"tools": list(tools)} if native and tools else {}
        try:
            return self.hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **extra)
        except Exception as e:  # jinja errors: report them as a bad request, not a crash
            raise TokenizerError(f"messages could not be rendered with the chat template: {e}") from e

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping] | None = None) -> list[int]:
        """Token ids of the chat-templated conversation (the template's own special tokens included)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))

    def __repr__(self) -> str:
        return f"Tokenizer({self.source.path if self.source else '?'}, vocab={self.vocab_size}, eos={self.eos_token_id})"


def load_tokenizer(model: str | ModelSource) -> Tokenizer:
    """The tokenizer of a model alias, HF directory or GGUF file (cached per process and on disk)."""
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    with _lock:
        tok = _loaded.get(source.path)
        if tok is None:
            tok = _loaded[source.path] = _load(source)
        return tok


@dataclass(frozen=True)
class TokenizerFacts:
    eos_token_ids: tuple[int, ...]
    vocab_size: int


def tokenizer_facts(model: str | ModelSource) -> TokenizerFacts:
    """The tokenizer's eos ids and vocabulary size: read from the facts file its first load wrote (keyed by the
    tokenizer files' paths, sizes and mtimes), else from the tokenizer, loaded now (which writes the file)."""
    source = model if isinstance(model, ModelSource) else resolve_model(model)
    try:
        with open(_facts_path(source)) as f:
            raw = json.load(f)
        return TokenizerFacts(tuple(int(x) for x in raw["eos_token_ids"]), int(raw["vocab_size"]))
    except (OSError, ValueError, KeyError, TypeError):
        tok = load_tokenizer(source)
        return TokenizerFacts(tok.eos_token_ids, tok.vocab_size)


def _facts_path(source: ModelSource) -> str:
    """Where the facts of this tokenizer's files, as they are now, are kept."""
    if source.is_gguf:
        stats = [source.path]
    else:
        stats = [os.path.join(source.directory, name) for name in _TOKENIZER_FILES]
    key = "|".join(f"{p}:{st.st_size}:{st.st_mtime_ns}" for p in stats if (st := _stat(p)) is not None)
    return os.path.join(_cache_root(), "facts", hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _write_facts(source: ModelSource, tok: Tokenizer) -> None:
    """Best effort (a read-only cache costs the next core a tokenizer load, nothing else)."""
    path = _facts_path(source)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump({"eos_token_ids": list(tok.eos_token_ids), "vocab_size": tok.vocab_size}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)  # no half-written file left beside the facts


def _load(source: ModelSource) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        if source.is_gguf:
            cache = _gguf_cache_dir(source)
            if not os.path.isfile(os.path.join(cache, "tokenizer.json")):
                hf = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
                _save_atomically(hf, cache)
            else:
                hf = AutoTokenizer.from_pretrained(cache)
        else:
            hf = AutoTokenizer.from_pretrained(source.directory)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"could not load a tokenizer from {source.path}: {e}") from e
    tok = Tokenizer(hf, source, _generation_eos_ids(source))
    _write_facts(source, tok)
    return tok


def _generation_eos_ids(source: ModelSource) -> list[int]:
    """Extra end-of-sequence ids from generation_config.json (Llama 3 lists several)."""
    path = os.path.join(source.directory, "generation_config.json")
    if source.is_gguf or not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [eos] if isinstance(eos, int) else [int(x) for x in eos or []]


def _cache_root() -> str:
    root = os.environ.get("KVFLEET_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvfleet")
    return os.path.join(root, "tokenizers")


def _gguf_cache_dir(source: ModelSource) -> str:
    st = os.stat(source.path)
    key = hashlib.sha256(f"{source.path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return os.path.join(_cache_root(), key)


_ARCHIVE_META = "kvfleet_tokenizer.json"


def tokenizer_archive(tok: Tokenizer) -> bytes:
    """The tokenizer's files (`save_pretrained`) and its extra eos ids, as an uncompressed tar (built once)."""
    data = getattr(tok, "_archive", None)
    if data is None:
        with tempfile.TemporaryDirectory() as tmp:
            tok.hf.save_pretrained(tmp)
            with open(os.path.join(tmp, _ARCHIVE_META), "w") as f:
                json.dump({"eos_token_ids": list(tok.eos_token_ids)}, f)
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for name in sorted(os.listdir(tmp)):
                    tar.add(os.path.join(tmp, name), arcname=name)
            data = tok._archive = buf.getvalue()
    return data


def load_tokenizer_archive(data: bytes) -> Tokenizer:
    """A tokenizer from `tokenizer_archive` bytes, unpacked once into the cache (keyed by its sha256)."""
    from transformers import AutoTokenizer

    key = hashlib.sha256(data).hexdigest()[:16]
    directory = os.path.join(_cache_root(), f"archive-{key}")
    try:
        if not os.path.isfile(os.path.join(directory, _ARCHIVE_META)):
            os.makedirs(os.path.dirname(directory), exist_ok=True)
            tmp = tempfile.mkdtemp(dir=os.path.dirname(directory))
            with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
                members = tar.getmembers()
                if any(not m.isfile() or os.path.basename(m.name) != m.name for m in members):
                    raise TokenizerError("a tokenizer archive holds plain files only")
                safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
                tar.extractall(tmp, members=members, **safe)
            try:
                os.rename(tmp, directory)
            except OSError:  # another process unpacked the same archive first
                import shutil
                shutil.rmtree(tmp, ignore_errors=True)
        with open(os.path.join(directory, _ARCHIVE_META)) as f:
            eos = json.load(f)["eos_token_ids"]
        hf = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError, tarfile.TarError) as e:
        raise TokenizerError(f"could not load the tokenizer archive: {e}") from e
    return Tokenizer(hf, ModelSource(directory, directory, None), eos)


def _save_atomically(hf, cache: str) -> None:
    """Write the extracted tokenizer next to its final place, then rename (safe across processes)."""
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        hf.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)
        except OSError:  # another process won the race; its copy is identical
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only home only costs the slow path next time
