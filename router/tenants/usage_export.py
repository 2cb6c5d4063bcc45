"""`kvfleet usage export`: every tenant's usage records (router/tenants/ledger.py) from the routers' Redis, as JSON
Lines or CSV, for billing and reconciliation.

    kvfleet usage export --redis-url redis://redis:6379/0 --tenants tenants.yaml --since 1796000000 --format csv

Tenants are those the tenants file names (the ledger's streams are per tenant); records come oldest first per
tenant, one per settled request, with every field of the record (in CSV a missing value is empty, and
`cached_by_tier` is its JSON object's text). Without `--output` they go to standard output.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import sys
import time
from dataclasses import fields
from typing import TextIO

from router.config_file import ConfigFileError
from router.tenants.file import load_tenants
from router.tenants.ledger import UsageRecord
from router.tenants.redis_store import RedisStore
from router.tenants.store import StoreError

COLUMNS = [f.name for f in fields(UsageRecord)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet usage", description="The usage ledger of the routers' tenants.")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    e = sub.add_parser("export", help="every record from --since to --until, as JSON Lines or CSV")
    e.add_argument("--redis-url", required=True, help="the Redis the routers share (their --redis-url)")
    e.add_argument("--tenants", required=True, help="the routers' tenants file: whose records to export")
    e.add_argument("--since", type=float, default=0.0, help="Unix seconds (default: the beginning)")
    e.add_argument("--until", type=float, default=None, help="Unix seconds, exclusive (default: now)")
    e.add_argument("--format", choices=("jsonl", "csv"), default="jsonl")
    e.add_argument("--output", default="-", help="a file to write (default: standard output)")
    return p


def write(records: list[UsageRecord], out: TextIO, fmt: str) -> None:
    if fmt == "jsonl":
        for r in records:
            out.write(r.to_json() + "\n")
        return
    w = csv.writer(out)
    w.writerow(COLUMNS)
    for r in records:
        row = json.loads(r.to_json())
        w.writerow([cell(row[c]) for c in COLUMNS])


def cell(value) -> str | int | float:
    """A record's field as a CSV cell: None empty, a mapping its compact JSON text, a number or text as it is."""
    if value is None:
        return ""
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    return value


async def collect(url: str, tenants: list[str], since: float, until: float) -> list[UsageRecord]:
    store = RedisStore.from_url(url, timeout_s=5.0)
    try:
        out = []
        for t in tenants:
            out += [UsageRecord.from_json(r) for r in await store.records(t, since, until)]
        return out
    finally:
        await store.close()


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    until = time.time() + 1 if ns.until is None else ns.until
    if until <= ns.since:
        print("kvfleet usage export: error: --until must be after --since", file=sys.stderr)
        return 2
    try:
        tenants = list(load_tenants(ns.tenants).tenants)
    except ConfigFileError as e:
        print(f"kvfleet usage export: error: --tenants: {e}", file=sys.stderr)
        return 2
    try:
        records = asyncio.run(collect(ns.redis_url, tenants, ns.since, until))
    except (StoreError, ValueError) as e:
        print(f"kvfleet usage export: error: --redis-url: {e}", file=sys.stderr)
        return 1
    if ns.output == "-":
        write(records, sys.stdout, ns.format)
    else:
        with open(ns.output, "w", newline="") as f:
            write(records, f, ns.format)
    print(f"{len(records)} records of {len(tenants)} tenants", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
