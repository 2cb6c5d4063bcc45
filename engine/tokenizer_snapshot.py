"""A loaded Hugging Face tokenizer written down so that later processes use it without importing transformers.

Importing transformers imports torch: ~4.5 s of CPU before a router or an engine's HTTP front end can serve,
for a tokenizer whose work is done by the `tokenizers` library (Rust) and a Jinja chat template. The first
process that loads a tokenizer through transformers writes, beside the tokenizer's files:

- `kvfleet_backend.json`: the loaded tokenizer's own Rust backend (`backend_tokenizer.to_str()`), so every
  change transformers made to it at load time (post-processor, added tokens) is in it;
- `kvfleet_snapshot.json` (written last: its presence means the backend is whole): the facts transformers
  computes around it (eos and bos ids, vocabulary size with added tokens, the special token ids and strings the
  chat template sees, the chat template) and the versions of transformers and tokenizers that made it.

`read(directory)` gives them back, or None where there are none, they are damaged, or transformers or tokenizers
is not the version that wrote them (the caller then loads through transformers and writes them again). A
tokenizer whose decoding transformers post-processes (`clean_up_tokenization_spaces` in effect) gets no
snapshot: it stays on the transformers path.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata

META = "kvfleet_snapshot.json"
BACKEND = "kvfleet_backend.json"
FORMAT = 1


@dataclass(frozen=True)
class Snapshot:
    backend: object  # tokenizers.Tokenizer
    eos_token_id: int
    bos_token_id: int | None
    vocab_size: int
    all_special_ids: frozenset[int]
    special_tokens: dict  # special_tokens_map: the names the chat template sees (bos_token, eos_token, ...)
    chat_template: str | dict | None


def _versions() -> dict[str, str]:
    try:
        return {"transformers": metadata.version("transformers"), "tokenizers": metadata.version("tokenizers")}
    except metadata.PackageNotFoundError:
        return {}


def eligible(hf) -> bool:
    """Whether the snapshot reproduces this tokenizer: a Rust backend, and no decoding clean-up in effect."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return False
    cleanup = bool(getattr(hf, "clean_up_tokenization_spaces", False))
    if cleanup and type(backend.model).__name__ == "BPE":  # transformers 5 skips it for BPE unless forced
        cleanup = bool(getattr(hf, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    return not cleanup


def write(hf, directory: str) -> bool:
    """Write the snapshot of `hf` into `directory` (each file atomically, the backend first); False where the
    tokenizer is not eligible or the directory is not writable (the next process loads through transformers)."""
    versions = _versions()
    if not versions or not eligible(hf):
        return False
    meta = {"format": FORMAT, **versions, "eos_token_id": int(hf.eos_token_id),
            "bos_token_id": None if hf.bos_token_id is None else int(hf.bos_token_id), "vocab_size": len(hf),
            "all_special_ids": sorted(int(i) for i in hf.all_special_ids),
            "special_tokens": json.loads(json.dumps(hf.special_tokens_map)),
            "chat_template": getattr(hf, "chat_template", None)}
    try:
        _write_atomically(directory, BACKEND, hf.backend_tokenizer.to_str())
        _write_atomically(directory, META, json.dumps(meta))
    except (OSError, TypeError, ValueError):
        return False
    return True


def read(directory: str) -> Snapshot | None:
    try:
        with open(os.path.join(directory, META)) as f:
            meta = json.load(f)
        if meta.get("format") != FORMAT or {k: meta.get(k) for k in ("transformers", "tokenizers")} != _versions():
            return None
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(os.path.join(directory, BACKEND))
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = False  # special tokens in text are matched, as transformers does by default
        return Snapshot(backend, int(meta["eos_token_id"]), meta["bos_token_id"], int(meta["vocab_size"]),
                        frozenset(int(i) for i in meta["all_special_ids"]), dict(meta["special_tokens"]),
                        meta["chat_template"])
    except Exception:  # noqa: BLE001 - missing, damaged or unreadable (tokenizers raises plain Exception): none
        return None


def _write_atomically(directory: str, name: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
