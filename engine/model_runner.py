"""Run the model on one scheduler step: flatten the batch, execute block copies, return logits.

The runner owns the paged KV cache (one [num_blocks, block_size, kv_heads, head_dim] K and V tensor
per layer). For each step it builds input ids, positions, slot mapping and AttentionMetadata with a
handful of tensor ops (no per-token Python loop), copies the copy-on-write blocks in every layer, and
returns float32 logits only for the sequences whose every known token is now computed: exactly the
rows the engine samples from (a sequence verifying k draft tokens, engine/spec/, gets k+1 rows in a row, one
per position). Decode-only steps (one new token per sequence, every one sampled) take
persistent device buffers instead (engine/decode_inputs.py: filled in place, non-blocking copies, no
host synchronisation before the sampled tokens are read) and, with cuda_graphs, replay a captured
CUDA graph of the whole forward pass (engine/cuda_graphs.py). `warm_up()` compiles every kernel variant
(and captures the graphs) at start-up, before the first request. With `debug_oom_every` N > 0 (--debug-oom-every, for tests and chaos
drills) every Nth model step raises MemoryError before it changes anything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs, buckets_for
from engine.decode_inputs import DecodeInputs
from engine.model.llama import LlamaForCausalLM, ModelConfig
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

logger = logging.getLogger(__name__)

GIB = 1 << 30


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """layers x 2 (K and V) x kv_heads x head_dim x bytes per element."""
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * elem


def num_blocks_for_memory(config: ModelConfig, dtype: torch.dtype, block_size: int, memory_gib: float) -> int:
    """How many KV blocks fit in memory_gib GiB."""
    return int(memory_gib * GIB) // (kv_bytes_per_token(config, dtype) * block_size)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seqs: list[Sequence]  # row i of the logits belongs to sample_seqs[i] (k+1 rows for one with k drafts)


def graphs_apply(asked: bool | None, device_type: str, backend: str, persistent_decode: bool,
                 lora: bool) -> tuple[bool, str | None]:
    """(whether decode steps replay CUDA graphs, the warning to log when they were asked for and cannot).
    asked None (--cuda-graphs left unset): on wherever they apply, off elsewhere without a word."""
    if asked is False:
        return False, None
    if not (device_type == "cuda" and backend == "triton" and persistent_decode):
        why = "CUDA graphs need a CUDA device, the triton backend and persistent decode inputs: off"
    elif lora:
        why = "CUDA graphs do not capture the LoRA products yet: off with LoRA enabled"
    else:
        return True, None
    return False, (why if asked else None)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, backend, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", debug_oom_every: int = 0, max_num_seqs: int = 256,
                 max_model_len: int | None = None, persistent_decode: bool = True, cuda_graphs: bool | None = False,
                 lora=None):
        """persistent_decode: decode-only steps run from persistent buffers (False: rebuilt each step, as
        before; kept for the equality test). cuda_graphs: replay captured graphs for decode steps (CUDA and
        the triton backend only; captured by warm_up); None: wherever that applies, off elsewhere without a
        warning. lora: the engine's LoRAManager (engine/lora/), told each
        step which rows run under which adapter; None: LoRA is off."""
        self.model = model
        self.lora = lora
        self.debug_oom_every = debug_oom_every
        self.num_model_steps = 0
        self.backend = backend
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=self.device),
                           torch.zeros(shape, dtype=dtype, device=self.device)) for _ in range(cfg.num_layers)]
        max_blocks = num_blocks if max_model_len is None else min(num_blocks, -(-max_model_len // block_size))
        self.decode_inputs = (DecodeInputs(max_num_seqs, max_blocks, block_size, self.device)
                              if persistent_decode else None)
        cuda_graphs, why_not = graphs_apply(cuda_graphs, self.device.type, backend.name, persistent_decode,
                                            lora is not None)
        if why_not:
            logger.warning(why_not)
        self.graphs = DecodeGraphs(model, self.kv_caches, backend, self.decode_inputs) if cuda_graphs else None
        per_token = kv_bytes_per_token(cfg, dtype)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f KiB/token, %.2f GiB, %s)",
                    num_blocks, block_size, num_blocks * block_size, per_token / 1024,
                    per_token * num_blocks * block_size / GIB, dtype)

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduled: Seq[ScheduledSeq], blocks_to_copy: Seq[tuple[int, int]] = ()
                ) -> tuple[torch.Tensor, list[Sequence]]:
        """Copy blocks, run the forward pass; (logits [len(sample_seqs), vocab] float32, sample_seqs)."""
        if scheduled:
            self.num_model_steps += 1
            if self.debug_oom_every and self.num_model_steps % self.debug_oom_every == 0:
                raise MemoryError(f"--debug-oom-every {self.debug_oom_every}: simulated out of memory in model "
                                  f"step {self.num_model_steps}")
        if blocks_to_copy:
            self.copy_blocks(blocks_to_copy)
        if not scheduled:
            return torch.empty(0, self.model.config.vocab_size), []
        if self.lora is not None:
            self.lora.set_batch(scheduled)  # rows are in `scheduled` order on both paths below
        if self.decode_inputs is not None:
            if (all(it.num_new_tokens == 1 and it.seq.num_computed_tokens + 1 == it.seq.num_tokens for it in scheduled)
                    and self.decode_inputs.fits(scheduled)):
                return self._execute_decode(scheduled), [it.seq for it in scheduled]
            self.decode_inputs.invalidate()
        inp = self.prepare(scheduled)
        if not inp.sample_seqs:  # only prefill chunks that do not reach the end of their prompt
            self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, self.backend, inp.logits_indices)
            return torch.empty(0, self.model.config.vocab_size), []
        logits = self.model(inp.input_ids, inp.positions, self.kv_caches, inp.meta, self.backend,
                            inp.logits_indices)
        return logits, inp.sample_seqs

    def _execute_decode(self, scheduled: Seq[ScheduledSeq]) -> torch.Tensor:
        n = len(scheduled)
        inp = self.decode_inputs
        bucket = self.graphs.bucket(n) if self.graphs is not None else None
        longest, width = inp.fill(scheduled, bucket or n)
        if bucket is not None:
            return self.graphs.replay(n, bucket)
        inp.derive(n)
        return self.model(inp.input_ids[:n], inp.positions[:n], self.kv_caches, inp.metadata(n, longest, width),
                          self.backend)

    @torch.inference_mode()
    def warm_up(self, prefill_tokens: int = 64) -> None:
        """Run every kernel variant once now (a prefill and decode steps at each graph bucket, nothing
        written to the cache), and capture the CUDA graphs if enabled, so no request pays for compilation.
        Only the triton backend compiles anything; for the others this does nothing."""
        if self.backend.name != "triton":
            return
        dev, bs, cfg = self.device, self.block_size, self.model.config
        variants = self._precompile() if dev.type == "cuda" else None
        if self.decode_inputs is not None:
            self.backend.reserve(self.decode_inputs.max_num_seqs, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dev)
        t = max(1, min(prefill_tokens, self.num_blocks * bs))
        nblk = -(-t // bs)
        meta = AttentionMetadata(
            slot_mapping=torch.full((t,), -1, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            block_tables=torch.zeros((1, nblk), dtype=torch.int32, device=dev), max_query_len=t, max_seq_len=t,
            query_lens_host=(t,), seq_lens_host=(t,))
        ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.model(ids, torch.arange(t, device=dev), self.kv_caches, meta, self.backend,
                   torch.tensor([t - 1], device=dev))
        if self.decode_inputs is not None:
            inp = self.decode_inputs
            inp.seq_lens.zero_()
            for b in buckets_for(inp.max_num_seqs):  # the batch sizes the graphs (if any) will use
                inp.fill([], b)
                inp.derive(b)
                self.model(inp.input_ids[:b], inp.positions[:b], self.kv_caches, inp.metadata(b, 0), self.backend)
            if self.graphs is not None:
                self.graphs.capture()
            inp.invalidate()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if variants is not None:
            from engine.kernels.variants import unexpected_compiles

            missed = unexpected_compiles(*variants)
            if missed:
                logger.warning("warm-up compiled Triton variants engine/kernels/variants.py does not enumerate "
                               "(python -m loadtest.gpu_compile does not check them): %s", "; ".join(missed))

    def _precompile(self) -> tuple[list, dict[str, int]]:
        """Compile the enumerated Triton variants (engine/kernels/variants.py) before the warm-up passes;
        returns them with each kernel's count of binaries before, for the check after the passes."""
        from engine.kernels.variants import compiled_counts, precompile

        lora_rank = self.lora.max_rank if self.lora is not None and self.lora.batch.kernel else 0
        variants = self.backend.kernel_variants(self.model.config, self.model.embed_tokens.weight.dtype,
                                                self.block_size, self.max_num_seqs, self.device, lora_rank)
        before = compiled_counts(variants)
        logger.info("compiled %d of %d Triton kernel variants", precompile(variants), len(variants))
        return variants, before

    def prepare(self, scheduled: Seq[ScheduledSeq]) -> StepInputs:
        ids: list[int] = []
        starts: list[int] = []
        q_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        row = 0
        for item in scheduled:
            seq, n, drafts = item.seq, item.num_new_tokens, item.spec_token_ids
            c = seq.num_computed_tokens
            if n == 1:
                ids.append(seq.token_ids[c])
            elif drafts:  # its last token and the drafts it verifies: a short chunk, every row sampled
                ids.append(seq.token_ids[c])
                ids.extend(drafts)
            else:
                ids.extend(seq.token_ids[c:c + n])
            starts.append(c)
            q_lens.append(n)
            seq_lens.append(c + n)
            tables.append(seq.block_table)
            row += n
            if drafts:
                sample_rows.extend(range(row - n, row))
                sample_seqs.extend([seq] * n)
            elif c + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq)
        dev = self.device
        bs = self.block_size
        num_tokens = len(ids)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32, device=dev)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        if num_tokens == len(scheduled):  # decode only: one token per sequence
            positions = seq_lens_t.long() - 1
            seq_idx = torch.arange(num_tokens, device=dev)
            query_start_loc = torch.arange(num_tokens + 1, dtype=torch.int32, device=dev)
        else:
            q_lens_t = torch.tensor(q_lens, device=dev)
            seq_idx = torch.repeat_interleave(torch.arange(len(scheduled), device=dev), q_lens_t)
            query_start_loc = torch.zeros(len(scheduled) + 1, dtype=torch.int32, device=dev)
            torch.cumsum(q_lens_t, 0, out=query_start_loc[1:])
            offsets = torch.tensor(starts, device=dev) - query_start_loc[:-1].long()
            positions = torch.arange(num_tokens, device=dev) + offsets[seq_idx]
        slot_mapping = block_tables[seq_idx, positions // bs].long() * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens_t,
            block_tables=block_tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            query_lens_host=tuple(q_lens), seq_lens_host=tuple(seq_lens))
        return StepInputs(torch.tensor(ids, dtype=torch.long, device=dev), positions, meta,
                          torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_seqs)

    def copy_blocks(self, blocks_to_copy: Seq[tuple[int, int]]) -> None:
        """Copy-on-write: block src's contents into block dst, in every layer's K and V cache."""
        src = torch.tensor([s for s, _ in blocks_to_copy], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in blocks_to_copy], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for k_cache, v_cache in self.kv_caches:
                k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
                v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
