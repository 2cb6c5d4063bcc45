"""Rewrite tests/file_seconds.json (each test file's seconds, which tests/conftest.py runs longest first) from a
pytest `--junitxml` report of a default run:

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/junit.xml
    .venv/bin/python -m tests.file_seconds /tmp/junit.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

OUT = Path(__file__).with_name("file_seconds.json")


def file_seconds(report: str) -> dict[str, float]:
    """Per test file (its path from the repository root), the seconds of its tests (setup and teardown included)."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "")
        parts = module.split(".")
        # classname is the dotted module, plus the class for tests in a class: keep the part that names a file
        for end in range(len(parts), 0, -1):
            path = "/".join(parts[:end]) + ".py"
            if Path(path).is_file():
                totals[path] += float(case.get("time", 0.0))
                break
    return dict(sorted(((k, round(v, 1)) for k, v in totals.items()), key=lambda kv: -kv[1]))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.file_seconds JUNIT_XML", file=sys.stderr)
        return 2
    seconds = file_seconds(argv[0])
    OUT.write_text(json.dumps(seconds, indent=0) + "\n", encoding="utf-8")
    print(f"{OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
