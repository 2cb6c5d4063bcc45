"""The lower KV tier on a real engine (SmolLM2, float32, offline API): a pool too small for the conversations'
history spills evicted blocks to the tier and reloads them for the next turn, and the greedy tokens are those of
an engine computing everything. Its events announce the tier's blocks with their medium."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

WORDS = "harbor ferry captain storm lantern compass tide anchor gull rope sail keel reef beacon island mist".split()


def text(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 5 + i * 3 + i * i) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tiered = LLM("smollm2", dtype="float32", num_blocks=40, max_num_seqs=4, num_threads=1, kv_tier_gib=0.05,
                 kv_tier_path=str(tmp_path_factory.mktemp("tier")))
    plain = LLM("smollm2", dtype="float32", num_blocks=40, max_num_seqs=4, num_threads=1, enable_prefix_caching=False,
                loaded_model=(tiered.engine.model, tiered.engine.hf_config))
    return tiered, plain


@pytest.mark.slow  # ~38 s; tests/engine/test_deterministic.py checks lower-tier reloads bit for bit in the default run
def test_reloaded_history_gives_the_same_greedy_tokens_as_computing_it(engines):
    tiered, plain = engines
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    convs = [f"Conversation {c}: " + text(c, 120) for c in range(4)]  # ~250 tokens each: 16 blocks; the pool has 40
    reloaded_before = tiered.engine.offload.reloaded_blocks
    for turn in range(4):  # 4 conversations x 4 turns = 16 prompts; each turn evicts the others' history
        for c in range(4):
            out_t = tiered.generate(convs[c], greedy)[0]
            out_p = plain.generate(convs[c], greedy)[0]
            assert out_t.outputs[0].token_ids == out_p.outputs[0].token_ids, (turn, c)
            convs[c] += out_t.outputs[0].text + f"\nUser: {text(turn + c, 12)}\nAssistant:"
    off = tiered.engine.offload
    assert off.spilled_blocks > 0 and off.reloaded_blocks - reloaded_before > 40  # more than the pool holds
    st = tiered.engine.stats()
    assert st.tier_blocks == len(off.tier) > 0 and st.tier_reloaded_blocks == off.reloaded_blocks
    assert st.num_free_blocks == 40  # nothing leaked
    events = tiered.engine.drain_kv_events()
    media = {ev.medium for ev in events}
    assert media == {None, "DISK"}
    assert tiered.engine.kv.prefix_hits_tokens > 0
