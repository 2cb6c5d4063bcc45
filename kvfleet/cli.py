"""The `kvfleet` command: `engine`, `router`, `up` and friends, each in its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "engine": ("engine.server.main", "start one engine replica (OpenAI API, metrics, KV events)"),
    "router": ("router.main", "start a KV-aware router in front of engine replicas"),
    "epp": ("router.epp.main", "start an endpoint picker (Gateway API Inference Extension, Envoy ext_proc) for a gateway"),
    "up": ("deploy.local", "start a router and N engine replicas of the bundled model on this machine"),
    "ray": ("deploy.ray.cli", "kvfleet on Ray Serve: `kvfleet ray up` runs deploy/ray/serve_config.yaml locally"),
    "sim": ("kvfleet.sim.main", "simulate a fleet: a trace through the router's policies over modelled engines"),
    "keys": ("router.tenants.keys", "API keys for the router's tenants file: hash a key, or make a new one"),
    "usage": ("router.tenants.usage_export", "the usage ledger: export every tenant's records (JSON Lines or CSV)"),
    "bench": ("kvfleet.bench.cli", "load an OpenAI-compatible endpoint (presets, traces, rates) and report it"),
    "profile": ("kvfleet.profile", "profile a JSONL trace: lengths, multi-turn and shared-prefix shares, burstiness"),
    "capacity": ("kvfleet.capacity", "KV bytes per token, sequences that fit, replicas for a target rate"),
    "plan": ("kvfleet.plan", "the fewest replicas that meet TTFT / TPOT targets at a rate, by simulation"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvfleet", description="KV-aware LLM serving.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.print_help() if not argv or argv[0] in ("-h", "--help") else parser.parse_args(argv)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)

