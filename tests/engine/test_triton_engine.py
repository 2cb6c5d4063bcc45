"""The engine with the triton backend (Triton's interpreter on CPU) yields the same greedy tokens as with
the torch backend, on a tiny random-weight Llama with GQA, small blocks, chunked prefill, prefix-cache
hits (extend over a cached prefix) and decodes mixed with prefill chunks in one step. With the triton
backend the layer glue runs through the fused Triton kernels too (engine/model/triton_layers.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.model.triton_layers import uses_triton_layers
from engine.sampling_params import SamplingParams
from tests.engine.triton_setup import DEVICE, load_kernels, triton_mode  # noqa: F401 (fixture)

load_kernels()
pytestmark = pytest.mark.usefixtures("triton_mode")
VOCAB = 96


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init, so greedy choices are never near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def greedy_tokens(model_dir: str, backend: str) -> list[list[int]]:
    llm = LLM(model_dir, attention_backend=backend, device=DEVICE, dtype="float32", block_size=8, num_blocks=64,
              max_num_batched_tokens=24, max_num_seqs=8, num_threads=1)
    assert llm.engine.runner.backend.name == backend
    assert uses_triton_layers(llm.engine.model) == (backend == "triton")  # the fused layer kernels serve triton
    if backend == "triton":
        llm.engine.runner.warm_up(prefill_tokens=16)  # what CUDA engines run at start-up: must leave no trace
    shared = [(7 * i) % (VOCAB - 3) + 3 for i in range(21)]
    prompts = [
        shared + [5, 9, 11],  # admitted together with the next: prefill chunks over several steps
        [4, 8, 15, 16, 23, 42],
        shared + [60, 61],  # after the first finished its prefill: its 16 full-block tokens hit the cache
        [3],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts[:2], params)
    rest = llm.generate(prompts[2:], params)
    stats = llm.engine.stats()
    assert stats.prefix_hits_tokens >= 16, "the shared prefix should have been served from the cache"
    return [list(o.outputs[0].token_ids) for o in first + rest]


def test_triton_backend_greedy_tokens_equal_torch(tiny_model_dir):
    torch_tokens = greedy_tokens(tiny_model_dir, "torch")
    triton_tokens = greedy_tokens(tiny_model_dir, "triton")
    assert all(len(t) == 12 for t in torch_tokens)
    assert triton_tokens == torch_tokens


def test_draft_model_speculation_on_the_triton_backend(tiny_model_dir):
    """The draft model's own runner and the verifying rows (k+1 query positions per sequence over the paged KV) on
    the triton backend: the model as its own draft keeps the greedy tokens and has its drafts kept (float32, sharp
    logits). In gpu_check this runs compiled on the GPU."""
    def run(spec):
        llm = LLM(tiny_model_dir, attention_backend="triton", device=DEVICE, dtype="float32", block_size=8,
                  num_blocks=64, max_num_batched_tokens=24, max_num_seqs=8, num_threads=1, speculative_config=spec)
        if spec is not None:
            llm.engine.spec.gate = None  # draft every step, whatever it gains here
        prompts = [[(7 * i) % (VOCAB - 3) + 3 for i in range(21)], [4, 8, 15, 16, 23, 42], [3]]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs], llm

    base, _ = run(None)
    spec, llm = run({"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 3})
    assert spec == base
    st = llm.engine.spec.stats
    assert st.num_drafts >= 6 and st.num_accepted_tokens >= 0.9 * st.num_draft_tokens
    assert llm.engine.spec.draft.runner.backend.name == "triton"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
