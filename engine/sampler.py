"""Turn one step's logits into the next token of every sequence, vectorized over the batch.

Interface (used by the engine loop):

    sampler = Sampler(seed=None)            # seed: the generator of rows without a per-request seed
    out = sampler(logits, seqs, eos_token_id)
    out.token_ids[i], out.logprobs[i]       # for seqs[i]; logprobs[i] is None unless params.logprobs is set

`logits` is `[len(seqs), vocab]` (float32, any device), row i belonging to `seqs[i]`, whose `token_ids`
must not yet contain the token being sampled. `eos_token_id` is an int, several ints, or None. The call
never modifies `logits` or the sequences. Call `check_token_ids(params, vocab_size)` when a request is
admitted so that out-of-vocabulary `logit_bias` / `stop_token_ids` are a clear error at the edge.
The two stages are also usable alone: `process_logits` (bias, min_tokens, penalties) and `warp_logits`
(temperature, top-k, top-p, min-p; -inf marks an excluded token).

Order of processing (vLLM's): logit_bias → min_tokens (EOS and stop_token_ids get -inf until the
sequence has min_tokens outputs; EOS only when ignore_eos is off, since it would not stop then) →
repetition penalty (Hugging Face: over prompt + output, positive logits divided, negative multiplied)
→ frequency / presence penalties (OpenAI: over output tokens, `logit -= f * count + p * (count > 0)`)
→ greedy rows take the argmax here; sampling rows go on: temperature → top-k → top-p (the smallest
set of best tokens whose mass, renormalized after top-k, reaches top_p) → min-p (drop tokens whose
probability is below min_p × the best one's) → one draw by inverse CDF.

Seeds: a row whose request has a `seed` draws its uniform number from a pure function of
(seed, seq.index, number of tokens generated so far), so the same request samples the same tokens in
every run, in any batch, in any order, and after preemption; the sampler keeps no per-sequence state
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

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.sequence import Sequence

_MASK64 = (1 << 64) - 1
_FIRST_CANDIDATES = 128  # top-p first looks for its set among this many best tokens, then 8x more


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Raise SamplingParamsError if logit_bias or stop_token_ids name a token outside the vocabulary."""
    for tok, _ in params.logit_bias:
        if tok >= vocab_size:
            raise SamplingParamsError("logit_bias", f"logit_bias token id {tok} is outside the vocabulary "
                                                    f"(size {vocab_size})")
    for tok in params.stop_token_ids:
        if not 0 <= tok < vocab_size:
            raise SamplingParamsError("stop_token_ids", f"stop_token_ids entry {tok} is outside the vocabulary "
                                                        f"(size {vocab_size})")


def seeded_uniform(seed: int, index: int, position: int) -> float:
    """The uniform number in [0, 1) that a seeded row uses for its `position`-th output token."""
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

    def __call__(self, logits: torch.Tensor, seqs: Seq[Sequence],
                 eos_token_id: int | Iterable[int] | None = None) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [num_seqs={len(seqs)}, vocab], got {tuple(logits.shape)}")
        if not seqs:
            return SamplerOutput([], [])
        logits = logits.float()
        params = [s.params for s in seqs]
        x = process_logits(logits, seqs, params, _eos_ids(eos_token_id))
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample(x, seqs, params, greedy)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(logits, params, token_list))

    def _sample(self, x: torch.Tensor, seqs: Seq[Sequence], params: list[SamplingParams],
                greedy: list[bool]) -> torch.Tensor:
        rows = [i for i, g in enumerate(greedy) if not g]
        dev = x.device
        tokens = x.argmax(dim=-1) if len(rows) < len(seqs) else torch.empty(len(seqs), dtype=torch.long, device=dev)
        sp = [params[i] for i in rows]
        xs = warp_logits(x if len(rows) == len(seqs) else x[torch.tensor(rows, device=dev)], sp)
        u = [seeded_uniform(p.seed, seqs[i].index, seqs[i].num_output_tokens) if p.seed is not None
             else self._rng.random() for i, p in zip(rows, sp, strict=True)]
        tokens[torch.tensor(rows, device=dev)] = _inverse_cdf(xs, torch.tensor(u, dtype=torch.float64, device=dev))
        return tokens


def warp_logits(x: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p for sampling rows: a new tensor, -inf where a token is excluded."""
    dev = x.device
    vocab = x.shape[1]
    x = x / torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        x = _top_k_top_p(x, top_k, top_p)
    if any(p.min_p > 0 for p in params):
        log_min_p = torch.tensor([p.min_p for p in params], device=dev).log().unsqueeze(1)
        x = x.masked_fill(x < x.max(dim=-1, keepdim=True).values + log_min_p, float("-inf"))
    return x


def _inverse_cdf(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: where u[i] (uniform in [0, 1)) falls in the CDF of softmax(x[i])."""
    cdf = torch.softmax(x, dim=-1).cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u.unsqueeze(1) * total, right=True)
    # rounding can put u * total at the very end: fall back to the last token with any probability
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
    x = logits.clone()
    if bias_r:
        x.index_put_((torch.tensor(bias_r, device=dev), torch.tensor(bias_t, device=dev)),
                     torch.tensor(bias_v, device=dev), accumulate=True)
    if mask_r:
        x[torch.tensor(mask_r, device=dev), torch.tensor(mask_t, device=dev)] = float("-inf")
    if rep_rows:
        seen = _token_counts(x, [seqs[i].token_ids for i in rep_rows]) > 0
        idx = torch.tensor(rep_rows, device=dev)
        pen = torch.tensor([params[i].repetition_penalty for i in rep_rows], device=dev).unsqueeze(1)
        sel = x[idx]
        x[idx] = torch.where(seen, torch.where(sel > 0, sel / pen, sel * pen), sel)
    if pen_rows:
        counts = _token_counts(x, [seqs[i].output_token_ids for i in pen_rows])
        idx = torch.tensor(pen_rows, device=dev)
        freq = torch.tensor([params[i].frequency_penalty for i in pen_rows], device=dev).unsqueeze(1)
        pres = torch.tensor([params[i].presence_penalty for i in pen_rows], device=dev).unsqueeze(1)
        x[idx] = x[idx] - freq * counts - pres * (counts > 0).float()
    return x


def _token_counts(x: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
    """[len(token_lists), vocab] float: how often each token occurs in each list (ids >= vocab ignored)."""
    vocab = x.shape[1]
    counts = torch.zeros(len(token_lists), vocab + 1, device=x.device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(t) for t in token_lists]))
    toks = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long).clamp_(0, vocab)
    counts.index_put_((rows.to(x.device), toks.to(x.device)), torch.ones(len(toks), device=x.device),
                      accumulate=True)
    return counts[:, :vocab]


def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep, per row, the top_k best tokens, then the fewest best of those whose mass reaches top_p.

    Exact (ties broken by torch.topk's order) without sorting the whole vocabulary: the kept set is
    looked for among the C best tokens, C growing 8x for the rows whose set could extend beyond C.
    """
    vocab = x.shape[1]
    dev = x.device
    out = x.clone()
    k = torch.tensor(top_k, device=dev)
    p = torch.tensor(top_p, device=dev)
    limited_k = [kk for kk in top_k if kk < vocab]
    c = min(vocab, max(_FIRST_CANDIDATES, max(limited_k, default=0)))
    pending = torch.tensor([i for i in range(len(top_k)) if top_k[i] < vocab or top_p[i] < 1.0], device=dev)
    lse_all = torch.logsumexp(x, dim=-1)
    while pending.numel():
        xr, kr, pr = x[pending], k[pending], p[pending]
        vals, idx = xr.topk(c, dim=-1)
        rank = torch.arange(c, device=dev).unsqueeze(0)
        vals = vals.masked_fill(rank >= kr.unsqueeze(1), float("-inf"))
        # top-p renormalizes over the top-k set: over all tokens when top-k is off (k >= C then).
        norm = torch.where(kr <= c, torch.logsumexp(vals, dim=-1), lse_all[pending])
        probs = torch.exp(vals - norm.unsqueeze(1))
        before = probs.cumsum(dim=-1) - probs
        keep = (before < pr.unsqueeze(1)) | (pr >= 1.0).unsqueeze(1)
        vals = vals.masked_fill(~keep, float("-inf"))
        done = (kr <= c) | (c == vocab) | ~keep[:, -1]
        if bool(done.any()):
            kept = torch.full((int(done.sum()), vocab), float("-inf"), device=dev)
            out[pending[done]] = kept.scatter_(1, idx[done], vals[done])
        pending = pending[~done]
        c = min(vocab, c * 8)
    return out


def _logprobs(logits: torch.Tensor, params: list[SamplingParams],
              tokens: list[int]) -> list[TokenLogprob | None]:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(params)
    if not rows:
        return result
    dev = logits.device
    idx = torch.tensor(rows, device=dev)
    lp = torch.log_softmax(logits[idx], dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=dev).unsqueeze(1)).squeeze(1).tolist()
    kmax = max(params[i].logprobs for i in rows)
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (None, None)
    top_v = top_v.tolist() if kmax else None
    top_i = top_i.tolist() if kmax else None
    for j, i in enumerate(rows):
        k = params[i].logprobs
        top = list(zip(top_i[j][:k], top_v[j][:k], strict=True)) if k else []
        result[i] = TokenLogprob(tokens[i], chosen[j], top)
    return result
