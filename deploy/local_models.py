"""The models of a local fleet (`kvfleet up --models`): each served by its own pool of engine replicas, kvfleet's
engine or vLLM's, and the router's pools file that puts them behind one router.

    --models smollm2                                   # the bundled model, served as `smollm2`
    --models smollm2,tiny=/data/tiny-llama             # two models: NAME=SOURCE (alias, HF directory, GGUF file)
    --models smollm2,vllm:smollm2-hf=/tmp/smollm2-hf   # ENGINE: picks the engine of one model (kvfleet, vllm)

The router tokenizes each model's prompts with that model's own tokenizer (its source, on this machine). A vLLM
replica publishes its KV events over ZMQ (an ipc:// socket in the log folder: vLLM binds a tcp:// publisher only
on all interfaces, and connects to any other address; replay on a free loopback port); the router mirrors them
into its exact prefix index.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ENGINES = ("kvfleet", "vllm")
_POOL_NAME = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True)
class LocalModel:
    name: str  # what clients put in "model"
    source: str  # what the engine loads
    engine: str = "kvfleet"

    @property
    def pool(self) -> str:
        """A pool name (a DNS label) derived from the model name."""
        return _POOL_NAME.sub("-", self.name.lower()).strip("-")[:63] or "model"


def parse_models(text: str, default_engine: str = "kvfleet") -> list[LocalModel]:
    """`[ENGINE:][NAME=]SOURCE,...`; raises ValueError naming the bad item."""
    models: list[LocalModel] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            raise ValueError(f"an empty item in {text!r}")
        engine, sep, rest = item.partition(":")
        if not sep or engine not in ENGINES:
            engine, rest = default_engine, item
        name, sep, source = rest.partition("=")
        if not sep:
            name = source = rest
        if not name or not source:
            raise ValueError(f"{item!r}: expected [ENGINE:][NAME=]SOURCE")
        if engine == "vllm" and name == source:
            raise ValueError(f"{item!r}: a vLLM model needs NAME=HF_DIRECTORY (vLLM loads no kvfleet alias)")
        models.append(LocalModel(name, source, engine))
    names = [m.name for m in models]
    for m in models:
        if names.count(m.name) > 1:
            raise ValueError(f"model {m.name!r} is listed twice")
    pools = [m.pool for m in models]
    for m in models:
        if pools.count(m.pool) > 1:
            raise ValueError(f"models {', '.join(x.name for x in models if x.pool == m.pool)} would share the pool "
                             f"name {m.pool!r}; rename one")
    return models


@dataclass(frozen=True)
class KVEvents:
    """Where one vLLM replica publishes its KV events: an ipc:// socket path and a loopback replay port."""

    socket: str
    replay_port: int

    def config(self, host: str) -> str:
        """vLLM's --kv-events-config."""
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{self.socket}",
                           "replay_endpoint": f"tcp://{host}:{self.replay_port}", "topic": "kv-events"})

    def spec(self, url: str) -> str:
        """The router's per-replica spec: REPLICA_URL=PUBLISHER|REPLAY."""
        return f"{url}=ipc://{self.socket}|tcp://{_host(url)}:{self.replay_port}"


def vllm_argv(python: str, model: LocalModel, host: str, port: int, events: KVEvents,
              max_model_len: int = 2048) -> list[str]:
    """A vLLM CPU engine serving `model` (docs/peers.md: the module, not the console script, starts it); blocks of
    32 tokens (the CPU build's default is larger, and a prefix hit needs a whole block)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model.source, "--served-model-name",
            model.name, "--host", host, "--port", str(port), "--dtype", "bfloat16", "--max-model-len",
            str(max_model_len), "--block-size", "32", "--enable-prompt-tokens-details",
            "--kv-events-config", events.config(host)]


def pools_file(placed: list[tuple[LocalModel, list[str], list[KVEvents]]]) -> dict:
    """The router's pools file: one pool per model (its replica URLs; a vLLM pool's KV event sockets per replica)."""
    pools = {}
    for model, urls, events in placed:
        pool: dict = {"version": "local", "weight": 1, "model": model.name, "engine": model.engine,
                      "tokenizer": model.source, "replicas": urls}
        if model.engine == "vllm":
            pool["kv_events"] = [e.spec(url) for url, e in zip(urls, events, strict=True)]
        pools[model.pool] = pool
    return {"pools": pools}


def _host(url: str) -> str:
    return url.split("//", 1)[1].rsplit(":", 1)[0]
