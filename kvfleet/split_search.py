"""The fewest prefill and decode replicas of a disaggregated pool that meet latency targets (`kvfleet plan
--disagg`). Pure: the runs are a callable (the simulator, in kvfleet/plan.py; hand-made tables in the tests).

A disaggregated pool's two sides answer for different targets: the prefill replicas for time to first token
(their queue and their prefill come before it), the decode replicas for time per output token. So each side is
sized first on its own target with the other side ample (`ample` replicas: enough that it does not limit), by the
same search as a colocated pool (router/pools/sizing.py smallest: doubling, then bisection). Together the two sizes
may still fall short (a request waits for a decode slot before its first token; a decode side loaded by every
request's prompt KV), so while the pair misses the goal, one replica is added to the side where it raises the
share of requests meeting both the more (both are tried). Last, a replica fewer on either side is tried, and taken while the pair still meets
the goal, so the answer meets it and neither neighbour with one replica fewer does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from router.pools.sizing import smallest


@dataclass(frozen=True)
class Shares:
    """A run's share of requests meeting the TTFT target, the TPOT target, and both (refused or dropped: none)."""

    ttft: float
    tpot: float
    both: float


@dataclass(frozen=True)
class Split:
    prefill: int
    decode: int
    shares: Shares  # of this pair's run


Run = Callable[[int, int], Shares]  # (prefill replicas, decode replicas) -> the shares meeting the targets


def fewest_split(run: Run, goal: float, ample: int, most: int) -> Split | None:
    """The (prefill, decode) pair with the fewest replicas found to meet `goal` (module docstring); None when a
    side does not meet its own target with up to `most` replicas while the other has `ample`, or the pair grows
    past `most` replicas in all. `run` is called once per pair (its results are kept)."""
    if ample < 1 or most < 1:
        raise ValueError(f"fewest_split: ample and most must be >= 1, got {ample}, {most}")
    seen: dict[tuple[int, int], Shares] = {}

    def shares(p: int, d: int) -> Shares:
        if (p, d) not in seen:
            seen[(p, d)] = run(p, d)
        return seen[(p, d)]

    p = smallest(lambda n: shares(n, ample).ttft >= goal, most)
    d = smallest(lambda n: shares(ample, n).tpot >= goal, most)
    if p is None or d is None:
        return None
    while shares(p, d).both < goal:
        if p + d + 1 > most:
            return None
        # one more replica on the side that raises the share meeting both the more (ties: the one that raises the
        # two targets' shares the more, then prefill): a short TTFT share may be the decode side's doing
        p, d = max(((p + 1, d), (p, d + 1)), key=lambda pd: (shares(*pd).both, shares(*pd).ttft + shares(*pd).tpot,
                                                             pd[0]))
    moved = True
    while moved:
        moved = False
        for q, e in ((p - 1, d), (p, d - 1)):
            if q >= 1 and e >= 1 and shares(q, e).both >= goal:
                p, d, moved = q, e, True
                break
    return Split(p, d, shares(p, d))
