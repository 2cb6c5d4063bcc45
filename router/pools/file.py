"""The pools file (`kvfleet router --pools pools.yaml`): engine pools, their discovery, weights and limits, and
the degradation thresholds. Parsed and validated once, reloaded within a second of a change (a ConfigMap
update: `helm upgrade` / `helm rollback` change weights without restarting routers).

    pools:
      stable:
        version: "v1"                 # configuration version label (metrics label `version`)
        weight: 95                    # share of new sessions (of its model's); 0 drains the pool
        model: smollm2                # the model name it serves (`models: [a, b]` for several); absent:
                                      #   learned from its replicas' /v1/models
        engine: kvfleet               # kvfleet | vllm | sglang | auto (default: --engine-type, i.e. auto)
        # kv_events: "tcp://{host}:5557|tcp://{host}:5558"   # vllm / sglang: their ZMQ KV events (publisher|replay;
        #                             #   a list of REPLICA_URL=tcp://...|tcp://... for replicas on other ports)
        # tokenizer: /models/llama    # this pool's models are tokenized with it (default: fetched from its
        #                             #   kvfleet engines with --tokenizer-from-engines, else --model)
        replicas: [http://10.0.0.1:8000, http://10.0.0.2:8000]      # exactly one discovery source:
        # dns: {name: kvfleet-engine-stable.ns.svc.cluster.local, port: 8000}
        # k8s: {service: kvfleet-engine-stable, namespace: ns, port_name: http}
        max_tokens_cap: 4096          # optional: a larger max_tokens is lowered to it (header says so)
        default_max_tokens: 512       # optional: max_tokens of requests without one
        max_context_tokens: 8192      # optional: prompt + max_tokens limit of the pool's engines
        # slo_ttft_ms: 1000           # optional: TTFT target of requests that carry none (x-llm-d-slo-ttft-ms) and
        #                             #   whose tenant sets none: placed where predicted met, else 429 slo_unattainable
        # slo_tpot_ms: 100            # optional: TPOT target likewise (x-llm-d-slo-tpot-ms)
        # slo_unattainable: refuse    # or best_effort: a target no replica is predicted to meet is served anyway,
        #                             #   behind the pool's other requests, instead of 429 slo_unattainable
        # adapters:                   # optional: LoRA adapters the router has a replica load on demand
        #   sql-expert: /adapters/sql # (POST /v1/load_lora_adapter, path as the engines see it) when no replica
        #                             #   holds one, or its holders are busier than an adapter load costs
        # role: decode                # optional: both (default), or decode: each request is prefilled on a
        #                             #   replica of a `role: prefill` pool of its model first, and this pool's
        #                             #   replica pulls that KV (kvfleet engines; router/http/disagg.py)
      canary:
        version: "v2"
        weight: 5
        canary: true                  # degradation may roll it back (weight -> 0)
        k8s: {service: kvfleet-engine-canary}
      long:
        version: "v1"
        weight: 1
        long_context: true            # only requests that fit no regular pool
        max_context_tokens: 32768
        dns: {name: kvfleet-engine-long.ns.svc.cluster.local}
    degradation:                      # optional; every key optional (defaults below)
      window_s: 30                    # signals are measured over this window
      min_requests: 20                # fewer requests in the window: latency and error signals unknown
      interval_s: 1                   # how often the router re-evaluates each pool
      dwell_s: 30                     # at least this long between two level changes of a pool
      max_tokens_factor: 0.5          # at lower_max_tokens: the pool's max_tokens default and cap times this
      p99_ttft_s: {trip: 2.0, clear: 1.0}
      p99_tpot_s: {trip: 0.2, clear: 0.1}
      error_rate: {trip: 0.05, clear: 0.01}
      oom_events: {trip: 1, clear: 1}
      alloc_failures: {trip: 500, clear: 50}
      kv_usage: {trip: 0.98, clear: 0.90}

A request's `model` chooses among the pools that serve it (router/pools/models.py); weights, canaries, the
long-context pool and degradation then work among those, per model.

Every error names the file, the line and the field (`pools.yaml:6: pools.canary.weight: must be an integer
>= 0, got -5`). A replica URL listed in two pools, unknown fields and repeated keys are errors.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import yaml

from contract.errors import ConfigError
from router.config import ENGINE_TYPES, VllmEventsConfig, check_replica_url
from router.config_file import NodeReader, WatchedFile
from router.pools.choice import PoolSpec
from router.pools.degradation import SIGNALS, DegradationConfig
from router.routing.discovery import DnsSource, K8sSource, Source, StaticSource

NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # a DNS label: pool names become k8s names and labels
TOP_FIELDS = ("pools", "degradation")
POOL_FIELDS = ("version", "weight", "canary", "long_context", "max_tokens_cap", "default_max_tokens",
               "max_context_tokens", "slo_ttft_ms", "slo_tpot_ms",
               "slo_unattainable", "model", "models", "adapters", "role", "engine", "kv_events",
               "tokenizer", "replicas", "dns", "k8s")
SOURCES = ("replicas", "dns", "k8s")
DEGRADATION_FIELDS = ("window_s", "min_requests", "interval_s", "dwell_s", "max_tokens_factor", *SIGNALS)


@dataclass(frozen=True)
class PoolConfig:
    spec: PoolSpec
    source: Source
    engine: str = "auto"  # one of ENGINE_TYPES: how readiness, KV events and load are read
    kv_events: VllmEventsConfig | None = None  # vLLM / SGLang ZMQ KV events; None: the --vllm-kv-events flags
    tokenizer: str | None = None  # tokenizer of the pool's models (a path or bundled name); None: fetched or --model


@dataclass(frozen=True)
class DegradationSettings:
    """The state machine's thresholds plus how the router measures: the window, the fewest requests that
    make latency and error signals known, and the evaluation interval."""

    thresholds: DegradationConfig = DegradationConfig()
    window_s: float = 30.0
    min_requests: int = 20
    interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not self.interval_s > 0:
            raise ConfigError("window_s", "window_s and interval_s must be > 0")
        if self.min_requests < 1:
            raise ConfigError("min_requests", f"must be >= 1, got {self.min_requests}")


@dataclass(frozen=True)
class PoolsConfig:
    pools: tuple[PoolConfig, ...]
    degradation: DegradationSettings = DegradationSettings()

    def describe(self) -> str:
        return ", ".join(f"{p.spec.name} ({p.spec.version}, weight {p.spec.weight})" for p in self.pools)


def parse_pools(text: str | bytes, path: str = "<pools>") -> PoolsConfig:
    """The pools a pools file describes; raises ConfigFileError naming the line and field."""
    r = NodeReader(path)
    _, top, entries = r.document(text, "pools", TOP_FIELDS)
    if not entries:
        raise r.error(top["pools"][1], "pools", "at least one pool is required")
    pools: list[PoolConfig] = []
    owner: dict[str, str] = {}
    for name, (name_node, body_node) in entries.items():
        pool = _pool(r, name, name_node, body_node)
        if isinstance(pool.source, StaticSource):
            items = r.mapping(body_node, name, "")["replicas"][1].value
            for i, url in enumerate(pool.source.urls):
                if url in owner:
                    raise r.error(items[i], f"pools.{name}.replicas", f"{url} is already a replica of pool "
                                  f"{owner[url]}: a replica belongs to one pool")
                owner[url] = name
        pools.append(pool)
    if not any(p.spec.weight > 0 and not p.spec.long_context and p.spec.role != "prefill" for p in pools):
        raise r.error(top["pools"][1], "pools", "no regular (not long_context) pool has a weight above 0: "
                      "nothing could take a request")
    degradation = _degradation(r, top["degradation"][1]) if "degradation" in top else DegradationSettings()
    return PoolsConfig(tuple(pools), degradation)


def _pool(r: NodeReader, name: str, name_node: yaml.Node, body_node: yaml.Node) -> PoolConfig:
    field = f"pools.{name}"
    if not NAME.fullmatch(name):
        raise r.error(name_node, field, "a pool name is 1-63 lower-case letters, digits or '-', starting and "
                                        "ending with a letter or digit (it names Kubernetes objects)")
    body = r.mapping(body_node, field, "a mapping of settings")
    r.known(body, field, POOL_FIELDS, "a pool has")
    for required in ("version", "weight"):
        if required not in body:
            raise r.error(name_node, f"{field}.{required}", "missing: every pool needs a version and a weight")
    sources = [k for k in SOURCES if k in body]
    if len(sources) != 1:
        raise r.error(name_node, field, f"needs exactly one discovery source ({', '.join(SOURCES)}), got "
                      f"{', '.join(sources) or 'none'}")

    def get(key: str, check, *args, default=None):
        return check(body[key][1], f"{field}.{key}", *args) if key in body else default

    version_node = body["version"][1]
    version = r.scalar(version_node, f"{field}.version") if isinstance(version_node, yaml.ScalarNode) else None
    if isinstance(version, (int, float)) and not isinstance(version, bool):
        version = version_node.value  # `version: 2` or `1.10` means the text as written
    if not isinstance(version, str) or not version:
        raise r.error(version_node, f"{field}.version", f"must be a non-empty string, got {r.kind(version_node)}")
    if "model" in body and "models" in body:
        raise r.error(body["models"][0], f"{field}.models", "give `model` (one name) or `models` (a list), not both")
    models = (r.str_field(body["model"][1], f"{field}.model"),) if "model" in body else \
        r.names_field(body["models"][1], f"{field}.models", "model names") if "models" in body else ()
    adapters: tuple[tuple[str, str], ...] = ()
    if "adapters" in body:
        entries = r.mapping(body["adapters"][1], f"{field}.adapters", "a mapping of adapter name to its path")
        adapters = tuple((name, r.str_field(node, f"{field}.adapters.{name}")) for name, (_, node) in entries.items())
    values = dict(weight=get("weight", r.int_field, 0, False), models=models, adapters=adapters,
                  max_tokens_cap=get("max_tokens_cap", r.int_field, 1, True),
                  default_max_tokens=get("default_max_tokens", r.int_field, 1, True),
                  max_context_tokens=get("max_context_tokens", r.int_field, 1, True),
                  long_context=get("long_context", r.bool_field, default=False),
                  canary=get("canary", r.bool_field, default=False), role=get("role", r.str_field, default="both"),
                  slo_ttft_s=None if "slo_ttft_ms" not in body else get("slo_ttft_ms", r.number_field, 1.0) / 1000.0,
                  slo_tpot_s=None if "slo_tpot_ms" not in body else get("slo_tpot_ms", r.number_field, 1.0) / 1000.0,
                  slo_unattainable=get("slo_unattainable", r.str_field, default="refuse"))
    try:
        spec = PoolSpec(name=name, version=version, **values)
    except ConfigError as e:  # a rule between two fields (e.g. default above cap)
        raise r.error(body[e.field][1] if e.field in body else name_node, f"{field}.{e.field}", str(e)) from None
    engine = get("engine", r.str_field, default="auto")
    if engine not in ENGINE_TYPES:
        raise r.error(body["engine"][1], f"{field}.engine", f"must be one of {', '.join(ENGINE_TYPES)}, got {engine!r}")
    kv_events = None
    if "kv_events" in body:
        node = body["kv_events"][1]
        specs = ([r.str_field(item, f"{field}.kv_events[{i}]") for i, item in enumerate(node.value)]
                 if isinstance(node, yaml.SequenceNode) else [r.str_field(node, f"{field}.kv_events")])
        try:
            kv_events = VllmEventsConfig.parse(specs)
        except ConfigError as e:
            raise r.error(body["kv_events"][1], f"{field}.kv_events", str(e)) from None
        if engine == "kvfleet":
            raise r.error(body["kv_events"][1], f"{field}.kv_events", "kvfleet engines serve their KV events over "
                          "HTTP; kv_events (ZMQ) is for vllm and sglang pools")
    tokenizer = get("tokenizer", r.str_field)
    source_key = sources[0]
    return PoolConfig(spec, _source(r, source_key, body[source_key][1], f"{field}.{source_key}"), engine, kv_events,
                      tokenizer)


def _source(r: NodeReader, kind: str, node: yaml.Node, field: str) -> Source:
    if kind == "replicas":
        if not isinstance(node, yaml.SequenceNode) or not node.value:
            raise r.error(node, field, f"must be a non-empty list of replica URLs, got {r.kind(node)}")
        urls = []
        for i, item in enumerate(node.value):
            url = r.str_field(item, f"{field}[{i}]")
            try:
                urls.append(check_replica_url(url))
            except ConfigError as e:
                raise r.error(item, f"{field}[{i}]", str(e)) from None
        return StaticSource(tuple(dict.fromkeys(urls)))
    body = r.mapping(node, field, "a mapping")
    if kind == "dns":
        r.known(body, field, ("name", "port"), "dns has")
        if "name" not in body:
            raise r.error(node, f"{field}.name", "missing: the headless Service's DNS name")
        port = r.int_field(body["port"][1], f"{field}.port", 1, False) if "port" in body else 8000
        if port > 65535:
            raise r.error(body["port"][1], f"{field}.port", f"must be in 1..65535, got {port}")
        return DnsSource(r.str_field(body["name"][1], f"{field}.name"), port)
    r.known(body, field, ("service", "namespace", "port_name"), "k8s has")
    if "service" not in body:
        raise r.error(node, f"{field}.service", "missing: the Service whose EndpointSlices list the pool")
    opt = {k: r.str_field(body[k][1], f"{field}.{k}") for k in ("namespace", "port_name") if k in body}
    return K8sSource(r.str_field(body["service"][1], f"{field}.service"), **opt)


def _degradation(r: NodeReader, node: yaml.Node) -> DegradationSettings:
    field = "degradation"
    body = r.mapping(node, field, "a mapping of settings")
    r.known(body, field, DEGRADATION_FIELDS, "degradation has")
    thresholds: dict[str, float] = {}
    for signal in SIGNALS:
        if signal not in body:
            continue
        levels = r.mapping(body[signal][1], f"{field}.{signal}", "a mapping {trip: ..., clear: ...}")
        r.known(levels, f"{field}.{signal}", ("trip", "clear"), "a signal has")
        for level in ("trip", "clear"):
            if level in levels:
                thresholds[f"{signal}_{level}"] = r.number_field(levels[level][1], f"{field}.{signal}.{level}")
    for key in ("dwell_s", "max_tokens_factor"):
        if key in body:
            thresholds[key] = r.number_field(body[key][1], f"{field}.{key}")
    try:
        config = dataclasses.replace(DegradationConfig(), **thresholds)
    except ConfigError as e:
        signal = e.field.rsplit("_", 1)[0] if e.field.endswith(("_trip", "_clear")) else e.field
        where = body[signal][1] if signal in body else node
        raise r.error(where, f"{field}.{signal}", str(e)) from None
    default = DegradationSettings(config)

    def seconds(key: str, otherwise: float) -> float:
        return r.number_field(body[key][1], f"{field}.{key}", 0.001) if key in body else otherwise

    window_s, interval_s = seconds("window_s", default.window_s), seconds("interval_s", default.interval_s)
    min_requests = (r.int_field(body["min_requests"][1], f"{field}.min_requests", 1, False) if "min_requests" in body
                    else default.min_requests)
    return DegradationSettings(config, window_s=window_s, min_requests=min_requests, interval_s=interval_s)


class PoolsFile(WatchedFile[PoolsConfig]):
    """The pools file and the configuration last read from it (reloaded on change, see WatchedFile)."""

    def __init__(self, path: str, interval_s: float = 1.0, on_reload=None):
        super().__init__(path, parse_pools, "pools", interval_s, on_reload, PoolsConfig.describe)

