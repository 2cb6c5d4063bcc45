"""`kvfleet keys`: API keys for the tenants file, which holds only their sha256.

    kvfleet keys new                 # a fresh random key and its sha256
    echo -n "$KEY" | kvfleet keys hash   # the sha256 of a key (one per input line)
"""

from __future__ import annotations

import argparse
import getpass
import secrets
import sys

from router.tenants.registry import key_sha256


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvfleet keys", description="API keys for the router's tenants file "
                                "(--tenants), which lists only each key's sha256 under api_key_sha256.")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    h = sub.add_parser("hash", help="print the sha256 of a key", description="Print the lowercase hex sha256 of "
                       "each key, one per line: the value for api_key_sha256 in the tenants file. Keys come from "
                       "the argument, else from standard input (one key per line, surrounding whitespace "
                       "ignored), else from a prompt that does not echo.")
    h.add_argument("key", nargs="?", help="the key (beware: an argument is kept in shell history and shown by ps; "
                   "prefer standard input)")
    n = sub.add_parser("new", help="print a fresh random key and its sha256",
                       description="Print a fresh random key (secrets.token_urlsafe) on a `key:` line and its sha256 "
                       "on a `sha256:` line. Give the key to the client and put the sha256 in the tenants file; "
                       "the key is not stored anywhere.")
    n.add_argument("--bytes", type=int, default=32, help="random bytes in the key (default 32: 43 characters)")
    return p


def _keys(ns: argparse.Namespace) -> list[str]:
    if ns.key is not None:
        return [ns.key.strip()]
    if sys.stdin.isatty():
        return [getpass.getpass("API key: ").strip()]
    return [line.strip() for line in sys.stdin.read().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.action == "new":
        if ns.bytes < 16:
            parser.error(f"--bytes must be >= 16, got {ns.bytes}")
        key = secrets.token_urlsafe(ns.bytes)
        print(f"key: {key}\nsha256: {key_sha256(key)}")
        return 0
    keys = _keys(ns)
    if not keys or not all(keys):
        print("kvfleet keys hash: error: no key given", file=sys.stderr)
        return 2
    for key in keys:
        print(key_sha256(key))
    return 0


if __name__ == "__main__":
    sys.exit(main())
