"""Grammars compiled once per guide and cached, on a worker thread, never on the engine loop.

    cache = GrammarCache(load_hf, vocab_size, stop_token_ids)   # load_hf() -> the Hugging Face tokenizer
    await cache.compile_async(guide)      # the HTTP edge: the request waits here ("compiling"), the batch runs on
    matcher = cache.matcher(guide)        # a fresh matcher (a cache hit after compile_async; else compiles now)

A guide that cannot be compiled (invalid schema, unsupported feature, bad regex or grammar) raises
InvalidRequestError naming `guide.param`; the failure is cached too, so a bad schema sent again costs
nothing. JSON Schemas are first checked against their meta-schema (jsonschema), since the grammar library
silently accepts some invalid ones. The library is xgrammar (docs/structured-outputs.md says why), imported
only when the first guided request arrives: unconstrained serving never loads it.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from engine.errors import InvalidRequestError
from engine.structured.spec import Guide, GuideKind

MAX_CACHED = 512  # compiled grammars kept (least recently used goes first)
_LIB_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


class GrammarCache:
    def __init__(self, load_hf: Callable[[], object], vocab_size: int, stop_token_ids: tuple[int, ...],
                 max_workers: int = 2):
        """load_hf: returns the Hugging Face tokenizer; called once, by the first compile (an engine core loads its
        tokenizer only when a guided request comes). max_workers: schemas compiled at once (a slow one then holds
        up new schemas on one worker only)."""
        self._load_hf = load_hf
        self._vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="kvfleet-grammar")
        self.hits = 0
        self.misses = 0

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def _future(self, guide: Guide) -> Future:
        with self._lock:
            fut = self._futures.get(guide.key)
            if fut is not None:
                self._futures.move_to_end(guide.key)
                self.hits += 1
                return fut
            self.misses += 1
            fut = self._futures[guide.key] = self._pool.submit(self._compile, guide)
            while len(self._futures) > MAX_CACHED:
                self._futures.popitem(last=False)
            return fut

    async def compile_async(self, guide: Guide):
        """The compiled grammar, waiting off the event loop (raises InvalidRequestError)."""
        try:
            return await asyncio.wrap_future(self._future(guide))
        except _GrammarError as e:
            raise e.for_field(guide.param) from None

    def compile(self, guide: Guide):
        try:
            return self._future(guide).result()
        except _GrammarError as e:
            raise e.for_field(guide.param) from None

    def ready(self, guide: Guide) -> bool:
        """Whether the guide's grammar is compiled (or failed); starts compiling it if not. Never waits."""
        with self._lock:
            fut = self._futures.get(guide.key)
        return (fut if fut is not None else self._future(guide)).done()

    def matcher(self, guide: Guide):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(guide))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, guide: Guide):
        """On the worker thread: check, then compile. A failure is cached with the guide's key, which does not
        hold the field (the same schema may come as a response_format or as a tool's parameters): its message
        leaves a place for the field of each request that asks."""
        import xgrammar as xgr

        with self._compiler_lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._load_hf(), vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        if guide.kind is GuideKind.JSON_SCHEMA:
            try:
                check_json_schema(guide.schema(), _FIELD)
            except InvalidRequestError as e:
                raise _GrammarError(str(e)) from None
        try:
            return _compile_with(self._compiler, guide)
        except Exception as e:  # noqa: BLE001 - the library's own errors: report them for this field
            raise _GrammarError(f"{_FIELD}: cannot be compiled into a grammar: {_clean(str(e))}") from None


_FIELD = "\x00field\x00"  # where a cached failure's message names the request's field


class _GrammarError(Exception):
    def for_field(self, param: str) -> InvalidRequestError:
        return InvalidRequestError(param, str(self).replace(_FIELD, param))


def _compile_with(compiler, guide: Guide):
    kind = guide.kind
    if kind is GuideKind.JSON_SCHEMA:
        return compiler.compile_json_schema(guide.text, any_whitespace=False, strict_mode=True)
    if kind is GuideKind.JSON_OBJECT:
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind is GuideKind.REGEX:
        return compiler.compile_regex(guide.text)
    if kind is GuideKind.CHOICE:
        return compiler.compile_grammar(choice_grammar(guide.choices()))
    return compiler.compile_grammar(guide.text)


def choice_grammar(options: list[str]) -> str:
    """EBNF accepting exactly one of the options (JSON string escapes are EBNF string escapes)."""
    import json

    return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options)


def check_json_schema(schema: object, param: str) -> None:
    """Raise InvalidRequestError(param) unless `schema` is a valid JSON Schema (its own meta-schema)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise InvalidRequestError(param, f"{param} must be a JSON Schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError:
        raise InvalidRequestError(param, f"{param} is nested too deeply") from None
    except jsonschema.SchemaError as e:
        where = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise InvalidRequestError(param, f"{param}{where} is not a valid JSON Schema: {e.message}") from None


def _clean(message: str) -> str:
    return _LIB_PREFIX.sub("", message.strip()).strip()
