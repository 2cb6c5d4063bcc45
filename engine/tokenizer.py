"""The one tokenizer path, shared by the engine, the server and the router.

`load_tokenizer(model)` resolves the model like the engine does (`engine.model.registry`) and gives its tokenizer
in a small, plain-list interface. The first load goes through Hugging Face transformers (from a model directory,
or from a GGUF file, which parses the whole file: seconds) and keeps the tokenizer's files in a cache
(KVFLEET_CACHE_DIR, default ~/.cache/kvfleet; keyed by the GGUF file's or the tokenizer files' paths, sizes and
mtimes) with a snapshot of the loaded tokenizer (engine/tokenizer_snapshot.py). Later loads read the snapshot:
the same Rust backend and facts, no transformers import (which imports torch: ~4.5 s of CPU per router or engine
front end here), the chat template rendered as transformers renders it (engine/chat_template.py).

`tokenizer_facts(model)` gives what an engine core needs before any request: the end-of-sequence ids and the
vocabulary size, kept on disk beside the cache the first time the tokenizer loads, so that a core process reads
them from a small file; it loads the tokenizer itself only on first use (a structured-output grammar, the
offline API's text).

`tokenizer_archive(tok)` packs a loaded tokenizer (its Hugging Face files, its snapshot and kvfleet's extra eos
ids) into a tar, which an engine serves to routers (`GET /v1/kvfleet/tokenizer`), and `load_tokenizer_archive(data)`
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
from typing import Any

from contract.messages import MessageError, chat_messages
from contract.tool_prompt import template_renders_tools, tool_messages
from engine import chat_template
from engine import tokenizer_snapshot as snapshot
from engine.model.registry import ModelSource, resolve_model

_lock = threading.RLock()
_loaded: dict[str, Tokenizer] = {}


class TokenizerError(ValueError):
    """The tokenizer could not be loaded or could not render the input; the message says why."""


class Tokenizer:
    """Plain-list wrapper around a Hugging Face (fast) tokenizer, or around its snapshot (engine/tokenizer_snapshot.py:
    the same Rust backend and facts, read without importing transformers; `hf` then loads on first use)."""

    def __init__(self, hf_tokenizer, source: ModelSource | None = None,
                 extra_eos_token_ids: Iterable[int] = ()):
        self._hf = hf_tokenizer
        self._backend: Any = None  # set from a snapshot: encode, decode and token strings go straight to it
        self._directory: str | None = None  # where its Hugging Face files (and snapshot) lie, if on disk
        self._archive: bytes | None = None  # tokenizer_archive's tar, built once
        self.source = source
        eos = hf_tokenizer.eos_token_id
        if eos is None:
            raise TokenizerError(f"tokenizer of {source.path if source else 'model'} has no eos_token_id")
        self._facts(int(eos), hf_tokenizer.bos_token_id, len(hf_tokenizer), hf_tokenizer.all_special_ids,
                    hf_tokenizer.special_tokens_map, getattr(hf_tokenizer, "chat_template", None), extra_eos_token_ids)

    @classmethod
    def from_snapshot(cls, snap: snapshot.Snapshot, directory: str, source: ModelSource | None = None,
                      extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        tok = cls.__new__(cls)
        tok._hf, tok._backend, tok._directory, tok._archive, tok.source = None, snap.backend, directory, None, source
        tok._facts(snap.eos_token_id, snap.bos_token_id, snap.vocab_size, snap.all_special_ids, snap.special_tokens,
                   snap.chat_template, extra_eos_token_ids)
        return tok

    def _facts(self, eos: int, bos: int | None, vocab_size: int, special_ids: Iterable[int], special_tokens: Mapping,
               chat_template, extra_eos: Iterable[int]) -> None:
        self.eos_token_id: int = eos
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([eos, *map(int, extra_eos)]))
        self.bos_token_id: int | None = bos
        self.vocab_size: int = vocab_size
        self.all_special_ids: frozenset[int] = frozenset(special_ids)
        self.special_tokens: dict = dict(special_tokens)
        self.chat_template: str | dict | None = chat_template

    @property
    def hf(self):
        """The Hugging Face tokenizer (grammars and tests need its object): loaded now if this one came from a
        snapshot."""
        if self._hf is None:
            with _lock:
                if self._hf is None:
                    from transformers import AutoTokenizer

                    self._hf = AutoTokenizer.from_pretrained(self._directory)
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"prompt must be a string, got {type(text).__name__}")
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        if self._backend is not None:
            return [self._backend.id_to_token(int(i)) for i in ids]
        return self.hf.convert_ids_to_tokens(list(ids))

    @property
    def added_tokens(self) -> dict[int, Any]:
        """The added tokens by id, each with its content and its lstrip / rstrip / single_word / special rules."""
        if self._backend is not None:
            return dict(self._backend.get_added_tokens_decoder())
        return dict(getattr(self.hf, "added_tokens_decoder", None) or {})

    def _template(self, tools: bool) -> str | None:
        """The template transformers would pick: a named set's `tool_use` when there are tools, else `default`."""
        t = self.chat_template
        if isinstance(t, dict):
            return t.get("tool_use") if tools and "tool_use" in t else t.get("default")
        return t

    def render_chat(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping] | None = None) -> str:
        """The chat template applied to messages (and tools: contract/tool_prompt.py), as text (engine/chat_template.py
        renders it as transformers does)."""
        default = self._template(False)
        if not default:
            raise TokenizerError("this model's tokenizer has no chat template; use a completion prompt instead")
        try:
            msgs = chat_messages(messages)
        except MessageError as e:
            raise TokenizerError(str(e)) from None
        native = template_renders_tools(default)
        msgs = tool_messages(msgs, tools, native)
        passed = list(tools) if native and tools else None
        template = self._template(True) if passed is not None else default
        if not template:
            raise TokenizerError("this model's tokenizer has no chat template for tools")
        try:
            return chat_template.render(template, msgs,
                                        add_generation_prompt=add_generation_prompt, tools=passed,
                                        special_tokens=self.special_tokens)
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
    """From the cache's snapshot (no transformers); else through transformers, writing the cache and snapshot."""
    cache = _cache_dir(source)
    extra_eos = _generation_eos_ids(source)
    snap = snapshot.read(cache)
    if snap is not None:
        return Tokenizer.from_snapshot(snap, cache, source, extra_eos)
    from transformers import AutoTokenizer

    try:
        if os.path.isfile(os.path.join(cache, "tokenizer.json")):
            hf = AutoTokenizer.from_pretrained(cache)
        elif source.is_gguf:
            hf = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
        else:
            hf = AutoTokenizer.from_pretrained(source.directory)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"could not load a tokenizer from {source.path}: {e}") from e
    tok = Tokenizer(hf, source, extra_eos)
    if _save_atomically(hf, cache):
        tok._directory = cache
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


def _cache_dir(source: ModelSource) -> str:
    """Where the tokenizer's files and snapshot are kept: keyed by the GGUF file, or by the tokenizer files of a
    model directory (paths, sizes, mtimes), so an edited or replaced file gets a fresh copy."""
    if source.is_gguf:
        g = os.stat(source.path)
        key = hashlib.sha256(f"{source.path}|{g.st_size}|{g.st_mtime_ns}".encode()).hexdigest()[:16]
        return os.path.join(_cache_root(), key)
    paths = [os.path.join(source.directory, name) for name in _TOKENIZER_FILES]
    key = "|".join(f"{p}:{st.st_size}:{st.st_mtime_ns}" for p in paths if (st := _stat(p)) is not None)
    return os.path.join(_cache_root(), "hf-" + hashlib.sha256(key.encode()).hexdigest()[:16])


_ARCHIVE_META = "kvfleet_tokenizer.json"


def tokenizer_archive(tok: Tokenizer) -> bytes:
    """The tokenizer's files (`save_pretrained`), its snapshot (engine/tokenizer_snapshot.py) and its extra eos ids, as
    an uncompressed tar (built once)."""
    if tok._archive is not None:
        return tok._archive
    with tempfile.TemporaryDirectory() as tmp:
        source = tok._directory
        if source is None or not os.path.isfile(os.path.join(source, snapshot.META)):
            source = tmp
            tok.hf.save_pretrained(tmp)
            snapshot.write(tok.hf, tmp)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name in sorted(os.listdir(source)):
                if not name.startswith(".") and name != _ARCHIVE_META:
                    tar.add(os.path.join(source, name), arcname=name)
            meta = json.dumps({"eos_token_ids": list(tok.eos_token_ids)}).encode()
            info = tarfile.TarInfo(_ARCHIVE_META)
            info.size = len(meta)
            tar.addfile(info, io.BytesIO(meta))
        tok._archive = buf.getvalue()
    return tok._archive


def load_tokenizer_archive(data: bytes) -> Tokenizer:
    """A tokenizer from `tokenizer_archive` bytes, unpacked once into the cache (keyed by its sha256): from its
    snapshot where it has one this transformers can trust, else through transformers."""
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
        source = ModelSource(directory, directory, None)
        snap = snapshot.read(directory)
        if snap is not None:
            return Tokenizer.from_snapshot(snap, directory, source, eos)
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, KeyError, tarfile.TarError) as e:
        raise TokenizerError(f"could not load the tokenizer archive: {e}") from e
    tok = Tokenizer(hf, source, eos)
    tok._directory = directory
    return tok


def _save_atomically(hf, cache: str) -> bool:
    """The tokenizer's files and snapshot in `cache`: written beside it, then renamed into place (safe across
    processes); into it where it exists already (an older cache, or one a newer transformers must re-snapshot).
    False where nothing could be written (a read-only home only costs the slow path next time)."""
    try:
        if os.path.isdir(cache):
            snapshot.write(hf, cache)
            return True
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache))
        hf.save_pretrained(tmp)
        snapshot.write(hf, tmp)
        try:
            os.rename(tmp, cache)
        except OSError:  # another process won the race; its copy is identical
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
        return True
    except OSError:
        return False
