"""Records the SGLang KV event frames that tests/router/routing/test_sglang_kv_events.py replays.

SGLang's engine does not run here (its CPU backend needs sgl-kernel built from SGLang's git repository; the
PyPI wheels are CUDA-only), so these frames are not from a live engine. They are encoded and served by SGLang's
own publishing code: its `KVEventBatch`/`BlockStored`/`BlockRemoved`/`AllBlocksCleared` msgspec classes and
its `ZmqEventPublisher` (PUB socket + ROUTER replay), from sglang/srt/disaggregation/kv_events.py of the
version below. The events are built as its radix cache's `KVCacheEventRecorder` builds them
(sglang/srt/mem_cache/events.py): one BlockStored per page, each chained on the previous page's hash,
`block_size` = the page's length, hashes = signed 64-bit ints taken from a sha256 chain, `cache_salt` and
`session_id` on every page of a salted request, token pairs for an EAGLE bigram page, one BlockRemoved per
evicted radix node listing its pages.

  live.msgpack         msgpack list of the live multipart frames [topic, seq(8 bytes), payload]
  replay_from_0.msgpack, replay_from_3.msgpack
                       the replay socket's answers as a DEALER receives them: [b"", topic, seq, payload],
                       the last with seq -1 (end marker)
  recording.json       SGLang's version, the page size, and the token ids of every request

Run from the repository root (a few seconds):
  pip install --no-deps --target /tmp/sgl sglang==0.5.23 msgspec
  /work/main/.venv/bin/python tests/router/routing/data/sglang_kv_events/record_frames.py --sglang-path /tmp/sgl
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
import time
import types
from pathlib import Path

import msgpack
import zmq

from deploy.ports import free_port

HERE = Path(__file__).resolve().parent
PAGE = 16
SGLANG_VERSION = "0.5.23"


def load_sglang_kv_events(path: Path) -> types.ModuleType:
    """sglang.srt.disaggregation.kv_events without importing the rest of SGLang (which needs CUDA packages):
    its package __init__s are skipped and the two helpers it imports for unrelated functions are stubbed."""
    sys.path.insert(0, str(path))
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path / name.replace(".", "/"))]
        sys.modules[name] = pkg
    ctx = types.ModuleType("sglang.srt.runtime_context")
    ctx.get_parallel = lambda: None
    net = types.ModuleType("sglang.srt.utils.network")
    net.NetworkAddress = None
    sys.modules.update({ctx.__name__: ctx, net.__name__: net})
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


def page_hashes(tokens: list, parent_hex: str | None, namespace: str | None = None) -> tuple[list[int], str]:
    """Per-page hashes as SGLang publishes them: a sha256 chain, each as a signed 64-bit int."""
    out = []
    for start in range(0, len(tokens), PAGE):
        h = hashlib.sha256((parent_hex or "").encode() + (namespace or "").encode()
                           + json.dumps(tokens[start:start + PAGE]).encode()).hexdigest()
        u = int(h[:16], 16)
        out.append(u - (1 << 64) if u >= 1 << 63 else u)
        parent_hex = h
    return out, parent_hex or ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sglang-path", type=Path, required=True, help="a --target dir holding sglang and msgspec")
    args = ap.parse_args()
    kv = load_sglang_kv_events(args.sglang_path)

    a = list(range(1000, 1048))  # 3 pages
    b = a[:32] + list(range(2000, 2016))  # shares A's first 2 pages, then 1 of its own
    d = list(range(4000, 4032))  # salted: 2 pages
    e = [[t, t + 1] for t in range(5000, 5016)]  # an EAGLE bigram page
    ha, _ = page_hashes(a, None)
    _, hex_a2 = page_hashes(a[:32], None)
    hb, _ = page_hashes(b[32:], hex_a2)
    hd, _ = page_hashes(d, None, "tenant-a")
    he, _ = page_hashes(e, None, "eagle")

    def stored(tokens: list, hashes: list[int], parent: int | None, **extra) -> list:
        events, prev = [], parent
        for i, h in enumerate(hashes):
            page = tokens[i * PAGE:(i + 1) * PAGE]
            events.append(kv.BlockStored(block_hashes=[h], parent_block_hash=prev, token_ids=page,
                                         block_size=len(page), lora_id=None, medium=kv.StorageMedium.GPU, **extra))
            prev = h
        return events

    steps = [
        stored(a, ha, None, session_id="s-a"),
        stored(b[32:], hb, ha[1], session_id="s-b"),
        stored(d, hd, None, cache_salt="tenant-a", session_id="s-d"),
        stored(e, he, None),
        [kv.BlockRemoved(block_hashes=[ha[2]], medium=kv.StorageMedium.GPU),  # A's leaf node (its page 2)
         kv.BlockRemoved(block_hashes=hb, medium=kv.StorageMedium.GPU)],
        [kv.BlockRemoved(block_hashes=[ha[0]], medium=kv.StorageMedium.CPU)],  # a host-tier removal
        [kv.AllBlocksCleared()],
        stored(a, ha, None),
    ]

    pub_port, replay_port = free_port(), free_port()
    publisher = kv.ZmqEventPublisher(attn_dp_rank=0, endpoint=f"tcp://*:{pub_port}",
                                     replay_endpoint=f"tcp://*:{replay_port}", topic="kv")
    zctx = zmq.Context.instance()
    sub = zctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    time.sleep(0.5)  # the slow-joiner: SUB must be connected before the first publish
    live = []
    for i, events in enumerate(steps):
        publisher.publish(kv.KVEventBatch(ts=1_700_000_000.0 + i, events=events))
        live.append(sub.recv_multipart())
    replays = {}
    for start in (0, 3):
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        msgs = []
        while True:
            msg = dealer.recv_multipart()
            msgs.append(msg)
            if msg[2] == kv.ZmqEventPublisher.END_SEQ:
                break
        dealer.close(linger=0)
        replays[start] = msgs
    publisher.shutdown()
    sub.close(linger=0)

    (HERE / "live.msgpack").write_bytes(msgpack.packb(live, use_bin_type=True))
    for start, msgs in replays.items():
        (HERE / f"replay_from_{start}.msgpack").write_bytes(msgpack.packb(msgs, use_bin_type=True))
    (HERE / "recording.json").write_text(json.dumps({
        "sglang": f"sglang {SGLANG_VERSION} (kv_events.py: msgspec classes and ZmqEventPublisher)",
        "page_size": PAGE, "topic": "kv",
        "requests": {"A": a, "B": b, "D": d, "D_cache_salt": "tenant-a", "E_bigram": e},
        "steps": ["A stored (3 pages)", "B's own page, chained on A's page 1", "D salted (2 pages)",
                  "E bigram page", "A's page 2 and B's page removed", "A's page 0 removed from the CPU tier",
                  "all cleared", "A stored again"],
    }, indent=1) + "\n")
    print(f"recorded {len(live)} batches with SGLang {SGLANG_VERSION}'s publisher")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
