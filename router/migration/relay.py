"""A continuation's chunks as the client's stream goes on: the same id, object, created and model as the chunks
before the break, the choice's own index, chat deltas for a chat stream (with the role if the choice had not
started), logprobs in the client's endpoint's shape (completions text offsets going on from the break), usage
for the whole request where the stream carries it, token ids only if the client asked for them.

    relay = Relay(progress, choice, straddle, top_logprobs=k, keep_ids=False, continuous=True)
    for chunk in relay.event(obj):      # obj: one parsed continuation chunk
        send(chunk)
    relay.done                           # the choice finished (the continuation can be closed)
    progress.final_events(include_usage) # after the last choice: the usage chunk, [DONE]
"""

from __future__ import annotations

import json

from contract.request import Endpoint
from contract.token_ids import TOKEN_IDS, token_ids_of
from router.migration.progress import ChoiceState, Progress
from router.migration.straddle import Straddle


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def final_events(progress: Progress, include_usage: bool) -> bytes:
    """What ends the stream: the whole request's usage (where the upstream request asked for it), `[DONE]`."""
    out = b""
    if include_usage:
        out = sse({**_base(progress), "choices": [], "usage": progress.usage()})
    return out + b"data: [DONE]\n\n"


class Relay:
    def __init__(self, progress: Progress, choice: ChoiceState, straddle: Straddle | None,
                 top_logprobs: int | None, keep_ids: bool, continuous: bool):
        self.p, self.c, self.straddle = progress, choice, straddle
        self.top = top_logprobs
        self.keep_ids, self.continuous = keep_ids, continuous
        self._offset = choice.next_offset  # completions: text offsets go on from here

    @property
    def done(self) -> bool:
        return self.c.finish is not None

    def event(self, obj: dict) -> list[dict]:
        out = []
        for ch in obj.get("choices") or ():
            if isinstance(ch, dict) and not self.done:
                chunk = self._choice(ch)
                if chunk is not None:
                    out.append(chunk)
        return out

    def _choice(self, ch: dict) -> dict | None:
        c = self.c
        ids = token_ids_of(ch) or []
        got = ch.get("text")
        text: str = got if isinstance(got, str) else ""
        finish, stop_reason = ch.get("finish_reason"), ch.get("stop_reason")
        if self.straddle is not None:
            text, hit = self.straddle.feed(text)
            if hit is None and finish is not None:
                rest, hit = self.straddle.finish(stop_reason if finish == "stop" else None)
                text += rest
            if hit is not None:
                finish, stop_reason = "stop", hit
        c.ids.extend(ids)
        lp = self._logprobs(ch.get("logprobs"))
        if not text and lp is None and finish is None and not (self.keep_ids and ids):
            return None
        first = not c.opened
        c.text += text
        c.opened = True
        c.finish = finish
        if self.p.endpoint is Endpoint.CHAT:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish,
                      "stop_reason": stop_reason}
            obj_type = "chat.completion.chunk"
        else:
            choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish,
                      "stop_reason": stop_reason}
            obj_type = "text_completion"
        if self.keep_ids:
            choice[TOKEN_IDS] = ids
        chunk = {**_base(self.p, obj_type), "choices": [choice]}
        if self.continuous:
            chunk["usage"] = self.p.usage()
        return chunk

    def _logprobs(self, lp) -> dict | None:
        if self.top is None or not isinstance(lp, dict) or not lp.get("tokens"):
            return None
        tokens, values = lp["tokens"], lp.get("token_logprobs") or []
        tops = lp.get("top_logprobs") or []
        if self.p.endpoint is Endpoint.CHAT:
            return {"content": [_chat_entry(t, values[j] if j < len(values) else None,
                                            tops[j] if j < len(tops) else None, self.top)
                                for j, t in enumerate(tokens)]}
        offsets, at = [], self._offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        self._offset = self.c.next_offset = at
        return {**lp, "text_offset": offsets}


def _chat_entry(token: str, logprob, top, k: int) -> dict:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:k] if isinstance(top, dict) else []
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in ranked]}


def _base(p: Progress, obj_type: str | None = None) -> dict:
    if obj_type is None:
        obj_type = "chat.completion.chunk" if p.endpoint is Endpoint.CHAT else "text_completion"
    return {"id": p.id, "object": obj_type, "created": p.created, "model": p.model}
