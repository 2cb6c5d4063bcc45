"""The tenants file (`kvfleet router --tenants tenants.yaml`): parsed and validated once, reloaded on change.

    tenants:
      acme:
        api_key_sha256: ["<hex sha256 of a key>"]   # `kvfleet keys hash`; plain keys never go in the file
        tokens_per_minute: 20000                   # required, or dollars_per_minute: 0.5 (a budget in money,
                                                   #   charged each request's cost; its models need model_prices)
        max_concurrent_requests: 8                 # optional (default: no limit)
        max_tokens: 1024                           # optional: cap, and default for requests without one
        max_context_tokens: 4096                   # optional
        priority: 1                                # optional (default 0): higher is shed last
        isolate_cache: true                        # optional (default false)
        models: [smollm2, llama-70b]               # optional: the models it may use (others: 404); default all
        weight: 3                                  # optional (default 1): its share when a pool is full and queues
        slo_ttft_ms: 500                           # optional: TTFT target of its requests without x-llm-d-slo-ttft-ms
        slo_tpot_ms: 100                           # optional: TPOT target of its requests without x-llm-d-slo-tpot-ms
    anonymous: null                                # or the tenant that requests without a key use
    model_token_weights:                           # optional: budget tokens one token of a model costs
      llama-70b: 8                                 #   (default 1; reserved and charged ceil(tokens x weight))
    model_prices:                                  # optional: US dollars per million tokens (router/tenants/pricing.py)
      smollm2: {input: 0.10, cached_input: 0.01, cache_write: 0.125, output: 0.40}
                                                   #   input and output required; the others default to input
and, under a tenant, `prices: {smollm2: {cached_input: 0.005}}`: its own prices for a model, field by field over
`model_prices` (a model it prices alone needs input and output). Where a model has prices, a cached prompt token
costs `cached_input / input` of a budget token.

Every error names the file, the line and the field (`tenants.yaml:7: tenants.acme.tokens_per_minute: must
be a positive integer, got -5`): the YAML is composed into nodes, which keep their marks, and each value is
checked against its node. Unknown fields, repeated keys and a key hash listed under two tenants are errors.
Error messages never quote a key hash field's value (it might be a plain key pasted by mistake).

`TenantsFile` holds the registry read from the file and reloads it when its content changes
(router/config_file.py): a file that fails to load is logged with its error, and the previous tenants stay
in force.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import yaml

from router.config_file import ConfigFileError, NodeReader, WatchedFile, read_file, show
from router.tenants.budget import token_weight
from router.tenants.pricing import MICRO_USD, PRICE_FIELDS, Prices, price
from router.tenants.registry import Tenant, TenantRegistry

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
HEX64 = re.compile(r"[0-9a-fA-F]{64}")
TOP_FIELDS = ("tenants", "anonymous", "model_token_weights", "model_prices")
TENANT_FIELDS = ("api_key_sha256", "tokens_per_minute", "dollars_per_minute", "max_concurrent_requests", "max_tokens",
                 "max_context_tokens", "priority", "isolate_cache", "models", "weight", "prices", "slo_ttft_ms",
                 "slo_tpot_ms")

TenantsFileError = ConfigFileError


class _KeyReader(NodeReader):
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
    p = _KeyReader(path)
    _, top, entries = p.document(text, "tenants", TOP_FIELDS)

    anonymous = None
    if "anonymous" in top:
        node = top["anonymous"][1]
        anonymous = p.scalar(node, "anonymous") if isinstance(node, yaml.ScalarNode) else node
        if anonymous is not None and not isinstance(anonymous, str):
            raise p.error(node, "anonymous", f"must be a tenant name or null, got {p.kind(node)}")
        if anonymous is not None and anonymous not in entries:
            raise p.error(node, "anonymous", f"names no tenant defined under `tenants`: {show(anonymous)}")

    tenants = []
    bodies: dict[str, dict[str, tuple[yaml.Node, yaml.Node]]] = {}
    seen: dict[str, _Seen] = {}
    for name, (name_node, body_node) in entries.items():
        field = f"tenants.{name}"
        if not NAME.fullmatch(name):
            raise p.error(name_node, field, "a tenant name is 1-64 letters, digits, '_', '.' or '-', starting "
                                            "with a letter or digit")
        body = p.mapping(body_node, field, "a mapping of settings")
        p.known(body, field, TENANT_FIELDS, "a tenant has")
        if ("tokens_per_minute" in body) == ("dollars_per_minute" in body):
            raise p.error(name_node, f"{field}.tokens_per_minute", "every tenant needs one budget: tokens_per_minute "
                                                                   "or dollars_per_minute, not both")
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
        bodies[name] = body
    weights = _weights(p, top["model_token_weights"][1]) if "model_token_weights" in top else {}
    prices = {model: _full_prices(p, fields, node, f"model_prices.{model}")
              for model, (node, fields) in _price_table(p, top, "model_prices").items()}
    own = {}
    for t in tenants:
        table = _price_table(p, bodies[t.name], f"tenants.{t.name}.prices")
        own[t.name] = {model: prices[model].merged(fields) if model in prices else
                       _full_prices(p, fields, node, f"tenants.{t.name}.prices.{model}")
                       for model, (node, fields) in table.items()}
    return TenantRegistry(tenants, anonymous, weights, prices, own)


def _price_table(p: _KeyReader, where: dict, field: str) -> dict[str, tuple[yaml.Node, dict[str, Fraction]]]:
    """{model: (its node, {price field: exact price})} of a `model_prices` / `prices` mapping (empty when absent)."""
    key = field.rsplit(".", 1)[-1]
    if key not in where:
        return {}
    out = {}
    for model, (model_node, value) in p.mapping(where[key][1], field, "a mapping of model name to prices").items():
        fields = p.mapping(value, f"{field}.{model}", f"a mapping of {', '.join(PRICE_FIELDS)}")
        p.known(fields, f"{field}.{model}", PRICE_FIELDS, "a model's prices have")
        got = {}
        for name, (_, node) in fields.items():
            number = p.scalar(node, f"{field}.{model}.{name}") if isinstance(node, yaml.ScalarNode) else None
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < float("inf"):
                raise p.error(node, f"{field}.{model}.{name}", f"must be US dollars per million tokens, a number "
                                                               f">= 0, got {p.kind(node)}")
            got[name] = price(node.value)  # the text as written: 0.1 is exactly 1/10
        out[model] = (model_node, got)
    return out


def _full_prices(p: _KeyReader, fields: dict[str, Fraction], node: yaml.Node, field: str) -> Prices:
    for need in ("input", "output"):
        if need not in fields:
            raise p.error(node, f"{field}.{need}", "missing: a model's prices need input and output (cached_input "
                                                   "and cache_write default to input)")
    return Prices(fields["input"], fields.get("cached_input", fields["input"]),
                  fields.get("cache_write", fields["input"]), fields["output"])


def _weights(p: _KeyReader, node: yaml.Node) -> dict[str, Fraction]:
    field = "model_token_weights"
    out = {}
    for model, (_, value) in p.mapping(node, field, "a mapping of model name to weight").items():
        number = p.scalar(value, f"{field}.{model}") if isinstance(value, yaml.ScalarNode) else None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 < number < float("inf"):
            raise p.error(value, f"{field}.{model}", f"must be a number > 0, got {p.kind(value)}")
        out[model] = token_weight(value.value)  # the text as written: 0.1 is exactly 1/10
    return out


def _tenant(p: _KeyReader, name: str, field: str, body: dict[str, tuple[yaml.Node, yaml.Node]],
            hashes: frozenset[str]) -> Tenant:
    def get(key: str, check, *args, default=None):
        return check(body[key][1], f"{field}.{key}", *args) if key in body else default

    max_tokens = get("max_tokens", p.int_field, 1, True)
    max_context = get("max_context_tokens", p.int_field, 1, True)
    if max_tokens is not None and max_context is not None and max_tokens >= max_context:
        raise p.error(body["max_tokens"][1], f"{field}.max_tokens", f"must be less than max_context_tokens "
                      f"({max_context}): a request's prompt and max_tokens must fit in it, got {max_tokens}")
    return Tenant(name=name, api_key_sha256=hashes,
                  tokens_per_minute=(get("tokens_per_minute", p.int_field, 1, False) if "tokens_per_minute" in body
                                     else max(1, round(get("dollars_per_minute", p.number_field, 1e-6) * MICRO_USD))),
                  cost_budget="dollars_per_minute" in body,
                  max_concurrent_requests=get("max_concurrent_requests", p.int_field, 1, True),
                  max_tokens=max_tokens, max_context_tokens=max_context,
                  priority=get("priority", p.int_field, None, False, default=0),
                  isolate_cache=get("isolate_cache", p.bool_field, default=False),
                  models=get("models", lambda node, f: frozenset(p.names_field(node, f, "model names"))),
                  weight=get("weight", p.number_field, 0.001, default=1.0),
                  slo_ttft_s=_ms(get("slo_ttft_ms", p.number_field, 1.0)),
                  slo_tpot_s=_ms(get("slo_tpot_ms", p.number_field, 1.0)))


def _ms(value: float | None) -> float | None:
    return None if value is None else value / 1000.0


def load_tenants(path: str) -> TenantRegistry:
    """Read and parse a tenants file; TenantsFileError names what is wrong (also an unreadable file)."""
    return parse_tenants(read_file(path, "tenants"), path)


class TenantsFile(WatchedFile[TenantRegistry]):
    """The tenants file and the registry last read from it (reloaded on change, see WatchedFile)."""

    def __init__(self, path: str, interval_s: float = 1.0, on_reload: Callable[[bool], None] | None = None):
        super().__init__(path, parse_tenants, "tenants", interval_s, on_reload,
                         lambda r: f"{len(r)} tenants ({', '.join(r.tenants)})")

    @property
    def registry(self) -> TenantRegistry:
        return self.value
