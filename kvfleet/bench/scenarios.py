"""Workloads for `kvfleet bench`: the seed articles' stress matrix, ShareGPT-like lengths, and trace replay.

A workload is a list of `Conversation`s: messages every turn starts with (a system prompt, a RAG template
with its retrieved chunks, or a replayed request's history), then one or more user turns. The runner sends
turn k with the conversation so far, the replies the server really gave included (multi-turn resends its
history). Lengths are in words of kvfleet.workload's vocabulary, about one token each for the
SmolLM2/Llama tokenizers. The same (preset, count, seed, scale) always gives the same workload.

Stress matrix (lengths at --scale 1; every length is multiplied by the scale, at least 4):

| preset | prompt | output | shape |
|---|---|---|---|
| short-short | 128 | 32 | one turn |
| long-short | 1536 | 32 | one turn (prefill-bound) |
| short-long | 128 | 512 | one turn (decode-bound) |
| long-long | 1536 | 512 | one turn |
| multi-turn | 4 turns x 96 user | 64 per turn | each turn resends the history, real replies included |
| rag | 192 template + 3 of 24 chunks x 160 + 16 question | 64 | shared template, retrieved chunks |
| shared-system | 512 system (one for all) + 64 user | 64 | shared system prompt |
| parallel-n | 128 | 64, n = 4 | parallel sampling (4 completions share the prompt) |
| sharegpt | log-normal, mean 256, sigma 1.0, in [8, 2048] | log-normal, mean 192, sigma 0.8, in [8, 1024] | one turn |
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from kvfleet.workload import lognormal_length, read_mooncake, words


@dataclass(frozen=True)
class Turn:
    user: str
    max_tokens: int


@dataclass(frozen=True)
class Conversation:
    id: str
    prefix: tuple[dict, ...]  # messages before the first user turn
    turns: tuple[Turn, ...]
    arrival_s: float | None = None  # replayed traces: when the first turn is sent
    n: int = 1  # completions per request (parallel sampling)


@dataclass(frozen=True)
class Preset:
    name: str
    prompt: int  # user words per turn (or the mean, for log-normal)
    output: int
    turns: int = 1
    system: int = 0  # words of a system prompt every conversation shares
    rag: tuple[int, int, int, int] | None = None  # template words, corpus chunks, chunks per request, chunk words
    n: int = 1
    sigma: tuple[float, float] | None = None  # log-normal sigmas (prompt, output); None = fixed lengths
    bounds: tuple[int, int, int, int] = (8, 2048, 8, 1024)  # prompt lo, hi, output lo, hi (log-normal)
    description: str = ""


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("short-short", 128, 32, description="short prompt, short output"),
    Preset("long-short", 1536, 32, description="long prompt, short output (prefill-bound)"),
    Preset("short-long", 128, 512, description="short prompt, long output (decode-bound)"),
    Preset("long-long", 1536, 512, description="long prompt, long output"),
    Preset("multi-turn", 96, 64, turns=4, description="4-turn conversations resending their history"),
    Preset("rag", 16, 64, rag=(192, 24, 3, 160), description="RAG: shared template + 3 retrieved chunks of 24"),
    Preset("shared-system", 64, 64, system=512, description="one shared 512-token system prompt"),
    Preset("parallel-n", 128, 64, n=4, description="parallel sampling, n = 4"),
    Preset("sharegpt", 256, 192, sigma=(1.0, 0.8), description="ShareGPT-like long-tailed lengths"),
)}
MATRIX = tuple(PRESETS)


def _scaled(x: int, scale: float) -> int:
    return max(4, round(x * scale))


def build(preset: str | Preset, count: int, seed: int = 0, scale: float = 1.0) -> list[Conversation]:
    """`count` conversations of the preset (a name from PRESETS or a Preset), lengths times `scale`."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = random.Random(f"{seed}-{p.name}")
    system = ({"role": "system", "content": words(random.Random(f"{seed}-system"), _scaled(p.system, scale))},) \
        if p.system else ()
    corpus: list[str] = []
    template = ""
    if p.rag:
        t_words, n_chunks, _, c_words = p.rag
        template = words(random.Random(f"{seed}-template"), _scaled(t_words, scale))
        corpus = [words(random.Random(f"{seed}-chunk-{i}"), _scaled(c_words, scale)) for i in range(n_chunks)]
    out = []
    for i in range(count):
        turns = []
        for _ in range(p.turns):
            if p.sigma:
                lo, hi, olo, ohi = p.bounds
                n_in = lognormal_length(rng, p.prompt * scale, p.sigma[0], lo, max(lo, round(hi * scale)))
                n_out = lognormal_length(rng, p.output * scale, p.sigma[1], olo, max(olo, round(ohi * scale)))
            else:
                n_in, n_out = _scaled(p.prompt, scale), _scaled(p.output, scale)
            turns.append(Turn(words(rng, n_in), n_out))
        prefix = system
        if p.rag:
            picked = rng.sample(range(len(corpus)), p.rag[2])
            context = "\n\n".join(f"[{k}] {corpus[k]}" for k in picked)
            prefix = ({"role": "system", "content": template},
                      {"role": "user", "content": f"Context:\n{context}"},
                      {"role": "assistant", "content": "I have read the context."})
        out.append(Conversation(f"{p.name}-{seed}-{i}", prefix, tuple(turns), None, p.n))
    return out


def read_trace(path: str | Path, limit: int | None = None, *, seed: int = 0, time_scale: float = 1.0,
               mooncake_token_scale: float = 1 / 16) -> list[Conversation]:
    """Replay a JSONL trace: the Mooncake format (`timestamp` ms, `input_length`, `output_length`,
    `hash_ids`; shared prefixes become shared text, lengths times `mooncake_token_scale`) or ours, one
    request per line: `timestamp` (s) or `arrival_s`; `messages` (sent as they are) or `prompt_tokens`
    (that many words); `max_tokens` or `output_tokens`; optional `n`. Arrival times times `time_scale`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace {path} does not exist")
    with path.open(encoding="utf-8") as f:
        first = f.readline()
    if not first.strip():
        raise ValueError(f"trace {path} is empty")
    if "hash_ids" in json.loads(first):
        reqs = read_mooncake(path, limit, token_scale=mooncake_token_scale, time_scale=time_scale, seed=seed)
        return [Conversation(r.request_id, r.messages[:-1], (Turn(r.messages[-1]["content"], r.max_tokens),),
                             r.arrival_s) for r in reqs]
    out = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            arrival = rec.get("arrival_s", rec.get("timestamp"))
            max_tokens = rec.get("max_tokens", rec.get("output_tokens"))
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"{path}:{i + 1}: needs max_tokens (or output_tokens) >= 1")
            if rec.get("messages"):
                msgs = tuple(rec["messages"])
            elif isinstance(rec.get("prompt_tokens"), int):
                msgs = ({"role": "user", "content": words(random.Random(f"{seed}-trace-{i}"), rec["prompt_tokens"])},)
            else:
                raise ValueError(f"{path}:{i + 1}: needs messages or prompt_tokens")
            out.append(Conversation(rec.get("request_id", f"trace-{i}"), msgs[:-1],
                                    (Turn(msgs[-1]["content"], max_tokens),),
                                    None if arrival is None else float(arrival) * time_scale, int(rec.get("n", 1))))
    return out
