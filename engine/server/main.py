"""`kvfleet engine`: one engine replica behind an OpenAI-compatible HTTP server (uvicorn).

    kvfleet engine --model smollm2 --port 8001

Engine flags (incl. --served-model-name) come from `EngineArgs.add_cli_args`; the server adds
--host, --port, --instance-id, --internal-token, --require-internal-token, --drain-timeout,
--max-body-bytes, --sse-keepalive, --kv-pull-timeout, --kv-pull-max-bytes, --header-timeout, --body-timeout, --max-connections,
--log-level and --access-log. The model loads after the server is up (/health answers, /ready
says 503 until it is loaded). SIGTERM (or Ctrl-C) drains: /ready turns 503, new requests get 503,
running ones finish for up to --drain-timeout seconds, then the process exits 0; a second signal
exits at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import uvicorn

from serving import http_limits
from serving.draining import DrainingServer

logger = logging.getLogger("kvfleet.server")


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in containers)")
    g.add_argument("--port", type=int, default=8001, help="port to bind")
    g.add_argument("--instance-id", default=None,
                   help="this replica's id in KV events and metrics; default: HOSTNAME:PORT")
    g.add_argument("--internal-token", default=os.environ.get("KVFLEET_INTERNAL_TOKEN") or None,
                   help="bearer token required on /v1/kv/events (default: env KVFLEET_INTERNAL_TOKEN; none: open)")
    g.add_argument("--require-internal-token", action="store_true",
                   help="require the internal token on every endpoint except /health and /ready (401 without it), "
                   "so that only routers reach this engine; needs --internal-token")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests may take to finish after SIGTERM before they are aborted")
    g.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body accepted; larger ones get 413")
    g.add_argument("--sse-keepalive", type=float, default=10.0, metavar="SECONDS",
                   help="a stream that has sent nothing for this long (queued, prefilling, between tokens) sends an "
                   "SSE comment `: keep-alive`; 0: never")
    g.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests allowed to wait beyond --max-num-seqs; more get 429 + Retry-After (default: no limit)")
    http_limits.add_cli_args(g)
    g.add_argument("--kv-pull-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="how long a request may spend pulling its cached prefix from the peer a router names "
                        "before it is queued; what has not arrived by then is computed (0: pulls off)")
    g.add_argument("--kv-pull-max-bytes", type=int, default=2 * 1024 ** 3, metavar="BYTES",
                   help="the most KV payload one pull takes from a peer")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    g.add_argument("--access-log", action="store_true", help="log every HTTP request")


async def _drain(state, timeout: float) -> None:
    """The engine's drain (engine/server/app.py), then no more requests of any kind."""
    from engine.server.app import drain

    try:
        if state.engine is not None:
            await drain(state, timeout)
    finally:
        state.draining = True
        state.closing = True


def _names(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def main(argv: list[str] | None = None) -> int:
    from contract.errors import ConfigError
    from engine.args import EngineArgs
    from engine.model.registry import resolve_model

    parser = argparse.ArgumentParser(prog="kvfleet engine", description="Start one kvfleet engine replica.")
    EngineArgs.add_cli_args(parser)
    add_server_args(parser)
    ns = parser.parse_args(argv)
    try:
        engine_args = EngineArgs.from_cli(ns)
        resolve_model(engine_args.model, engine_args.allow_download)  # a wrong path fails here, before the server starts
        spec = engine_args.speculative_config
        if spec is not None and spec.model is not None:  # and a draft model's
            try:
                resolve_model(spec.model, engine_args.allow_download)
            except ValueError as e:
                raise ConfigError("--speculative-config", f"--speculative-config: model {spec.model!r}: {e}") from None
        if ns.max_queued_requests is not None and ns.max_queued_requests < 0:
            raise ConfigError("--max-queued-requests", f"--max-queued-requests must be >= 0, got {ns.max_queued_requests}")
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the core process loads the model while this one imports the server (torch, FastAPI: about two seconds)
    core = None
    if engine_args.engine_core == "process":
        from engine.core.process import ProcessCore

        core = ProcessCore(engine_args)
    try:
        from engine.server.app import build_app
        from engine.server.lora import LoRARegistry
        from engine.server.serving import ServerConfig

        config = ServerConfig(
            served_model_names=tuple(_names(ns.served_model_name) or [ns.model]),
            instance_id=ns.instance_id or f"{socket.gethostname()}:{ns.port}",
            internal_token=ns.internal_token, require_internal_token=ns.require_internal_token,
            drain_timeout=ns.drain_timeout, max_body_bytes=ns.max_body_bytes, sse_keepalive=ns.sse_keepalive,
            kv_pull_timeout=ns.kv_pull_timeout, kv_pull_max_bytes=ns.kv_pull_max_bytes)
        limits = http_limits.from_cli(ns)
        lora = LoRARegistry.from_args(engine_args, config.served_model_names)  # --lora-modules checked here
    except ValueError as e:
        if core is not None:
            core.kill()
        parser.error(str(e))

    def make_engine():
        from engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine(engine_args, max_queued_requests=ns.max_queued_requests, core=core)

    server: DrainingServer | None = None
    app = build_app(config, engine_factory=make_engine, on_load_error=lambda msg: server and server.fail(msg),
                    on_engine_dead=lambda msg: server and server.fail(msg), lora=lora)
    uv_config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level, access_log=ns.access_log,
                               timeout_graceful_shutdown=5, lifespan="on", http=http_limits.protocol_class(limits))
    server = DrainingServer(uv_config, lambda: _drain(app.state.server, ns.drain_timeout))
    server.run()
    # the server, the core and every stream are done: skip the interpreter's teardown of torch and its
    # libraries (most of a second), which only delays a rolling restart
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)


if __name__ == "__main__":
    sys.exit(main())
