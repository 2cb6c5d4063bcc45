"""The engine loop: schedule → run the model → sample → update the sequences.

`LLMEngine(EngineArgs)` loads the model, sizes the KV cache and owns the scheduler. `add_request`
validates a prompt (engine/admission.py, once) and queues it; every `step()` runs one batch and returns a
RequestDelta (only the new token ids and logprobs) for each request that produced tokens or
finished. A request with n > 1 runs as one sequence until its prompt is prefilled, then forks into n
sequences that share the prompt's blocks.

A step whose forward pass runs out of memory (CUDA's OutOfMemoryError, or MemoryError) does not kill the
engine: it is counted (`oom_events`), CUDA's cached memory is released, and the scheduler retries with
smaller steps; a request that keeps failing alone ends with RequestOutOfMemoryError on its last delta
(engine/oom_backoff.py). Nothing advanced in the failed step, so outputs are what they would have been.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence as Seq

import torch

from contract.errors import ConfigError
from contract.kv_events import KVEvent
from engine.admission import EngineLimits, admit
from engine.args import EngineArgs
from engine.attention import get_attention_backend
from engine.config import SchedulerConfig
from engine.cpu_cores import parse_cpu_list, pin_process
from engine.errors import InvalidRequestError, RequestOutOfMemoryError
from engine.kv import transfer as kv_transfer
from engine.kv.config import CacheConfig
from engine.kv.manager import KVCacheManager
from engine.kv.offload import Offload
from engine.kv.sizing import GIB, plan_fixed, plan_from_profile
from engine.kv.tier import KVTier
from engine.lora.manager import lora_manager
from engine.memory_profile import cuda_baseline, host_memory_bytes, profile_cuda, tensor_bytes
from engine.model.fast_paths import use_fast_paths
from engine.model.llama import ModelConfig
from engine.model.loader import load_hf_config, load_model, resolve_dtype
from engine.model.registry import resolve_model
from engine.model_runner import ModelRunner, kv_bytes_per_token
from engine.onednn_caches import bound_onednn_caches
from engine.oom_backoff import GIVE_UP_AFTER
from engine.outputs import CompletionDelta, RequestDelta, RequestMetrics
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.spec.decoder import SpecDecoder
from engine.spec.draft_model import load_draft
from engine.stats import EngineStats
from engine.stop import StopChecker
from engine.structured.grammars import GrammarCache
from engine.tokenizer import Tokenizer, load_tokenizer, tokenizer_facts

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_GIB = 2.0
_FINISH_STATUS = {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH}


class _Request:
    """What the engine tracks for one request across its n completions."""

    def __init__(self, seq: Sequence):
        self.request_id = seq.request_id
        self.prompt = list(seq.token_ids)
        self.params = seq.params
        self.seqs: list[Sequence] = [seq]  # by completion index, n of them after the fork
        self.checkers: dict[int, StopChecker] = {}
        self.metrics = RequestMetrics(arrival_time=seq.arrival_time)
        self.aborted = False

    @property
    def finished(self) -> bool:
        return self.aborted or (len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs))


class LLMEngine:
    def __init__(self, args: EngineArgs, model=None):
        """model: an already loaded (LlamaForCausalLM, hf_config) of args.model to reuse (tests, benchmarks)."""
        self.args = args
        bound_onednn_caches()  # before the model's first oneDNN op reads them
        if args.cpu_cores is not None:  # first, so the torch threads below start on these cores
            pin_process(parse_cpu_list(args.cpu_cores))
        threads = args.num_threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        self.device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                                   else ("cpu" if args.device == "auto" else args.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device", "--device: cuda was asked for but no CUDA device is available")
        self.source = resolve_model(args.model, args.allow_download)
        self.model_name = args.model_name
        self.dtype = resolve_dtype(args.dtype, self.device)
        hf_config = load_hf_config(self.source)
        config = ModelConfig.from_hf(hf_config)
        self.max_model_len = args.max_model_len or config.max_position_embeddings
        rope_type = config.rope_parameters.get("rope_type", config.rope_parameters.get("type", "default"))
        if self.max_model_len > config.max_position_embeddings and rope_type == "default":
            raise ConfigError("--max-model-len", f"--max-model-len: {self.max_model_len} exceeds the model's context length "
                                                     f"({config.max_position_embeddings})")
        if config.sliding_window and self.max_model_len > config.sliding_window:
            raise ConfigError("--max-model-len", f"--max-model-len: {self.max_model_len} exceeds the model's sliding attention "
                                                     f"window ({config.sliding_window}), which is not implemented; "
                                                     f"use --max-model-len {config.sliding_window} or less")
        free_at_start = cuda_baseline(self.device) if self.device.type == "cuda" else 0
        self.model, self.hf_config = model or load_model(self.source, self.dtype, self.device, self.max_model_len,
                                                         hf_config=hf_config)
        self.config = self.model.config
        self._tokenizer: Tokenizer | None = None  # loaded on first use (`tokenizer`): a core process may never need it
        facts = tokenizer_facts(self.source)
        self.eos_token_ids = facts.eos_token_ids
        self.block_size = args.block_size
        self.hash_seed = args.hash_seed
        try:
            backend = get_attention_backend(args.attention_backend, self.device, self.dtype, args.deterministic)
        except ValueError as e:
            if not args.deterministic:
                raise
            raise ConfigError("--deterministic", f"--deterministic: {e}") from None
        self.model = use_fast_paths(self.model, backend.name, self.dtype, args.deterministic)
        self.lora = lora_manager(self.model, args, backend.name)  # None unless LoRA is on: projections untouched
        self.kv_cache_plan = None  # how the KV cache was sized (engine/kv/sizing.py); None with --num-blocks
        spec = args.speculative_config  # a draft model is loaded first: its caches share the KV memory
        draft = (load_draft(args, self.config, self.dtype, self.device, self.max_model_len)
                 if spec is not None and spec.method == "draft_model" else None)
        num_blocks = args.num_blocks or self._size_kv_cache(
            backend, free_at_start, draft.kv_bytes_per_token(self.dtype) if draft is not None else 0)
        # pins take at most --kv-pin-fraction of the blocks and never room the longest request needs: a request
        # that fits max_model_len fits beside any pins (on a cache no larger than that, nothing can be pinned)
        room = num_blocks - -(-self.max_model_len // args.block_size)
        pinned = max(0, min(int(args.kv_pin_fraction * num_blocks), room)) if args.enable_prefix_caching else 0
        self.kv = KVCacheManager(CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching, args.hash_seed,
                                             max_pinned_blocks=pinned,
                                             max_pinned_blocks_per_tenant=int(args.kv_pin_tenant_fraction * num_blocks)))
        self.clock = time.monotonic  # the time cache_control pins expire by (a benchmark may set another)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, self.max_model_len,
                                                   args.scheduling_policy, args.priority_aging, args.max_loras,
                                                   args.max_step_ms),
                                   self.kv)
        self.limits = EngineLimits(min(self.config.vocab_size, facts.vocab_size), self.max_model_len,
                                   args.max_num_seqs, args.block_size, num_blocks, pinned)
        self.runner = ModelRunner(self.model, backend, num_blocks, args.block_size, self.device,
                                  args.debug_oom_every, max_num_seqs=args.max_num_seqs,
                                  max_model_len=self.max_model_len, cuda_graphs=args.cuda_graphs, lora=self.lora)
        self.offload = None  # engine/kv/offload.py: evicted blocks kept in a lower tier (--kv-tier-gib)
        if args.kv_tier_gib > 0:
            self.offload = Offload(self.kv, self.runner.kv_caches, KVTier(int(args.kv_tier_gib * GIB), args.kv_tier_path))
        if self.device.type == "cuda":
            self.runner.warm_up()  # every Triton kernel compiled (and graphs captured) before the first request
        self.sampler = Sampler(seed=args.seed)
        self.spec = None  # engine/spec/: draft tokens verified in one step (--speculative-config)
        if spec is not None:
            runner = draft.runner(num_blocks, args.block_size, self.device, args.max_num_seqs) if draft else None
            self.spec = self.scheduler.proposer = SpecDecoder(spec, self.max_model_len, runner)
        self.grammars = GrammarCache(lambda: self.tokenizer.hf, self.config.vocab_size, self.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.oom_events = 0
        logger.info("engine ready: %s (%s, %s), max_model_len %d, %d KV blocks of %d tokens, %d threads",
                    self.source.path, self.dtype, self.device, self.max_model_len, num_blocks, args.block_size, threads)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, loaded on first use (per process, engine/tokenizer.py)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.source)
        return self._tokenizer

    def _size_kv_cache(self, backend, free_at_start: int, draft_per_token: int = 0) -> int:
        """KV blocks from the memory left for them (engine/kv/sizing.py); the arithmetic goes to the log.
        draft_per_token: a draft model's K/V bytes per token, held beside every block's (engine/spec/draft_model.py)."""
        per_block = (kv_bytes_per_token(self.config, self.dtype) + draft_per_token) * self.args.block_size
        if self.args.kv_cache_memory is not None or self.device.type != "cuda":
            gib = self.args.kv_cache_memory if self.args.kv_cache_memory is not None else DEFAULT_CPU_KV_GIB
            total = None if self.device.type == "cuda" else host_memory_bytes()
            plan = plan_fixed(int(gib * GIB), per_block, tensor_bytes(self.model), total,
                              explicit=self.args.kv_cache_memory is not None)
        else:
            plan = plan_from_profile(profile_cuda(
                self.model, backend, self.device, self.args.block_size, self.args.max_num_batched_tokens,
                self.args.max_num_seqs, self.max_model_len, self.args.gpu_memory_fraction, free_at_start), per_block)
        logger.info("%s", plan.line)
        self.kv_cache_plan = plan
        return plan.num_blocks

    # ---- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises InvalidRequestError (engine/errors.py) if it can never run."""
        self.add_sequence(self.new_sequence(request_id, prompt_token_ids, params, cache_salt, arrival_time))

    def new_sequence(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams | None = None,
                     cache_salt: str | None = None, arrival_time: float | None = None) -> Sequence:
        """Validate a request without touching engine state (safe from any thread); its first sequence."""
        prompt, params = admit(prompt_token_ids, params or SamplingParams(), self.limits)
        return self.make_sequence(request_id, prompt, params, cache_salt, arrival_time)

    def make_sequence(self, request_id: str, prompt: list[int], params: SamplingParams, cache_salt: str | None = None,
                      arrival_time: float | None = None) -> Sequence:
        """The first sequence of a request admitted already (engine/admission.py), without checking it again."""
        seq = Sequence(request_id, prompt, params, cache_salt, arrival_time=arrival_time)
        if params.guide is not None:  # compiled already (the server's compile_async, the core's ready()): a hit
            seq.matcher = self.grammars.matcher(params.guide)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        """Queue a sequence made by new_sequence (engine thread only)."""
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already running")
        if seq.lora is not None:  # read from its directory the first time (LoRAError: the request fails)
            if self.lora is None:
                raise InvalidRequestError("model", f"{seq.lora.name!r} is a LoRA adapter, but this engine serves "
                                                   f"none (start it with --enable-lora)")
            self.lora.ensure_loaded(seq.lora)
            self.kv.on_adapter_load(seq.lora.name, seq.lora.id)  # a reloaded name: its old blocks leave the cache
        if self.offload is not None:  # its prompt's blocks the lower tier holds come back before it is scheduled
            self.offload.reload(seq)
        if seq.params.cache_pin is not None:  # PinLimitError: its prefix would pin more than the limits allow
            self.kv.tick(self.clock())  # pins that expired while the engine was idle leave room first
            self.kv.reserve_pin(seq)
        self.scheduler.add(seq)
        req = self.requests[seq.request_id] = _Request(seq)
        self._track(req, seq)

    def abort_request(self, request_id: str) -> RequestDelta | None:
        """Stop a request in any state and free its blocks; its last delta (finish_reason "abort")."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        ended = [CompletionDelta(s.index, finish_reason="abort") for s in req.seqs if not s.is_finished]
        self.scheduler.abort(request_id)
        req.aborted = True
        req.metrics.finished_time = time.monotonic()
        return self._delta(req, ended)

    def stop_completion(self, request_id: str, index: int) -> None:
        """End one completion of a request, as a stop string seen by the front end did (engine/output_text.py);
        the request ends with its last completion. The front end has the finish already: no delta."""
        req = self.requests.get(request_id)
        if req is None or index >= len(req.seqs):
            return
        self.scheduler.finish(req.seqs[index], SequenceStatus.FINISHED_STOPPED)
        if req.finished:
            req.metrics.finished_time = time.monotonic()
            del self.requests[request_id]

    def abort_all(self) -> list[RequestDelta]:
        return [out for rid in list(self.requests) if (out := self.abort_request(rid)) is not None]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- the loop ------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        outputs = self._step()
        if self.args.debug_step_delay_ms:
            time.sleep(self.args.debug_step_delay_ms / 1000)
        return outputs

    def _step(self) -> list[RequestDelta]:
        t0 = time.perf_counter()
        self.kv.tick(self.clock())  # cache_control pins whose TTL passed become ordinary cached blocks
        if self.spec is not None:
            self.spec.begin_step(self.scheduler.running)  # the gate: whether it drafts (a draft model drafts here)
        out = self.scheduler.schedule()
        try:
            logits, seqs = self.runner.execute(out.scheduled, out.blocks_to_copy)
        except (torch.OutOfMemoryError, MemoryError) as e:
            error = f"{type(e).__name__}: {e}"
        else:
            error = None
        if error is not None:  # out of the except block: the failed step's tensors are released
            return self._recover_from_oom(out, error)
        self.scheduler.on_step_done(out)
        logits, seqs = self._fork(logits, seqs)
        deltas = self._update(self._sample(logits, seqs, out)) if seqs else []
        self.scheduler.observe_step(out, time.perf_counter() - t0)  # the step-time model's sample
        if self.spec is not None:
            self.spec.end_step(time.perf_counter() - t0, out)  # what drafting gained, for the gate
        return deltas

    def _recover_from_oom(self, out: SchedulerOutput, error: str) -> list[RequestDelta]:
        """The step ran out of memory and advanced nothing: count it, shrink the next steps, and end the
        request that keeps failing alone, if any (its last delta carries the error)."""
        self.oom_events += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        give_up = self.scheduler.on_step_failed(out)
        logger.warning("a step of %d tokens (%d sequences) ran out of memory: %s; next steps: at most %d tokens",
                       out.num_batched_tokens, len(out.scheduled), error, self.scheduler.oom.token_budget)
        if give_up is None:
            return []
        last = self.abort_request(give_up)
        last.error = RequestOutOfMemoryError(
            f"the model ran out of memory in {GIVE_UP_AFTER} steps in a row that ran this request alone ({error}); "
            f"retry later or with a shorter prompt")
        logger.warning("gave up on request %s: out of memory", give_up)
        return [last]

    def _fork(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Parents of n > 1 requests that just finished their prompt fork; each child samples the same row."""
        rows = list(range(len(seqs)))
        extra_seqs: list[Sequence] = []
        for i, seq in enumerate(seqs):
            if seq.params.n > 1 and seq.index == 0 and seq.num_output_tokens == 0:
                req = self.requests[seq.request_id]
                if len(req.seqs) == 1:
                    children = self.scheduler.fork(seq, seq.params.n - 1)
                    for child in children:
                        if seq.matcher is not None:
                            child.matcher = seq.matcher.fork()
                        req.seqs.append(child)
                        self._track(req, child)
                    extra_seqs.extend(children)
                    rows.extend([i] * len(children))
        if not extra_seqs:
            return logits, seqs
        return logits[torch.tensor(rows, device=logits.device)], seqs + extra_seqs

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], out: SchedulerOutput):
        """(seq, tokens, logprobs, drafts verified) per sequence sampled: one token each, or with drafts
        (engine/spec/) the drafts the sampled tokens agree with and the token after them."""
        drafts = {it.seq.seq_id: it.spec_token_ids for it in out.scheduled if it.spec_token_ids}
        if not drafts:
            sampled = self.sampler(logits, seqs, self.eos_token_ids)
            return [(seq, [tok], [lp], 0) for seq, tok, lp in zip(seqs, sampled.token_ids, sampled.logprobs,
                                                                  strict=True)]
        sampled = self.sampler(logits, self.spec.sampling_rows(seqs, drafts), self.eos_token_ids)
        return self.spec.accept(seqs, sampled.token_ids, sampled.logprobs, drafts)

    def _update(self, sampled: list[tuple[Sequence, list[int], list, int]]) -> list[RequestDelta]:
        now = time.monotonic()
        news: dict[str, tuple[_Request, list[CompletionDelta]]] = {}
        for seq, toks, lps, num_drafts in sampled:
            if seq.is_finished:
                continue
            req = self.requests[seq.request_id]
            checker = req.checkers[seq.index]
            n = 0
            for tok in toks:  # several with drafts: a stop inside the run cuts it there
                n += 1
                seq.append_token(tok)
                if seq.matcher is not None and not seq.matcher.accept_token(tok):
                    logger.warning("request %s: the grammar refused sampled token %d", seq.request_id, tok)
                res = checker.update(seq)
                if res.finish_reason is not None:
                    break
            self.generation_tokens_total += n
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                req.metrics.first_scheduled_time = seq.first_scheduled_time
                self.prompt_tokens_total += len(req.prompt)
            if res.finish_reason is not None:
                self.scheduler.finish(seq, _FINISH_STATUS[res.finish_reason])
            elif num_drafts:
                self.scheduler.on_drafts_verified(seq, n - 1)
            delta = CompletionDelta(seq.index, "", toks[:n], None if lps[0] is None else lps[:n], res.finish_reason,
                                    res.stop_reason)
            news.setdefault(req.request_id, (req, []))[1].append(delta)
        outputs = []
        for req, deltas in news.values():
            req.metrics.last_token_time = now
            if req.finished:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            outputs.append(self._delta(req, deltas))
        return outputs

    # ---- helpers -------------------------------------------------------------------------

    def _track(self, req: _Request, seq: Sequence) -> None:
        req.checkers[seq.index] = StopChecker(seq.params, self.eos_token_ids, self.max_model_len)

    def _delta(self, req: _Request, deltas: list[CompletionDelta]) -> RequestDelta:
        first = req.seqs[0]
        return RequestDelta(req.request_id, deltas, req.finished, len(req.prompt), first.num_cached_tokens,
                            req.metrics, cache_creation_tokens=first.num_cache_created_tokens,
                            cached_tokens_by_tier=first.cached_by_tier)

    @property
    def kv_layout(self):
        """contract.kv_transfer.Layout of this engine's KV cache."""
        return kv_transfer.layout_of(self.model_name, self.runner.kv_caches, self.hash_seed)

    def export_blocks(self, hashes, max_blocks: int, out: memoryview):
        """Blocks a peer pulls (engine/kv/transfer.py): (hashes, tokens, adapter, payload bytes written to `out`) of
        the leading run held, and whether the next of `hashes` is being computed here (a request in the engine
        has it in its prompt)."""
        found, tokens, lora, size = kv_transfer.export_blocks(self.kv, self.runner.kv_caches, hashes, max_blocks, out)
        nxt = hashes[len(found)] if len(found) < min(len(hashes), max_blocks) else None
        pending = nxt is not None and any(nxt in self.kv.hash_prompt(seq) for req in self.requests.values()
                                          for seq in req.seqs if not seq.is_finished)
        return found, tokens, lora, size, pending

    def import_blocks(self, prefix, hashes, tokens, lora: str | None, payload: memoryview) -> tuple[int, int]:
        """Verified blocks of a peer into the prefix cache: (blocks imported, blocks held already)."""
        return kv_transfer.import_blocks(self.kv, self.runner.kv_caches, prefix, hashes, tokens, lora, payload)

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv.drain_events()

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            kv_usage=kv.usage, num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_total_blocks=kv.num_blocks, block_size=kv.block_size,
            prefix_queries_tokens=kv.prefix_queries_tokens, prefix_hits_tokens=kv.prefix_hits_tokens,
            num_preemptions=kv.num_preemptions, alloc_failures=kv.alloc_failures, evictions=kv.evictions,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            oom_events=self.oom_events, gpu_memory_used_bytes=self._gpu_memory_used(),
            deterministic=self.args.deterministic,
            num_free_blocks=kv.num_free_blocks, num_cached_blocks=len(kv.pool.cached),
            num_pinned_blocks=kv.pins.num_pinned,
            **self._step_time_stats(),
            **(self._spec_stats() if self.spec is not None else {}),
            **(self._tier_stats() if self.offload is not None else {}),
            **(self._lora_stats() if self.lora is not None else {}))

    def _step_time_stats(self) -> dict:
        st = self.scheduler.step_stats
        return {"step_seconds": st.last_s, "step_predicted_seconds": st.last_predicted_s,
                "steps_predicted": st.predicted_steps, "step_predicted_seconds_total": st.predicted_s_total,
                "step_observed_seconds_total": st.observed_s_total,
                "step_prediction_error_seconds_total": st.abs_error_s_total}

    def _spec_stats(self) -> dict:
        st, gate = self.spec.stats, self.spec.gate
        return {"spec_num_drafts": st.num_drafts, "spec_num_draft_tokens": st.num_draft_tokens,
                "spec_num_accepted_tokens": st.num_accepted_tokens,
                "spec_accepted_per_pos": tuple(st.accepted_per_pos),
                **({} if gate is None else {"spec_gate_open": gate.open, "spec_gate_speedup": gate.speedup,
                                            "spec_gate_closed_steps": gate.num_closed_steps})}

    def _tier_stats(self) -> dict:
        off = self.offload
        return {"tier_blocks": len(off.tier), "tier_bytes": off.tier.used_bytes, "tier_spilled_blocks": off.spilled_blocks,
                "tier_reloaded_blocks": off.reloaded_blocks}

    def _lora_stats(self) -> dict:
        sched = self.scheduler
        running = dict.fromkeys(s.lora.name for s in sched.running if s.lora is not None)
        waiting = dict.fromkeys(s.lora.name for s in sched.waiting if s.lora is not None)
        return {"max_loras": self.lora.max_loras, "lora_running": tuple(running), "lora_waiting": tuple(waiting)}

    def remove_lora(self, adapter_id: int) -> None:
        """Forget an unloaded adapter's weights (requests already running under it finish first)."""
        if self.lora is not None and not any(
                r.params.lora is not None and r.params.lora.id == adapter_id for r in self.requests.values()):
            self.lora.remove(adapter_id)

    def _gpu_memory_used(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else None
