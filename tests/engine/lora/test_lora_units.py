"""LoRA pieces without a model: adapter checks, the gathered products against a per-row reference, the
step's row groups, adapter-keyed block hashes and KV events, the scheduler's slot limit, the flags."""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from torch import nn

from contract.errors import ConfigError
from contract.hashing import hash_blocks
from contract.kv_events import KVEvent, KVEventKind
from contract.kv_wire import decode_line, encode_line
from engine.args import EngineArgs, add_cli_args
from engine.config import SchedulerConfig
from engine.kernels import cpu_ops
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.lora.adapter import LoRAError, load_adapter
from engine.lora.layers import LoRABatch, LoRALinear
from engine.lora.request import LoRARequest, parse_lora_module
from engine.model.llama import ModelConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from tests.engine.lora._adapters import write_adapter

TINY = ModelConfig(vocab_size=100, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=4, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=True)
TINY_SHAPES = {"layers": 2, "q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
               "gate_proj": (16, 32), "up_proj": (16, 32), "down_proj": (32, 16)}


# ---- adapters ------------------------------------------------------------------------------------

def test_adapter_is_read_with_its_scale_folded_into_b(tmp_path):
    path = write_adapter(str(tmp_path / "a"), rank=4, targets=("q_proj", "down_proj"), shapes=TINY_SHAPES, alpha=2)
    w = load_adapter(path, TINY, max_rank=8)
    assert w.rank == 4 and w.modules == ("q_proj", "down_proj") and len(w.tensors) == 4
    from safetensors.torch import load_file

    raw = load_file(os.path.join(path, "adapter_model.safetensors"))
    b = raw["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"]
    assert torch.equal(w.tensors[(1, "down_proj")][1], b * 0.5)  # alpha / r = 2 / 4
    rs = load_adapter(write_adapter(str(tmp_path / "rs"), rank=4, shapes=TINY_SHAPES, alpha=2, use_rslora=True),
                      TINY, 8)
    b = load_file(os.path.join(str(tmp_path / "rs"), "adapter_model.safetensors"))[
        "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
    assert torch.allclose(rs.tensors[(0, "v_proj")][1], b * 1.0)  # alpha / sqrt(r) = 2 / 2


@pytest.mark.parametrize("case, param", [
    ("missing", "lora_path"), ("rank", "r"), ("shape", "lora_path"), ("layers", "lora_path"),
    ("target", "target_modules"), ("dora", "use_dora"), ("bias", "bias"), ("modules_to_save", "modules_to_save"),
    ("json", "lora_path"),
])
def test_adapter_errors_name_the_field(tmp_path, case, param):
    path = str(tmp_path / case)
    if case == "rank":
        write_adapter(path, rank=16, shapes=TINY_SHAPES)
    elif case == "shape":
        write_adapter(path, shapes={**TINY_SHAPES, "q_proj": (16, 12)})
    elif case == "layers":
        write_adapter(path, shapes={**TINY_SHAPES, "layers": 3})
    elif case == "target":
        write_adapter(path, shapes=TINY_SHAPES, target_modules=["q_proj", "embed_tokens"])
    elif case == "dora":
        write_adapter(path, shapes=TINY_SHAPES, use_dora=True)
    elif case == "bias":
        write_adapter(path, shapes=TINY_SHAPES, bias="all")
    elif case == "modules_to_save":
        write_adapter(path, shapes=TINY_SHAPES, modules_to_save=["lm_head"])
    elif case == "json":
        write_adapter(path, shapes=TINY_SHAPES)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write("{not json")
    with pytest.raises(LoRAError) as e:
        load_adapter(path, TINY, max_rank=8)
    assert e.value.param == param, str(e.value)


def test_tensor_of_an_unsupported_module_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = write_adapter(str(tmp_path / "emb"), shapes=TINY_SHAPES)
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 100)},
              os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAError) as e:
        load_adapter(path, TINY, max_rank=8)
    assert e.value.param == "target_modules" and "embed_tokens" in str(e.value)


# ---- the gathered products ------------------------------------------------------------------------

def _fused_kernels_or_off(fused: bool) -> None:
    """The fused CPU kernels must build wherever the suite runs (as tests/engine/kernels/test_cpu_kernels.py
    asserts); only KVFLEET_CPU_KERNELS=torch turns their cases off."""
    if not fused:
        return
    if os.environ.get(cpu_ops.ENV) == "torch":
        pytest.skip(f"{cpu_ops.ENV}=torch: the fused CPU kernels are off")
    assert cpu_ops.load(), f"the fused CPU kernels must build here: {cpu_ops.unavailable_reason()}"


@pytest.mark.parametrize("fused", [False, True], ids=["torch", "cpu-kernel"])
@pytest.mark.parametrize("repeat", [1, 6])  # 7 rows: every slot (masked, or the fused kernel); 42: per slot
def test_gathered_products_equal_a_per_row_reference(repeat, fused):
    """A fused q|k|v projection; slot 0 targets q and v (rank 3), slot 1 all three (rank 5), slot 2 is empty;
    rows of the three slots and the base interleaved."""
    _fused_kernels_or_off(fused)
    torch.manual_seed(0)
    sizes = [8, 4, 4]
    base = nn.Linear(6, 16, bias=False)
    batch = LoRABatch()
    batch.cpu_kernel = fused
    layer = LoRALinear(base, batch, sizes, 6, 3, 8, torch.float32, torch.device("cpu"))
    weights = {0: [(torch.randn(3, 6), torch.randn(8, 3)), None, (torch.randn(3, 6), torch.randn(4, 3))],
               1: [(torch.randn(5, 6), torch.randn(n, 5)) for n in sizes]}
    for slot, parts in weights.items():
        layer.set_slot(slot, parts)
    def reference(x, row_slots):
        want = base(x).detach().clone()
        for t, slot in enumerate(row_slots):
            if slot in weights:
                off = 0
                for pair, size in zip(weights[slot], sizes, strict=True):
                    if pair is not None:
                        want[t, off:off + size] += (x[t] @ pair[0].t()) @ pair[1].t()
                    off += size
        return want

    row_slots = [0, -1, 1, 1, 2, 0, -1] * repeat
    x = torch.randn(len(row_slots), 6)
    want = reference(x, row_slots)
    with torch.no_grad():
        batch.set(row_slots, x.device)
        assert batch.dense == (repeat == 1 and not fused) and (batch.fused_rows is not None) == fused
        assert [s for s, _ in batch.groups] == ([] if fused or repeat == 1 else [0, 1, 2])
        got = layer(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        batch.set([1] * 520, x.device)  # every row under one adapter, more than the fused kernel takes: no gather
        assert batch.groups[0][1] == slice(0, 520) and not batch.dense and batch.fused_rows is None
        mixed = [1] * 513 + [0, -1]  # a long run of slot 1 (matmuls) beside a decode of slot 0 (fused)
        batch.set(mixed, x.device)
        assert [s for s, _ in batch.groups] == ([1] if fused else [0, 1]) and (batch.fused_rows is not None) == fused
        x2 = torch.randn(len(mixed), 6)
        torch.testing.assert_close(layer(x2), reference(x2, mixed), rtol=1e-5, atol=1e-5)
        batch.set([-1] * 7, x.device)  # no adapter rows: the base path
        assert batch.groups == [] and torch.equal(layer(x), base(x))
        layer.clear_slot(1)
        batch.set([1, 0], x.device)
        assert torch.equal(layer(x[:2])[0], base(x[:2])[0])  # a cleared slot adds nothing


# ---- prefix cache keyed by adapter ----------------------------------------------------------------

def test_block_hashes_are_keyed_by_adapter_and_unchanged_without_one():
    tokens = list(range(40))
    base = hash_blocks(tokens, 16)
    a, b = hash_blocks(tokens, 16, adapter="a"), hash_blocks(tokens, 16, adapter="b")
    assert base == hash_blocks(tokens, 16, adapter=None)
    assert len({base[0], a[0], b[0]}) == 3 and len({base[1], a[1], b[1]}) == 3  # the whole chain differs
    # a cache_salt cannot spell an adapter (tagged, length-prefixed)
    assert hash_blocks(tokens, 16, cache_salt="\x02\x01\x00\x00\x00a") != a
    assert hash_blocks(tokens, 16, cache_salt="s", adapter="a") != hash_blocks(tokens, 16, cache_salt="s")


def test_kv_events_carry_the_adapter():
    kv = KVCacheManager(CacheConfig(16, 32, True, 0))
    lora = LoRARequest("a", 1, "/x")
    seq = Sequence("r", list(range(40)), SamplingParams(lora=lora))
    assert seq.lora is lora
    kv.allocate_slots(seq, 40)
    seq.num_computed_tokens = 40
    kv.cache_full_blocks(seq)
    (event,) = kv.drain_events()
    assert event.lora_name == "a" and event.block_hashes == tuple(hash_blocks(seq.token_ids, 16, None, 0,
                                                                              adapter="a"))
    line = encode_line("e1", event)
    assert json.loads(line)["lora_name"] == "a" and decode_line(line).message == event
    plain = KVEvent(1, KVEventKind.STORED, (5,), None)
    assert "lora_name" not in json.loads(encode_line("e1", plain)) and decode_line(encode_line("e1", plain)).message == plain


# ---- scheduling ------------------------------------------------------------------------------------

def test_a_step_never_needs_more_than_max_loras_adapters():
    kv = KVCacheManager(CacheConfig(16, 64, True, 0))
    sched = Scheduler(SchedulerConfig(256, 8, 256, max_loras=2), kv)
    loras = [LoRARequest(n, i, "/x") for i, n in enumerate("abc")]
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams(lora=lora)) for i, lora in
            enumerate([loras[0], None, loras[1], loras[0], loras[2], None])]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [it.seq.request_id for it in out.scheduled] == ["r0", "r1", "r2", "r3"]  # r4 (adapter c) waits
    assert {it.seq.lora.name for it in out.scheduled if it.seq.lora} == {"a", "b"}


# ---- flags ------------------------------------------------------------------------------------------

def test_lora_flags():
    parser = add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--max-loras", "2",
                            "--max-lora-rank", "64"])
    args = EngineArgs.from_cli(ns)
    assert args.lora_modules == (("a", "/x"), ("b", "/y")) and args.lora_enabled and args.max_cpu_loras is None
    assert not EngineArgs().lora_enabled and EngineArgs(enable_lora=True).lora_enabled
    assert EngineArgs(lora_modules={"a": "/x"}).lora_modules == (("a", "/x"),)
    assert parse_lora_module(" a = /p ") == ("a", "/p")
    for bad, field in [(dict(lora_modules=(("a", "/x"), ("a", "/y"))), "--lora-modules"),
                       (dict(lora_modules=(("smollm2", "/x"),)), "--lora-modules"),
                       (dict(max_loras=2, max_cpu_loras=1), "--max-cpu-loras"),
                       (dict(max_lora_rank=0), "--max-lora-rank"), (dict(max_loras=0), "--max-loras")]:
        with pytest.raises(ConfigError) as e:
            EngineArgs(**bad)
        assert e.value.field == field
    with pytest.raises(ValueError):
        parse_lora_module("no-path")


# the packed 4-bit kernel is one of the fused CPU kernels: it comes only with them
@pytest.mark.parametrize("fast, fused", [("onednn", False), ("onednn", True), ("q4", True)],
                         ids=["onednn-torch", "onednn-cpu-kernel", "q4-cpu-kernel"])
def test_gathered_products_on_the_fast_cpu_projections(fast, fused):
    """The wrapper adds the same products whatever the load swapped in for the projection (bf16 on CPU), in
    torch and in the fused CPU kernel."""
    from engine.model.cpu_linear import OneDnnLinear, Q4Linear, can_prepack
    from engine.model.quantized import find_q4, pack_q4

    _fused_kernels_or_off(fused)
    if not can_prepack(torch.bfloat16, "cpu"):
        pytest.skip("no oneDNN bf16 linear on this CPU")
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    base: nn.Module = OneDnnLinear(linear)
    if fast == "q4":
        q = torch.randint(0, 16, (48, 64))
        q[:, ::32], q[:, 1::32] = 0, 15  # every group of 32 spans all 16 levels
        with torch.no_grad():  # 4-bit data, as a GGUF Q4 checkpoint holds
            linear.weight.copy_((q * 0.0625).to(torch.bfloat16))
        found = find_q4((q * 0.0625).float())
        assert found is not None
        packed = pack_q4(*found)
        base = Q4Linear(OneDnnLinear(linear, packed), packed)
    batch = LoRABatch()
    batch.cpu_kernel = fused
    layer = LoRALinear(base, batch, [32, 16], 64, 1, 4, torch.bfloat16, torch.device("cpu"))
    a, b = torch.randn(4, 64).to(torch.bfloat16), torch.randn(16, 4).to(torch.bfloat16)
    layer.set_slot(0, [None, (a, b)])
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        plain = base(x).float()
        batch.set([0, -1, 0], x.device)
        got = layer(x).float()
    want = plain.clone()
    for t in (0, 2):
        want[t, 32:] += (x[t].float() @ a.float().t()) @ b.float().t()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)


def test_a_reloaded_adapter_never_finds_the_old_loads_blocks():
    kv = KVCacheManager(CacheConfig(16, 32, True, 0))
    old, new = LoRARequest("a", 1, "/v1"), LoRARequest("a", 2, "/v2")

    def run(lora) -> int:
        seq = Sequence("r", list(range(40)), SamplingParams(lora=lora))
        _, hit = kv.get_computed_blocks(seq)
        kv.allocate_slots(seq, 40)
        seq.num_computed_tokens = 40
        kv.cache_full_blocks(seq)
        kv.free(seq)
        return hit

    kv.on_adapter_load("a", 1)
    assert run(old) == 0 and run(old) == 32
    kv.drain_events()
    kv.on_adapter_load("a", 2)  # unload + load under the same name: maybe other weights
    (removed,) = kv.drain_events()  # every block of the old load's chains, not only their first ones
    assert removed.kind is KVEventKind.REMOVED
    assert set(removed.block_hashes) == set(hash_blocks(list(range(32)), 16, None, 0, adapter="a"))
    assert not kv.pool.cached
    assert run(new) == 0 and run(new) == 32
    assert run(old) == 0  # a request of the old load finds nothing and caches nothing
    kv.on_adapter_load("a", 1)  # an older load arriving late changes nothing
    assert run(new) == 32


def test_the_core_frees_an_unloaded_adapter():
    """POST /v1/unload_lora_adapter reaches the engine core as DropAdapter; the engine forgets the load's weights."""
    from engine.core.arena import ALIGN, Arena
    from engine.core.loop import CoreLoop
    from engine.core.messages import DropAdapter

    class Engine:
        dropped: list[int] = []

        def remove_lora(self, adapter_id):
            self.dropped.append(adapter_id)

        def has_unfinished_requests(self):
            return False

        def drain_kv_events(self):
            return []

        def stats(self):
            return None

    engine = Engine()
    CoreLoop(engine, Arena(ALIGN)).turn([DropAdapter(7)])
    assert engine.dropped == [7]
