"""The Lua of pending ledger records (router/tenants/pending.py) in the shared store: the bodies that
router/tenants/redis_store.py joins to its bucket prelude and ledger append. Keys as there: KEYS[5] the tenant's
pending hash (request id -> 'deadline record' or 'deadline replica record'), KEYS[6] its charged counter.
"""

from __future__ import annotations

# The replica a request was sent to, written into its pending record before it leaves (a retry elsewhere
# replaces it); nothing where the record is gone (settled or reconciled already). ARGV: request id, replica URL.
ATTACH = """
local v = redis.call('HGET', KEYS[5], ARGV[1])
if not v then return 0 end
local sp = string.find(v, ' ', 1, true)
local rest = string.sub(v, sp + 1)
if string.sub(rest, 1, 1) ~= '{' then rest = string.sub(rest, string.find(rest, ' ', 1, true) + 1) end
redis.call('HSET', KEYS[5], ARGV[1], string.sub(v, 1, sp - 1) .. ' ' .. ARGV[2] .. ' ' .. rest)
return 1
"""

# The pending records past their deadline, left in place: [request id, value, ...]. No ARGV.
DUE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rows = redis.call('HGETALL', KEYS[5])
local due = {}
for i = 1, #rows, 2 do
  local sp = string.find(rows[i + 1], ' ', 1, true)
  if tonumber(string.sub(rows[i + 1], 1, sp - 1)) <= now then
    table.insert(due, rows[i])
    table.insert(due, rows[i + 1])
  end
end
return due
"""

# Close due pending records, each once: HDEL decides (of two routers reconciling at once, one closes it; a record
# its router settled meanwhile is gone). Each closed one refunds reserved - used into the bucket, as a settle does,
# and appends its record. After the prelude's ARGV (tpm, now|'', margin): retention_s, then (request id, reserved,
# used, record) quadruples. Returns how many it closed.
CLOSE = """
local appended = {ARGV[4]}
local closed = 0
for i = 5, #ARGV - 3, 4 do
  if redis.call('HDEL', KEYS[5], ARGV[i]) == 1 then
    local refund = tonumber(ARGV[i + 1]) - tonumber(ARGV[i + 2])
    if refund ~= 0 then
      level = math.min(cap, level + refund)
      redis.call('INCRBY', KEYS[6], -refund)
    end
    table.insert(appended, ARGV[i])
    table.insert(appended, ARGV[i + 3])
    closed = closed + 1
  end
end
if closed > 0 then
  store()
  append(appended, 1)
end
return closed
"""
