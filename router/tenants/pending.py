"""Pending ledger records: what a request's record becomes when no router settled it. Pure: no I/O (the records
live in Redis, router/tenants/redis_store.py; router/tenants/reconcile.py asks the engines).

At admission the reserve script writes the request's pending record (router/tenants/ledger.py, outcome
`router_lost`, the whole reservation charged) under `deadline record`; once placement chose a replica, the
router writes its URL into it (`deadline replica record`) before the request leaves for that replica. A
request its router settles loses its pending record in the same script. One whose router died is due at its
deadline; any router then asks the replica named in it what the request used (engine/usage_book.py), and:

- the engine knows it (finished, or aborted when the dead router's connection dropped): the record carries the
  engine's prompt, cached, written (to cache_control breakpoints; 0 from an engine that does not say) and output
  tokens, their cost at the model's prices, outcome `router_lost_settled`,
  and the budget is charged what they cost (the rest of the reservation refunded);
- the engine does not know it (restarted, forgot it, never got it) or no replica was named (the router died
  before sending it): the record as reserved (`router_lost`, the whole reservation charged);
- the engine still runs it, or could not be asked: left pending, until `grace_s` past its deadline, then as
  unknown.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from fractions import Fraction

from contract.usage_lookup import RUNNING, UNKNOWN
from router.tenants import ledger
from router.tenants.pricing import Prices, Usage, charge_units, cost_usd, tiers_of

ROUTER_LOST_SETTLED = "router_lost_settled"  # no router settled it; its engine said what it used


@dataclass(frozen=True)
class Pending:
    request_id: str
    deadline: float  # Redis time (Unix seconds) when it is due
    replica: str | None  # the replica's URL, once placement chose one
    record: ledger.UsageRecord  # as reserved: router_lost, the reservation charged


@dataclass(frozen=True)
class Close:
    """A due pending record closed: the budget charged `used` of the `reserved` tokens, `record` in the ledger."""

    request_id: str
    reserved: int
    used: int
    record: str  # JSON
    outcome: str  # the record's: router_lost or router_lost_settled


def parse(request_id: str, value: str) -> Pending:
    """A pending hash's value: `deadline record` or `deadline replica record` (a URL holds no space)."""
    deadline, rest = value.split(" ", 1)
    replica = None
    if not rest.startswith("{"):
        replica, rest = rest.split(" ", 1)
    return Pending(request_id, float(deadline), replica, ledger.UsageRecord.from_json(rest))


def close(p: Pending, answer: dict | str | None, weight: Fraction, prices: Prices | None, now: float,
          grace_s: float, cost_budget: bool = False) -> Close | None:
    """What a due pending record becomes, given its engine's answer (contract/usage_lookup.py: a usage dict,
    RUNNING or UNKNOWN; None: not asked, or the engine could not be reached). None: leave it pending."""
    rec, reserved = p.record, p.record.budget_tokens
    if p.replica is None:  # never sent to a replica (the router died before): no engine ran it
        answer = UNKNOWN
    elif (answer is None or answer == RUNNING) and now < p.deadline + grace_s:
        return None
    if p.replica is not None and rec.replica is None:
        rec = dataclasses.replace(rec, replica=p.replica)
    if not isinstance(answer, dict) or answer == UNKNOWN:
        return Close(p.request_id, reserved, reserved, rec.to_json(), rec.outcome)
    prompt, cached = answer["prompt_tokens"], answer["cached_tokens"]
    written = min(answer.get("written_tokens", 0), prompt - cached)
    usage = Usage(prompt, cached, answer["completion_tokens"], written, tiers_of(answer.get("cached_tokens_by_tier")))
    used = min(charge_units(usage, weight, prices, cost_budget), reserved)  # never beyond what it reserved
    cost = ledger.decimal_text(cost_usd(usage, prices)) if prices is not None else None
    rec = dataclasses.replace(rec, prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                              output_tokens=usage.completion_tokens, written_tokens=usage.written_tokens,
                              cached_by_tier=ledger.by_tier(usage),
                              budget_tokens=used, cost_usd=cost,
                              outcome=ROUTER_LOST_SETTLED, time=now)
    return Close(p.request_id, reserved, used, rec.to_json(), ROUTER_LOST_SETTLED)
