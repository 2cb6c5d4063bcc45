"""`kvfleet epp`: the endpoint picker for the Gateway API Inference Extension (Envoy ext_proc over gRPC, port 9002
by convention). It takes the router's flags (the same placement, admission, tenants and pools; `kvfleet router
--help` describes them), static endpoints through `--replicas`, or an InferencePool's pods through
`--inference-pool`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from contract.errors import ConfigError
from router.epp.objectives import load_objectives
from router.epp.server import Picker
from router.epp.stream import PickerSettings
from router.main import build_parser, config_from_args, configure_logging

DEFAULT_PORT = 9002
DEFAULT_METRICS_PORT = 9090

log = logging.getLogger("kvfleet.epp")


def build_epp_parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog = "kvfleet epp"
    p.description = ("Endpoint picker for gateways that implement the Gateway API Inference Extension: each request "
                     "the gateway asks about (Envoy ext_proc) goes through the router's admission and placement core, "
                     "and the picker answers with the endpoint (and ordered fallbacks) that should serve it.")
    p.set_defaults(port=DEFAULT_PORT)
    g = p.add_argument_group("endpoint picker")
    g.add_argument("--fallbacks", type=int, default=2,
                   help="endpoints named after the primary, in the placement core's order, for the gateway to try "
                   "when the primary cannot be reached (default %(default)s)")
    g.add_argument("--inference-pool", metavar="NAME",
                   help="the InferencePool (inference.networking.k8s.io/v1) whose pods are the endpoints: its "
                   "selector and targetPorts, watched with its pods (each podIP:targetPort an endpoint)")
    g.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="HTTP port of /metrics (the router's kvfleet_router_* metrics) and /ready (default "
                   "%(default)s; -1: none)")
    g.add_argument("--objectives", metavar="FILE",
                   help="YAML list of InferenceObjectives ({name, priority}): a request's "
                   "x-llm-d-inference-objective header orders it in a full pool's fair queue (higher first)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_epp_parser()
    ns = p.parse_args(argv)
    if ns.fallbacks < 0:
        print(f"kvfleet epp: error: --fallbacks: must be >= 0, got {ns.fallbacks}", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(ns)
        objectives = load_objectives(ns.objectives) if ns.objectives else {}
        picker = Picker(cfg, PickerSettings(ns.fallbacks, objectives))
    except ConfigError as e:
        flag = e.field[:-2] if e.field.endswith("_s") else e.field
        print(f"kvfleet epp: error: --{flag.replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    configure_logging(ns.log_level)
    return asyncio.run(_serve(picker, ns.drain_timeout, None if ns.metrics_port < 0 else ns.metrics_port))


async def _serve(picker: Picker, drain_timeout: float, metrics_port: int | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        stop.set()
        if signals > 1:  # a second signal: exit at once
            raise SystemExit(1)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        await picker.start(metrics_port)
    except OSError as e:
        print(f"kvfleet epp: error: {e}", file=sys.stderr)
        await picker.stop()
        return 2
    print(f"kvfleet epp: listening on {picker.cfg.host}:{picker.port}"
          + (f", metrics on :{picker.metrics_port}" if picker.metrics_port else ""), flush=True)
    await stop.wait()
    with contextlib.suppress(Exception):
        await picker.drain(drain_timeout)
    await picker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
