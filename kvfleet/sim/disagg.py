"""Prefill/decode disaggregation in the fleet simulator: how a fleet splits, and how a request crosses it.

A disaggregated fleet of N replicas runs P prefill replicas and N - P decode replicas. The router places each
request over the prefill replicas with its policy (the same placement core, fed by their KV events); the chosen
one prefills the prompt (its own prefix cache, its cost model's prefill rate) and hands the prompt's KV over
`link` to a decode replica chosen at that moment by `decode_policy` over the decode replicas (least-load by
default). The decode replica takes blocks for the prompt and the output when it admits the request, caches
nothing, and produces every output token, the first one included: TTFT runs from arrival to that first token,
after the prefill, the transfer and any wait for a decode slot. Not modelled: failures, a shared or contended
link, the prefill replica holding the KV until the decode side has room, decode replicas reusing prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.sim.link import PullLink
from router.routing.policies import POLICIES


@dataclass(frozen=True)
class Disagg:
    prefill_replicas: int
    link: PullLink = field(default_factory=PullLink)
    decode_policy: str = "least-load"

    def __post_init__(self) -> None:
        if self.prefill_replicas < 1:
            raise ValueError(f"Disagg.prefill_replicas: must be >= 1, got {self.prefill_replicas}")
        if self.decode_policy not in POLICIES:
            raise ValueError(f"Disagg.decode_policy: must be one of {sorted(POLICIES)}, got {self.decode_policy!r}")


def prefill_count(spec: str, replicas: int) -> int:
    """Prefill replicas for `--disagg-prefill`: a count ("12") or a prefill:decode ratio ("3:1", rounded, at
    least one replica on each side)."""
    p, sep, d = spec.partition(":")
    try:
        if not sep:
            n = int(p)
        else:
            a, b = float(p), float(d)
            if not (a > 0 and b > 0):
                raise ValueError
            n = min(max(round(replicas * a / (a + b)), 1), replicas - 1)
    except ValueError:
        raise ValueError(f"--disagg-prefill: a count or a ratio P:D of positive numbers, got {spec!r}") from None
    if not 1 <= n < replicas:
        raise ValueError(f"--disagg-prefill: {n} prefill replicas leave none of {replicas} to decode")
    return n
