"""Attention of a long prefill chunk over its cached prefix on CPUs, in two flash passes instead of one mask.

    o = extend_attention(q, k, v, scale)   # q [1, H, q_len, d]: the chunk's queries; k, v [1, Hkv, seq_len, d]

Query j of the chunk sees keys 0 .. seq_len - q_len + j. One scaled_dot_product_attention call with that
boolean mask is what the step used to do; the mask makes the kernel score every key for every query (the
upper triangle of the chunk's own keys too) and read the mask besides. Here the same result comes from two
unmasked flash passes: the chunk over the whole prefix (every key visible; the grouped query heads of a KV
head folded into its query rows, so K/V are not copied) and the chunk over itself (plain causal), merged by their log-sum-exps:
o = (o1·e^(l1−m) + o2·e^(l2−m)) / (e^(l1−m) + e^(l2−m)), m = max(l1, l2), in float32. Where the flash
operator is missing (another PyTorch build) the masked call is used. Measured in the engine, same process,
alternating (quiet 2-core AMD EPYC, bf16): an 8,000-token prompt in four 2,048-token chunks prefilled in
14.5 s instead of 17.6 s (its last chunk 5.5 s instead of 6.6 s).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    _, h, q_len, d = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    prefix = seq_len - q_len
    gqa = h != hkv
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if _FLASH is None or q.device.type != "cpu":
        pos = torch.arange(prefix, seq_len)
        mask = torch.arange(seq_len)[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    group = h // hkv
    # the chunk over the prefix: no mask; a KV head's `group` query heads are one run of query rows
    qg = q.reshape(1, hkv, group * q_len, d)
    o1, l1 = _FLASH(qg, k[:, :, :prefix], v[:, :, :prefix], scale=scale)[:2]
    o1, l1 = o1.reshape(1, h, q_len, d), l1.reshape(1, h, q_len)
    # the chunk over itself: causal (its K/V are q_len rows: repeating them for the query heads is cheap)
    kc, vc = k[:, :, prefix:], v[:, :, prefix:]
    if gqa:
        kc, vc = kc.repeat_interleave(group, 1), vc.repeat_interleave(group, 1)
    o2, l2 = _FLASH(q, kc, vc, is_causal=True, scale=scale)[:2]
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m).unsqueeze(-1), torch.exp(l2 - m).unsqueeze(-1)
    return ((o1.float() * w1 + o2.float() * w2) / (w1 + w2)).to(q.dtype)
