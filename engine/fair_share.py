"""Fair share of the waiting queue across tenants: the Virtual Token Counter (VTC) of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI 2024), on the fairness id each request carries (contract/fairness.py).

- Each fairness id has a counter of the service the engine gave it, at the paper's default weights: every prompt
  token the engine computes for it costs PROMPT_WEIGHT (w_p = 1), every token generated GENERATED_WEIGHT (w_q = 2).
  A prompt is charged when it is admitted (the paper's rule), for the tokens the prefix cache does not hold; a
  sequence preempted and recomputed is not charged its prompt again (the engine's choice, not the tenant's).
- The waiting queue is served lowest counter first: `order` merges the ids' own queues (each in queue order) by
  their counters, each counter projected forward by what the requests taken before it will be charged, so one
  tenant's burst interleaves with the others' requests as the paper's one-at-a-time admission would. Ties go to
  the id whose next request comes first in the queue.
- An id that (re)appears with nothing queued or running is lifted to the lowest counter among the ids that have
  work (to the counter of the last id whose work ended when none has): time spent idle is not banked.
Counters only grow and the floor a returning id is lifted to never falls, so an idle id at or below it is
forgotten (it would be lifted anyway): memory stays bounded by the ids with work and those above the floor.
With a single id the order is the queue's own: first come, first served.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence as Seq
from typing import Protocol, TypeVar

PROMPT_WEIGHT = 1
GENERATED_WEIGHT = 2


class Queued(Protocol):
    fairness_id: str
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...


Q = TypeVar("Q", bound=Queued)


class FairShare:
    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self.active: dict[str, int] = {}  # id -> its unfinished sequences (waiting or running)
        self.last_left = 0  # the counter of the last id whose work ended

    def floor(self) -> int:
        """What a returning id is lifted to: the lowest counter among the ids with work."""
        return min((self.counters[i] for i in self.active), default=self.last_left)

    def enter(self, fairness_id: str) -> None:
        """A sequence of this id joins the queue (a new request, or a fork of a running one)."""
        n = self.active.get(fairness_id, 0)
        if n == 0:
            self.counters[fairness_id] = max(self.counters.get(fairness_id, 0), self.floor())
        self.active[fairness_id] = n + 1

    def leave(self, fairness_id: str) -> None:
        """A sequence of this id finished (or was aborted)."""
        n = self.active[fairness_id] - 1
        if n:
            self.active[fairness_id] = n
            return
        del self.active[fairness_id]
        self.last_left = self.counters[fairness_id]
        if len(self.counters) > 2 * len(self.active) + 64:
            floor = self.floor()
            self.counters = {i: c for i, c in self.counters.items() if i in self.active or c > floor}

    def charge(self, fairness_id: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        self.counters[fairness_id] = (self.counters.get(fairness_id, 0) + PROMPT_WEIGHT * prompt_tokens
                                      + GENERATED_WEIGHT * generated_tokens)

    def order(self, queue: Seq[Q]) -> list[Q]:
        """The queue served lowest counter first (module docstring); the queue itself when one id holds it all."""
        by_id: dict[str, list[int]] = {}
        for pos, seq in enumerate(queue):
            by_id.setdefault(seq.fairness_id, []).append(pos)
        if len(by_id) <= 1:
            return list(queue)
        heap = [(self.counters.get(i, 0), positions[0], i, 0) for i, positions in by_id.items()]
        heapq.heapify(heap)
        out = []
        while heap:
            counter, pos, i, k = heapq.heappop(heap)
            seq = queue[pos]
            out.append(seq)
            positions = by_id[i]
            if k + 1 < len(positions):
                counter += PROMPT_WEIGHT * (seq.num_tokens - seq.num_computed_tokens)
                heapq.heappush(heap, (counter, positions[k + 1], i, k + 1))
        return out
