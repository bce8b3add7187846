-- Shared prologue of every broker script. KEYS[1] is the run hash "<prefix>:{<run_id>}:run";
-- every other key of the run is derived from it, so all of them share the {<run_id>} hash tag
-- and the scripts run unchanged on Redis Cluster. The key locals (RUN, B, TAG, EV, Q, VS, OPEN,
-- OV, LEASES, SEEN, GDONE, WAITING) and key functions (qvkey, ukey, mkey, rkey, dkey, bkey) come
-- before this file, generated from app/broker/keys.py.
--
-- Replies: every script returns ok(...) or err(code, ...); app/broker/replies.py decodes them
-- and maps each code to an HTTP error. Outcomes the caller tells apart ('created' or 'exists')
-- are the first value of an ok; refusals are err codes listed in that module's table.
redis.replicate_commands()  -- TIME before writes (a no-op on Redis >= 7)

local WAKE = ARGV[1]         -- pub/sub channel that wakes long-polling trainers

local function ok(...) return { 'ok', ... } end
local function err(code, ...) return { 'err', code, ... } end

-- A batch's state is stored as one letter in its hash ('st'); replies name it in words.
local BATCH_STATE = { l = 'leased', a = 'acked', n = 'nacked', e = 'expired' }

local t = redis.call('TIME')
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function I(x) return string.format('%d', x) end
local function qv(v) return qvkey(I(v)) end

-- A unit's rollout ids. A single rollout is its own unit, 'r:<rollout_id>', and keeps no
-- member list; a group 'g:<group_id>' lists its members in arrival order.
local function members(u)
  if string.sub(u, 1, 2) == 'r:' then return { string.sub(u, 3) } end
  return redis.call('LRANGE', mkey(u), 0, -1)
end

local function emit(e, d)
  d['t'] = NOW
  redis.call('XADD', EV, '*', 'e', e, 'd', cmsgpack.pack(d))
end

-- The run's state, read once per call.
local R = nil
local CFG = nil
local function load_run()
  local f = redis.call('HMGET', RUN, 'cfg', 'ver', 'st', 'floor')
  if not f[1] then return false end
  CFG = cjson.decode(f[1])
  R = { ver = tonumber(f[2]), st = f[3], floor = tonumber(f[4]) }
  return true
end

-- The version rule, in one place. Lowest version still eligible: the staleness bound, raised
-- by the last kl_flush; retire_below() walks the indexes up to it.
local function min_version()
  return math.max(R.ver - CFG.max_staleness, R.floor)
end

-- Why a rollout of version v may not be handed out any more ('stale': its lag is above
-- max_staleness; 'kl_flush': below the floor the last flush raised), or nil.
local function version_reason(v)
  if v >= min_version() then return nil end
  if v < R.ver - CFG.max_staleness then return 'stale' end
  return 'kl_flush'
end

-- Retirements are collected per reason and written as one event per reason at the end.
local RETIRED = {}
local RETIRED_ORDER = {}
local RETIRED_N = 0
local LIVE_DELTA = 0  -- change of the run's 'live' count, written once by finish()
local WOKE = false

-- Take a ready unit out of the ready indexes. A version whose index empties leaves VS; a
-- caller that unreadies many units passes `emptied` and calls prune_versions once instead.
local function unready(u, v, emptied)
  redis.call('ZREM', Q, u)
  local k = qv(v)
  redis.call('ZREM', k, u)
  if emptied then
    emptied[v] = true
  elseif redis.call('EXISTS', k) == 0 then
    redis.call('ZREM', VS, I(v))
  end
end

local function prune_versions(emptied)
  for v in pairs(emptied) do
    if redis.call('EXISTS', qv(v)) == 0 then redis.call('ZREM', VS, I(v)) end
  end
end

local function make_ready(u, v, seq)
  redis.call('ZADD', Q, seq, u)
  redis.call('ZADD', qv(v), seq, u)
  redis.call('ZADD', VS, I(v), I(v))
  redis.call('HSET', ukey(u), 'st', 'r')
  WOKE = true
end

-- Remove a unit (ready 'r', open 'o', or just back from a lease 'l') and its rollouts.
-- `known` = {st, v, uses} when the caller has just read them.
local function retire(u, reason, known)
  local uk = ukey(u)
  local f = known or redis.call('HMGET', uk, 'st', 'v', 'uses')
  if not f[1] then return 0 end
  local v = tonumber(f[2])
  if f[1] == 'r' then
    unready(u, v)
  elseif f[1] == 'o' then
    redis.call('ZREM', OPEN, u)
    redis.call('ZREM', OV, u)
  end  -- 'l': a unit back from a lease is in no index
  local items = RETIRED[reason]
  if not items then
    items = {}
    RETIRED[reason] = items
    table.insert(RETIRED_ORDER, reason)
  end
  local uses = tonumber(f[3])
  local ids = members(u)
  for _, rid in ipairs(ids) do
    local rk = rkey(rid)
    local rf = redis.call('HMGET', rk, 'v', 'n')
    table.insert(items, { rid, tonumber(rf[1]), tonumber(rf[2]), uses })
    redis.call('DEL', rk, dkey(rid))
  end
  if string.sub(u, 1, 2) == 'g:' then
    redis.call('DEL', uk, mkey(u))
    redis.call('SADD', GDONE, u)
  else
    redis.call('DEL', uk)
  end
  LIVE_DELTA = LIVE_DELTA - #ids
  RETIRED_N = RETIRED_N + #ids
  return #ids
end

-- Why a complete unit can never be handed out again under the current rules, or nil.
local function permanent_reason(uses, v, kl)
  if R.st == 'closed' then return 'run_closed' end
  if uses >= CFG.max_reuse then return 'max_reuse' end
  local vr = version_reason(v)
  if vr then return vr end
  if kl and kl > CFG.kl_max then return 'kl' end
  return nil
end

-- A unit back from a nack or an expiry: retire it or make it ready again (ack.lua does the
-- same with the use and KL the ack adds).
local function settle(u)
  local uk = ukey(u)
  local f = redis.call('HMGET', uk, 'v', 'seq', 'uses', 'kl')
  local v = tonumber(f[1])
  local reason = permanent_reason(tonumber(f[3]), v, tonumber(f[4]))
  if reason then
    retire(u, reason, { 'l', f[1], f[3] })
  else
    redis.call('HDEL', uk, 'b')
    make_ready(u, v, tonumber(f[2]))
  end
end

local function batch_items(units)
  local items = {}
  for _, u in ipairs(units) do
    for _, rid in ipairs(members(u)) do
      local rf = redis.call('HMGET', rkey(rid), 'v', 'n')
      table.insert(items, { rid, tonumber(rf[1]), tonumber(rf[2]) })
    end
  end
  return items
end

-- Return an expired batch's units to the buffer.
local function expire_batch(bid)
  local bk = bkey(bid)
  local f = redis.call('HMGET', bk, 'st', 'units', 'n')
  redis.call('ZREM', LEASES, bid)
  if f[1] ~= 'l' then return 0 end
  local units = cjson.decode(f[2])
  emit('expired', { batch_id = bid, items = batch_items(units) })
  for _, u in ipairs(units) do settle(u) end
  redis.call('HINCRBY', RUN, 'leased', -tonumber(f[3]))
  redis.call('HSET', bk, 'st', 'e', 'end', NOW)
  redis.call('PEXPIRE', bk, 86400000)
  return 1
end

-- Retire buffered units below the version floor (everything, in a closed run), at most
-- `budget` units; returns the budget left.
local function retire_below(budget)
  local floor_v
  if R.st == 'closed' then floor_v = '+inf' else floor_v = '(' .. I(min_version()) end
  local function reason_for(v)
    if R.st == 'closed' then return 'run_closed' end
    return version_reason(v)
  end
  if budget > 0 then
    local open_old = redis.call('ZRANGEBYSCORE', OV, '-inf', floor_v, 'WITHSCORES', 'LIMIT', 0, budget)
    for i = 1, #open_old, 2 do retire(open_old[i], reason_for(tonumber(open_old[i + 1]))) end
    budget = budget - #open_old / 2
  end
  while budget > 0 do
    local vs = redis.call('ZRANGEBYSCORE', VS, '-inf', floor_v, 'LIMIT', 0, 1)
    if #vs == 0 then break end
    local units = redis.call('ZRANGE', qv(tonumber(vs[1])), 0, budget - 1)
    if #units == 0 then redis.call('ZREM', VS, vs[1]) end
    for _, u in ipairs(units) do retire(u, reason_for(tonumber(vs[1]))) end
    budget = budget - #units
  end
  return budget
end

-- Bounded clean-up: expired leases, timed-out groups, units below the version floor, and
-- everything buffered in a closed run. Returns 1 when work was left for a later call.
local function sweep(limit)
  local more = 0
  local expired = redis.call('ZRANGEBYSCORE', LEASES, '-inf', I(NOW), 'LIMIT', 0, limit)
  for _, bid in ipairs(expired) do expire_batch(bid) end
  if #expired == limit then more = 1 end

  local budget = limit
  local cutoff = NOW - CFG.group_timeout_s * 1000
  local late = redis.call('ZRANGEBYSCORE', OPEN, '-inf', I(cutoff), 'LIMIT', 0, budget)
  for _, u in ipairs(late) do retire(u, R.st == 'closed' and 'run_closed' or 'incomplete_group') end
  budget = budget - #late

  budget = retire_below(budget)
  if budget <= 0 then more = 1 end
  return more
end

-- What this call retired, per reason in first-retired order: { {reason, rollouts}, ... }.
local function retired_counts()
  local res = {}
  for _, reason in ipairs(RETIRED_ORDER) do table.insert(res, { reason, #RETIRED[reason] }) end
  return res
end

local function finish()
  if LIVE_DELTA ~= 0 then redis.call('HINCRBY', RUN, 'live', LIVE_DELTA) end
  for _, reason in ipairs(RETIRED_ORDER) do
    emit('retired', { reason = reason, items = RETIRED[reason] })
  end
  -- Every API process receives every wake-up, so none is sent while nobody waits.
  if WOKE and redis.call('EXISTS', WAITING) == 1 then
    redis.call('PUBLISH', WAKE, TAG)
  end
end

local function run_snapshot(change)
  local f = redis.call('HMGET', RUN, 'id', 'cfg', 'ver', 'st', 'created')
  emit('run', {
    run_id = f[1], change = change, config = cjson.decode(f[2]),
    policy_version = tonumber(f[3]), status = f[4], created_at = tonumber(f[5]),
  })
end
