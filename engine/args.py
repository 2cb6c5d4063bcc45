"""Every engine setting, as one frozen dataclass validated at the edge (CLI or code).

`add_cli_args(parser)` adds the engine flags to an argparse parser (the server adds its own next to
them); `EngineArgs.from_cli(namespace)` builds and validates. A bad value raises ConfigError
(engine/errors.py), a ValueError whose `field` is the command-line flag (e.g. "--max-num-seqs") and whose
message starts with it.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from contract.errors import ConfigError
from contract.hashing import DEFAULT_HASH_SEED
from engine.config import DEFAULT_MAX_STEP_MS, SCHEDULING_POLICIES, check, check_int, check_max_step_ms
from engine.cpu_cores import format_cpu_list, parse_cpu_list
from engine.kv.config import BLOCK_SIZES, valid_block_size
from engine.spec.config import SpeculativeConfig

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
BACKEND_CHOICES = ("auto", "torch", "cpu", "triton")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
ENGINE_CORES = ("process", "thread")


@dataclass(frozen=True)
class EngineArgs:
    model: str = "smollm2"
    served_model_name: str | None = None  # name clients use; default: the --model value
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    kv_cache_memory: float | None = None  # GiB; default: 2 GiB on CPU, profiled on GPU (engine/kv/sizing.py)
    gpu_memory_fraction: float = 0.9  # share of the GPU's total memory this engine may use (weights + activations + KV)
    num_blocks: int | None = None  # overrides kv_cache_memory
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    scheduling_policy: str = "fcfs"  # fcfs | priority (requests' `priority` field; engine/scheduler.py)
    priority_aging: float = 30.0  # seconds of waiting that raise a request's priority by one (policy priority)
    max_step_ms: float = DEFAULT_MAX_STEP_MS  # under contention, prompt chunks shrink to keep steps this short; 0: off
    enable_prefix_caching: bool = True
    kv_tier_gib: float = 0.0  # a lower tier of this many GiB keeps evicted blocks (engine/kv/tier.py); 0: none
    kv_tier_path: str | None = None  # the tier's directory on local disk; None: host memory
    kv_pin_fraction: float = 0.25  # share of the KV blocks cache_control prefixes may pin (engine/kv/pins.py); 0: off
    kv_pin_tenant_fraction: float = 0.125  # share of the KV blocks one tenant's cache_control prefixes may pin
    allow_download: bool = False  # fetch a hub id missing from the local Hugging Face cache (off: offline)
    hash_seed: int = DEFAULT_HASH_SEED
    seed: int = 0
    num_threads: int | None = None  # torch CPU threads; default: every core this process may use
    cpu_cores: str | None = None  # Linux CPU list ("0", "0-1", "0,2-3") to pin the engine to; default: no pinning
    deterministic: bool = False  # a request's tokens and logprobs independent of its batch and of the cache
    cuda_graphs: bool | None = None  # decode steps replay CUDA graphs; None: wherever they apply (CUDA, triton, no LoRA)
    engine_core: str = "process"  # process: the core in a process of its own (engine/core/); thread: in the server's
    enable_lora: bool = False  # serve LoRA adapters (implied by lora_modules); off: the projections are untouched
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT adapter directory) registered at start
    max_loras: int = 1  # adapters one step can run (slots in the model)
    max_cpu_loras: int | None = None  # adapters kept read in memory; default: max_loras
    max_lora_rank: int = 16  # the largest adapter rank accepted
    speculative_config: SpeculativeConfig | None = None  # vLLM's JSON object (engine/spec/config.py); None: off
    debug_step_delay_ms: int = 0  # fault injection: sleep this long after every step (a slow replica)
    debug_oom_every: int = 0  # fault injection: every Nth model step raises MemoryError (0: off)

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model.strip() != "", "--model", "must be a model name or path")
        _check(self.served_model_name is None or (isinstance(self.served_model_name, str)
                                                  and self.served_model_name.strip() != ""),
               "--served-model-name", "must be a non-empty string")
        _choice("--dtype", self.dtype, DTYPE_CHOICES)
        _choice("--device", self.device, DEVICE_CHOICES)
        _choice("--attention-backend", self.attention_backend, BACKEND_CHOICES)
        _check(valid_block_size(self.block_size), "--block-size", f"must be {BLOCK_SIZES}, got {self.block_size!r}")
        if self.kv_cache_memory is not None:
            _check(isinstance(self.kv_cache_memory, (int, float)) and not isinstance(self.kv_cache_memory, bool)
                   and 0 < self.kv_cache_memory <= 4096, "--kv-cache-memory",
                   f"must be a number of GiB in (0, 4096], got {self.kv_cache_memory!r}")
        _check(isinstance(self.gpu_memory_fraction, (int, float)) and not isinstance(self.gpu_memory_fraction, bool)
               and 0 < self.gpu_memory_fraction <= 1, "--gpu-memory-fraction",
               f"must be a number in (0, 1], got {self.gpu_memory_fraction!r}")
        _check(isinstance(self.allow_download, bool), "--allow-download", "must be a bool")
        if self.num_blocks is not None:
            check_int("--num-blocks", self.num_blocks, 1)
        if self.max_model_len is not None:
            check_int("--max-model-len", self.max_model_len, 2)
        check_int("--max-num-seqs", self.max_num_seqs, 1)
        _check(isinstance(self.kv_tier_gib, (int, float)) and not isinstance(self.kv_tier_gib, bool)
               and 0 <= self.kv_tier_gib <= 65536, "--kv-tier-gib", f"must be a number of GiB in [0, 65536], got "
                                                                     f"{self.kv_tier_gib!r}")
        _check(self.kv_tier_path is None or (isinstance(self.kv_tier_path, str) and self.kv_tier_path.strip() != ""),
               "--kv-tier-path", "must be a directory path")
        _check(self.kv_tier_path is None or self.kv_tier_gib > 0, "--kv-tier-path", "needs --kv-tier-gib above 0")
        _check(self.kv_tier_gib == 0 or self.enable_prefix_caching, "--kv-tier-gib",
               "a lower tier keeps cached blocks: it needs --enable-prefix-caching")
        for flag, value in (("--kv-pin-fraction", self.kv_pin_fraction),
                            ("--kv-pin-tenant-fraction", self.kv_pin_tenant_fraction)):
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 0.9, flag,
                   f"must be a share of the KV blocks in [0, 0.9], got {value!r}")
        check_int("--max-num-batched-tokens", self.max_num_batched_tokens, 1)
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "--max-num-batched-tokens",
               f"must be at least --max-num-seqs ({self.max_num_seqs}) so every running sequence can decode "
               f"each step, got {self.max_num_batched_tokens}")
        _choice("--scheduling-policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _choice("--engine-core", self.engine_core, ENGINE_CORES)
        _check(isinstance(self.priority_aging, (int, float)) and not isinstance(self.priority_aging, bool)
               and self.priority_aging > 0, "--priority-aging", f"must be a number of seconds > 0, got "
               f"{self.priority_aging!r}")
        check_max_step_ms("--max-step-ms", self.max_step_ms)
        _check(isinstance(self.enable_prefix_caching, bool), "--enable-prefix-caching", "must be a bool")
        check_int("--hash-seed", self.hash_seed, 0)
        _check(self.hash_seed < 2**64, "--hash-seed", f"must fit in 64 bits, got {self.hash_seed}")
        check_int("--seed", self.seed, 0)
        if self.num_threads is not None:
            check_int("--num-threads", self.num_threads, 1)
        if self.cpu_cores is not None:
            _cpu_cores(self.cpu_cores)
        _check(self.cuda_graphs is None or isinstance(self.cuda_graphs, bool), "--cuda-graphs", "must be a bool")
        _check(isinstance(self.deterministic, bool), "--deterministic", "must be a bool")
        _check(not (self.deterministic and (self.enable_lora or self.lora_modules)), "--deterministic",
               "does not cover LoRA adapters yet (their products take batch-dependent paths); "
               "drop --enable-lora / --lora-modules or --deterministic")
        _check(not (self.deterministic and self.dtype == "float16"), "--deterministic",
               "runs bfloat16 and float32 models; --dtype float16 is not covered")
        _check(isinstance(self.enable_lora, bool), "--enable-lora", "must be a bool")
        if isinstance(self.lora_modules, (list, dict)):  # from code: a list of pairs or {name: path}
            pairs = self.lora_modules.items() if isinstance(self.lora_modules, dict) else self.lora_modules
            object.__setattr__(self, "lora_modules", tuple(tuple(m) for m in pairs))
        _lora_modules(self.lora_modules, self.model_name)
        check_int("--max-loras", self.max_loras, 1)
        if self.max_cpu_loras is not None:
            check_int("--max-cpu-loras", self.max_cpu_loras, 1)
            _check(self.max_cpu_loras >= self.max_loras, "--max-cpu-loras",
                   f"must be at least --max-loras ({self.max_loras}), got {self.max_cpu_loras}")
        check_int("--max-lora-rank", self.max_lora_rank, 1)
        _check(self.max_lora_rank <= 512, "--max-lora-rank", f"must be at most 512, got {self.max_lora_rank}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        check_int("--debug-step-delay-ms", self.debug_step_delay_ms, 0)
        check_int("--debug-oom-every", self.debug_oom_every, 0)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @classmethod
    def from_cli(cls, ns: argparse.Namespace) -> EngineArgs:
        """Build from parsed arguments (flags added by add_cli_args); unknown attributes are ignored."""
        values = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        names = values.get("served_model_name")
        if isinstance(names, (list, tuple)):  # --served-model-name takes one or more names; the first is primary
            values["served_model_name"] = names[0] if names else None
        if values.get("lora_modules") is None:
            values["lora_modules"] = ()
        elif isinstance(values["lora_modules"], list):
            values["lora_modules"] = tuple(values["lora_modules"])
        return cls(**values)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_cli_args(parser)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model,
                   help="bundled model name (smollm2), Hugging Face model directory, .gguf file, or a hub id "
                        "(org/name) found in the local Hugging Face cache (HF_HUB_CACHE / HF_HOME)")
    g.add_argument("--allow-download", action="store_true", default=d.allow_download,
                   help="download a hub id that the local Hugging Face cache lacks (default: off, never download)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use; the first is reported (default: --model)")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPE_CHOICES,
                   help="weights and KV cache dtype; auto = bf16 on GPUs and CPUs with native bf16, else float32")
    g.add_argument("--device", default=d.device, choices=DEVICE_CHOICES, help="auto = cuda if available")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=BACKEND_CHOICES,
                   help="auto = triton on CUDA; on CPUs the fused C++ kernels (cpu) for bfloat16, torch otherwise")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache size in GiB (default: 2 on CPU; on GPU what --gpu-memory-fraction of the device "
                        "leaves after the weights and a profiled forward pass at --max-num-batched-tokens)")
    g.add_argument("--gpu-memory-fraction", type=float, default=d.gpu_memory_fraction,
                   help="share of the GPU's total memory this engine uses for weights, activations and KV cache "
                        "(default 0.9; replicas sharing a GPU each get their part, see kvfleet up)")
    g.add_argument("--num-blocks", type=int, default=None, help="number of KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context length)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (prefill chunks + decodes)")
    g.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help="fcfs (default): requests run in arrival order; priority: by the request's `priority` field "
                        "(lower first, vLLM's convention), and a running request of a lower priority is preempted "
                        "for a waiting one that cannot get in")
    g.add_argument("--priority-aging", type=float, default=d.priority_aging, metavar="SECONDS",
                   help="with --scheduling-policy priority: a waiting request's priority improves by one per this "
                        "many seconds, so low priorities are never starved; under either policy, a request without "
                        "an x-llm-d-slo-ttft-ms target (or past it) waits at most about this long for those with "
                        "one (default %(default)s)")
    g.add_argument("--max-step-ms", type=float, default=d.max_step_ms, metavar="MS",
                   help="when more than one request is waiting or running, prompt chunks shrink so that a step is "
                        "predicted to take at most 90%% of MS milliseconds (a step-time model the engine fits from its "
                        "own steps), and short waiting prompts get a step of their own, keeping the time to first "
                        "token of short requests low under a flood of long prompts; a lone request still gets "
                        "--max-num-batched-tokens. 0: off (default %(default)s)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse KV blocks of shared prefixes")
    g.add_argument("--kv-tier-gib", type=float, default=d.kv_tier_gib, metavar="GIB",
                   help="keep blocks evicted from the KV cache in a lower tier of this many GiB (host memory, or "
                        "files under --kv-tier-path) and bring them back for a request that needs them instead of "
                        "prefilling them again; 0: no tier")
    g.add_argument("--kv-tier-path", default=d.kv_tier_path, metavar="DIR",
                   help="directory of the lower tier on local disk (emptied at start); default: host memory")
    g.add_argument("--kv-pin-fraction", type=float, default=d.kv_pin_fraction, metavar="SHARE",
                   help="share of the KV blocks that prefixes marked with cache_control may pin (kept from eviction "
                        "for their ttl, 5m or 1h, refreshed by every request that reads them); a request that would "
                        "pin more is refused with 429 cache_pin_limit_exceeded. Pins never take the room a "
                        "request of --max-model-len needs (on a KV cache no larger than that nothing is pinned); "
                        "0: cache_control is accepted and ignored (default %(default)s)")
    g.add_argument("--kv-pin-tenant-fraction", type=float, default=d.kv_pin_tenant_fraction, metavar="SHARE",
                   help="share of the KV blocks one tenant (the x-llm-d-inference-fairness-id header; requests "
                        "without it are one tenant) may pin, within --kv-pin-fraction (default %(default)s)")
    g.add_argument("--hash-seed", type=int, default=d.hash_seed,
                   help="seed of the prefix block hashes (must match the routers')")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of requests sampled without their own seed")
    g.add_argument("--num-threads", type=int, default=None,
                   help="CPU threads for torch (default: all usable cores, i.e. those of --cpu-cores if given)")
    g.add_argument("--cpu-cores", default=None,
                   help="pin the engine process to these cores, a Linux CPU list like 0, 0-1 or 0,2-3 "
                        "(default: no pinning)")
    g.add_argument("--deterministic", action="store_true", default=d.deterministic,
                   help="bit-for-bit the same tokens and logprobs for a request whatever else shares its steps and "
                        "whatever the prefix cache holds (batch-invariant kernels with fixed reduction orders; CPUs "
                        "with the fused kernels, bfloat16 or float32, no LoRA). Default: off, the fastest kernel per "
                        "step size; see docs/engine.md#determinism")
    g.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=d.cuda_graphs,
                   help="replay CUDA graphs of the decode step, captured at start-up per batch-size bucket. Default: "
                        "on wherever they apply (a CUDA device, the triton backend, no LoRA), off elsewhere; "
                        "--no-cuda-graphs runs every step eagerly")
    g.add_argument("--engine-core", default=d.engine_core, choices=ENGINE_CORES,
                   help="process (default): the loop that schedules, runs the model and samples runs in a process of "
                        "its own, so the HTTP server's work overlaps its steps; thread: in the server's process "
                        "(one fewer process, for a single core)")
    lo = parser.add_argument_group("LoRA adapters (PEFT format: adapter_config.json + adapter_model.safetensors)")
    lo.add_argument("--enable-lora", action="store_true", default=d.enable_lora,
                    help="serve LoRA adapters, named as a request's model (implied by --lora-modules); adapters can "
                         "then be added at run time with POST /v1/load_lora_adapter")
    lo.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                    help="adapters to serve from start: NAME=PATH (a PEFT adapter directory) or vLLM's JSON "
                         "'{\"name\": ..., \"path\": ...}'")
    lo.add_argument("--max-loras", type=int, default=d.max_loras,
                    help="most adapters one step runs together (default %(default)s)")
    lo.add_argument("--max-cpu-loras", type=int, default=None,
                    help="most adapters kept read in memory, least recently used dropped first (default: --max-loras)")
    lo.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                    help="the largest adapter rank accepted (default %(default)s)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding, vLLM's JSON object: '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                        "4, \"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}' (prompt lookup: drafts copied from "
                        "the prompt and output, verified in one step, greedy output unchanged) or "
                        "'{\"method\": \"suffix\", \"num_speculative_tokens\": 8}' (suffix decoding: the most "
                        "frequent continuation in the request's own tokens and recent requests' outputs; "
                        "suffix_decoding_* fields as vLLM's) or '{\"method\": \"draft_model\", \"model\": PATH, "
                        "\"num_speculative_tokens\": 4}' (a smaller model of the same vocabulary drafts); optional "
                        "\"disable_by_batch_size\" (default 16): no drafts in steps with more running sequences. "
                        "Drafting stops by itself while it measures slower than no drafts (the gate). "
                        "Default: off; see docs/engine.md#speculative-decoding")
    t = parser.add_argument_group("fault injection (for tests and chaos drills only; off by default)")
    t.add_argument("--debug-step-delay-ms", type=int, default=d.debug_step_delay_ms, metavar="MS",
                   help="sleep MS milliseconds after every engine step, making this replica slow (0: off)")
    t.add_argument("--debug-oom-every", type=int, default=d.debug_oom_every, metavar="N",
                   help="make every Nth model step raise MemoryError before it changes anything, exercising the "
                        "out-of-memory recovery (0: off)")
    return parser


def _check(ok: bool, flag: str, message: str) -> None:
    check(ok, flag, f"{flag}: {message}")


def _lora_module(text: str) -> tuple[str, str]:
    from engine.lora.request import parse_lora_module

    try:
        return parse_lora_module(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lora_modules(modules: object, model_name: str) -> None:
    _check(isinstance(modules, tuple) and all(isinstance(m, tuple) and len(m) == 2 and all(
        isinstance(v, str) and v for v in m) for m in modules), "--lora-modules",
        f"must be (name, path) pairs, got {modules!r}")
    names = [name for name, _ in modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    _check(not dup, "--lora-modules", f"names must be unique, got {dup} more than once")
    _check(model_name not in names, "--lora-modules", f"an adapter cannot take the base model's name {model_name!r}")


def _cpu_cores(text: object) -> None:
    try:
        cores = parse_cpu_list(text)
    except ValueError as e:
        raise ConfigError("--cpu-cores", f"--cpu-cores: {e}") from None
    usable = os.sched_getaffinity(0)
    outside = set(cores) - usable
    _check(not outside, "--cpu-cores", f"{text!r} names core(s) {format_cpu_list(outside)} that this process may "
                                       f"not use; usable: {format_cpu_list(usable)}")


def _choice(flag: str, value: object, choices: tuple[str, ...]) -> None:
    _check(value in choices, flag, f"must be one of {', '.join(choices)}; got {value!r}")
