"""Checkpoints as users have them: sharded safetensors read through their index (a stray consolidated.safetensors
beside them is ignored), hub ids from a local Hugging Face cache (offline), and the memory a bf16 load takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine.model.checkpoint import checkpoint_shards
from engine.model.hub_cache import hub_cache_dir
from engine.model.loader import load_model
from engine.model.registry import ModelNotFoundError, resolve_model
from tests.engine._checkpoints import INDEX, hub_cache, random_bf16_llama, reshard
from tests.engine._tiny_llama import make_tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("single")), seed=3)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory, single) -> str:
    path = str(tmp_path_factory.mktemp("sharded"))
    for name in os.listdir(single):
        with open(os.path.join(single, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
            dst.write(src.read())
    reshard(path, num_shards=3, stray_consolidated=True)
    return path


def _state(path: str) -> dict[str, torch.Tensor]:
    model, _ = load_model(resolve_model(path), torch.float32, "cpu", 64)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_sharded_checkpoint_loads_exactly_the_shards_named_by_the_index(single, sharded):
    shards = checkpoint_shards(sharded)
    assert [os.path.basename(s.path) for s in shards] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert os.path.isfile(os.path.join(sharded, "consolidated.safetensors"))
    expected, got = _state(single), _state(sharded)
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert not any(bool((t == 7.0).all()) for t in got.values())  # nothing of the consolidated file


def test_sharded_checkpoint_gives_the_same_logits_as_the_source_model(single, sharded):
    from engine import SamplingParams
    from engine.llm import LLM

    prompt = [(i * 7919) % 40000 + 3 for i in range(21)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    outs = [LLM(p, dtype="float32", num_blocks=16, max_num_seqs=2, max_model_len=64, num_threads=1)
            .generate([prompt], params)[0].outputs[0] for p in (single, sharded)]
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].logprobs == outs[1].logprobs


def test_a_shard_named_by_the_index_but_missing_is_a_clear_error(tmp_path, single):
    path = make_tiny_llama(str(tmp_path / "m"), seed=3)
    reshard(path, num_shards=2, stray_consolidated=False)
    os.remove(os.path.join(path, "model-00002-of-00002.safetensors"))
    with pytest.raises(ModelNotFoundError) as e:
        load_model(resolve_model(path), torch.float32, "cpu", 64)
    assert "model-00002-of-00002.safetensors" in str(e.value) and INDEX in str(e.value)


def test_an_index_pointing_at_a_shard_without_the_tensor_is_a_clear_error(tmp_path):
    path = make_tiny_llama(str(tmp_path / "m"), seed=3)
    weight_map = reshard(path, num_shards=2, stray_consolidated=False)
    moved = next(n for n, f in weight_map.items() if f.startswith("model-00002"))
    weight_map[moved] = "model-00001-of-00002.safetensors"
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    with pytest.raises(ModelNotFoundError, match="model-00001-of-00002.safetensors lacks 1 tensors"):
        load_model(resolve_model(path), torch.float32, "cpu", 64)


def test_several_safetensors_without_an_index_is_an_error_not_a_guess(tmp_path):
    path = make_tiny_llama(str(tmp_path / "m"), seed=3)
    reshard(path, num_shards=2, stray_consolidated=True)
    os.remove(os.path.join(path, INDEX))
    with pytest.raises(ModelNotFoundError, match=f"no {INDEX}"):
        checkpoint_shards(path)


# ---- hub ids from the local Hugging Face cache -----------------------------------------------------


def test_hub_cache_dir_follows_the_hugging_face_variables():
    assert hub_cache_dir({"HF_HUB_CACHE": "/c/hub", "HF_HOME": "/h"}) == "/c/hub"
    assert hub_cache_dir({"HF_HOME": "/h"}) == "/h/hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/huggingface/hub"
    assert hub_cache_dir({}) == os.path.expanduser("~/.cache/huggingface/hub")


def test_hub_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch, sharded, single):
    cache = str(tmp_path / "hub")
    snapshot = hub_cache(cache, "acme/tiny-llama", sharded)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = resolve_model("acme/tiny-llama")
    assert source.directory == snapshot and not source.is_gguf
    got, expected = _state("acme/tiny-llama"), _state(single)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    from engine.tokenizer import load_tokenizer
    assert load_tokenizer(source).eos_token_id == 2


def test_hub_id_through_hf_home(tmp_path, monkeypatch, single):
    hub_cache(str(tmp_path / "home" / "hub"), "acme/tiny", single)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve_model("acme/tiny").directory.startswith(str(tmp_path / "home" / "hub" / "models--acme--tiny"))


def test_unknown_hub_id_is_a_clear_error_naming_the_id_the_flag_and_where_it_looked(tmp_path, monkeypatch):
    cache = str(tmp_path / "hub")
    os.makedirs(cache)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model("acme/missing-model")
    msg = str(e.value)
    assert "'acme/missing-model'" in msg and "--allow-download" in msg
    assert os.path.join(cache, "models--acme--missing-model", "refs", "main") in msg


def test_engine_args_and_cli_carry_allow_download():
    import argparse

    from engine.args import EngineArgs, add_cli_args

    assert EngineArgs().allow_download is False
    ns = add_cli_args(argparse.ArgumentParser()).parse_args(["--allow-download"])
    assert EngineArgs.from_cli(ns).allow_download is True


# ---- memory ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bf16_load_peaks_at_the_bf16_size(tmp_path):
    """No float32 copy, no second state dict: the anonymous memory a bf16 load adds stays within 1.1x the
    model's bf16 bytes (327 MB here). The old loader (to_empty in float32, cast afterwards) peaked at 2.04x."""
    size = random_bf16_llama(str(tmp_path / "big"))
    random_bf16_llama(str(tmp_path / "warm"), hidden=96, intermediate=128, layers=1, vocab=256, shards=2)
    env = {**os.environ, "PYTHONPATH": ROOT, "MALLOC_PERTURB_": "7", "MALLOC_MMAP_THRESHOLD_": "1048576",
           "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "engine", "_load_peak.py"),
                          str(tmp_path / "big"), str(tmp_path / "warm")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dtypes"] == ["torch.bfloat16"] and result["model_bytes"] == size
    ratio = result["peak_delta"] / size
    print(f"bf16 load: model {size / 1e6:.0f} MB, peak growth {result['peak_delta'] / 1e6:.0f} MB "
          f"({ratio:.3f}x), {result['seconds']:.1f} s")
    assert ratio <= 1.1
