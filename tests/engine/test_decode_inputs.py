"""Persistent decode inputs (engine/decode_inputs.py): exact buffer contents and incremental table writes,
and the engine on the bundled SmolLM2 giving the same greedy tokens as with inputs rebuilt every step."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import buckets_for
from engine.decode_inputs import DecodeInputs
from engine.model.loader import load_model
from engine.model.registry import resolve_model
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence

BS = 4


def decoding(prompt_len: int, blocks: list[int]) -> Sequence:
    seq = Sequence("r", list(range(10, 10 + prompt_len)))
    seq.num_computed_tokens = prompt_len - 1  # the last token is the new one
    seq.block_table = list(blocks)
    return seq


def step(inp: DecodeInputs, seqs: list[Sequence], padded: int | None = None):
    longest, width = inp.fill([ScheduledSeq(s, 1) for s in seqs], padded)
    b = padded or len(seqs)
    inp.derive(b)
    return inp.metadata(b, longest, width)


def test_buffers_hold_the_step_and_padding_rows_write_nothing():
    inp = DecodeInputs(8, 6, BS, torch.device("cpu"))
    a, b = decoding(5, [7, 3]), decoding(9, [1, 2, 0])
    meta = step(inp, [a, b], padded=4)
    assert inp.input_ids[:2].tolist() == [14, 18]
    assert inp.positions[:4].tolist() == [4, 8, 0, 0]
    assert meta.seq_lens.tolist() == [5, 9, 0, 0]
    assert meta.slot_mapping.tolist() == [3 * BS + 0, 0 * BS + 0, -1, -1]  # pos 4 -> block 1; pos 8 -> block 2
    assert meta.block_tables[:2, :3].tolist() == [[7, 3, 0], [1, 2, 0]]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.max_query_len == 1 and meta.max_seq_len == 9
    assert meta.seq_lens_host == (5, 9, 0, 0)


def test_block_tables_are_written_incrementally():
    inp = DecodeInputs(4, 8, BS, torch.device("cpu"))
    a, b = decoding(4, [5]), decoding(2, [6])
    step(inp, [a, b])
    assert (inp.rows_rewritten, inp.blocks_written) == (2, 2)
    a.num_computed_tokens, a.token_ids = 4, a.token_ids + [1]  # a's 5th token needs a new block
    a.block_table.append(9)
    b.num_computed_tokens, b.token_ids = 2, b.token_ids + [1]
    meta = step(inp, [a, b])
    assert (inp.rows_rewritten, inp.blocks_written) == (2, 3)  # only block 9 was written
    assert meta.slot_mapping.tolist() == [9 * BS, 6 * BS + 2]
    b.block_table[-1] = 11  # copy-on-write replaced b's last block: its row is rewritten
    meta = step(inp, [a, b])
    assert (inp.rows_rewritten, inp.blocks_written) == (3, 4)
    assert meta.slot_mapping.tolist() == [9 * BS, 11 * BS + 2]
    meta = step(inp, [b, a])  # rows now hold other sequences: both rewritten
    assert inp.rows_rewritten == 5  # (columns past a sequence's own blocks are stale: never read)
    assert meta.block_tables[0, :1].tolist() == [11] and meta.block_tables[1, :2].tolist() == [5, 9]
    inp.invalidate()
    step(inp, [b, a])
    assert inp.rows_rewritten == 7


def test_too_many_sequences_or_blocks_name_the_limit():
    inp = DecodeInputs(2, 2, BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        step(inp, [decoding(2, [0])] * 3)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        step(inp, [decoding(12, [0, 1, 2])])


def test_steps_that_do_not_fit_are_told_apart():
    """The runner sends these to the rebuilt path (forks can outnumber max_num_seqs for a while)."""
    inp = DecodeInputs(2, 2, BS, torch.device("cpu"))
    assert inp.fits([ScheduledSeq(decoding(2, [0]), 1)] * 2)
    assert not inp.fits([ScheduledSeq(decoding(2, [0]), 1)] * 3)
    assert not inp.fits([ScheduledSeq(decoding(12, [0, 1, 2]), 1)])


def test_graph_buckets():
    assert buckets_for(1) == [1]
    assert buckets_for(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert buckets_for(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(resolve_model("smollm2"), torch.float32, "cpu", 256)


def greedy(loaded, persistent: bool) -> tuple[list[list[int]], LLM]:
    llm = LLM("smollm2", loaded_model=loaded, dtype="float32", max_model_len=256, num_blocks=12, block_size=8,
              max_num_seqs=6, max_num_batched_tokens=32, num_threads=2, attention_backend="torch")
    if not persistent:
        llm.engine.runner.decode_inputs = None  # every step rebuilt from the sequences, as before
    prompts = ["The capital of France is", "Once upon a time", "The capital of France is a city",
               "1, 2, 3, 4,", "def fib(n):"]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)] * 4 + [
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2)]
    outs = llm.generate(prompts, params)
    return [list(c.token_ids) for o in outs for c in o.outputs], llm


def test_engine_greedy_tokens_equal_with_persistent_decode_inputs(smollm2):
    """Chunked prefill, prefix hits, a fork (n=2: copy-on-write of the shared last block) and preemption
    (12 blocks of 8 tokens for 6 sequences of up to 22 tokens) mixed with decode-only steps."""
    before, _ = greedy(smollm2, persistent=False)
    after, llm = greedy(smollm2, persistent=True)
    assert after == before
    assert llm.engine.stats().num_preemptions > 0, "the test should have preempted a sequence"
    inp = llm.engine.runner.decode_inputs
    assert inp.blocks_written < inp.rows_rewritten * 8, "block tables should have been written incrementally"
