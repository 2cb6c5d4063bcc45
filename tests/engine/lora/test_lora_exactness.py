"""LoRA adapters are exact: greedy tokens under each adapter equal PEFT's (Hugging Face model + adapter), in float32.

Three adapters made here with `peft` on SmolLM2 (tests/engine/lora/_adapters.py: ranks 8, 16, 64; attention
only, MLP only, all seven projections; non-zero B from a fixed seed). One engine (LoRA on, 4 slots) serves:
each adapter alone; one batch mixing the three adapters and the base model (each row gets exactly its own
tokens); the same after the adapters are dropped and read again under new ids (unload + load); and the
prefix cache keyed by adapter (the same prompt under two adapters shares no cached token, twice under one
does). The default run takes 4 prompts x 16 tokens; the full 16 prompts x 32 tokens run under -m slow.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.lora.request import LoRARequest  # noqa: E402
from engine.model.registry import resolve_model  # noqa: E402
from tests.engine.lora._adapters import ADAPTERS, hf_base, make_adapters, peft_greedy  # noqa: E402

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Translate to French: I love reading books in the garden.",
    "日本の首都は東京です。東京について教えてください。",
    "Emoji story: 🐱🚀🌙 Once upon a time",
    "Привет! Как дела? Расскажи мне о Москве.",
    "1, 2, 3, 4, 5,",
    "Write a haiku about autumn.",
    "The three laws of thermodynamics are",
    "Once upon a time in a small village by the sea, there lived an old fisherman who",
    "Q: What is 12 times 7?\nA:",
    "import numpy as np\n\ndef softmax(x):",
    "The best way to learn a new language is",
    "Hi",
    "In 1969, the first humans landed on",
]
QUICK = [0, 1, 4, 10]
NAMES = list(ADAPTERS)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(PEFT model holding the three adapters, {name: directory}, the engine)."""
    source = resolve_model("smollm2")
    peft_model, paths = make_adapters(hf_base(source), str(tmp_path_factory.mktemp("adapters")))
    llm = LLM("smollm2", dtype="float32", max_model_len=512, num_blocks=512, max_num_seqs=32, seed=0, num_threads=1,
              enable_lora=True, max_loras=4, max_cpu_loras=4, max_lora_rank=64)
    return peft_model, paths, llm


def _lora(paths, name: str | None, generation: int = 0) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, 1 + NAMES.index(name) + 10 * generation, paths[name])


def _params(paths, name, new_tokens, generation=0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, lora=_lora(paths, name, generation))


@pytest.fixture(scope="module", params=["quick", pytest.param("full", marks=pytest.mark.slow)])
def case(request, setup):
    """(prompt token lists, new tokens, {adapter name or None: PEFT's greedy tokens per prompt})."""
    peft_model, _, llm = setup
    indices, new_tokens = (QUICK, 16) if request.param == "quick" else (range(len(PROMPTS)), 32)
    prompts = [llm.tokenizer.encode(PROMPTS[i]) for i in indices]
    refs = {name: peft_greedy(peft_model, name, prompts, new_tokens) for name in [None, *NAMES]}
    return prompts, new_tokens, refs


def test_adapters_change_the_output(case):
    """Each adapter's reference differs from the base model's (non-zero B), so equality below means something."""
    _, _, refs = case
    for name in NAMES:
        assert refs[name] != refs[None], f"{name} produces the base model's tokens"


@pytest.mark.parametrize("name", NAMES)
def test_each_adapter_equals_peft(setup, case, name):
    _, paths, llm = setup
    prompts, new_tokens, refs = case
    outs = llm.generate(prompts, _params(paths, name, new_tokens))
    assert [o.outputs[0].token_ids for o in outs] == refs[name]


def test_mixed_batch_gives_each_row_its_own_tokens(setup, case):
    """Every prompt under the base model and each adapter, all in one batch (rows interleaved)."""
    _, paths, llm = setup
    prompts, new_tokens, refs = case
    names = [None, *NAMES]
    jobs = [(i, name) for i in range(len(prompts)) for name in names]
    outs = llm.generate([prompts[i] for i, _ in jobs], [_params(paths, name, new_tokens) for _, name in jobs])
    got = {(i, name): o.outputs[0].token_ids for (i, name), o in zip(jobs, outs, strict=True)}
    for i, name in jobs:
        assert got[(i, name)] == refs[name][i], f"prompt {i} under {name or 'the base model'}"
    assert llm.engine.lora.slots.count(None) == 4 - len(NAMES)  # three adapter slots in use, one free


def test_unload_and_load_again(setup, case):
    """Adapters dropped from memory and slots, then named again under new ids (what unload + load does): the
    same tokens, read from disk again."""
    _, paths, llm = setup
    prompts, new_tokens, refs = case
    manager = llm.engine.lora
    for name in NAMES:
        llm.engine.remove_lora(_lora(paths, name).id)
    assert not manager.cpu and all(s is None for s in manager.slots)
    loads = manager.loads
    names = [*NAMES, None]
    outs = llm.generate([p for p in prompts for _ in names],
                        [_params(paths, name, new_tokens, generation=1) for _ in prompts for name in names])
    got = [o.outputs[0].token_ids for o in outs]
    want = [refs[name][i] for i in range(len(prompts)) for name in names]
    assert got == want
    assert manager.loads == loads + len(NAMES)


def test_prefix_cache_is_keyed_by_adapter(setup):
    """The same 3-block prompt: under adapter a, then adapter b (no cached token), then a again (all its full
    blocks but the last token's), then the base model (none)."""
    _, paths, llm = setup
    prompt = llm.tokenizer.encode("Prefix isolation: " + "the quick brown fox jumps over the lazy dog " * 6)
    assert len(prompt) >= 48
    kv = llm.engine.kv
    full = (len(prompt) - 1) // 16 * 16

    def hits(name) -> int:
        before = kv.prefix_hits_tokens
        llm.generate([prompt], _params(paths, name, 2, generation=2))
        return kv.prefix_hits_tokens - before

    assert hits("attn-r8") == 0
    assert hits("mlp-r16") == 0  # same tokens, another adapter: nothing shared
    assert hits("attn-r8") == full  # same adapter again: cached
    assert hits(None) == 0  # the base model shares nothing with either
    assert hits(None) == full
