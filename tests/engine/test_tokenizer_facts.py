"""What an engine core needs of its tokenizer before any request (eos ids, vocabulary size) comes from a small
file the first load wrote, so that a core process does not import transformers; the tokenizer itself loads on
first use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine.model.registry import resolve_model
from engine.tokenizer import _facts_path, load_tokenizer, tokenizer_facts


def test_the_facts_are_the_loaded_tokenizers_and_read_without_transformers(tmp_path):
    env = {**os.environ, "KVFLEET_CACHE_DIR": str(tmp_path)}
    code = ("import sys; from engine.tokenizer import tokenizer_facts; f = tokenizer_facts('smollm2'); "
            "print(list(f.eos_token_ids), f.vocab_size, 'transformers' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                           cwd=os.getcwd()).stdout.split("\n")[-2] for _ in range(2)]
    tok = load_tokenizer("smollm2")
    facts = f"{list(tok.eos_token_ids)} {tok.vocab_size}"
    assert runs == [f"{facts} True", f"{facts} False"]  # the first run loads the tokenizer and writes the file


def test_changed_tokenizer_files_are_read_again(tmp_path, monkeypatch):
    from tests.engine._tiny_llama import make_tiny_llama

    monkeypatch.setenv("KVFLEET_CACHE_DIR", str(tmp_path / "cache"))
    path = make_tiny_llama(str(tmp_path / "m"))
    source = resolve_model(path)
    first = tokenizer_facts(source)
    assert os.path.isfile(_facts_path(source))
    config = os.path.join(path, "generation_config.json")
    with open(config, "w") as f:
        json.dump({"eos_token_id": [first.eos_token_ids[0], 7]}, f)  # a second eos, as Llama 3 lists
    assert not os.path.isfile(_facts_path(source))  # another file now: a new key
    from engine import tokenizer

    monkeypatch.setattr(tokenizer, "_loaded", {})  # this process's loaded tokenizers: as a new process would be
    assert tokenizer_facts(source).eos_token_ids == (first.eos_token_ids[0], 7)


def test_an_engine_loads_its_tokenizer_on_first_use(tmp_path):
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from tests.engine._tiny_llama import make_tiny_llama

    path = make_tiny_llama(str(tmp_path / "m"))
    eng = LLMEngine(EngineArgs(model=path, num_blocks=16))
    assert eng._tokenizer is None and eng.eos_token_ids == (2,)
    assert eng.tokenizer is load_tokenizer(path) and eng._tokenizer is not None
