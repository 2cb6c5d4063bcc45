"""Token ids in the response, on request: what a router needs to continue a stream on another replica.

The wire is vLLM's (`return_token_ids`, vLLM 0.10.2 and later), so one reader serves kvfleet's engines and
vLLM's alike. A request with `"return_token_ids": true` gets, besides the usual fields:
- `token_ids` on every choice of every chunk (streamed) or on every choice (whole response): the ids of the
  tokens that chunk (or choice) carries. A streamed choice sends a chunk for every token it generates, even
  one whose text is held back (a partial stop string, a character split over tokens), so the ids of a stream
  add up to every token generated, in order;
- `prompt_token_ids`, the prompt exactly as the engine tokenized it (chat template applied): at the top of
  a chat response (of its first chunk, when streamed), on each choice of a completions response (on each
  choice's first chunk, when streamed).
A reader takes the prompt's ids from either place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RETURN_TOKEN_IDS = "return_token_ids"  # the request's field
TOKEN_IDS = "token_ids"  # a choice's generated ids
PROMPT_TOKEN_IDS = "prompt_token_ids"  # the prompt's ids (top level of chat, per choice of completions)


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def prompt_ids_of(obj: Mapping, choice: Mapping | None) -> list[int] | None:
    """The prompt's ids a response (or chunk) `obj` carries for `choice`, from either place; None if none."""
    if choice is not None:
        ids = _ids(choice.get(PROMPT_TOKEN_IDS))
        if ids is not None:
            return ids
    return _ids(obj.get(PROMPT_TOKEN_IDS))


def token_ids_of(choice: Mapping) -> list[int] | None:
    """A choice's generated ids (of this chunk, when streamed); None if it carries none."""
    return _ids(choice.get(TOKEN_IDS))
