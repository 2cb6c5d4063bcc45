"""Offline batch generation: `LLM("smollm2").generate(prompts, params)` and `.chat(messages, params)`.

Prompts are strings, token id lists, or {"prompt_token_ids": [...]} dicts; results come back in the
order of the prompts, each accumulated from the engine's per-step deltas once it finished. Everything
runs through the same LLMEngine the server uses, and the text is made as the server makes it
(engine/output_text.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from engine.args import EngineArgs
from engine.llm_engine import LLMEngine
from engine.output_text import RequestText
from engine.outputs import RequestDelta, RequestOutput
from engine.sampling_params import SamplingParams

PromptLike = str | Sequence[int] | Mapping


class LLM:
    def __init__(self, model: str = "smollm2", *, loaded_model=None, **engine_args):
        """engine_args: EngineArgs fields (dtype, num_blocks, max_num_seqs, ...); loaded_model: see LLMEngine."""
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args), loaded_model)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: PromptLike | Sequence[PromptLike],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching over all of them); outputs in prompt order."""
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, Sequence) and prompts
                                                   and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self._tokens(p, i) for i, p in enumerate(prompts)]
        return self._run(token_lists, params)

    def chat(self, messages: Sequence[Mapping] | Sequence[Sequence[Mapping]],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat-templated generation for one conversation or a list of conversations."""
        convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        token_lists = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in convs]
        return self._run(token_lists, params)

    def _tokens(self, prompt: PromptLike, i: int) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return [int(t) for t in prompt["prompt_token_ids"]]
            if isinstance(prompt.get("prompt"), str):
                return self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"prompts[{i}] must have 'prompt' (text) or 'prompt_token_ids'")
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError(f"prompts[{i}] must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def _run(self, token_lists: list[list[int]], params) -> list[RequestOutput]:
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(token_lists)
        if len(params) != len(token_lists):
            raise ValueError(f"got {len(params)} SamplingParams for {len(token_lists)} prompts")
        ids: list[str] = []
        deltas: dict[str, list[RequestDelta]] = {}
        texts: dict[str, RequestText] = {}
        try:
            for tokens, p in zip(token_lists, params, strict=True):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, tokens, p)
                ids.append(rid)
                deltas[rid] = []
                texts[rid] = RequestText(p, tokens, self.tokenizer)
            left = len(ids)
            while left:
                for out in self.engine.step():
                    if out.error is not None:
                        raise out.error
                    d, stops = texts[out.request_id].apply(out)
                    for index in stops:  # a stop string ended a completion (None: the last one, so the request)
                        if index is None:
                            self.engine.abort_request(out.request_id)
                        else:
                            self.engine.stop_completion(out.request_id, index)
                    if d is None:
                        continue
                    deltas[d.request_id].append(d)
                    left -= d.finished
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return [RequestOutput.from_deltas(tokens, deltas[rid]) for rid, tokens in zip(ids, token_lists, strict=True)]
