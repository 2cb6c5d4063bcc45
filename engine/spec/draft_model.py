"""Drafts from a smaller model (`"method": "draft_model"`): k greedy tokens of the draft, batched over the step.

The draft runs in the engine's process beside the target, on its own ModelRunner and its own paged KV cache:
blocks of the target's block size, a pool of them owned here (`DraftKV`), a table per sequence. It keeps, per
sequence, the tokens whose draft K/V it holds; at each proposal the part that still agrees with the sequence
(the target's tokens are only ever appended to) stays, and the rest is recomputed: the tokens the target emitted
since, and nothing of the drafts it rejected, whose slots are simply written over. So a proposal of k drafts for
a batch is k forward passes of the draft: the first over each sequence's unseen tokens (its whole prompt the
first time), then one token per sequence per pass.

Drafts are the draft's argmax: a point mass, for which the engine's acceptance rule (engine/spec/decoder.py:
sample the target's token, keep the draft while they agree) is exact, so the target's output distribution is
unchanged whatever the draft proposes. A draft model with another vocabulary size is refused at start.

Memory: the pool holds as many tokens as the target's cache, and the engine sizes the two together: each block
of its KV memory is the model's K/V and the draft's (its layers x KV heads x head dim) for as many tokens, so a
draft's cache takes its share of `--kv-cache-memory` or of the GPU's free memory, not memory beside it. When it
runs out, sequences not proposed for in this step give their draft blocks back (the longest idle first) and
recompute them when next proposed for; a sequence that still does not fit gets no drafts this step.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from contract.errors import ConfigError
from engine.attention import get_attention_backend
from engine.model.fast_paths import use_fast_paths
from engine.model.llama import LlamaForCausalLM, ModelConfig, UnsupportedModelError
from engine.model.loader import load_hf_config, load_model
from engine.model.registry import ModelNotFoundError, resolve_model
from engine.model_runner import ModelRunner, kv_bytes_per_token
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec.config import FLAG

logger = logging.getLogger(__name__)


class _DraftSeq:
    """The draft's view of one target sequence: what ModelRunner reads of a sequence."""

    __slots__ = ("seq_id", "token_ids", "num_computed_tokens", "block_table", "stable")

    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.token_ids: list[int] = []  # the target's tokens, then the drafts proposed last
        self.num_computed_tokens = 0  # of token_ids, those whose draft K/V is in this cache
        self.block_table: list[int] = []
        self.stable = 0  # token_ids[:stable] were copied from the target sequence: known to agree with it

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftKV:
    """The draft's block pool: a free list, blocks handed out per sequence and given back whole."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = list(range(num_blocks - 1, -1, -1))

    def grow(self, ds: _DraftSeq, num_tokens: int) -> bool:
        """Enough blocks in ds's table for num_tokens tokens; False (nothing taken) when the pool is short."""
        need = -(-num_tokens // self.block_size) - len(ds.block_table)
        if need > len(self.free):
            return False
        for _ in range(max(0, need)):
            ds.block_table.append(self.free.pop())
        return True

    def release(self, ds: _DraftSeq) -> None:
        self.free.extend(reversed(ds.block_table))
        ds.block_table = []
        ds.num_computed_tokens = 0
        ds.stable = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)


class DraftWeights(NamedTuple):
    """A loaded draft model, before its KV pool is sized (the engine sizes its own cache and the draft's together)."""

    model: LlamaForCausalLM
    backend: object
    max_model_len: int
    path: str

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(self.model.config, dtype)

    def runner(self, num_blocks: int, block_size: int, device: torch.device, max_num_seqs: int) -> DraftModel:
        """The draft on a pool of num_blocks blocks: the engine's own count (its caches hold as many tokens)."""
        cfg = self.model.config
        logger.info("draft model %s: %d layers, hidden %d, %d KV blocks of %d tokens of its own", self.path,
                    cfg.num_layers, cfg.hidden_size, num_blocks, block_size)
        return DraftModel(self.model, self.backend, num_blocks, block_size, device, max_num_seqs, self.max_model_len)


def load_draft(args, target: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_model_len: int) -> DraftWeights:
    """The draft model named by --speculative-config's `model`, in the target's dtype, on the same kind of
    kernels. A checkpoint that cannot be read, or whose vocabulary differs from the target's, is a ConfigError
    naming the field."""
    cfg = args.speculative_config
    where = f"{FLAG}: model {cfg.model!r}"
    try:
        source = resolve_model(cfg.model, args.allow_download)
        hf_config = load_hf_config(source)
        config = ModelConfig.from_hf(hf_config)
    except (ModelNotFoundError, UnsupportedModelError) as e:
        raise ConfigError(FLAG, f"{where}: {e}") from None
    if config.vocab_size != target.vocab_size:
        raise ConfigError(FLAG, f"{where}: its vocabulary has {config.vocab_size} tokens, the model's "
                                f"{target.vocab_size}; a draft model must share the model's tokenizer")
    max_len = min(max_model_len, config.max_position_embeddings)
    model, _ = load_model(source, dtype, device, max_len, hf_config=hf_config)
    backend = get_attention_backend(args.attention_backend, device, dtype, args.deterministic)
    return DraftWeights(use_fast_paths(model, backend.name, dtype, args.deterministic), backend, max_len, source.path)


class DraftModel:
    def __init__(self, model: LlamaForCausalLM, backend, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", max_num_seqs: int = 256, max_model_len: int | None = None):
        self.model = model
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.runner = ModelRunner(model, backend, num_blocks, block_size, device, max_num_seqs=max_num_seqs,
                                  max_model_len=max_model_len, persistent_decode=False)
        self.kv = DraftKV(num_blocks, block_size)
        self._seqs: OrderedDict[int, _DraftSeq] = OrderedDict()  # by seq_id, least recently proposed for first
        self.num_forward_passes = 0
        self.last_cost_s = 0.0  # the last propose's passes, each at a one-token pass's time (engine/spec/draft_gate.py)

    def propose(self, wanted: Seq[tuple[Sequence, int]]) -> dict[int, list[int]]:
        """Up to k drafts per (sequence, k), by seq_id: the draft model's greedy continuation of its tokens."""
        self.last_cost_s = 0.0
        live: list[tuple[_DraftSeq, int]] = []
        ids = {seq.seq_id for seq, k in wanted if k > 0}
        for seq, k in wanted:
            k = min(k, self.max_model_len - seq.num_tokens + 1)  # the last draft is not fed: positions < max len
            if k <= 0:
                continue
            ds = self._sync(seq)
            if not self._room(ds, seq.num_tokens + k - 1, ids):
                continue
            live.append((ds, k))
        drafts: dict[int, list[int]] = {ds.seq_id: [] for ds, _ in live}
        wants = {ds.seq_id: k for ds, k in live}
        rows = [(ds, ds.num_tokens - ds.num_computed_tokens) for ds, _ in live]  # first pass: each one's unseen tokens
        times: list[float] = []
        while rows:
            step = [ScheduledSeq(ds, n) for ds, n in rows]  # type: ignore[arg-type]  # a _DraftSeq reads as a Sequence
            t = time.perf_counter()
            logits, _ = self.runner.execute(step)
            self.num_forward_passes += 1
            following = []
            for (ds, n), tok in zip(rows, logits.argmax(dim=-1).tolist(), strict=True):
                ds.num_computed_tokens += n
                ds.token_ids.append(tok)
                out = drafts[ds.seq_id]
                out.append(tok)
                if len(out) < wants[ds.seq_id]:
                    following.append((ds, 1))
            rows = following
            times.append(time.perf_counter() - t)
        # what these passes cost in steady state: each as a one-token pass (a first pass over many unseen tokens is
        # the catch-up of steps that did not draft)
        self.last_cost_s = len(times) * (sum(times[1:]) / (len(times) - 1) if len(times) > 1 else sum(times))
        return drafts

    def _sync(self, seq: Sequence) -> _DraftSeq:
        """ds for seq, its computed tokens cut to where they still agree with seq's, its tokens made seq's."""
        ds = self._seqs.pop(seq.seq_id, None)
        if ds is None:
            ds = _DraftSeq(seq.seq_id)
        self._seqs[seq.seq_id] = ds  # most recently proposed for: last to be evicted
        target = seq.token_ids
        same = min(ds.stable, len(target))
        end = min(ds.num_computed_tokens, len(target))
        while same < end and ds.token_ids[same] == target[same]:
            same += 1
        # the last token is fed again even where its K/V is kept (the target's token equal to a draft fed before):
        # its logits are the first draft's
        ds.num_computed_tokens = min(ds.num_computed_tokens, same, len(target) - 1)
        ds.token_ids = list(target)
        ds.stable = len(target)
        return ds

    def _room(self, ds: _DraftSeq, num_tokens: int, keep: set[int]) -> bool:
        """Blocks for num_tokens of ds, evicting the draft caches of sequences not in `keep`, oldest first."""
        while not self.kv.grow(ds, num_tokens):
            victim = next((s for sid, s in self._seqs.items() if sid not in keep and s.block_table), None)
            if victim is None:
                return False
            self.kv.release(victim)
        return True

    def unseen(self, seq: Sequence) -> int:
        """Tokens of seq the draft would compute before its first draft (its whole prompt if it never drafted)."""
        ds = self._seqs.get(seq.seq_id)
        return seq.num_tokens - (min(ds.num_computed_tokens, ds.stable) if ds is not None else 0)

    def finished(self, seq: Sequence) -> None:
        ds = self._seqs.pop(seq.seq_id, None)
        if ds is not None:
            self.kv.release(ds)

    @property
    def num_tracked(self) -> int:
        return len(self._seqs)
