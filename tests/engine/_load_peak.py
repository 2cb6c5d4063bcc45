"""Run as a script: load a checkpoint in bf16 on the CPU and print, as JSON, the model's bytes and the peak
growth of this process's anonymous resident memory while loading (sampled every 0.5 ms).

Run it with MALLOC_PERTURB_ set (glibc then writes every allocation, so memory that is allocated counts as
resident, as it would on a GPU, even if never touched) and a fixed MALLOC_MMAP_THRESHOLD_ (large blocks go
back to the system when freed). A small checkpoint is loaded first, so lazy initialisation is not counted.

    python tests/engine/_load_peak.py BIG_CHECKPOINT WARMUP_CHECKPOINT
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from engine.model.loader import load_model
from engine.model.registry import resolve_model


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(big: str, warmup: str) -> None:
    load_model(resolve_model(warmup), torch.bfloat16, "cpu", cpu_prepack=False)
    source = resolve_model(big)
    base = rss_anon()
    peak = [base]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.monotonic()
    model, _ = load_model(source, torch.bfloat16, "cpu", cpu_prepack=False)
    seconds = time.monotonic() - start
    done.set()
    watcher.join()
    peak[0] = max(peak[0], rss_anon())
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    print(json.dumps({"model_bytes": size, "peak_delta": peak[0] - base, "seconds": seconds, "dtypes": dtypes}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
