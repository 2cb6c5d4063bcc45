"""What a stream has sent its client so far, read from the upstream's SSE events as they pass.

    p = Progress(Endpoint.CHAT, n=1, strip=True)
    out = p.feed(upstream_bytes)        # the bytes for the client: whole events only
    p.unfinished()                      # the choices a continuation must finish
    p.error                             # an error event the replica sent (held back: the caller decides)

Per choice: the prompt's token ids and every generated id (contract/token_ids.py; the request went upstream
with `return_token_ids`), the text the client got, whether a chunk of it went out, its finish reason and, for
completions logprobs, the text offset of its next token. `strip`: the router asked for the token ids, the
client did not: they are taken out of every event. An error event and the `[DONE]` after it are held back, so
the stream can go on elsewhere instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from contract.request import Endpoint
from contract.token_ids import PROMPT_TOKEN_IDS, TOKEN_IDS, prompt_ids_of, token_ids_of

_DONE = b"data: [DONE]"
_CLIENT_FAULTS = frozenset({"invalid_request_error", "authentication_error", "permission_error",
                            "not_found_error", "BadRequestError", "NotFoundError"})


@dataclass(slots=True)
class ChoiceState:
    index: int
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)  # every token generated so far
    text: str = ""  # the text its client got
    opened: bool = False  # a chunk of it went out (a chat choice's first one carries the role)
    finish: str | None = None
    next_offset: int = 0  # completions logprobs: text_offset of its next token


def replica_failed(error: dict) -> bool:
    """An error event that says the replica failed (the engine died, was shut down, ran out of memory), not
    that the request was wrong: the request may go on elsewhere."""
    err = error.get("error")
    if not isinstance(err, dict):
        return True
    code = err.get("code")
    if isinstance(code, int) and not isinstance(code, bool):
        return code >= 500
    return err.get("type") not in _CLIENT_FAULTS


class Progress:
    def __init__(self, endpoint: Endpoint, n: int, strip: bool):
        self.endpoint = endpoint
        self.strip = strip
        self.choices = {i: ChoiceState(i) for i in range(n)}
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.prompt_ids: list[int] | None = None
        self.prompt_tokens: int | None = None  # the replica's usage, when it reported one
        self.cached_tokens: int | None = None
        self.error: dict | None = None  # an error event from the replica, held back
        self.done = False  # `[DONE]` went out
        self.events = 0  # events with choices that went out
        self._pending = b""

    # -- reading the upstream --------------------------------------------------------------------------------
    def feed(self, data: bytes) -> bytes:
        """The bytes for the client: whole events, token ids taken out where the client did not ask for them."""
        data = self._pending + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        self._pending = data[end + 2:]
        return b"".join(self._event(ev) for ev in data[:end].split(b"\n\n"))

    def _event(self, ev: bytes) -> bytes:
        if ev.startswith(_DONE):
            if self.error is not None:
                return b""
            self.done = True
            return ev + b"\n\n"
        if not ev.startswith(b"data: {"):
            return ev + b"\n\n"
        try:
            obj = json.loads(ev[6:])
        except ValueError:
            return ev + b"\n\n"
        if not isinstance(obj, dict):
            return ev + b"\n\n"
        if "error" in obj and not obj.get("choices"):
            self.error = obj
            return b""
        self.record(obj)
        if not self.strip:
            return ev + b"\n\n"
        obj.pop(PROMPT_TOKEN_IDS, None)
        for ch in obj.get("choices") or ():
            if isinstance(ch, dict):
                ch.pop(PROMPT_TOKEN_IDS, None)
                ch.pop(TOKEN_IDS, None)
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    def record(self, obj: dict) -> None:
        """Account for one chunk the client gets (from the replica, or made by relay.py)."""
        if self.id is None:
            self.id, self.created, self.model = obj.get("id"), obj.get("created"), obj.get("model")
        top = prompt_ids_of(obj, None)
        if top is not None and self.prompt_ids is None:
            self.prompt_ids = top
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached_tokens = details["cached_tokens"]
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return
        if choices:
            self.events += 1
        for ch in choices:
            if not isinstance(ch, dict) or not isinstance(ch.get("index"), int):
                continue
            c = self.choices.get(ch["index"])
            if c is None:
                c = self.choices[ch["index"]] = ChoiceState(ch["index"])
            self._choice(c, obj, ch)

    def _choice(self, c: ChoiceState, obj: dict, ch: dict) -> None:
        if c.prompt_ids is None:
            c.prompt_ids = prompt_ids_of(obj, ch)
        ids = token_ids_of(ch)
        if ids:
            c.ids.extend(ids)
        if self.endpoint is Endpoint.CHAT:
            delta = ch.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
        else:
            text = ch.get("text")
            lp = ch.get("logprobs")
            if isinstance(lp, dict) and lp.get("tokens") and lp.get("text_offset"):
                c.next_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
        if isinstance(text, str):
            c.text += text
        c.opened = True
        if ch.get("finish_reason") is not None:
            c.finish = ch["finish_reason"]

    # -- what is left -----------------------------------------------------------------------------------------
    def unfinished(self) -> list[ChoiceState]:
        return [c for _, c in sorted(self.choices.items()) if c.finish is None]

    def prompt_of(self, c: ChoiceState) -> list[int] | None:
        """The choice's prompt ids (one prompt per request: any choice's, or the chat's top-level ones)."""
        if c.prompt_ids is not None:
            return c.prompt_ids
        if self.prompt_ids is not None:
            return self.prompt_ids
        return next((o.prompt_ids for o in self.choices.values() if o.prompt_ids is not None), None)

    def usage(self) -> dict:
        """The whole request's usage: its prompt once, every choice's tokens from both replicas."""
        prompt = self.prompt_tokens
        if prompt is None:
            ids = next((self.prompt_of(c) for c in self.choices.values() if self.prompt_of(c)), None)
            prompt = len(ids) if ids is not None else 0
        completion = sum(len(c.ids) for c in self.choices.values())
        out: dict = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out
