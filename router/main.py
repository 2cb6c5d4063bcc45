"""`kvfleet router`: parse flags into a RouterConfig and serve the router with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from contract.errors import ConfigError
from router.config import (
    DISCOVERY_KINDS,
    ENGINE_TYPES,
    RateLimitConfig,
    RouterConfig,
    ScoringConfig,
    SheddingConfig,
    VllmEventsConfig,
)
from router.routing.policies import POLICIES
from serving import http_limits


def build_parser() -> argparse.ArgumentParser:
    d = RouterConfig.__dataclass_fields__
    s = ScoringConfig()
    p = argparse.ArgumentParser(prog="kvfleet router", description="KV-aware router in front of engine replicas "
                                "(OpenAI API). Routes each request to the replica whose prefix cache holds most of "
                                "its prompt, weighed against load.")
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument("--policy", default=d["policy"].default, choices=list(POLICIES),
                   help="how each request picks a replica (default kv: the prefix-cache hit predicted from the "
                   "engines' KV events, weighed against load; the others are described in the README)")
    p.add_argument("--model", default=d["model"].default,
                   help="the tokenizer and chat template of models that have no other (pools file `tokenizer:`, "
                   "--tokenizer-from-engines): the prompt tokens of a single-model fleet, for prefix matching")
    p.add_argument("--tokenizer-from-engines", action="store_true",
                   help="fetch the tokenizer and chat template from the first ready engine "
                   "(GET /v1/kvfleet/tokenizer) instead of loading --model here: the router needs no model "
                   "files; /ready says 503 until it has it")
    p.add_argument("--default-model", metavar="MODEL",
                   help="the model of requests that name none (without it they get 400, as OpenAI answers); "
                   "a request's `model` chooses among the pools that serve it, an unknown one gets 404")
    p.add_argument("--engine-type", default=d["engine_type"].default, choices=ENGINE_TYPES,
                   help="what the replicas are: auto (default: readiness from /ready, else /health; the exact "
                   "index from kvfleet KV events where an engine serves them, else the approximate index), "
                   "kvfleet, or vllm / sglang (readiness from /health, no kvfleet KV event stream)")
    p.add_argument("--vllm-kv-events", action="append", default=[], metavar="SPEC",
                   help="vLLM (and SGLang) engines started with --kv-events-config publish their KV cache over "
                   "ZMQ; the router "
                   "mirrors it into its exact index: tcp://{host}:5557|tcp://{host}:5558 (publisher|replay, "
                   "{host} = each replica's host) or REPLICA_URL=tcp://...|tcp://... for one replica (repeatable)")
    p.add_argument("--discovery", default=None, choices=DISCOVERY_KINDS,
                   help="static (--replicas), dns (--dns-name) or k8s (--k8s-service); default from the flags given")
    p.add_argument("--replicas", default="", help="comma-separated replica base URLs, e.g. "
                   "http://127.0.0.1:8001,http://127.0.0.1:8002")
    p.add_argument("--dns-name", help="headless Service DNS name; every A record is a replica")
    p.add_argument("--dns-port", type=int, default=d["dns_port"].default)
    p.add_argument("--dns-interval", type=float, default=d["dns_interval_s"].default, dest="dns_interval_s")
    p.add_argument("--dns-nameserver", help="ip[:port] of the DNS server (default: the system resolver)")
    p.add_argument("--k8s-service")
    p.add_argument("--k8s-namespace", default=os.environ.get("POD_NAMESPACE", d["k8s_namespace"].default))
    p.add_argument("--k8s-port-name")
    p.add_argument("--scheme", default=d["scheme"].default)
    p.add_argument("--health-interval", type=float, default=d["health_interval_s"].default, dest="health_interval_s")
    p.add_argument("--scrape-interval", type=float, default=d["scrape_interval_s"].default, dest="scrape_interval_s")
    p.add_argument("--scrape-stale", type=float, default=d["scrape_stale_s"].default, dest="scrape_stale_s",
                   help="seconds after which a replica's scraped load counts as unknown")
    p.add_argument("--kv-heartbeat-timeout", type=float, default=d["kv_heartbeat_timeout_s"].default,
                   dest="kv_heartbeat_timeout_s", help="seconds of silence after which a KV event stream is resynced")
    p.add_argument("--block-size", type=int, default=d["block_size"].default,
                   help="block size for the approximate index (the exact index uses each engine's own)")
    p.add_argument("--hash-seed", type=int, default=d["hash_seed"].default)
    p.add_argument("--approx-max-blocks", type=int, default=d["approx_max_blocks"].default)
    p.add_argument("--breaker-failures", type=int, default=d["breaker_failures"].default)
    p.add_argument("--breaker-open", type=float, default=d["breaker_open_s"].default, dest="breaker_open_s")
    p.add_argument("--max-attempts", type=int, default=d["max_attempts"].default,
                   help="attempts per request, each on another replica, while none has sent a byte (connection "
                   "errors, 502/503/504, 429 queue full)")
    p.add_argument("--max-migrations", type=int, default=d["max_migrations"].default,
                   help="times a stream may move to another replica of its pool when its replica fails after "
                   "tokens went out (the client sees one stream; see docs/router.md); 0: never, the stream ends "
                   "with an error event (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=d["request_timeout_s"].default, dest="request_timeout_s")
    p.add_argument("--internal-token", default=os.environ.get("KVFLEET_INTERNAL_TOKEN"),
                   help="bearer token for the engines' KV event endpoint (env KVFLEET_INTERNAL_TOKEN)")
    p.add_argument("--kv-token-cost", type=float, default=s.kv_token_cost,
                   help="cost of one KV-cache token held by running requests, in prefill tokens")
    p.add_argument("--prefill-weight", type=float, default=s.prefill_weight,
                   help="weight of the prefill a request would add (its uncached prompt) against the prefill "
                        "queued ahead of it")
    p.add_argument("--waiting-cost-tokens", type=float, default=s.waiting_cost_tokens,
                   help="cost of one waiting request this router did not send, in prefill-token equivalents")
    p.add_argument("--running-cost-tokens", type=float, default=s.running_cost_tokens,
                   help="cost of one running request on a replica, in prefill-token equivalents")
    p.add_argument("--pull-token-cost", type=_pull_cost, default="auto",
                   help="cost of pulling one cached prompt token from a peer replica instead of prefilling it, in "
                        "prefill tokens (loadtest/kv_transfer_bench.py measures it; 0: no pulls), or `auto` (the "
                        "default): measured from the engines' prefill and pull rates (0.05 until both are known). "
                        "With it, a replica chosen for its load pulls the prefix another replica holds (between "
                        "kvfleet engines only; `auto` means no pulls with --engine-type vllm or sglang)")
    p.add_argument("--pull-fixed-tokens", type=float, default=s.pull_fixed_tokens,
                   help="fixed cost of one pull (its set-up), in prefill tokens")
    p.add_argument("--tier-token-cost", type=float, default=s.tier_token_cost,
                   help="cost of reloading one prompt token a replica's lower KV tier holds (engine --kv-tier-gib), "
                        "in prefill tokens (default %(default)s)")
    p.add_argument("--overload-waiting", type=int, default=s.overload_waiting)
    p.add_argument("--overload-kv-usage", type=float, default=s.overload_kv_usage)
    p.add_argument("--pools", metavar="FILE", help="engine pools YAML: per pool its replicas (static, DNS or "
                   "Kubernetes), version label, canary weight, max_tokens limits, context limit, and the automatic "
                   "degradation thresholds; reloaded when it changes (see docs/router.md). Instead of --replicas, "
                   "--dns-name, --k8s-service")
    q = p.add_argument_group("fair queuing when a pool is full")
    q.add_argument("--replica-slots", type=int, default=d["replica_slots"].default, metavar="N",
                   help="requests each replica holds (running + waiting) before the router keeps the next ones in a "
                   "fair queue across tenants (Virtual Token Counter; tenants' `weight`), sending them as room frees; "
                   "set it to the engines' --max-num-seqs (default 0: no queue, everything goes straight on)")
    q.add_argument("--forward-priority", action="store_true",
                   help="send each tenant's priority to the engines as the request's `priority` field (vLLM's "
                   "convention, lower first: the tenant's priority negated) unless the client set one; for engines "
                   "that accept it: kvfleet's always (it orders by it with --scheduling-policy priority), vLLM and "
                   "SGLang only with their priority scheduling on")
    q.add_argument("--queue-timeout", type=float, default=d["queue_timeout_s"].default, dest="queue_timeout_s",
                   help="seconds a request may wait in the queue before it gets 503 + Retry-After (default %(default)s)")
    q.add_argument("--queue-max-per-tenant", type=int, default=d["queue_max_per_tenant"].default,
                   help="queued requests per tenant and pool; past it 429 + Retry-After (default %(default)s)")
    q.add_argument("--queue-max-total", type=int, default=d["queue_max_total"].default,
                   help="queued requests per pool in all; past it 429 + Retry-After (default %(default)s)")
    sh = SheddingConfig()
    g = p.add_argument_group("tenants and token budgets")
    g.add_argument("--tenants", metavar="FILE", help="tenants YAML (API key hashes, tokens_per_minute, limits, "
                   "priority, isolate_cache), reloaded when it changes; without it every request is admitted "
                   "with no key (see docs/router.md)")
    g.add_argument("--redis-url", default=os.environ.get("KVFLEET_REDIS_URL"),
                   help="redis://HOST:PORT/DB holding the budgets every router replica shares (env "
                   "KVFLEET_REDIS_URL); without it, budgets live in this router's memory")
    g.add_argument("--ratelimit-on-store-error", choices=("open", "closed"), default="open",
                   help="when Redis fails: open = local limits (each tenant's budget divided by the routers last "
                   "seen), closed = 503 (default open)")
    g.add_argument("--usage-reconcile-after", type=float, default=3600.0, dest="usage_reconcile_after_s",
                   help="seconds after admission from which a request no router has settled (its router died) goes "
                   "to the usage ledger with what its engine says it used, or its whole reservation where the engine "
                   "does not know it (with --redis-url; default 3600; looked for every 10 s, or every heartbeat "
                   "when this is shorter)")
    g.add_argument("--shed-kv-high", type=float, default=sh.kv_high,
                   help="fleet KV usage from which, with --shed-waiting-high waiting requests per replica, the "
                   "expensive requests of the lowest-priority tenants get 503 + Retry-After")
    g.add_argument("--shed-waiting-high", type=float, default=sh.waiting_high)
    g.add_argument("--shed-min-cost-tokens", type=int, default=sh.min_cost_tokens,
                   help="a request reserving at least this many tokens (prompt + n x max_tokens) is expensive")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM: seconds running requests (streams too) may take to finish; meanwhile /ready "
                   "is 503 and new requests get 503 + Retry-After (a second signal exits at once)")
    conn = p.add_argument_group("client connections")
    conn.add_argument("--max-body-bytes", type=int, default=d["max_body_bytes"].default,
                      help="largest request body accepted; larger ones get 413 (default %(default)s)")
    http_limits.add_cli_args(conn)
    p.add_argument("--log-level", default="info")
    p.add_argument("--access-log", action="store_true",
                   help="log one INFO line per proxied request: method, path, status, replica, latency, "
                   "predicted cached tokens, retries")
    return p


AUTO_PULL_PRIOR = 0.05  # --pull-token-cost auto: the cost until the engines' rates are known


def _pull_cost(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of prefill tokens or `auto`, got {text!r}") from None


def config_from_args(ns: argparse.Namespace) -> RouterConfig:
    replicas = tuple(u.strip().rstrip("/") for u in ns.replicas.split(",") if u.strip())
    inference_pool = getattr(ns, "inference_pool", None)  # kvfleet epp's flag
    discovery = ns.discovery or ("dns" if ns.dns_name else "k8s" if ns.k8s_service
                                 else "inference-pool" if inference_pool else "static")
    auto_pulls = ns.pull_token_cost == "auto" and ns.engine_type not in ("vllm", "sglang")
    pull_cost = (AUTO_PULL_PRIOR if auto_pulls else 0.0) if ns.pull_token_cost == "auto" else ns.pull_token_cost
    scoring = ScoringConfig(kv_token_cost=ns.kv_token_cost, prefill_weight=ns.prefill_weight,
                            waiting_cost_tokens=ns.waiting_cost_tokens,
                            running_cost_tokens=ns.running_cost_tokens,
                            pull_token_cost=pull_cost, pull_cost_measured=auto_pulls,
                            pull_fixed_tokens=ns.pull_fixed_tokens,
                            tier_token_cost=ns.tier_token_cost,
                            overload_waiting=ns.overload_waiting,
                            overload_kv_usage=ns.overload_kv_usage)
    return RouterConfig(
        host=ns.host, port=ns.port, policy=ns.policy, model=ns.model or None,
        tokenizer_from_engines=ns.tokenizer_from_engines, default_model=ns.default_model, engine_type=ns.engine_type, discovery=discovery,
        replicas=replicas, dns_name=ns.dns_name, dns_port=ns.dns_port, dns_interval_s=ns.dns_interval_s,
        dns_nameserver=ns.dns_nameserver, k8s_service=ns.k8s_service, k8s_namespace=ns.k8s_namespace,
        k8s_port_name=ns.k8s_port_name, inference_pool=inference_pool, scheme=ns.scheme, health_interval_s=ns.health_interval_s,
        scrape_interval_s=ns.scrape_interval_s, scrape_stale_s=ns.scrape_stale_s,
        kv_heartbeat_timeout_s=ns.kv_heartbeat_timeout_s, block_size=ns.block_size,
        hash_seed=ns.hash_seed, approx_max_blocks=ns.approx_max_blocks, breaker_failures=ns.breaker_failures,
        breaker_open_s=ns.breaker_open_s, max_attempts=ns.max_attempts, request_timeout_s=ns.request_timeout_s,
        max_migrations=ns.max_migrations,
        internal_token=ns.internal_token, max_body_bytes=ns.max_body_bytes, access_log=ns.access_log, pools_file=ns.pools, scoring=scoring,
        replica_slots=ns.replica_slots, forward_priority=ns.forward_priority, queue_timeout_s=ns.queue_timeout_s,
        queue_max_per_tenant=ns.queue_max_per_tenant, queue_max_total=ns.queue_max_total,
        vllm_events=VllmEventsConfig.parse(ns.vllm_kv_events),
        ratelimit=RateLimitConfig(tenants_file=ns.tenants, redis_url=ns.redis_url or None,
                                  on_store_error=ns.ratelimit_on_store_error,
                                  usage_reconcile_after_s=ns.usage_reconcile_after_s,
                                  shedding=SheddingConfig(kv_high=ns.shed_kv_high, waiting_high=ns.shed_waiting_high,
                                                          min_cost_tokens=ns.shed_min_cost_tokens)))


def configure_logging(level: str) -> None:
    """Root logging at `level`; httpx/httpcore (health checks, scrapes: two lines per replica per second at
    INFO) only from WARNING up, unless `level` is debug."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(ns)
    except ConfigError as e:
        flag = e.field[:-2] if e.field.endswith("_s") else e.field
        print(f"kvfleet router: error: --{flag.replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    try:
        limits = http_limits.from_cli(ns)
    except ConfigError as e:
        print(f"kvfleet router: error: {e}", file=sys.stderr)
        return 2
    configure_logging(ns.log_level)
    import uvicorn

    from router.http.app import RouterApp

    try:
        app = RouterApp(cfg)
    except ConfigError as e:  # a bad tenants or pools file: its message names the file and line
        print(f"kvfleet router: error: {e}", file=sys.stderr)
        return 2
    if not ns.drain_timeout >= 0:
        print(f"kvfleet router: error: --drain-timeout: must be >= 0, got {ns.drain_timeout}", file=sys.stderr)
        return 2
    from serving.draining import DrainingServer

    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=ns.log_level.lower(), access_log=False,
                            lifespan="on", loop="uvloop", http=http_limits.protocol_class(limits),
                            timeout_graceful_shutdown=5)
    server = DrainingServer(config, lambda: app.drain(ns.drain_timeout))
    server.run()
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
