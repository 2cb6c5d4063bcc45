"""What the ingress computes once per request and passes along with it, so the request router only looks it up:
the prompt's token count, its session key and its chained block hashes (for the fleet-wide block size and hash
seed). Built from the HTTP router's own PreparedRequest (router/routing/prepare.py)."""

from __future__ import annotations

from dataclasses import dataclass

from contract.hashing import DEFAULT_HASH_SEED
from router.routing.prepare import PreparedRequest

ROUTE_KWARG = "route"  # the keyword argument of EngineReplica.generate that carries the hint
PIN_KWARG = "replica"  # a call with replica=<Serve replica id> goes to that replica only (e.g. its metrics)


@dataclass(frozen=True, slots=True)
class RouteHint:
    num_prompt_tokens: int = 0
    session_key: str | None = None
    block_size: int = 16
    hash_seed: int = DEFAULT_HASH_SEED
    block_hashes: tuple[int, ...] = ()

    @classmethod
    def of(cls, prep: PreparedRequest, block_size: int, hash_seed: int) -> RouteHint:
        return cls(prep.num_prompt_tokens, prep.session_key, block_size, hash_seed,
                   tuple(prep.block_hashes(block_size, hash_seed)))
