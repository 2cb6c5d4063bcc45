"""YAML configuration files of the router (tenants, pools): read node by node so every error names the file,
the line and the field, and re-read when their content changes.

`NodeReader` checks values against the composed YAML nodes, which keep their marks (`pools.yaml:7:
pools.canary.weight: must be an integer >= 0, got -5`). `WatchedFile` holds what a parse function made of
the file; `poll()` / `watch()` swap in a new value when the content changes and keep the previous one,
logging why, when the new content does not load.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections.abc import Callable
from typing import Generic, Literal, TypeVar, overload

import yaml

from contract.errors import ConfigError

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
T = TypeVar("T")


class ConfigFileError(ConfigError):
    """A bad configuration file: `path`, `line` (1-based; None when the file could not be read) and `field`
    (a dotted path such as `tenants.acme.max_tokens`; "" for the whole file)."""

    def __init__(self, path: str, line: int | None, field: str, problem: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(field, f"{where}: {field}: {problem}" if field else f"{where}: {problem}")
        self.path, self.line, self.problem = path, line, problem


def show(value) -> str:
    """A value as YAML would write it, for messages."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return json.dumps(value) if isinstance(value, str) else str(value)


class NodeReader:
    """Reads checked values out of one file's YAML nodes; every failure raises ConfigFileError."""

    def __init__(self, path: str):
        self.path = path
        self.constructor = yaml.SafeLoader("")

    def root(self, text: str | bytes, what: str) -> yaml.Node:
        """The document's root node; `what` says what an empty file should have held."""
        try:
            root = yaml.compose(text, Loader=_Loader)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            raise ConfigFileError(self.path, mark.line + 1 if mark else None, "",
                                  f"not valid YAML: {e.problem or e.context}") from None
        except yaml.YAMLError as e:
            raise ConfigFileError(self.path, None, "", f"not valid YAML: {e}") from None
        if root is None:
            raise ConfigFileError(self.path, 1, "", f"the file is empty; it needs {what}")
        return root

    def document(self, text: str | bytes, main: str, fields: tuple[str, ...]
                 ) -> tuple[yaml.Node, dict[str, tuple[yaml.Node, yaml.Node]], dict[str, tuple[yaml.Node, yaml.Node]]]:
        """(root, top-level entries, entries of the `main` mapping) of a file whose top level holds `fields`,
        `main` required: e.g. `tenants:` (name -> settings) and `anonymous:`."""
        root = self.root(text, f"a `{main}:` mapping")
        others = " and ".join(f"`{f}:`" for f in fields if f != main)
        top = self.mapping(root, "", f"a mapping with `{main}:`" + (f" (and {others})" if others else ""))
        self.known(top, "", fields, "the file holds")
        if main not in top:
            raise self.error(root, main, f"missing: the file needs a `{main}:` mapping of name to settings")
        singular = main[:-1] if main.endswith("s") else main
        return root, top, self.mapping(top[main][1], main, f"a mapping of {singular} name to settings")

    def error(self, node: yaml.Node | None, field: str, problem: str) -> ConfigFileError:
        return ConfigFileError(self.path, node.start_mark.line + 1 if node is not None else 1, field, problem)

    def fail(self, node: yaml.Node, field: str, problem: str):
        raise self.error(node, field, problem)

    def mapping(self, node: yaml.Node, field: str, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """A mapping node's entries by key (string keys only, each once): key -> (key node, value node)."""
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, field, f"must be {what}, got {self.kind(node)}")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node, field) if isinstance(key_node, yaml.ScalarNode) else None
            name = f"{field}.{key}" if field else str(key)
            if not isinstance(key, str):
                raise self.error(key_node, field, f"keys must be names, got {self.kind(key_node)}")
            if key in out:
                raise self.error(key_node, name, f"given twice (first on line {out[key][0].start_mark.line + 1})")
            out[key] = (key_node, value_node)
        return out

    def known(self, entries: dict[str, tuple[yaml.Node, yaml.Node]], field: str, allowed: tuple[str, ...],
              what: str) -> None:
        """Every key of `entries` is one of `allowed`; `what` starts the hint, e.g. "a tenant has"."""
        for key, (key_node, _) in entries.items():
            if key not in allowed:
                name = f"{field}.{key}" if field else key
                raise self.error(key_node, name, f"unknown field ({what} {', '.join(allowed)})")

    def scalar(self, node: yaml.Node, field: str = ""):
        try:
            return self.constructor.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            raise self.error(node, field, f"cannot read this value: {getattr(e, 'problem', e)}") from None

    def kind(self, node: yaml.Node, field: str = "") -> str:
        if isinstance(node, yaml.MappingNode):
            return "a mapping"
        if isinstance(node, yaml.SequenceNode):
            return "a list"
        return show(self.scalar(node, field))

    def _value(self, node: yaml.Node, field: str):
        return self.scalar(node, field) if isinstance(node, yaml.ScalarNode) else node

    @overload
    def int_field(self, node: yaml.Node, field: str, minimum: int | None, optional: Literal[False]) -> int: ...

    @overload
    def int_field(self, node: yaml.Node, field: str, minimum: int | None, optional: bool) -> int | None: ...

    def int_field(self, node: yaml.Node, field: str, minimum: int | None, optional: bool) -> int | None:
        value = self._value(node, field)
        if value is None and optional:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum):
            return value
        want = {None: "an integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        return self.fail(node, field, f"must be {want}{' or null' if optional else ''}, got {self.kind(node)}")

    def number_field(self, node: yaml.Node, field: str, minimum: float = 0.0) -> float:
        value = self._value(node, field)
        if (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value >= minimum):
            return float(value)
        return self.fail(node, field, f"must be a number >= {minimum:g}, got {self.kind(node)}")

    def bool_field(self, node: yaml.Node, field: str) -> bool:
        value = self._value(node, field)
        if isinstance(value, bool):
            return value
        return self.fail(node, field, f"must be true or false, got {self.kind(node)}")

    def names_field(self, node: yaml.Node, field: str, what: str = "names") -> tuple[str, ...]:
        """A non-empty list of distinct non-empty strings (e.g. model names)."""
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            raise self.error(node, field, f"must be a non-empty list of {what}, got {self.kind(node)}")
        names = [self.str_field(item, f"{field}[{i}]") for i, item in enumerate(node.value)]
        for i, name in enumerate(names):
            if names.index(name) != i:
                raise self.error(node.value[i], f"{field}[{i}]", f"{name!r} is listed twice")
        return tuple(names)

    def str_field(self, node: yaml.Node, field: str) -> str:
        value = self._value(node, field)
        if isinstance(value, str) and value:
            return value
        return self.fail(node, field, f"must be a non-empty string, got {self.kind(node)}")


def read_file(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigFileError(path, None, "", f"cannot read the {what} file: {e.strerror or e}") from None


class WatchedFile(Generic[T]):
    """A configuration file and the value last parsed from it. The constructor raises ConfigFileError
    (start-up fails on a bad file); afterwards `poll()` / `watch()` swap in a new value when the content
    changes and keep the previous one, logging why, when the new content does not load."""

    def __init__(self, path: str, parse: Callable[[bytes, str], T], what: str, interval_s: float = 1.0,
                 on_reload: Callable[[bool], None] | None = None, describe: Callable[[T], str] = str):
        """parse(content, path) -> value or ConfigFileError; on_reload(ok) after each attempt to load changed
        content (for metrics); describe(value) for the log line of a reload."""
        self.path, self.parse, self.what = str(path), parse, what
        self.interval_s = interval_s
        self.on_reload = on_reload
        self.describe = describe
        self.log = logging.getLogger(f"kvfleet.router.{what}")
        data = read_file(self.path, what)
        self.value: T = parse(data, self.path)
        self._digest = hashlib.sha256(data).digest()  # of the content last tried, good or bad
        self._unreadable = False
        self.reloads = 0
        self.failed_reloads = 0

    def poll(self) -> bool:
        """Read the file once; True when a new value took over."""
        try:
            data = read_file(self.path, self.what)
        except ConfigFileError as e:
            if not self._unreadable:  # logged once, until it can be read again
                self.log.warning("%s; the %s in force stay", e, self.what)
            self._unreadable = True
            return False
        self._unreadable = False
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return False
        self._digest = digest
        try:
            value = self.parse(data, self.path)
        except ConfigFileError as e:
            self.failed_reloads += 1
            self.log.error("%s file not reloaded, the %s in force stay: %s", self.what, self.what, e)
            if self.on_reload:
                self.on_reload(False)
            return False
        self.value = value
        self.reloads += 1
        self.log.info("%s reloaded from %s: %s", self.what, self.path, self.describe(value))
        if self.on_reload:
            self.on_reload(True)
        return True

    async def watch(self, on_change: Callable[[T], None] | None = None) -> None:
        """Poll every interval_s until cancelled; on_change(new value) after each swap."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                if self.poll() and on_change is not None:
                    on_change(self.value)
            except Exception:  # never let the watcher die: the value in force stays
                self.log.exception("%s file check failed", self.what)
