"""Turn one step's logits into the next token of every sequence, vectorized over the batch.

Interface (used by the engine loop):

    sampler = Sampler(seed=None)            # seed: the generator of rows without a per-request seed
    out = sampler(logits, seqs, eos_token_id)
    out.token_ids[i], out.logprobs[i]       # for seqs[i]; logprobs[i] is None unless params.logprobs is set

`logits` is `[len(seqs), vocab]` (float32, any device), row i belonging to `seqs[i]`, whose `token_ids`
must not yet contain the token being sampled. `eos_token_id` is an int, several ints, or None. The call
never modifies `logits` or the sequences. Requests are admitted by
engine/admission.py, which refuses out-of-vocabulary `logit_bias` / `stop_token_ids` with a clear error.
The two stages are also usable alone: `process_logits` (bias, min_tokens, penalties) and `warp_logits`
(temperature, top-k, top-p, min-p; -inf marks an excluded token).

Order of processing (vLLM's): logit_bias → min_tokens (EOS and stop_token_ids get -inf until the
sequence has min_tokens outputs; EOS only when ignore_eos is off, since it would not stop then) →
repetition penalty (Hugging Face: over prompt + output, positive logits divided, negative multiplied)
→ frequency / presence penalties (OpenAI: over output tokens, `logit -= f * count + p * (count > 0)`)
→ grammar (rows of sequences with a matcher: tokens the grammar forbids get -inf; engine/structured/bitmask.py)
→ greedy rows take the argmax here; sampling rows go on: temperature → top-k → top-p (the smallest
set of best tokens whose mass, renormalized after top-k, reaches top_p) → min-p (drop tokens whose
probability is below min_p × the best one's) → one draw by inverse CDF.

Seeds: a row whose request has a `seed` draws its uniform number from a pure function of
(seed, seq.index, the position of the token it samples: prompt and output so far), so the same request samples
the same tokens in every run, in any batch, in any order, after preemption, and in the continuation that goes on
with a stream moved to another replica (its prompt is the original prompt and what was generated, so the
positions go on; a moved choice of n > 1 continues as choice 0); the sampler keeps no per-sequence state
(nothing to free when a sequence finishes). Rows without a seed draw from the sampler's own generator.

Logprobs are of the model's raw distribution (log-softmax of the unprocessed logits, like vLLM's
default): the sampled token's plus the `params.logprobs` most likely tokens (TokenLogprob.top).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engine.kernels import cpu_ops
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured.bitmask import GrammarMasks, mask_constrained_rows

_MASK64 = (1 << 64) - 1
_BLOCK = 256  # inverse-CDF sampling over wide rows: block sums first, then inside one block
_FIRST_CANDIDATES = 128  # top-p / min-p look for their kept set among this many best tokens, then 8x more


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def seeded_uniform(seed: int, index: int, position: int) -> float:
    """The uniform number in [0, 1) that a seeded row uses for the token at `position` (prompt included)."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (index & _MASK64))
    h = _splitmix64(h ^ (position & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class Sampler:
    def __init__(self, seed: int | None = None):
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little") if seed is None else seed)
        self._masks = GrammarMasks()

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence],
                 eos_token_id: int | Iterable[int] | None = None) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [num_seqs={len(seqs)}, vocab], got {tuple(logits.shape)}")
        if not seqs:
            return SamplerOutput([], [])
        logits = logits.float()
        params = [s.params for s in seqs]
        x = process_logits(logits, seqs, params, _eos_ids(eos_token_id))
        x = mask_constrained_rows(x, logits, seqs, self._masks)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = argmax(x)
        else:
            tokens = self._sample(x, seqs, params, greedy)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(logits, params, token_list))

    def _sample(self, x: torch.Tensor, seqs: Seq[Sequence], params: list[SamplingParams],
                greedy: list[bool]) -> torch.Tensor:
        rows = [i for i, g in enumerate(greedy) if not g]
        dev = x.device
        tokens = argmax(x) if len(rows) < len(seqs) else torch.empty(len(seqs), dtype=torch.long, device=dev)
        u = torch.tensor([seeded_uniform(params[i].seed, seqs[i].index, seqs[i].num_tokens)
                          if params[i].seed is not None else self._rng.random() for i in rows],
                         dtype=torch.float64, device=dev)
        rows_t = torch.tensor(rows, device=dev)
        xs = x if len(rows) == len(seqs) else x[rows_t]
        for group, vals, ids in candidates(xs, [params[i] for i in rows]):
            picked = _inverse_cdf(vals, u[group])
            tokens[rows_t[group]] = picked if ids is None else ids.gather(1, picked.unsqueeze(1)).squeeze(1)
        return tokens


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), through the vectorized CPU kernel when the engine loaded it (same answer, ~4x faster
    over a 49k-token vocabulary)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] > 0 \
            and x.stride(1) == 1 and cpu_ops.loaded():
        return cpu_ops.ops().argmax_rows(x)
    return x.argmax(dim=-1)


def warp_logits(x: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p over whole rows: a new tensor, -inf where a token is excluded."""
    out = torch.full_like(x, float("-inf"))
    for group, vals, ids in candidates(x, params):
        out[group] = vals if ids is None else out[group].scatter_(1, ids, vals)
    return out


def candidates(x: torch.Tensor, params: Seq[SamplingParams]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """What each sampling row may draw: groups (rows of x, temperature-scaled logits, token ids or None).

    Rows without top-k / top-p / min-p keep the whole vocabulary (token ids None: column = token id).
    The others get their best tokens sorted, -inf past the kept set, found without sorting the vocabulary.
    """
    dev = x.device
    vocab = x.shape[1]
    temp = torch.tensor([p.temperature for p in params], device=dev)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    filtered = [i for i, p in enumerate(params) if top_k[i] < vocab or p.top_p < 1.0 or p.min_p > 0.0]
    groups = []
    if len(filtered) < len(params):
        chosen = set(filtered)
        full = torch.tensor([i for i in range(len(params)) if i not in chosen], device=dev)
        xf = x if not filtered else x[full]
        groups.append((full, xf / temp[full].unsqueeze(1), None))
    if filtered:
        groups += _best_tokens(x, filtered, temp, top_k, params)
    return groups


def _best_tokens(x: torch.Tensor, rows: list[int], temp: torch.Tensor, top_k: list[int],
                 params: Seq[SamplingParams]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per row: keep the top_k best tokens, then the fewest of those whose mass (renormalized) reaches
    top_p, then those with probability >= min_p x the best one's. Exact (ties in torch.topk's order).

    Each kept set is the first r tokens in sorted order, so it is looked for among the C best tokens,
    C growing 8x for the rows whose set might extend beyond C.
    """
    dev = x.device
    vocab = x.shape[1]
    rows_t = torch.tensor(rows, device=dev)
    k = torch.tensor([top_k[i] for i in rows], device=dev)
    p = torch.tensor([params[i].top_p for i in rows], device=dev)
    log_min_p = torch.tensor([params[i].min_p for i in rows], device=dev).log()
    t = temp[rows_t]
    c = min(vocab, max(_FIRST_CANDIDATES, max((top_k[i] for i in rows if top_k[i] < vocab), default=0)))
    # top-p over the whole vocabulary (top-k off) needs the normalizer of all tokens
    whole = [j for j, i in enumerate(rows) if top_k[i] >= vocab and params[i].top_p < 1.0]
    lse = torch.zeros(len(rows), device=dev)
    if whole:
        w = torch.tensor(whole, device=dev)
        lse[w] = torch.logsumexp(x[rows_t[w]] / t[w].unsqueeze(1), dim=-1)
    groups = []
    pending = torch.arange(len(rows), device=dev)
    while pending.numel():
        xr = x if pending.numel() == x.shape[0] == len(rows) else x[rows_t[pending]]
        vals, ids = xr.topk(c, dim=-1)  # sorted; dividing by the temperature keeps the order
        vals = vals / t[pending].unsqueeze(1)
        kr, pr = k[pending], p[pending]
        keep = torch.arange(c, device=dev).unsqueeze(0) < kr.unsqueeze(1)
        vals = vals.masked_fill(~keep, float("-inf"))
        norm = torch.where(kr <= c, torch.logsumexp(vals, dim=-1), lse[pending])
        probs = torch.exp(vals - norm.unsqueeze(1))
        keep &= (probs.cumsum(dim=-1) - probs < pr.unsqueeze(1)) | (pr >= 1.0).unsqueeze(1)
        keep[:, 0] = True  # the best token always survives (a top_p that rounds to 0 in float32 too)
        keep &= vals >= vals[:, :1] + log_min_p[pending].unsqueeze(1)
        vals = vals.masked_fill(~keep, float("-inf"))
        done = (kr <= c) | (c == vocab) | ~keep[:, -1]
        if bool(done.any()):
            groups.append((rows_t[pending[done]], vals[done], ids[done]))
        pending = pending[~done]
        c = min(vocab, c * 8)
    return groups


def _inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's column: where u[i] (uniform in [0, 1)) falls in the CDF of softmax(x[i]).

    Wide rows go in two levels (which block of _BLOCK columns, then where inside it), so that the
    running sum is float64 and short instead of a float64 cumsum over the whole vocabulary.
    """
    probs = torch.softmax(x, dim=-1)
    degenerate = ~torch.isfinite(probs).all(dim=-1)
    if bool(degenerate.any()):
        # no distribution to draw from (every token excluded, or a +inf / NaN logit): the row's best token, as
        # a temperature near 0 would pick; NaN counts as the lowest, -inf everywhere gives token 0
        best = torch.nan_to_num(x[degenerate], nan=float("-inf")).argmax(dim=-1)
        if bool(degenerate.all()):
            return best
        picked = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        picked[degenerate] = best
        picked[~degenerate] = _inverse_cdf(x[~degenerate], u[~degenerate])
        return picked
    rows, width = probs.shape
    if width <= 4 * _BLOCK:
        return _search(probs.cumsum(dim=-1, dtype=torch.float64), u)
    nblocks = -(-width // _BLOCK)
    if nblocks * _BLOCK != width:
        probs = torch.nn.functional.pad(probs, (0, nblocks * _BLOCK - width))
    blocks = probs.view(rows, nblocks, _BLOCK)
    block_cdf = blocks.sum(dim=-1).double().cumsum(dim=-1)
    block = _search(block_cdf, u)
    ar = torch.arange(rows, device=x.device)
    before = torch.where(block > 0, block_cdf[ar, (block - 1).clamp(min=0)], 0.0)
    mass = block_cdf[ar, block] - before
    u_in = ((u * block_cdf[:, -1] - before) / mass).clamp(0.0, 1.0)
    return block * _BLOCK + _search(blocks[ar, block].cumsum(dim=-1, dtype=torch.float64), u_in)


def _search(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First column whose CDF exceeds u * total: never a column without probability mass."""
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
    # rounding can put u * total at the very end: fall back to the last column with any mass
    return torch.minimum(picked, torch.searchsorted(cdf, total)).squeeze(1)


def _eos_ids(eos_token_id: int | Iterable[int] | None) -> tuple[int, ...]:
    if eos_token_id is None:
        return ()
    if isinstance(eos_token_id, int):
        return (eos_token_id,)
    return tuple(int(t) for t in eos_token_id)


def process_logits(logits: torch.Tensor, seqs: Seq[Sequence], params: Seq[SamplingParams],
                   eos: tuple[int, ...] = ()) -> torch.Tensor:
    """logit_bias, min_tokens and penalties; returns `logits` itself when none applies (no copy)."""
    vocab = logits.shape[1]
    dev = logits.device
    bias_r, bias_t, bias_v = [], [], []
    mask_r, mask_t = [], []
    rep_rows, pen_rows = [], []
    for i, (s, p) in enumerate(zip(seqs, params, strict=True)):
        for tok, b in p.logit_bias:
            if tok < vocab:
                bias_r.append(i)
                bias_t.append(tok)
                bias_v.append(b)
        if s.num_output_tokens < p.min_tokens:
            banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(eos)
            for tok in banned:
                if 0 <= tok < vocab:
                    mask_r.append(i)
                    mask_t.append(tok)
        if p.repetition_penalty != 1.0:
            rep_rows.append(i)
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            pen_rows.append(i)
    if not (bias_r or mask_r or rep_rows or pen_rows):
        return logits
    x = logits.clone(memory_format=torch.contiguous_format)
    if bias_r:
        x.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                     torch.tensor(bias_v, device=dev), accumulate=True)
    if mask_r:
        x[torch.tensor(mask_r, device=dev), torch.tensor(mask_t, device=dev)] = float("-inf")
    flat = x.view(-1)  # penalties touch only the tokens a sequence holds: O(tokens), not O(batch x vocab)
    if rep_rows:
        at, j, _ = _occurrences(x, rep_rows, [seqs[i].token_ids for i in rep_rows])
        pen = torch.tensor([params[i].repetition_penalty for i in rep_rows], device=dev)[j]
        val = flat[at]
        flat[at] = torch.where(val > 0, val / pen, val * pen)
    if pen_rows:
        at, j, counts = _occurrences(x, pen_rows, [seqs[i].output_token_ids for i in pen_rows])
        freq = torch.tensor([params[i].frequency_penalty for i in pen_rows], device=dev)[j]
        pres = torch.tensor([params[i].presence_penalty for i in pen_rows], device=dev)[j]
        flat[at] -= freq * counts + pres
    return x


def _occurrences(x: torch.Tensor, rows: list[int],
                 token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each distinct token of token_lists[j] (logits row rows[j]): its flat index into x, j, and its count."""
    vocab = x.shape[1]
    toks = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long)
    pairs = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(t) for t in token_lists]))
    pairs = pairs * vocab + toks
    pairs, counts = torch.unique(pairs[(toks >= 0) & (toks < vocab)], return_counts=True)
    j = pairs // vocab
    at = torch.tensor(rows)[j] * vocab + pairs % vocab
    return at.to(x.device), j.to(x.device), counts.to(x.device, torch.float32)


def _logprobs(logits: torch.Tensor, params: list[SamplingParams],
              tokens: list[int]) -> list[TokenLogprob | None]:
    """Raw log-softmax of the sampled token and of the `logprobs` best tokens, for rows that ask."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return result
    dev = logits.device
    x = logits if len(rows) == len(params) else logits[torch.tensor(rows, device=dev)]
    # row by row: torch sums one row over its threads but several rows one per thread, in another order, so a
    # batched logsumexp moves a row's logprob in its last bits with the number of rows (--deterministic, engine/spec/)
    lse = torch.stack([torch.logsumexp(r, dim=-1) for r in x]) if x.shape[0] > 1 else torch.logsumexp(x, dim=-1)
    picked = torch.tensor([tokens[i] for i in rows], device=dev).unsqueeze(1)
    chosen = (x.gather(1, picked).squeeze(1) - lse).tolist()
    kmax = max(params[i].logprobs for i in rows)
    top_v, top_i = x.topk(kmax, dim=-1) if kmax else (x[:, :0], x[:, :0].long())
    top_v, top_i = (top_v - lse.unsqueeze(1)).tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        k = params[i].logprobs
        result[i] = TokenLogprob(tokens[i], chosen[j], list(zip(top_i[j][:k], top_v[j][:k], strict=True)))
    return result
