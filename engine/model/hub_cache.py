"""Hugging Face hub ids (`org/name`) resolved from the local Hugging Face cache, offline.

The cache is the one huggingface_hub writes: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`; a model lives in `models--org--name/` with `refs/main` (the commit of the
main branch) and `snapshots/<commit>/` (its files). Nothing is downloaded here unless the caller allows
it (the engine's --allow-download flag, off by default); then only what the engine reads is fetched
(config, tokenizer, safetensors weights named by the index; never the `consolidated.*` or `.bin` copies).
"""

from __future__ import annotations

import os
import re

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DOWNLOAD_FLAG = "--allow-download"
# what --allow-download fetches: the engine reads config, tokenizer, generation config and safetensors
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja")
DOWNLOAD_IGNORED = ("consolidated*", "original/*")


class HubModelNotCachedError(ValueError):
    """A hub id that the local cache does not hold (and downloading was not allowed)."""


def is_hub_id(name: str) -> bool:
    """`org/name` (one slash, no path syntax): a hub id when no such path exists."""
    return bool(HUB_ID.match(name)) and ".." not in name


def hub_cache_dir(env: dict[str, str] | None = None) -> str:
    """Where huggingface_hub keeps models: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub."""
    env = os.environ if env is None else env
    if env.get("HF_HUB_CACHE"):
        return os.path.expanduser(env["HF_HUB_CACHE"])
    if env.get("HUGGINGFACE_HUB_CACHE"):  # the older name, still honoured by huggingface_hub
        return os.path.expanduser(env["HUGGINGFACE_HUB_CACHE"])
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                              "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def repo_folder(repo_id: str, cache_dir: str) -> str:
    return os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))


def find_snapshot(repo_id: str, cache_dir: str, revision: str = "main") -> str | None:
    """The snapshot directory of `repo_id` at `revision` (a branch/tag under refs/, or a commit), or None."""
    folder = repo_folder(repo_id, cache_dir)
    ref = os.path.join(folder, "refs", revision)
    commit = revision
    if os.path.isfile(ref):
        with open(ref) as f:
            commit = f.read().strip()
    snapshot = os.path.join(folder, "snapshots", commit)
    return snapshot if commit and os.path.isdir(snapshot) else None


def resolve_hub_id(repo_id: str, allow_download: bool = False, cache_dir: str | None = None) -> str:
    """The local snapshot directory of `repo_id`; downloads it first only when allow_download."""
    cache_dir = cache_dir or hub_cache_dir()
    snapshot = find_snapshot(repo_id, cache_dir)
    if snapshot is not None:
        return snapshot
    if allow_download:
        return download_snapshot(repo_id, cache_dir)
    folder = repo_folder(repo_id, cache_dir)
    raise HubModelNotCachedError(
        f"model {repo_id!r} is not a local path and is not in the Hugging Face cache: looked for "
        f"{os.path.join(folder, 'refs', 'main')} and {os.path.join(folder, 'snapshots', '<commit>')} (cache "
        f"{cache_dir}, from HF_HUB_CACHE / HF_HOME). kvfleet does not download at run time unless "
        f"{DOWNLOAD_FLAG} is given; or fetch it first: `hf download {repo_id}`")


def download_snapshot(repo_id: str, cache_dir: str) -> str:
    """Fetch what the engine reads of `repo_id` into the cache (only under --allow-download)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=list(DOWNLOAD_PATTERNS),
                                 ignore_patterns=list(DOWNLOAD_IGNORED))
    except Exception as e:  # network, auth, offline mode, unknown repo: one error naming the id
        raise HubModelNotCachedError(f"{DOWNLOAD_FLAG}: could not download {repo_id!r} into {cache_dir}: {e}") from e
