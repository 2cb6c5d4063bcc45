r"""`kvfleet capacity`: how much KV cache a GPU holds for a model, how many sequences of your traffic's lengths
fit, and how many replicas a target rate needs.

    kvfleet capacity --model path/to/config.json --gpu-memory-gib 80 --profile profile.json \
        --target-rps 20 --replica-throughput 2500

The arithmetic (every figure in the output follows from it):

- KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes (GQA: kv_heads, not heads).
- Weights: the safetensors files' sizes (a model directory), the GGUF file's size (smollm2), or the parameter
  count computed from config.json (embeddings, per layer q/k/v/o + biases for Qwen2, gate/up/down MLP, two
  RMSNorms; final norm; an untied LM head) x the weight dtype's bytes.
- Activation reserve (our rule, stated so it can be checked): one step's transients at the token budget
  T = --max-num-batched-tokens: T x (4 x hidden + 2 x intermediate) x activation bytes (residual, normed
  input, q/k/v/attention output; MLP gate and up), plus fp32 logits for --max-num-seqs rows:
  max_num_seqs x vocab x 4 bytes.
- KV budget = gpu memory x --gpu-memory-utilization - weights - activation reserve; blocks = floor(budget /
  (block size x KV bytes per token)).
- A sequence of L tokens holds ceil(L / block size) blocks; the unused tail of its last block is the waste.
- Replicas for a target rate = ceil(rate x mean output tokens / one replica's measured output tokens/s).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "int8": 1}
GIB = 1024 ** 3

# SmolLM2-135M-Instruct's architecture (its GGUF header / Hugging Face config.json), for `--model smollm2`.
SMOLLM2_CONFIG = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
                  "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
                  "tie_word_embeddings": True, "torch_dtype": "bfloat16"}


@dataclass(frozen=True)
class Arch:
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    dtype: str
    qkv_bias: bool

    @classmethod
    def from_config(cls, cfg: dict, where: str = "config") -> Arch:
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in need if not isinstance(cfg.get(k), int)]
        if missing:
            raise ValueError(f"{where}: needs integer {', '.join(missing)} (a Llama/Qwen2/Mistral config.json)")
        heads = cfg["num_attention_heads"]
        mt = cfg.get("model_type", "llama")
        return cls(mt, cfg["hidden_size"], cfg["num_hidden_layers"], heads, cfg.get("num_key_value_heads") or heads,
                   cfg.get("head_dim") or cfg["hidden_size"] // heads, cfg["intermediate_size"], cfg["vocab_size"],
                   bool(cfg.get("tie_word_embeddings", False)), cfg.get("torch_dtype") or "bfloat16",
                   bool(cfg.get("attention_bias", mt == "qwen2")))

    def kv_bytes_per_token(self, dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[dtype]

    def num_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * h * self.intermediate + 2 * h
        embed = self.vocab * h
        return embed + self.layers * layer + h + (0 if self.tied else embed)


@dataclass(frozen=True)
class Budget:
    gpu_memory_gib: float
    utilization: float = 0.9
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    kv_dtype: str | None = None  # None: the model's dtype
    weight_dtype: str | None = None

    def __post_init__(self):
        for name in ("gpu_memory_gib", "utilization", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.utilization > 1:
            raise ValueError(f"--gpu-memory-utilization must be <= 1, got {self.utilization}")
        for name in ("kv_dtype", "weight_dtype"):
            v = getattr(self, name)
            if v is not None and v not in DTYPE_BYTES:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {sorted(DTYPE_BYTES)}, got {v!r}")


def activation_bytes(arch: Arch, b: Budget, act_dtype: str) -> int:
    step = b.max_num_batched_tokens * (4 * arch.hidden + 2 * arch.intermediate) * DTYPE_BYTES[act_dtype]
    return step + b.max_num_seqs * arch.vocab * 4


def seq_fit(blocks: int, block_size: int, tokens: int) -> dict:
    per_seq = math.ceil(tokens / block_size)
    return {"tokens": tokens, "blocks_per_seq": per_seq, "concurrent_seqs": blocks // per_seq,
            "block_waste": (per_seq * block_size - tokens) / (per_seq * block_size)}


def plan(arch: Arch, weights_bytes: int, b: Budget, lengths: dict[str, int], target_rps: float | None = None,
         mean_output_tokens: float | None = None, replica_tok_s: float | None = None) -> dict:
    kv_dtype = b.kv_dtype or arch.dtype
    kv_tok = arch.kv_bytes_per_token(kv_dtype)
    act = activation_bytes(arch, b, arch.dtype if arch.dtype in DTYPE_BYTES else "bfloat16")
    usable = int(b.gpu_memory_gib * GIB * b.utilization)
    kv_budget = usable - weights_bytes - act
    blocks = max(0, kv_budget // (b.block_size * kv_tok))
    out = {"params": arch.num_params(), "weights_bytes": weights_bytes, "kv_dtype": kv_dtype,
           "kv_bytes_per_token": kv_tok, "kv_bytes_per_token_by_dtype":
               {d: arch.kv_bytes_per_token(d) for d in ("float32", "bfloat16", "fp8")},
           "usable_bytes": usable, "activation_reserve_bytes": act, "kv_budget_bytes": kv_budget,
           "blocks": blocks, "kv_tokens": blocks * b.block_size, "fits": kv_budget > 0,
           "at_lengths": {k: seq_fit(blocks, b.block_size, v) for k, v in lengths.items()}}
    if target_rps is not None:
        if not replica_tok_s or not mean_output_tokens:
            raise ValueError("--target-rps needs --replica-throughput and an output length "
                             "(--profile or --output-tokens)")
        need = target_rps * mean_output_tokens
        out["replicas"] = {"target_rps": target_rps, "mean_output_tokens": mean_output_tokens,
                           "output_tok_s_needed": need, "replica_output_tok_s": replica_tok_s,
                           "replicas_needed": math.ceil(need / replica_tok_s - 1e-9)}
    return out


def load_model(model: str) -> tuple[Arch, int, str]:
    """(architecture, weight bytes, where the weight figure came from) for a config.json, a model directory or
    the bundled smollm2. Weight bytes 0 means: compute from the parameter count."""
    if model.lower() in ("smollm2", "smollm2-135m-instruct"):
        from engine.model.registry import resolve_model
        src = resolve_model(model)
        return Arch.from_config(SMOLLM2_CONFIG, "smollm2"), Path(src.path).stat().st_size, f"GGUF file {src.path}"
    p = Path(model)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise ValueError(f"--model {model}: expected a model directory with config.json, a config.json, or smollm2")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--model {cfg_path}: not JSON ({e})") from e
    cfg = cfg.get("text_config", cfg)
    arch = Arch.from_config(cfg, f"--model {cfg_path}")
    shards = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if shards:
        return arch, sum(s.stat().st_size for s in shards), f"{len(shards)} safetensors files"
    return arch, 0, "parameter count from config.json"


def lengths_from_profile(profile: dict) -> tuple[dict[str, int], float]:
    try:
        pr, ou = profile["prompt_tokens"], profile["output_tokens"]
        lengths = {q: int(round(pr[q] + ou[q])) for q in ("p50", "p95", "p99")}
        return lengths, float(ou["mean"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"--profile: not a `kvfleet profile --json` file (missing {e})") from e


def print_plan(r: dict, arch: Arch, b: Budget, source: str) -> None:
    print(f"model: {arch.model_type}, {arch.layers} layers, {arch.heads} heads / {arch.kv_heads} KV heads x "
          f"{arch.head_dim}, {r['params'] / 1e9:.3f} B parameters; weights {r['weights_bytes'] / GIB:.2f} GiB "
          f"({source})")
    by = ", ".join(f"{d} {v / 1024:.1f} KiB" for d, v in r["kv_bytes_per_token_by_dtype"].items())
    print(f"KV bytes per token: {r['kv_bytes_per_token']:,} ({r['kv_dtype']}); by dtype: {by}")
    print(f"GPU {b.gpu_memory_gib:g} GiB x {b.utilization:g} = {r['usable_bytes'] / GIB:.2f} GiB usable - weights - "
          f"activation reserve {r['activation_reserve_bytes'] / GIB:.2f} GiB = KV {r['kv_budget_bytes'] / GIB:.2f} GiB")
    if not r["fits"]:
        print("does NOT fit: the weights and activation reserve exceed the usable memory")
        return
    print(f"KV cache: {r['blocks']:,} blocks of {b.block_size} = {r['kv_tokens']:,} tokens")
    for k, s in r["at_lengths"].items():
        print(f"  at {k} length {s['tokens']:,} tokens: {s['blocks_per_seq']} blocks/seq, "
              f"{s['concurrent_seqs']:,} concurrent sequences, block waste {s['block_waste']:.1%}")
    if "replicas" in r:
        x = r["replicas"]
        print(f"replicas for {x['target_rps']:g} req/s x {x['mean_output_tokens']:.1f} output tokens = "
              f"{x['output_tok_s_needed']:.1f} tok/s at {x['replica_output_tok_s']:g} tok/s each: "
              f"{x['replicas_needed']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfleet capacity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="model directory, config.json, or smollm2")
    ap.add_argument("--gpu-memory-gib", type=float, required=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-dtype", choices=sorted(DTYPE_BYTES), default=None, help="default: the model's")
    ap.add_argument("--weight-dtype", choices=sorted(DTYPE_BYTES), default=None,
                    help="for weights computed from the parameter count (default: the model's)")
    ap.add_argument("--profile", default=None, help="`kvfleet profile --json` output: lengths and mean output")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="without --profile: one prompt length")
    ap.add_argument("--output-tokens", type=int, default=None, help="without --profile: one output length")
    ap.add_argument("--target-rps", type=float, default=None)
    ap.add_argument("--replica-throughput", type=float, default=None, metavar="TOK_S",
                    help="one replica's measured output tokens/s (e.g. `kvfleet bench` out tok/s)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    a = ap.parse_args(argv)
    try:
        b = Budget(a.gpu_memory_gib, a.gpu_memory_utilization, a.block_size, a.max_num_batched_tokens,
                   a.max_num_seqs, a.kv_cache_dtype, a.weight_dtype)
        arch, weights, source = load_model(a.model)
        if not weights:
            wd = a.weight_dtype or (arch.dtype if arch.dtype in DTYPE_BYTES else "bfloat16")
            weights = arch.num_params() * DTYPE_BYTES[wd]
            source = f"parameter count x {wd}"
        mean_out = None
        if a.profile:
            try:
                lengths, mean_out = lengths_from_profile(json.loads(Path(a.profile).read_text()))
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"--profile {a.profile}: {e}") from e
        elif a.prompt_tokens or a.output_tokens:
            if not (a.prompt_tokens and a.output_tokens) or a.prompt_tokens < 1 or a.output_tokens < 1:
                raise ValueError("--prompt-tokens and --output-tokens go together and must be >= 1")
            lengths, mean_out = {"given": a.prompt_tokens + a.output_tokens}, float(a.output_tokens)
        else:
            lengths = {}
        if a.target_rps is not None and a.target_rps <= 0:
            raise ValueError(f"--target-rps must be > 0, got {a.target_rps}")
        if a.replica_throughput is not None and a.replica_throughput <= 0:
            raise ValueError(f"--replica-throughput must be > 0, got {a.replica_throughput}")
        r = plan(arch, weights, b, lengths, a.target_rps, mean_out, a.replica_throughput)
    except ValueError as e:
        print(f"kvfleet capacity: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"arch": asdict(arch), "weights_source": source, **r}, indent=1))
    else:
        print_plan(r, arch, b, source)
    return 0


if __name__ == "__main__":
    sys.exit(main())
