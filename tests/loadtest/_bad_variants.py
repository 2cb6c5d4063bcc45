"""Deliberately bad variants of the engine's own paged decode kernel, for tests/loadtest/test_gpu_compile.py:
the Llama-3-8B bf16 split-kernel variant with its launch changed so that it spills registers (128-token tiles
on one warp) or overflows shared memory (256-token tiles, six pipeline stages). Prints loadtest.gpu_compile's
failure lines as JSON; exits 1 when there are any, as `python -m loadtest.gpu_compile` does.

    python -m tests.loadtest._bad_variants
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

BAD = {"spills": dict(BLOCK_N=128, num_warps=1), "overflows shared memory": dict(BLOCK_N=256, num_warps=8,
                                                                                 num_stages=6)}


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    from loadtest import gpu_compile

    base = next(v for _, v in gpu_compile.variants_for(90, ("llama3-8b",), ("bfloat16",))
                if v.kernel == "paged_decode_split")
    extra = [(f"bad-{what.replace(' ', '-')}", dataclasses.replace(base, meta=base.meta | change))
             for what, change in BAD.items()]
    rows = gpu_compile.run([90, 100], models=(), extra=extra)
    bad = gpu_compile.failures(rows)
    print(json.dumps({"failures": bad, "rows": len(rows)}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
