"""The shared budget store: every router replica reserves and settles in one Redis, so a tenant has one
budget however many routers it talks to.

Each operation is one Lua script (atomic in Redis; sent by EVALSHA, loaded again after NOSCRIPT, e.g. after a
Redis restart) that repeats router/tenants/budget.py's arithmetic operation for operation on IEEE doubles, so both
stores give the same numbers; floats cross the boundary as `%.17g` / `repr` strings, which round-trip
exactly. Time comes from Redis `TIME`, one clock for all routers (tests may pass `now`).

Keys (the `{tenant}` hash tag keeps a tenant's keys in one cluster slot):
- `kvfleet:budget:{tenant}`, a hash `level`, `updated`; it expires `ttl_margin_s` after the bucket would be
  full again, since a missing bucket reads as full;
- `kvfleet:budget:{tenant}:leases`, a sorted set lease id -> expiry; leases with expiry <= now are removed
  before counting; the set expires `lease_s + ttl_margin_s` after its last lease was added;
- `kvfleet:routers`, a sorted set router id -> heartbeat expiry (`heartbeat`, `live_routers`);
- `kvfleet:usage:{tenant}`, a stream of the tenant's usage records (router/tenants/ledger.py), one entry (field `r`,
  the record's JSON) per settled request, appended by the same script that settles its budget; entries older than
  `usage_retention_s` are trimmed as new ones arrive (XADD MINID ~, Redis >= 6.2);
- `kvfleet:usage:{tenant}:pending`, a hash request id -> 'deadline record', then 'deadline replica record' once the
  router named the replica it sent the request to (`attach`): each admitted request's record should its router die
  before settling it (written by the reserve script, removed by the settle script); past the deadline
  (`reconcile_after_s` after admission) any router closes it, once (router/tenants/pending.py, reconcile.py);
- `kvfleet:budget:{tenant}:charged`, an integer: every budget token charged to the tenant in this store (reserved, less what
  settles and reconciles refunded), for audits: it equals the sum of the ledger's `budget_tokens`;
- `kvfleet:usage:{tenant}:ids`, a sorted set request id -> time of the last day's records: a record sent twice (its
  settle timed out here but ran in Redis) is appended once.

A Redis restarted without persistence has lost these: every tenant starts again from a full bucket, and
settling a reservation made before the restart refunds into that full bucket (capped) and frees no lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.tenants import redis_pending
from router.tenants.budget import CONCURRENCY_RETRY_S, Bucket, BudgetSpec, Leases, Quota, Reason
from router.tenants.pending import Close, Pending, parse
from router.tenants.store import Rejection, Reservation, StoreError, new_lease_id

# Shared by both scripts: load the bucket (missing: full at now), refill it to now.
_PRELUDE = """
if redis.replicate_commands then redis.replicate_commands() end
local function fmt(x) return string.format('%.17g', x) end
local tpm = tonumber(ARGV[1])
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local margin = tonumber(ARGV[3])
local cap = tpm
local rate = tpm / 60.0
local h = redis.call('HMGET', KEYS[1], 'level', 'updated')
local level, updated = tonumber(h[1]), tonumber(h[2])
if not level or not updated then level = cap; updated = now end
if now > updated then
  level = math.min(cap, level + (now - updated) * rate)
  updated = now
end
local function store()
  redis.call('HSET', KEYS[1], 'level', fmt(level), 'updated', fmt(updated))
  local full_in = 0
  if level < cap then full_in = (cap - level) / rate end
  redis.call('PEXPIRE', KEYS[1], math.ceil((full_in + margin) * 1000))
end
"""

# ARGV: tpm, now|'', margin, amount, largest, max_concurrent|'', lease_id, lease_s, request id|'', pending record,
# reconcile_after_s. The pending record (KEYS[5] request id -> 'deadline record') is the request's record should its
# router never settle it (router/tenants/ledger.py: outcome router_lost, the reservation charged).
_RESERVE = _PRELUDE + """
local amount = tonumber(ARGV[4])
if amount > tonumber(ARGV[5]) then return {'too_large', fmt(level), fmt(updated), ''} end
local need = math.min(amount, cap)
if level < need then return {'tokens', fmt(level), fmt(updated), fmt((need - level) / rate)} end
local mcr = tonumber(ARGV[6])
if mcr then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', fmt(now))
  if redis.call('ZCARD', KEYS[2]) >= mcr then return {'concurrency', fmt(level), fmt(updated), ''} end
  local lease_s = tonumber(ARGV[8])
  redis.call('ZADD', KEYS[2], fmt(now + lease_s), ARGV[7])
  redis.call('PEXPIRE', KEYS[2], math.ceil((lease_s + margin) * 1000))
end
level = level - amount
store()
redis.call('INCRBY', KEYS[6], amount)
if ARGV[9] and ARGV[9] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[9], fmt(now + tonumber(ARGV[11])) .. ' ' .. ARGV[10])
end
return {'ok', fmt(level), fmt(updated), ''}
"""

# Append records to the usage stream KEYS[3]: a[first] the retention in seconds, then (request id, record) pairs.
# A request id already in KEYS[4] (a sorted set id -> time, the last day's) is not appended again: a settle that timed
# out may still have run in Redis, and its record is sent again with the next append. Entry ids are Redis's clock
# in milliseconds: records are read back by time with XRANGE.
_APPEND = """
local function append(a, first)
  local t = redis.call('TIME')
  local now = tonumber(t[1])
  local minid = math.floor((now - tonumber(a[first])) * 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - 86400)
  for i = first + 1, #a - 1, 2 do
    if redis.call('ZADD', KEYS[4], 'NX', now, a[i]) == 1 then
      redis.call('XADD', KEYS[3], 'MINID', '~', tostring(math.max(minid, 0)), '*', 'r', a[i + 1])
    end
  end
  redis.call('EXPIRE', KEYS[4], 90000)
end
"""

# ARGV: tpm, now|'', margin, reserved, used, lease_id|'', request id|'', retention_s, [request id, record]. A request
# whose pending record was already closed (it outlived reconcile_after_s) stays charged what that close charged, as
# the ledger's record says, and adds no second record.
_SETTLE = _PRELUDE + _APPEND + """
local used = tonumber(ARGV[5])
local settled = true
if ARGV[7] ~= '' and redis.call('HDEL', KEYS[5], ARGV[7]) == 0 and redis.call('ZSCORE', KEYS[4], ARGV[7]) then
  used = tonumber(ARGV[4])
  settled = false
end
level = math.min(cap, level + (tonumber(ARGV[4]) - used))
store()
if used ~= tonumber(ARGV[4]) then redis.call('INCRBY', KEYS[6], used - tonumber(ARGV[4])) end
if ARGV[6] ~= '' then redis.call('ZREM', KEYS[2], ARGV[6]) end
if settled then append(ARGV, 8) end
return {fmt(level), fmt(updated)}
"""

# ARGV: retention_s, (request id, record)...
_APPEND_ONLY = "if redis.replicate_commands then redis.replicate_commands() end\n" + _APPEND + "append(ARGV, 1)\nreturn 1\n"
_REPLICATE = "if redis.replicate_commands then redis.replicate_commands() end\n"


# KEYS: routers; ARGV: router id, ttl_s. Returns the number of routers whose heartbeat has not expired.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%.17g', now + ttl), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000))
return redis.call('ZCARD', KEYS[1])
"""

_ERRORS = (RedisError, OSError, asyncio.TimeoutError)
RECONCILE_AFTER_S = 3600.0  # a request not settled an hour after admission: its router is gone
USAGE_RETENTION_S = 400 * 86400.0  # usage records kept this long (a year of monthly invoices and their disputes)


def _text(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


def _pairs(records: list[str]) -> list[str]:
    """(request id, record) pairs, flat, for the append script (the id from each record's JSON)."""
    return [x for r in records for x in (json.loads(r)["request_id"], r)]


def _arg(x: float | None) -> str:
    return "" if x is None else repr(float(x))


class RedisStore:
    """A `BudgetStore` in Redis. Every Redis failure is raised as `StoreError`."""

    def __init__(self, client: aioredis.Redis, lease_s: float = 600.0, ttl_margin_s: float = 60.0,
                 prefix: str = "kvfleet", usage_retention_s: float = USAGE_RETENTION_S,
                 reconcile_after_s: float = RECONCILE_AFTER_S):
        self.client, self.lease_s, self.ttl_margin_s, self.prefix = client, lease_s, ttl_margin_s, prefix
        self.usage_retention_s, self.reconcile_after_s = usage_retention_s, reconcile_after_s
        self._reserve = client.register_script(_RESERVE)
        self._settle = client.register_script(_SETTLE)
        self._append = client.register_script(_APPEND_ONLY)
        self._attach = client.register_script(_REPLICATE + redis_pending.ATTACH)
        self._due = client.register_script(_REPLICATE + redis_pending.DUE)
        self._close = client.register_script(_PRELUDE + _APPEND + redis_pending.CLOSE)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._batch = _Batch(client)

    @classmethod
    def from_url(cls, url: str, timeout_s: float = 0.5, max_connections: int = 64, **kwargs) -> RedisStore:
        """A client that fails fast on a dead or slow Redis (socket timeouts `timeout_s`, one immediate
        retry, which reconnects after a Redis restart) and, under a burst, waits for one of its
        `max_connections` connections (up to 4 x timeout_s) instead of failing the request."""
        pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=4 * timeout_s,
                                                        socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        client = aioredis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 1))
        return cls(client, **kwargs)

    async def close(self) -> None:
        await self.client.aclose()

    def keys(self, tenant: str) -> list[str]:
        return [f"{self.prefix}:budget:{{{tenant}}}", f"{self.prefix}:budget:{{{tenant}}}:leases",
                f"{self.prefix}:usage:{{{tenant}}}", f"{self.prefix}:usage:{{{tenant}}}:ids",
                f"{self.prefix}:usage:{{{tenant}}}:pending", f"{self.prefix}:budget:{{{tenant}}}:charged"]

    async def reserve(self, tenant: str, spec: BudgetSpec, amount: int, now: float | None = None,
                      pending: tuple[str, str] | None = None) -> Reservation | Rejection:
        if amount < 0:
            raise ValueError(f"amount must be >= 0, got {amount}")
        mcr = spec.max_concurrent_requests
        lease_id = new_lease_id() if mcr is not None else None
        rid, rec = pending or ("", "")
        args = [_arg(spec.tokens_per_minute), _arg(now), _arg(self.ttl_margin_s), str(amount),
                _arg(spec.max_request), "" if mcr is None else str(mcr), lease_id or "", _arg(self.lease_s),
                rid, rec, _arg(self.reconcile_after_s)]
        reason, level, updated, retry = await self._call(self._reserve, self.keys(tenant), args)
        quota = Bucket(float(level), float(updated)).quota(spec)
        reason = _text(reason)
        if reason == "ok":
            return Reservation(tenant, spec, amount, lease_id, quota, pending_id=rid or None)
        if reason == "tokens":
            return Rejection(tenant, Reason.TOKENS, float(retry), quota)
        if reason == "concurrency":
            return Rejection(tenant, Reason.CONCURRENCY, CONCURRENCY_RETRY_S, quota)
        return Rejection(tenant, Reason.TOO_LARGE, None, quota)

    async def settle(self, reservation: Reservation, used: int, now: float | None = None,
                     record: str | None = None) -> Quota:
        if used < 0:
            raise ValueError(f"used must be >= 0, got {used}")
        spec = reservation.spec
        args = [_arg(spec.tokens_per_minute), _arg(now), _arg(self.ttl_margin_s), str(reservation.amount),
                str(used), reservation.lease_id or "", reservation.pending_id or "", _arg(self.usage_retention_s)] + \
            _pairs([record] if record else [])
        level, updated = await self._call(self._settle, self.keys(reservation.tenant), args)
        return Bucket(float(level), float(updated)).quota(spec)

    async def state(self, tenant: str) -> tuple[Bucket | None, Leases]:
        bucket_key, leases_key = self.keys(tenant)[:2]
        try:
            level, updated = await self.client.hmget(bucket_key, ["level", "updated"])
            rows = await self.client.zrange(leases_key, 0, -1, withscores=True)
        except _ERRORS as e:
            raise StoreError(f"redis: {e!r}") from e
        # withscores=True: (member, score) pairs; redis-py's hints are one union over every zrange mode
        held = cast("list[tuple[bytes | str, float]]", rows)
        bucket = None if level is None or updated is None else Bucket(float(level), float(updated))
        return bucket, Leases(tuple((_text(m), float(s)) for m, s in held))

    async def append(self, tenant: str, records: list[str]) -> None:
        if records:
            await self._call(self._append, self.keys(tenant), [_arg(self.usage_retention_s), *_pairs(records)])

    async def attach(self, tenant: str, request_id: str, replica: str) -> None:
        """Name the replica a request goes to in its pending record (before it is sent there)."""
        await self._call(self._attach, self.keys(tenant), [request_id, replica])

    async def due(self, tenant: str) -> list[Pending]:
        """The tenant's pending records past their deadline (requests no router settled in time), left in place."""
        rows = await self._call(self._due, self.keys(tenant), [])
        return [parse(_text(rows[i]), _text(rows[i + 1])) for i in range(0, len(rows), 2)]

    async def close_pending(self, tenant: str, spec: BudgetSpec, closes: list[Close]) -> int:
        """Close due pending records (router/tenants/pending.py), each once whoever else tries: its record to the
        ledger, the budget charged what it used. How many this call closed."""
        if not closes:
            return 0
        args = [_arg(spec.tokens_per_minute), "", _arg(self.ttl_margin_s), _arg(self.usage_retention_s)]
        for c in closes:
            args += [c.request_id, str(c.reserved), str(c.used), c.record]
        return int(await self._call(self._close, self.keys(tenant), args))

    async def charged(self, tenant: str) -> int:
        """Budget tokens ever charged to the tenant (the sum of its ledger's budget_tokens)."""
        try:
            return int(await self.client.get(self.keys(tenant)[5]) or 0)
        except _ERRORS as e:
            raise StoreError(f"redis: {e!r}") from e

    async def records(self, tenant: str, start: float, end: float) -> list[str]:
        try:
            rows = await self.client.xrange(self.keys(tenant)[2], min=str(int(start * 1000)),
                                            max="(" + str(int(end * 1000)))
        except _ERRORS as e:
            raise StoreError(f"redis: {e!r}") from e
        held = cast("list[tuple[bytes | str, dict[bytes | str, bytes | str]]]", rows)
        return [_text(fields.get(b"r") or fields.get("r") or b"") for _, fields in held]

    async def heartbeat(self, router_id: str, ttl_s: float) -> int:
        """Register this router as live for `ttl_s` seconds; returns the number of live routers."""
        return int(await self._call(self._heartbeat, [f"{self.prefix}:routers"], [router_id, _arg(ttl_s)]))

    async def _call(self, script, keys: list[str], args: list[str]):
        try:
            return await self._batch.call(script, keys, args)
        except _ERRORS as e:
            if isinstance(e, (RedisConnectionError, RedisTimeoutError)):
                # a restarted Redis leaves every idle pooled connection dead: drop them, so the calls that
                # follow connect afresh instead of each failing once on a stale one
                with contextlib.suppress(Exception):
                    await self.client.connection_pool.disconnect(inuse_connections=False)
            raise StoreError(f"redis: {e!r}") from e


class _Batch:
    """Script calls made in the same turn of the event loop go to Redis as one pipeline: one round trip and
    one reply parse for all of them (each script still runs atomically on its own). redis-py costs ~80-140 us
    of CPU per single call and ~15 us per pipelined one; at a router's 1,000 requests/s (a reserve and a
    settle each) that is the difference. A script Redis does not know (NOSCRIPT, after a restart or a
    SCRIPT FLUSH) is loaded and its calls sent again once."""

    def __init__(self, client: aioredis.Redis):
        self.client = client
        self._pending: list[tuple[object, list[str], list[str], asyncio.Future]] = []

    def call(self, script, keys: list[str], args: list[str]) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((script, keys, args, fut))
        return fut

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.ensure_future(self._send(batch))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # errors reach the futures

    async def _send(self, batch) -> None:
        try:
            results = await self._execute(batch)
            missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
            if missing:
                for script in {id(batch[i][0]): batch[i][0] for i in missing}.values():
                    await self.client.script_load(script.script)
                again = await self._execute([batch[i] for i in missing])
                for i, r in zip(missing, again, strict=True):
                    results[i] = r
        except BaseException as e:  # noqa: BLE001 - every caller gets the failure
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            return
        for (*_, fut), r in zip(batch, results, strict=True):
            if not fut.done():
                if isinstance(r, Exception):
                    fut.set_exception(r)
                else:
                    fut.set_result(r)

    async def _execute(self, batch) -> list:
        pipe = self.client.pipeline(transaction=False)
        for script, keys, args, _ in batch:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        return await pipe.execute(raise_on_error=False)
