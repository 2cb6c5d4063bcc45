"""A request the router answers itself: an OpenAI error (contract/errors.py) with its status, headers and the
outcome its metrics count it under. Every admission stage and the tenant edge return one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from contract.errors import error_body, error_type


class Refusal(NamedTuple):
    """A request answered by the router itself: status, OpenAI error body, response headers, and the outcome
    label its metrics count it under."""

    status: int
    body: dict
    headers: list[tuple[bytes, bytes]]
    outcome: str


def refuse(status: int, message: str, outcome: str, param: str | None = None, code: str | None = None,
           headers: Sequence[tuple[bytes, bytes]] = ()) -> Refusal:
    return Refusal(status, error_body(message, error_type(status), param, code), list(headers), outcome)
