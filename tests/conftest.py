"""Test files run longest first: `make test` gives two workers a file at a time (`--dist loadfile`), and a long file
started last keeps one worker busy while the other has nothing left. Each file's seconds are those of a measured
run (tests/file_seconds.json: `python -m tests.file_seconds JUNIT_XML` rewrites it from a `--junitxml` report);
files it does not list come after, in their collection order. The Makefile passes `--no-loadscope-reorder`, or
xdist would reorder the files by their number of tests."""

from __future__ import annotations

import json
from pathlib import Path

SECONDS = Path(__file__).with_name("file_seconds.json")


def pytest_collection_modifyitems(config, items) -> None:
    try:
        seconds: dict[str, float] = json.loads(SECONDS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::", 1)[0], i)
    items.sort(key=lambda item: (-seconds.get(f := item.nodeid.split("::", 1)[0], 0.0), first_seen[f]))
