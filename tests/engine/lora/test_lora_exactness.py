"""LoRA adapters are exact: greedy tokens under each adapter equal PEFT's (Hugging Face model + adapter), in float32.

Three adapters made here with `peft` on SmolLM2 (tests/engine/lora/_adapters.py: ranks 8, 16, 64; attention
only, MLP only, all seven projections; non-zero B from a fixed seed). One engine (LoRA on, 4 slots) serves:
each adapter alone; one batch mixing the three adapters and the base model (each row gets exactly its own
tokens); the same after the adapters are dropped and read again under new ids (unload + load); and the
prefix cache keyed by adapter (the same prompt under two adapters shares no cached token, twice under one
does). The default run takes 4 prompts x 16 tokens; the full 16 prompts x 32 tokens run under -m slow.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from engine import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.lora.request import LoRARequest  # noqa: E402
from engine.model.registry import resolve_model  # noqa: E402
from tests.engine._references import made_with, reference  # noqa: E402
from tests.engine.lora._adapters import (  # noqa: E402
    ADAPTERS,
    hf_base,
    make_adapters,
    peft_greedy,
    peft_model_of,
    write_adapters,
)

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
QUICK = [0, 4, 10]
NAMES = list(ADAPTERS)


@pytest.fixture(scope="module", autouse=True)
def one_thread(one_torch_thread):
    """One torch thread for the whole module (tests/engine/conftest.py)."""


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2", dtype="float32", max_model_len=512, num_blocks=512, max_num_seqs=64, seed=0, num_threads=1,
               enable_lora=True, max_loras=4, max_cpu_loras=4, max_lora_rank=64)


@dataclass(frozen=True)
class Case:
    name: str
    paths: dict[str, str]
    prompts: list[list[int]]
    new_tokens: int
    refs: dict  # adapter name ("" for the base model) -> PEFT's greedy tokens per prompt
    ids: int  # LoRARequest ids of this case start here

    def lora(self, name: str | None, generation: int = 0) -> LoRARequest | None:
        return None if name is None else LoRARequest(name, self.ids + NAMES.index(name) + 10 * generation,
                                                     self.paths[name])

    def params(self, name: str | None, generation: int = 0, new_tokens: int | None = None) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=new_tokens or self.new_tokens, ignore_eos=True,
                              lora=self.lora(name, generation))

    def ref(self, name: str | None) -> list[list[int]]:
        return self.refs[name or ""]


# quick (the default run): 4 prompts x 16 tokens, the adapters written to disk in PEFT's format from the recipe and
# PEFT's references kept in pytest's cache; full (-m slow): all 16 prompts x 32 tokens, the adapters made by peft
@pytest.fixture(scope="module", params=["quick", pytest.param("full", marks=pytest.mark.slow)])
def case(request, llm, tmp_path_factory) -> Case:
    directory = str(tmp_path_factory.mktemp(f"adapters-{request.param}"))
    source = resolve_model("smollm2")
    if request.param == "quick":
        prompts = [llm.tokenizer.encode(PROMPTS[i]) for i in QUICK]
        paths, new_tokens = write_adapters(directory), 16
        refs = _cached_refs(request, source, paths, prompts, new_tokens)
        return Case("quick", paths, prompts, new_tokens, refs, 100)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    peft_model, paths = make_adapters(hf_base(source), directory)
    refs = {name or "": peft_greedy(peft_model, name, prompts, 32) for name in [None, *NAMES]}
    return Case("full", paths, prompts, 32, refs, 1000)


def _adapter_files(paths: dict[str, str]) -> list[tuple[str, str]]:
    """(adapter, sha256) of every file of every adapter: the references' key holds the adapters' bytes."""
    return sorted((name, hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest())
                  for name, path in paths.items() for f in os.listdir(path))


def _cached_refs(request, source, paths, prompts, new_tokens) -> dict:
    """PEFT's greedy tokens per adapter (tests/engine/_references.py), keyed by the adapters' bytes among the rest."""
    files = _adapter_files(paths)

    def compute() -> dict:
        model = peft_model_of(hf_base(source), paths)
        return {name or "": peft_greedy(model, name, prompts, new_tokens) for name in [None, *NAMES]}
    return reference(request, f"peft_{len(prompts)}x{new_tokens}", made_with(source, "transformers", "peft", "torch"),
                     [files, prompts, new_tokens], compute)


def test_adapters_change_the_output(case):
    """Each adapter's reference differs from the base model's (non-zero B), so equality below means something."""
    for name in NAMES:
        assert case.ref(name) != case.ref(None), f"{name} produces the base model's tokens"


@pytest.mark.parametrize("name", NAMES)
def test_each_adapter_equals_peft(llm, case, name):
    outs = llm.generate(case.prompts, case.params(name))
    assert [o.outputs[0].token_ids for o in outs] == case.ref(name)


def test_mixed_batch_gives_each_row_its_own_tokens(llm, case):
    """Every prompt under the base model and each adapter, all in one batch (rows interleaved)."""
    jobs = [(i, name) for i in range(len(case.prompts)) for name in [None, *NAMES]]
    outs = llm.generate([case.prompts[i] for i, _ in jobs], [case.params(name) for _, name in jobs])
    for (i, name), out in zip(jobs, outs, strict=True):
        assert out.outputs[0].token_ids == case.ref(name)[i], f"prompt {i} under {name or 'the base model'}"
    manager = llm.engine.lora
    ids = {case.lora(name).id for name in NAMES}
    assert sum(s in ids for s in manager.slots) == len(NAMES)  # each adapter of the case in a slot


def test_unload_and_load_again(llm, case):
    """Adapters dropped from memory and slots, then named again under new ids (what unload + load does): the
    same tokens, read from disk again."""
    manager = llm.engine.lora
    for slot in list(manager.slots):
        if slot is not None:
            llm.engine.remove_lora(slot)
    for adapter_id in list(manager.cpu):
        llm.engine.remove_lora(adapter_id)
    assert not manager.cpu and all(s is None for s in manager.slots)
    loads = manager.loads
    names = [*NAMES, None]
    jobs = [(i, name) for i in range(len(case.prompts)) for name in names]
    outs = llm.generate([case.prompts[i] for i, _ in jobs], [case.params(name, generation=1) for _, name in jobs])
    assert [o.outputs[0].token_ids for o in outs] == [case.ref(name)[i] for i, name in jobs]
    assert manager.loads == loads + len(NAMES)


def test_prefix_cache_is_keyed_by_adapter(llm, case):
    """The same 3-block prompt: under adapter a, then adapter b (no cached token), then a again (all its full
    blocks but the last token's), then the base model (none), and the base again (cached)."""
    prompt = llm.tokenizer.encode(f"Prefix isolation ({case.name}): " + "the quick brown fox jumps over the lazy dog " * 6)
    assert len(prompt) >= 48
    kv = llm.engine.kv
    full = (len(prompt) - 1) // 16 * 16

    def hits(name) -> int:
        before = kv.prefix_hits_tokens
        llm.generate([prompt], case.params(name, generation=2, new_tokens=2))
        return kv.prefix_hits_tokens - before

    assert hits("attn-r8") == 0
    assert hits("mlp-r16") == 0  # same tokens, another adapter: nothing shared
    assert hits("attn-r8") == full  # same adapter again: cached
    assert hits(None) == 0  # the base model shares nothing with either
    assert hits(None) == full


def test_stats_name_running_and_waiting_adapters(llm, case):
    """What vllm:lora_requests_info reads: the adapters of the waiting requests, then of the running ones."""
    engine = llm.engine
    for i, name in enumerate(NAMES):
        engine.add_request(f"stats-{case.name}-{i}", case.prompts[0], case.params(name, generation=3, new_tokens=2))
    stats = engine.stats()
    assert stats.max_loras == 4 and set(stats.lora_waiting) == set(NAMES) and stats.lora_running == ()
    engine.step()
    stats = engine.stats()
    assert set(stats.lora_running) == set(NAMES) and stats.lora_waiting == ()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().lora_running == ()


@pytest.mark.slow
def test_committed_reference_is_computed_again(tmp_path):
    """The committed PEFT reference of the default run is what PEFT computes here now (where its key is this run's)."""
    from engine.tokenizer import load_tokenizer
    from tests.engine._references import committed, key_of

    source = resolve_model("smollm2")
    tok = load_tokenizer(source)
    prompts = [tok.encode(PROMPTS[i]) for i in QUICK]
    paths = write_adapters(str(tmp_path))
    files = _adapter_files(paths)
    kept = committed(f"peft_{len(prompts)}x16")
    assert kept is not None
    if kept["key"] != key_of([made_with(source, "transformers", "peft", "torch"), [files, prompts, 16]]):
        pytest.skip("the committed reference was made with other versions: the default run computes its own")
    model = peft_model_of(hf_base(source), paths)
    assert {name or "": peft_greedy(model, name, prompts, 16) for name in [None, *NAMES]} == kept["value"]
