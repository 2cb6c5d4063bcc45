"""Prices per model, and what a request's usage costs in money and in budget tokens. Pure: no I/O.

A model's prices are US dollars per million tokens, exact decimals as written in the tenants file (`0.1` is 1/10):

- `input`: a prompt token the engine computed;
- `cached_input`: a prompt token read from the prefix cache (computed earlier, by whichever request: a block is
  paid for once, when it is computed, at `input`; every later read pays `cached_input`);
- `cache_write`: a prompt token written to a pinned cache breakpoint (priced for clients' `cache_control`);
- `output`: a generated token.

Token budgets (`tokens_per_minute`) keep today's unit, one budget token per token times the model's token weight,
with one change where a model has prices: a cached prompt token counts `cached_input / input` of a token, and a
prompt token written to a breakpoint `cache_write / input`. So a request with nothing cached and no breakpoints is
charged exactly as without prices, and one whose prompt was 90% cached at a tenth of the input price is charged 0.19
of its prompt. A request reserves its worst case (every prompt token at the dearest of the three prompt rates) at
admission and settles what the engine reported it used (`usage.prompt_tokens_details.cached_tokens`, and
`usage.cache_creation_input_tokens` for a request with `cache_control` breakpoints), never the router's own
prediction.

Cost budgets (`dollars_per_minute`) count micro-dollars instead: a request reserves its prompt and output tokens at
the model's highest price (`reserve_units`) and is charged its exact cost, rounded up to a micro-dollar
(`charge_units`); a model without prices cannot be charged to such a budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from contract.usage_lookup import TIERS  # where cached tokens came from (`cached_tokens_by_tier`)

PRICE_FIELDS = ("input", "cached_input", "cache_write", "output")
PER_TOKENS = 1_000_000  # prices are per million tokens


@dataclass(frozen=True)
class Prices:
    """US dollars per million tokens, exact."""

    input: Fraction
    cached_input: Fraction
    cache_write: Fraction
    output: Fraction

    @classmethod
    def of(cls, input: str | int | float, output: str | int | float, cached_input: str | int | float | None = None,
           cache_write: str | int | float | None = None) -> Prices:
        """From decimals as written; a cached or cache-write price not given is the input price (no discount)."""
        i = price(input)
        return cls(i, i if cached_input is None else price(cached_input),
                   i if cache_write is None else price(cache_write), price(output))

    def cached_weight(self) -> Fraction:
        """A cached prompt token in budget tokens: cached_input / input (1 where input is free)."""
        return self.cached_input / self.input if self.input else Fraction(1)

    def written_weight(self) -> Fraction:
        """A prompt token written to a breakpoint in budget tokens: cache_write / input (1 where input is free)."""
        return self.cache_write / self.input if self.input else Fraction(1)

    def prompt_weight(self) -> Fraction:
        """The most a prompt token can count in budget tokens: computed (1), cached or written, the dearest."""
        return max(Fraction(1), self.cached_weight(), self.written_weight())

    def merged(self, override: dict[str, Fraction]) -> Prices:
        """These prices with some fields replaced (a tenant's own prices for a model)."""
        return Prices(**{f: override.get(f, getattr(self, f)) for f in PRICE_FIELDS})


def price(value: str | int | float) -> Fraction:
    """A price as the exact decimal it is written as; ValueError below zero."""
    p = Fraction(str(value))
    if p < 0:
        raise ValueError(f"a price must be >= 0, got {value}")
    return p


@dataclass(frozen=True)
class Usage:
    """What one request used, as its engine reported it."""

    prompt_tokens: int
    cached_tokens: int  # of prompt_tokens, read from the prefix cache
    completion_tokens: int
    written_tokens: int = 0  # of the computed ones, written to a cache_control breakpoint (priced at cache_write)
    cached_by_tier: tuple[int, int, int] | None = None  # cached_tokens by origin (TIERS); None: not reported

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens




def _count(x) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def tiers_of(x) -> tuple[int, int, int] | None:
    """`cached_tokens_by_tier` as (device, lower_tier, peer): None unless every tier is a count."""
    if not isinstance(x, dict):
        return None
    d, lower, peer = (_count(x.get(t)) for t in TIERS)
    return (d, lower, peer) if d is not None and lower is not None and peer is not None else None


def usage_of(report) -> Usage | None:
    """An OpenAI `usage` object as a Usage: None when it has no prompt and completion counts; cached tokens
    missing (an engine that does not report them) count as none, and never more than the prompt; written tokens
    (Anthropic's top-level `cache_creation_input_tokens`) likewise, never more than the computed ones."""
    if not isinstance(report, dict):
        return None
    prompt, completion = _count(report.get("prompt_tokens")), _count(report.get("completion_tokens"))
    if prompt is None or completion is None:
        total = _count(report.get("total_tokens"))
        if total is None:
            return None
        return Usage(total, 0, 0)  # only a total: all of it at the full rate
    details = report.get("prompt_tokens_details")
    cached = min((_count(details.get("cached_tokens")) if isinstance(details, dict) else None) or 0, prompt)
    written = min(_count(report.get("cache_creation_input_tokens")) or 0, prompt - cached)
    tiers = tiers_of(details.get("cached_tokens_by_tier")) if isinstance(details, dict) else None
    return Usage(prompt, cached, completion, written, tiers)


def cost_usd(usage: Usage, prices: Prices) -> Fraction:
    """What the request costs in US dollars, exactly: computed prompt tokens at `input`, those of them written to a
    breakpoint at `cache_write` instead, cached ones at `cached_input`, output at `output`."""
    plain = usage.computed_tokens - usage.written_tokens
    return (plain * prices.input + usage.written_tokens * prices.cache_write
            + usage.cached_tokens * prices.cached_input + usage.completion_tokens * prices.output) / PER_TOKENS


def budget_tokens(usage: Usage, weight: Fraction, prices: Prices | None) -> int:
    """Budget tokens the request is charged: ceil(weight x (computed - written + written x written_weight + cached x
    cached_weight + completion)), exactly; without prices every token counts 1 (ceil(weight x total), as budgets
    always charged)."""
    if prices is None:
        return math.ceil(weight * usage.total_tokens)
    prompt = (usage.computed_tokens - usage.written_tokens + usage.written_tokens * prices.written_weight()
              + usage.cached_tokens * prices.cached_weight())
    return math.ceil(weight * (prompt + usage.completion_tokens))


MICRO_USD = 1_000_000  # budget units of a cost budget per US dollar


def reserve_units(tokens: int, weight: Fraction, prices: Prices | None, cost_budget: bool,
                  prompt_tokens: int | None = None) -> int:
    """What a request that may use `tokens` tokens, `prompt_tokens` of them its prompt (None: unknown, any of them),
    reserves: its worst case. For a token budget ceil(weight x tokens) budget tokens, the prompt's counted at the
    dearest prompt rate (`prompt_weight`) where the model's cached or cache-write price is above its input price; for
    a cost budget micro-dollars, every token at the model's highest price (prices per million tokens are
    micro-dollars per token)."""
    if not cost_budget:
        if prices is None or prices.prompt_weight() == 1:
            return math.ceil(weight * tokens)
        prompt = tokens if prompt_tokens is None else min(prompt_tokens, tokens)
        return math.ceil(weight * (prompt * prices.prompt_weight() + tokens - prompt))
    if prices is None:
        raise ValueError("a cost budget needs the model's prices")
    return math.ceil(tokens * max(prices.input, prices.cached_input, prices.cache_write, prices.output))


def charge_units(usage: Usage, weight: Fraction, prices: Prices | None, cost_budget: bool) -> int:
    """What a request that used `usage` is charged: budget tokens (budget_tokens), or for a cost budget its exact
    cost rounded up to a micro-dollar."""
    if not cost_budget:
        return budget_tokens(usage, weight, prices)
    if prices is None:
        raise ValueError("a cost budget needs the model's prices")
    return math.ceil(cost_usd(usage, prices) * MICRO_USD)
