"""A fast fake engine: the kvfleet engine's HTTP surface without a model, for router tests and the router
overhead benchmark.

It speaks the same wire formats (OpenAI chat/completions with SSE streaming and `usage` incl.
`prompt_tokens_details.cached_tokens`, `/ready`, `/health`, `/metrics` with vLLM names, NDJSON KV events) and
keeps a real prefix cache index for `/v1/completions` requests whose prompt is a list of token ids (chained
block hashes from contract/hashing.py), so KV-aware routing can be tested without a model. Behaviour per
request comes from headers: `x-fake-delay-ms` (before the first byte), `x-fake-chunks`, `x-fake-chunk-delay-ms`,
`x-fake-break-after` (drop the connection after N chunks; = the chunks: before `[DONE]`), `x-fake-error-after`
(after N chunks an SSE error event of status `x-fake-error-status`, default 503, then `[DONE]`: an engine whose
core died), `x-fake-status` (answer with this status),
`x-fake-keepalives` (SSE comments `: keep-alive` sent before the first chunk of a stream, one per
`x-fake-keepalive-ms`). With `return_token_ids` (contract/token_ids.py) every streamed choice carries its token
id (100 + its position) and the first chunk the prompt's ids (the request's token ids, else 1..8).
Per process: `--fail-status` (every completion answers it), `--no-kv-events` (404, like a third-party engine),
`--flavor vllm|sglang` (no /ready and no KV events, like those engines; sglang exports SGLang's metric names),
`--delay-ms` (before every response's first byte), `--oom-events` (its `kvfleet:oom_events_total`),
`--max-running N` (like an engine's max_num_seqs: more requests wait first come, first served, and count as
waiting in /metrics);
`POST /fake/set?delay_ms=..&oom_events=..&fail_status=..` changes those three at run time. A request's
`max_tokens` caps its chunks.
`POST /v1/kvfleet/usage/lookup` (contract/usage_lookup.py) answers what each request sent under an
`x-request-id` used (its prompt, cached and sent tokens; `aborted` where its client went away), the last
100,000 of them (flavor kvfleet only: the others answer 404, as vLLM and SGLang do).
`GET /fake/stats` reports requests served, cancelled streams and the event sequence; `POST /fake/skip-seq`
makes the event stream skip a sequence number (to test resync); `POST /fake/clear` clears the cache.

    python -m loadtest.fake_engine --port 8101 --instance-id a
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from contract.cacheable import cacheable_blocks
from contract.errors import error_body, error_type
from contract.hashing import DEFAULT_HASH_SEED, hash_blocks
from contract.kv_events import Heartbeat, KVEvent, KVEventKind, Snapshot
from contract.kv_wire import encode_line
from contract.request import max_tokens_of
from contract.usage_lookup import PATH as USAGE_LOOKUP
from contract.usage_lookup import RUNNING, UNKNOWN

USAGE_KEPT = 100_000


class FakeEngine:
    def __init__(self, ns: argparse.Namespace):
        self.ns = ns
        self.block_size = ns.block_size
        self.cached: set[int] = set()
        self.seq = 0
        self.subscribers: list[asyncio.Queue] = []
        self.stats = {"requests": 0, "cancelled": 0, "completed": 0, "running": 0, "prefix_queries": 0,
                      "prefix_hits": 0, "last_max_tokens": None, "last_priority": None}
        self.ready = True
        self.slots: asyncio.Semaphore | None = None  # --max-running (made on first use, in the server's loop)
        self.queued = 0
        self.adapters: dict[str, None] = dict.fromkeys(ns.lora_modules or ())  # LoRA adapters it holds
        self.stats.update(lora_requests=0, lora_loads=0, lora_by_adapter={})
        self.usage: dict[str, dict] = {}  # router request id -> what it used, oldest first (the usage lookup)

    # -- KV cache ------------------------------------------------------------------------------------------
    def _publish(self, kind: KVEventKind, block_hashes: tuple[int, ...] = ()) -> None:
        self.seq += 1
        event = KVEvent(self.seq, kind, block_hashes)
        for q in self.subscribers:
            q.put_nowait(event)

    def admit(self, tokens: list[int] | None, salt: str | None, adapter: str | None = None) -> int:
        """Cached prompt tokens of this request; stores its full blocks (publishing `stored`)."""
        if not tokens:
            return 0
        bs = self.block_size
        hashes = hash_blocks(tokens, bs, salt, DEFAULT_HASH_SEED, adapter=adapter)
        hit = 0
        for h in hashes[: cacheable_blocks(len(tokens), bs)]:
            if h not in self.cached:
                break
            hit += 1
        self.stats["prefix_queries"] += len(tokens)
        self.stats["prefix_hits"] += hit * bs
        new = [h for h in hashes if h not in self.cached]
        if new:
            self.cached.update(new)
            if not self.ns.no_kv_events:
                self._publish(KVEventKind.STORED, tuple(new))
        return hit * bs

    # -- ASGI ----------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            await self.completion(scope, receive, send, path)
        elif path == "/ready" and self.ns.flavor != "kvfleet":
            await _json(send, 404, {"detail": "Not Found"})
        elif path == "/ready":
            await _json(send, 200 if self.ready else 503, {"status": "ready" if self.ready else "not ready"})
        elif path == "/health":
            await _json(send, 200, {"status": "ok"})
        elif path == "/metrics":
            await _send(send, 200, self.metrics().encode(), b"text/plain; version=0.0.4")
        elif path == "/v1/models":
            await asyncio.sleep(self.ns.models_delay_ms / 1000)
            await _json(send, 200, {"object": "list", "data": [{"id": self.ns.model, "object": "model",
                                                                 "created": 0, "owned_by": "fake", "parent": None}]
                                    + [{"id": a, "object": "model", "created": 0, "owned_by": "fake",
                                        "parent": self.ns.model, "root": f"/adapters/{a}"} for a in self.adapters]})
        elif path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            await self.lora_endpoint(receive, send, path)
        elif path == "/v1/kv/events":
            await self.kv_events(receive, send)
        elif path == USAGE_LOOKUP and self.ns.flavor == "kvfleet":
            ids = json.loads(await _read_body(receive)).get("request_ids") or []
            await _json(send, 200, {"object": "kvfleet.usage_lookup", "data": {
                i: self.usage.get(i, UNKNOWN) for i in ids}})
        elif path == "/fake/stats":
            await _json(send, 200, {**self.stats, "seq": self.seq, "cached_blocks": len(self.cached)})
        elif path == "/fake/skip-seq":
            self.seq += 1
            await _json(send, 200, {"seq": self.seq})
        elif path == "/fake/clear":
            self.cached.clear()
            self._publish(KVEventKind.CLEARED)
            await _json(send, 200, {"seq": self.seq})
        elif path == "/fake/set":
            for item in scope["query_string"].decode().split("&"):
                key, _, value = item.partition("=")
                if key in ("delay_ms", "oom_events"):
                    setattr(self.ns, key, float(value))
                elif key == "fail_status":
                    self.ns.fail_status = int(value)
            await _json(send, 200, {"delay_ms": self.ns.delay_ms, "oom_events": self.ns.oom_events,
                                    "fail_status": self.ns.fail_status})
        elif path == "/fake/ready":
            self.ready = scope["query_string"] != b"0"
            await _json(send, 200, {"ready": self.ready})
        else:
            await _json(send, 404, error_body(f"no route {path}", error_type(404)))

    def metrics(self) -> str:
        n = self.ns.model
        if self.ns.flavor == "sglang":
            return (f'sglang:num_running_reqs{{model_name="{n}"}} {self.stats["running"]}\n'
                    f'sglang:num_queue_reqs{{model_name="{n}"}} {self.ns.waiting + self.queued}\n'
                    f'sglang:token_usage{{model_name="{n}"}} {self.ns.kv_usage}\n')
        return (f'vllm:num_requests_running{{model_name="{n}"}} {self.stats["running"]}\n'
                f'vllm:num_requests_waiting{{model_name="{n}"}} {self.ns.waiting + self.queued}\n'
                f'vllm:kv_cache_usage_perc{{model_name="{n}"}} {self.ns.kv_usage}\n'
                f'vllm:prefix_cache_queries_total{{model_name="{n}"}} {self.stats["prefix_queries"]}\n'
                f'vllm:prefix_cache_hits_total{{model_name="{n}"}} {self.stats["prefix_hits"]}\n'
                + (f'kvfleet:oom_events_total{{model_name="{n}"}} {self.ns.oom_events}\n'
                   if self.ns.flavor == "kvfleet" else ""))

    async def lora_endpoint(self, receive, send, path: str) -> None:
        """vLLM's load / unload endpoints: the adapter's name is all a fake engine keeps."""
        body = await _read_body(receive)
        name = json.loads(body or b"{}").get("lora_name")
        if path == "/v1/load_lora_adapter":
            if name in self.adapters:
                await _json(send, 400, error_body(f"The lora adapter '{name}' has already been loaded.",
                                                  error_type(400), "lora_name"))
                return
            self.adapters[name] = None
            self.stats["lora_loads"] += 1
        elif self.adapters.pop(name, 0) is not None:
            await _json(send, 404, error_body(f"The lora adapter '{name}' cannot be found", error_type(404)))
            return
        await _send(send, 200, f"Success: LoRA adapter '{name}'".encode(), b"text/plain")

    async def kv_events(self, receive, send):
        if self.ns.no_kv_events or self.ns.flavor != "kvfleet":
            await _json(send, 404, error_body("no KV events here", error_type(404)))
            return
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers.append(q)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/x-ndjson")]})
        iid = self.ns.instance_id
        snap = Snapshot(self.seq, self.block_size, DEFAULT_HASH_SEED, tuple(self.cached))
        disconnected = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await send({"type": "http.response.body", "body": encode_line(iid, snap), "more_body": True})
            while not disconnected.done():
                try:
                    ev = await asyncio.wait_for(q.get(), self.ns.heartbeat_s)
                except TimeoutError:
                    ev = Heartbeat(self.seq)
                await send({"type": "http.response.body", "body": encode_line(iid, ev), "more_body": True})
        except OSError:
            pass
        finally:
            disconnected.cancel()
            self.subscribers.remove(q)

    async def completion(self, scope, receive, send, path):
        body = await _read_body(receive)
        hdr = {k.decode(): v.decode() for k, v in scope["headers"] if k.startswith(b"x-fake-")}
        status = int(hdr.get("x-fake-status", self.ns.fail_status or 200))
        self.stats["requests"] += 1
        if status != 200:
            retry_after = [(b"retry-after", b"1")] if status in (429, 503) else []  # as the engine sends them
            await _json(send, status, error_body(f"fake failure {status}", error_type(status)), retry_after)
            return
        req = json.loads(body)
        model = req.get("model")
        adapter = model if isinstance(model, str) and model != self.ns.model else None
        if adapter is not None:
            if adapter not in self.adapters:
                await _json(send, 404, error_body(f"The model `{adapter}` does not exist", error_type(404), "model",
                                                  "model_not_found"))
                return
            self.stats["lora_requests"] += 1
            by = self.stats["lora_by_adapter"]
            by[adapter] = by.get(adapter, 0) + 1
        prompt = req.get("prompt")
        tokens = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else None
        cached = self.admit(tokens, req.get("cache_salt"), adapter)
        n_prompt = len(tokens) if tokens else 8
        chunks = int(hdr.get("x-fake-chunks", self.ns.chunks))
        max_tokens = max_tokens_of(req.get("max_completion_tokens"), req.get("max_tokens"))  # the engine's rule
        self.stats["last_max_tokens"] = max_tokens
        self.stats["last_priority"] = req.get("priority")
        self.stats["last_prompt_tokens"] = len(tokens) if tokens else None
        ids = (tokens or list(range(1, 9))) if req.get("return_token_ids") else None
        if isinstance(max_tokens, int) and max_tokens > 0:
            chunks = min(chunks, max_tokens)
        delay = float(hdr.get("x-fake-delay-ms", self.ns.delay_ms)) / 1000
        chunk_delay = float(hdr.get("x-fake-chunk-delay-ms", 0)) / 1000
        break_after = int(hdr.get("x-fake-break-after", -1))
        error_after = (int(hdr.get("x-fake-error-after", -1)), int(hdr.get("x-fake-error-status", 503)))
        usage = {"prompt_tokens": n_prompt, "completion_tokens": chunks, "total_tokens": n_prompt + chunks,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        chat = path == "/v1/chat/completions"
        rid = f"fake-{self.ns.instance_id}-{self.stats['requests']}"
        key = dict(scope["headers"]).get(b"x-request-id", b"").decode()
        tally = {"prompt_tokens": n_prompt, "cached_tokens": cached, "completion_tokens": 0, "outcome": "aborted"}
        if key:
            self.usage[key] = RUNNING
        if self.ns.max_running:
            if self.slots is None:
                self.slots = asyncio.Semaphore(self.ns.max_running)
            self.queued += 1
            try:
                await self.slots.acquire()  # first come, first served (asyncio wakes waiters in order)
            finally:
                self.queued -= 1
        self.stats["running"] += 1
        try:
            if delay:
                await asyncio.sleep(delay)
            if not req.get("stream"):
                text = " tok" * chunks
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                          if chat else {"index": 0, "text": text, "finish_reason": "length"})
                tally.update(completion_tokens=chunks, outcome="length")
                await _json(send, 200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                        "created": int(time.time()), "model": self.ns.model, "choices": [choice],
                                        "usage": usage}, [(b"x-fake-instance", self.ns.instance_id.encode())])
                self.stats["completed"] += 1
                return
            opts = req.get("stream_options") or {}
            keepalives = (int(hdr.get("x-fake-keepalives", 0)), float(hdr.get("x-fake-keepalive-ms", 100)) / 1000)
            await self.stream(receive, send, rid, chat, chunks, chunk_delay, break_after, usage,
                              bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats")), keepalives,
                              ids, error_after, tally)
        finally:
            self.stats["running"] -= 1
            if key:
                self.usage.pop(key, None)
                self.usage[key] = {**tally, "finished_at": time.time()}
                while len(self.usage) > USAGE_KEPT:
                    del self.usage[next(iter(self.usage))]
            if self.slots is not None:
                self.slots.release()

    async def stream(self, receive, send, rid, chat, chunks, chunk_delay, break_after, usage, include_usage,
                     continuous=False, keepalives=(0, 0.0), prompt_ids=None, error_after=(-1, 503), tally=None):
        tally = {} if tally is None else tally  # what was sent: completion_tokens, and outcome once it ended
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": int(time.time()), "model": self.ns.model}
        disconnected = asyncio.ensure_future(_wait_disconnect(receive))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                                (b"x-fake-instance", self.ns.instance_id.encode())]})
        try:
            for _ in range(keepalives[0]):
                await send({"type": "http.response.body", "body": b": keep-alive\n\n", "more_body": True})
                await asyncio.sleep(keepalives[1])
            for i in range(chunks):
                if break_after == i:
                    raise ConnectionAbortedError("x-fake-break-after")  # uvicorn drops the connection
                if error_after[0] == i:
                    err = error_body(f"fake failure {error_after[1]}", error_type(error_after[1]))
                    await send({"type": "http.response.body", "more_body": False,
                                "body": b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"})
                    return
                if chunk_delay:
                    await asyncio.sleep(chunk_delay)
                if disconnected.done():
                    self.stats["cancelled"] += 1
                    return
                last = i == chunks - 1
                choice = ({"index": 0, "delta": {"content": " tok"}, "finish_reason": "length" if last else None}
                          if chat else {"index": 0, "text": " tok", "finish_reason": "length" if last else None})
                event = {**base, "choices": [choice]}
                if prompt_ids is not None:
                    choice["token_ids"] = [100 + i]
                    if i == 0:
                        (event if chat else choice)["prompt_token_ids"] = prompt_ids
                if continuous:  # usage so far in every chunk (vLLM's and kvfleet's continuous_usage_stats)
                    event["usage"] = {**usage, "completion_tokens": i + 1, "total_tokens": usage["prompt_tokens"] + i + 1}
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps(event).encode() + b"\n\n"})
                tally["completion_tokens"] = i + 1
            if break_after == chunks:  # after the last token, before the stream's end
                raise ConnectionAbortedError("x-fake-break-after")
            tail = b""
            if include_usage:
                tail = b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})
            tally["outcome"] = "length"
            self.stats["completed"] += 1
        finally:
            disconnected.cancel()


async def _wait_disconnect(receive):
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


async def _send(send, status, body: bytes, ctype: bytes, headers=()):
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def _json(send, status, obj, headers=()):
    await _send(send, status, json.dumps(obj).encode(), b"application/json", headers)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fake_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--instance-id", default="fake")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunks", type=int, default=8, help="streamed chunks per response")
    p.add_argument("--heartbeat-s", type=float, default=2.0)
    p.add_argument("--fail-status", type=int, default=0, help="answer every completion with this status")
    p.add_argument("--no-kv-events", action="store_true", help="no KV event endpoint (404)")
    p.add_argument("--kv-usage", type=float, default=0.0, help="KV cache usage (0..1) its /metrics report")
    p.add_argument("--waiting", type=int, default=0, help="waiting requests its /metrics report")
    p.add_argument("--flavor", choices=("kvfleet", "vllm", "sglang"), default="kvfleet",
                   help="vllm / sglang: no /ready (404) and no KV events, like those engines")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay before every response's first byte")
    p.add_argument("--models-delay-ms", type=float, default=0.0, help="delay before every /v1/models answer")
    p.add_argument("--max-running", type=int, default=0,
                   help="requests served at once; more wait first come, first served (0: no limit)")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME",
                   help="LoRA adapters it holds from the start (listed on /v1/models with the model as parent)")
    p.add_argument("--oom-events", type=float, default=0.0, help="kvfleet:oom_events_total its /metrics report")
    return p


def make_app(instance_id: str, **options) -> FakeEngine:
    """The app for in-process use, e.g. by Ray Serve's engine replicas (deploy/ray/app.py's
    `app_factory: loadtest.fake_engine:make_app`); `options` are its flags (chunks, delay_ms, block_size, ...)."""
    argv = ["--port", "0", "--instance-id", instance_id]
    for k, v in options.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return FakeEngine(parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    import uvicorn

    uvicorn.run(FakeEngine(ns), host=ns.host, port=ns.port, log_level="warning", access_log=False,
                loop="uvloop", http="httptools", lifespan="on", timeout_graceful_shutdown=2)
    return 0


async def _read_body(receive) -> bytes:
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


if __name__ == "__main__":
    sys.exit(main())
