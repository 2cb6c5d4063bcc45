"""The tenants file (`kvfleet router --tenants tenants.yaml`): parsed and validated once, reloaded on change.

    tenants:
      acme:
        api_key_sha256: ["<hex sha256 of a key>"]   # `kvfleet keys hash`; plain keys never go in the file
        tokens_per_minute: 20000                   # required
        max_concurrent_requests: 8                 # optional (default: no limit)
        max_tokens: 1024                           # optional: cap, and default for requests without one
        max_context_tokens: 4096                   # optional
        priority: 1                                # optional (default 0): higher is shed last
        isolate_cache: true                        # optional (default false)
    anonymous: null                                # or the tenant that requests without a key use

Every error names the file, the line and the field (`tenants.yaml:7: tenants.acme.tokens_per_minute: must
be a positive integer, got -5`): the YAML is composed into nodes, which keep their marks, and each value is
checked against its node. Unknown fields, repeated keys and a key hash listed under two tenants are errors.
Error messages never quote a key hash field's value (it might be a plain key pasted by mistake).

`TenantsFile` holds the registry read from the file; `watch()` polls the file and swaps in a new registry
when its content changes. A file that fails to load is logged once with its error, and the previous tenants
stay in force.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from contract.errors import ConfigError
from router.tenants import Tenant, TenantRegistry

log = logging.getLogger("kvfleet.router.tenants")

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
HEX64 = re.compile(r"[0-9a-fA-F]{64}")
TOP_FIELDS = ("tenants", "anonymous")
TENANT_FIELDS = ("api_key_sha256", "tokens_per_minute", "max_concurrent_requests", "max_tokens",
                 "max_context_tokens", "priority", "isolate_cache")
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class TenantsFileError(ConfigError):
    """A bad tenants file: `path`, `line` (1-based; None when the file could not be read) and `field`
    (a dotted path such as `tenants.acme.max_tokens`; "" for the whole file)."""

    def __init__(self, path: str, line: int | None, field: str, problem: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(field, f"{where}: {field}: {problem}" if field else f"{where}: {problem}")
        self.path, self.line, self.problem = path, line, problem


def _show(value) -> str:
    """A value as YAML would write it, for messages."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    return json.dumps(value) if isinstance(value, str) else str(value)


class _Parser:
    def __init__(self, path: str):
        self.path = path
        self.constructor = yaml.SafeLoader("")

    def error(self, node: yaml.Node | None, field: str, problem: str) -> TenantsFileError:
        return TenantsFileError(self.path, node.start_mark.line + 1 if node is not None else 1, field, problem)

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
        return _show(self.scalar(node, field))

    def int_field(self, node: yaml.Node, field: str, minimum: int | None, optional: bool) -> int | None:
        value = self.scalar(node, field) if isinstance(node, yaml.ScalarNode) else node
        if value is None and optional:
            return None
        if isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum):
            return value
        want = {None: "an integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        return self.fail(node, field, f"must be {want}{' or null' if optional else ''}, got {self.kind(node)}")

    def bool_field(self, node: yaml.Node, field: str) -> bool:
        value = self.scalar(node, field) if isinstance(node, yaml.ScalarNode) else node
        if isinstance(value, bool):
            return value
        return self.fail(node, field, f"must be true or false, got {self.kind(node)}")

    def fail(self, node: yaml.Node, field: str, problem: str):
        raise self.error(node, field, problem)

    def key_hashes(self, node: yaml.Node, field: str) -> list[tuple[str, yaml.Node]]:
        if not isinstance(node, yaml.SequenceNode):
            what = "a mapping" if isinstance(node, yaml.MappingNode) else "a single value"
            raise self.error(node, field, f"must be a list of hex sha256 digests (`kvfleet keys hash`), got {what}")
        out = []
        for i, item in enumerate(node.value):
            # the raw text, not the constructed value: a digest of decimal digits only would read as an int
            text = item.value if isinstance(item, yaml.ScalarNode) else None
            if text is None or not HEX64.fullmatch(text):
                got = f"{len(text)} characters" if text is not None else self.kind(item)
                raise self.error(item, f"{field}[{i}]", f"must be the 64-character hex sha256 of a key "
                                 f"(`kvfleet keys hash`), got {got}")
            out.append((text.lower(), item))
        return out


@dataclass
class _Seen:
    tenant: str
    node: yaml.Node


def parse_tenants(text: str | bytes, path: str = "<tenants>") -> TenantRegistry:
    """The registry a tenants file describes; raises TenantsFileError naming the line and field."""
    p = _Parser(path)
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise TenantsFileError(path, mark.line + 1 if mark else None, "",
                               f"not valid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise TenantsFileError(path, None, "", f"not valid YAML: {e}") from None
    if root is None:
        raise TenantsFileError(path, 1, "", "the file is empty; it needs a `tenants:` mapping")
    top = p.mapping(root, "", "a mapping with `tenants:` (and `anonymous:`)")
    for key, (key_node, _) in top.items():
        if key not in TOP_FIELDS:
            raise p.error(key_node, key, f"unknown field (the file holds {', '.join(TOP_FIELDS)})")
    if "tenants" not in top:
        raise p.error(root, "tenants", "missing: the file needs a `tenants:` mapping of name to settings")
    entries = p.mapping(top["tenants"][1], "tenants", "a mapping of tenant name to settings")

    anonymous = None
    if "anonymous" in top:
        node = top["anonymous"][1]
        anonymous = p.scalar(node, "anonymous") if isinstance(node, yaml.ScalarNode) else node
        if anonymous is not None and not isinstance(anonymous, str):
            raise p.error(node, "anonymous", f"must be a tenant name or null, got {p.kind(node)}")
        if anonymous is not None and anonymous not in entries:
            raise p.error(node, "anonymous", f"names no tenant defined under `tenants`: {_show(anonymous)}")

    tenants = []
    seen: dict[str, _Seen] = {}
    for name, (name_node, body_node) in entries.items():
        field = f"tenants.{name}"
        if not NAME.fullmatch(name):
            raise p.error(name_node, field, "a tenant name is 1-64 letters, digits, '_', '.' or '-', starting "
                                            "with a letter or digit")
        body = p.mapping(body_node, field, "a mapping of settings")
        for key, (key_node, _) in body.items():
            if key not in TENANT_FIELDS:
                raise p.error(key_node, f"{field}.{key}", f"unknown field (a tenant has {', '.join(TENANT_FIELDS)})")
        if "tokens_per_minute" not in body:
            raise p.error(name_node, f"{field}.tokens_per_minute", "missing: every tenant needs a token budget")
        hashes = p.key_hashes(body["api_key_sha256"][1], f"{field}.api_key_sha256") if "api_key_sha256" in body else []
        for i, (h, node) in enumerate(hashes):
            first = seen.setdefault(h, _Seen(name, node))
            if first.node is not node:
                owner = "this tenant" if first.tenant == name else f"tenant {first.tenant}"
                raise p.error(node, f"{field}.api_key_sha256[{i}]", f"this key hash is already a key of {owner} "
                                                                    f"(line {first.node.start_mark.line + 1})")
        if not hashes and name != anonymous:
            raise p.error(name_node, f"{field}.api_key_sha256", "missing: a tenant that is not the `anonymous` "
                                                               "one needs at least one key hash")

        tenants.append(_tenant(p, name, field, body, frozenset(h for h, _ in hashes)))
    return TenantRegistry(tenants, anonymous)


def _tenant(p: _Parser, name: str, field: str, body: dict[str, tuple[yaml.Node, yaml.Node]],
            hashes: frozenset[str]) -> Tenant:
    def get(key: str, check, *args, default=None):
        return check(body[key][1], f"{field}.{key}", *args) if key in body else default

    max_tokens = get("max_tokens", p.int_field, 1, True)
    max_context = get("max_context_tokens", p.int_field, 1, True)
    if max_tokens is not None and max_context is not None and max_tokens >= max_context:
        raise p.error(body["max_tokens"][1], f"{field}.max_tokens", f"must be less than max_context_tokens "
                      f"({max_context}): a request's prompt and max_tokens must fit in it, got {max_tokens}")
    return Tenant(name=name, api_key_sha256=hashes,
                  tokens_per_minute=get("tokens_per_minute", p.int_field, 1, False),
                  max_concurrent_requests=get("max_concurrent_requests", p.int_field, 1, True),
                  max_tokens=max_tokens, max_context_tokens=max_context,
                  priority=get("priority", p.int_field, None, False, default=0),
                  isolate_cache=get("isolate_cache", p.bool_field, default=False))


def load_tenants(path: str) -> TenantRegistry:
    """Read and parse a tenants file; TenantsFileError names what is wrong (also an unreadable file)."""
    return parse_tenants(_read(path), path)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise TenantsFileError(path, None, "", f"cannot read the tenants file: {e.strerror or e}") from None


class TenantsFile:
    """The tenants file and the registry last read from it. The constructor raises TenantsFileError (start-up
    fails on a bad file); afterwards `poll()` / `watch()` swap in a new registry when the content changes
    and keep the previous one, logging why, when the new content does not load."""

    def __init__(self, path: str, interval_s: float = 1.0, on_reload: Callable[[bool], None] | None = None):
        """on_reload(ok): called after each attempt to load changed content (for metrics)."""
        self.path = str(path)
        self.interval_s = interval_s
        self.on_reload = on_reload
        data = _read(self.path)
        self.registry: TenantRegistry = parse_tenants(data, self.path)
        self._digest = hashlib.sha256(data).digest()  # of the content last tried, good or bad
        self._unreadable = False
        self.reloads = 0
        self.failed_reloads = 0

    def poll(self) -> bool:
        """Read the file once; True when a new registry took over."""
        try:
            data = _read(self.path)
        except TenantsFileError as e:
            if not self._unreadable:  # logged once, until it can be read again
                log.warning("%s; the previous %d tenants stay in force", e, len(self.registry))
            self._unreadable = True
            return False
        self._unreadable = False
        digest = hashlib.sha256(data).digest()
        if digest == self._digest:
            return False
        self._digest = digest
        try:
            registry = parse_tenants(data, self.path)
        except TenantsFileError as e:
            self.failed_reloads += 1
            log.error("tenants file not reloaded, the previous %d tenants stay in force: %s", len(self.registry), e)
            if self.on_reload:
                self.on_reload(False)
            return False
        self.registry = registry
        self.reloads += 1
        log.info("tenants reloaded from %s: %d tenants (%s)", self.path, len(registry), ", ".join(registry.tenants))
        if self.on_reload:
            self.on_reload(True)
        return True

    async def watch(self) -> None:
        """Poll every interval_s until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.poll()
            except Exception:  # never let the watcher die: the tenants in force stay
                log.exception("tenants file check failed")
