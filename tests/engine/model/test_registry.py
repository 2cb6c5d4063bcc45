"""Model name resolution and the shared tokenizer path."""

from __future__ import annotations

import os

import pytest

from engine.model.registry import ModelNotFoundError, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_bundled_alias_resolves_to_the_gguf():
    src = resolve_model("smollm2")
    assert src.is_gguf and src.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert os.path.isfile(src.path)
    assert resolve_model("SmolLM2").path == src.path


def test_gguf_file_path_and_directory_with_one_gguf(tmp_path):
    src = resolve_model(resolve_model("smollm2").path)
    assert src.is_gguf and src.directory == resolve_model("smollm2").directory
    (tmp_path / "m.gguf").write_bytes(b"")
    assert resolve_model(str(tmp_path)).gguf_file == "m.gguf"


def test_hf_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    src = resolve_model(str(tmp_path))
    assert not src.is_gguf and src.directory == str(tmp_path)


@pytest.mark.parametrize("setup,needle", [
    (lambda p: None, "does not exist"),
    (lambda p: (p / "x.bin").write_bytes(b""), "not a .gguf file"),
    (lambda p: (p / "config.json").write_text("{}"), "no *.safetensors"),
    (lambda p: [(p / "a.gguf").write_bytes(b""), (p / "b.gguf").write_bytes(b"")], "several .gguf"),
    (lambda p: (p / "README").write_text(""), "neither config.json"),
])
def test_bad_models_give_one_clear_error_naming_the_path(tmp_path, setup, needle):
    target = tmp_path / "model"
    if needle != "does not exist":
        target.mkdir()
        setup(target)
    if needle == "not a .gguf file":
        target = target / "x.bin"
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(str(target))
    assert needle in str(e.value) and str(target) in str(e.value)


def test_empty_name_is_rejected():
    with pytest.raises(ModelNotFoundError, match="--model"):
        resolve_model("  ")


@pytest.fixture(scope="module")
def tok():
    from engine.tokenizer import load_tokenizer
    return load_tokenizer("smollm2")


def test_tokenizer_roundtrip_and_chat_template(tok):
    ids = tok.encode("Hello wörld 你好 🤖")
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == "Hello wörld 你好 🤖"
    assert tok.eos_token_id == 2 and tok.vocab_size == 49152
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    parts = tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert parts == chat


def test_tokenizer_bad_messages_name_the_field(tok):
    from engine.tokenizer import TokenizerError
    with pytest.raises(TokenizerError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TokenizerError, match="non-empty"):
        tok.apply_chat_template([])
