-- Shared prologue of every broker script. KEYS[1] is the run hash "<prefix>:{<run_id>}:run";
-- every other key of the run is derived from it, so all of them share the {<run_id>} hash tag
-- and the scripts run unchanged on Redis Cluster. KEYS[2] is the run's never-written guard
-- key: declared so that a cluster refuses a script while the run's slot is being moved
-- (app/broker/keys.py, GUARD), never read or written here. The key locals (RUN, B, TAG, EV, Q,
-- VS, OPEN, OV, LEASES, SEEN, GDONE, WAITING, PQ, PSEEN, WLEASES, WWAITING) and key functions
-- (qvkey, ukey, mkey, rkey, dkey, bkey, ppkey, pbkey, wkey) come before this file, generated
-- from app/broker/keys.py.
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

-- Prompt passes ----------------------------------------------------------------------------
-- A pass '<prompt_id>#<pass>' is queued ('q'), handed out in a work lease ('w'), its group
-- complete and buffered or leased ('b'), done ('d') or failed ('f'). Its attempt 'att' names
-- the group a generator posts: '<prompt_id>#<pass>.<att>'. ADM_DELTA is the change of the
-- run's 'adm' (groups admitted, the staleness budget's count), written once by finish().
local PASS_STATE = { q = 'queued', w = 'in_flight', b = 'in_flight', d = 'done', f = 'failed' }
local WORK_STATE = { l = 'live', c = 'complete', r = 'returned', e = 'expired' }
local ADM_DELTA = 0
local WORK_WOKE = false
local PASS_EVENTS = {}  -- { {cause, lease_id or false, items}, ... } in order, for finish()

local function pass_prompt(pk) return string.match(pk, '^(.*)#%d+$') end
local function pass_number(pk) return tonumber(string.match(pk, '#(%d+)$')) end
local function attempt_group(pk, att) return pk .. '.' .. I(att) end

-- The pass and attempt a group id names, when it names a registered pass: (pk, att) or nil.
local function group_pass(gid)
  local pk, att = string.match(gid, '^(.*#%d+)%.(%d+)$')
  if not pk or redis.call('EXISTS', ppkey(pk)) == 0 then return nil end
  return pk, tonumber(att)
end

-- Queue order: earlier passes first, then registration order. A pass that comes back (returned,
-- expired, retried) therefore goes before every pass of its number never handed out: those are
-- handed out in registration order, so all that are left were registered after it. Exact as a
-- double for passes up to 1000 and 2^40 prompts.
local function pass_score(pk, seq)
  return I(pass_number(pk) * 1099511627776 + seq)
end

local function pass_fields(pk)
  return redis.call('HMGET', ppkey(pk), 'st', 'att', 'tries', 'lease', 'seq')
end

local function note_pass(cause, lease_id, pk, att, st, tries)
  local last = PASS_EVENTS[#PASS_EVENTS]
  if not last or last[1] ~= cause or last[2] ~= (lease_id or false) then
    last = { cause, lease_id or false, {} }
    table.insert(PASS_EVENTS, last)
  end
  table.insert(last[3], { pass_prompt(pk), pass_number(pk), att, PASS_STATE[st], tries })
end

-- A group of the work lease came in whole or left it: the lease ends once none is open.
local function work_settled(lid)
  local wk = wkey(lid)
  if redis.call('HGET', wk, 'st') ~= 'l' then return end
  if redis.call('HINCRBY', wk, 'open', -1) <= 0 then
    redis.call('HSET', wk, 'st', 'c')
    redis.call('ZREM', WLEASES, lid)
    redis.call('PEXPIRE', wk, 86400000)
  end
end

-- An attempt ended without its group reaching a gradient: the pass goes back to the queue at
-- the next attempt, ahead of fresh passes, or is failed once `counts` (a try that retired unused
-- or expired, not a return) brings its tries to max_attempts. `f` = pass_fields(pk).
local function requeue(pk, f, cause, lease_id, counts)
  if f[1] == 'w' then work_settled(f[4]) end
  ADM_DELTA = ADM_DELTA - 1
  local att, tries = tonumber(f[2]), tonumber(f[3])
  if counts then tries = tries + 1 end
  if tries >= CFG.max_attempts then
    redis.call('HSET', ppkey(pk), 'st', 'f', 'tries', tries)
    redis.call('HDEL', ppkey(pk), 'lease')
    note_pass(cause, lease_id, pk, att, 'f', tries)
  else
    att = att + 1
    redis.call('HSET', ppkey(pk), 'st', 'q', 'att', att, 'tries', tries)
    redis.call('HDEL', ppkey(pk), 'lease')
    redis.call('ZADD', PQ, pass_score(pk, tonumber(f[5])), pk)
    note_pass(cause, lease_id, pk, att, 'q', tries)
  end
end

-- The group of a prompt attempt retired (see retire()). Unused, it sends its pass back, except
-- `zero_variance`, which makes it done (its data says nothing); used, it was done at its first use.
-- A group of an attempt that has already ended (expired, returned) changes nothing.
local function attempt_retired(pk, att, uses, reason)
  local f = pass_fields(pk)
  if (f[1] ~= 'w' and f[1] ~= 'b') or tonumber(f[2]) ~= att or uses > 0 then return end
  if reason == 'zero_variance' then
    if f[1] == 'w' then work_settled(f[4]) end
    ADM_DELTA = ADM_DELTA - 1
    redis.call('HSET', ppkey(pk), 'st', 'd')
    note_pass('retired', nil, pk, att, 'd', tonumber(f[3]))
  else
    requeue(pk, f, 'retired', nil, true)
  end
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
    local pf = redis.call('HMGET', uk, 'pk', 'att')
    redis.call('DEL', uk, mkey(u))
    redis.call('SADD', GDONE, u)
    if pf[1] then
      attempt_retired(pf[1], tonumber(pf[2]), uses, reason)
    elseif uses == 0 then
      ADM_DELTA = ADM_DELTA - 1
    end
  else
    redis.call('DEL', uk)
    if uses == 0 then ADM_DELTA = ADM_DELTA - 1 end
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

-- End a work lease whose time ran out: its passes still in flight go back to the queue (a try
-- each), and a partial group of theirs retires ('incomplete_group').
local function expire_work(lid)
  local wk = wkey(lid)
  local f = redis.call('HMGET', wk, 'st', 'items')
  redis.call('ZREM', WLEASES, lid)
  if f[1] ~= 'l' then return 0 end
  redis.call('HSET', wk, 'st', 'e')
  redis.call('PEXPIRE', wk, 86400000)
  for _, item in ipairs(cjson.decode(f[2])) do
    local pk, att = item[1], item[2]
    local pf = pass_fields(pk)
    if pf[1] == 'w' and pf[4] == lid and tonumber(pf[2]) == att then
      requeue(pk, pf, 'expired', lid, true)
      retire('g:' .. attempt_group(pk, att), 'incomplete_group')
    end
  end
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
  local work = redis.call('ZRANGEBYSCORE', WLEASES, '-inf', I(NOW), 'LIMIT', 0, limit)
  for _, lid in ipairs(work) do expire_work(lid) end
  if #work == limit then more = 1 end

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
  if ADM_DELTA ~= 0 then
    redis.call('HINCRBY', RUN, 'adm', ADM_DELTA)
    if ADM_DELTA < 0 then WORK_WOKE = true end  -- budget came free
  end
  for _, reason in ipairs(RETIRED_ORDER) do
    emit('retired', { reason = reason, items = RETIRED[reason] })
  end
  for _, p in ipairs(PASS_EVENTS) do
    local ev = { cause = p[1], items = p[3] }
    if p[2] then ev['lease_id'] = p[2] end
    emit('passes', ev)
  end
  -- Every API process receives every wake-up, so none is sent while nobody waits.
  if WOKE and redis.call('EXISTS', WAITING) == 1 then
    redis.call('PUBLISH', WAKE, TAG)
  end
  if WORK_WOKE and redis.call('EXISTS', WWAITING) == 1 then
    redis.call('PUBLISH', WAKE, WORK_WAKE)
  end
end

-- The staleness budget, in one place: groups that may still be admitted at the run's version
-- (nil: no budget, step_groups is not set).
local function admission_left()
  local B = CFG.step_groups
  if B == nil or B == cjson.null then return nil end
  local adm = tonumber(redis.call('HGET', RUN, 'adm') or '0') + ADM_DELTA
  return (R.ver + CFG.max_staleness + 1) * B - adm
end

local function run_snapshot(change)
  local f = redis.call('HMGET', RUN, 'id', 'cfg', 'ver', 'st', 'created')
  emit('run', {
    run_id = f[1], change = change, config = cjson.decode(f[2]),
    policy_version = tonumber(f[3]), status = f[4], created_at = tonumber(f[5]),
  })
end
