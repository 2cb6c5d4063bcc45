"""How steps shrink after the model runs out of memory, and when the engine gives up on a request.

A step whose forward pass raised an out-of-memory error advanced no sequence. The next steps get a token
budget of half the failed step's tokens (a prefill is chunked smaller, fewer decodes run at once); after
RECOVER_AFTER good steps in a row the budget doubles, up to --max-num-batched-tokens. The KV cache is
allocated up front, so what a smaller step saves is activation memory. A request that was alone in
GIVE_UP_AFTER failed steps in a row, each smaller than the one before, cannot run here: the engine fails
it rather than retrying forever. Pure: no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Set

GIVE_UP_AFTER = 3  # failed steps in a row with one request scheduled
RECOVER_AFTER = 4  # good steps in a row before the token budget doubles


class OomBackoff:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.token_budget = max_tokens  # tokens the next step may schedule
        self._good_steps = 0
        self._alone: str | None = None  # the request alone in the last failed steps
        self._alone_failures = 0  # how many failed steps in a row it was alone in

    def on_oom(self, num_tokens: int, request_ids: Set[str]) -> str | None:
        """A step of num_tokens tokens for these requests ran out of memory; the request to give up on, if any."""
        self.token_budget = max(1, num_tokens // 2)
        self._good_steps = 0
        alone = next(iter(request_ids)) if len(request_ids) == 1 else None
        if alone != self._alone:
            self._alone, self._alone_failures = alone, 0
        self._alone_failures += 1
        if alone is None or self._alone_failures < GIVE_UP_AFTER:
            return None
        self._alone, self._alone_failures = None, 0
        return alone

    def on_success(self) -> None:
        """A step ran."""
        self._alone, self._alone_failures = None, 0
        self._good_steps += 1
        if self._good_steps >= RECOVER_AFTER and self.token_budget < self.max_tokens:
            self.token_budget = min(self.max_tokens, self.token_budget * 2)
            self._good_steps = 0
