-- requires: batches, rewards
-- Bounded clean-up of a run: expired batches, work and reward leases, timed-out groups, and units
-- below the version floor (everything buffered, in a closed run, whose queued prompt passes are
-- also cancelled).

-- End a live work lease (state `st`: 'e'xpired, 'r'eturned by a rewind): its passes still in
-- flight go back to the queue (`cause`; a try when `counts`), and a partial group of theirs
-- retires (`reason`).
local function end_work(lid, st, cause, counts, reason)
  local wk = wkey(lid)
  local f = redis.call('HMGET', wk, 'st', 'items')
  redis.call('ZREM', WLEASES, lid)
  if f[1] ~= 'l' then return 0 end
  redis.call('HSET', wk, 'st', st)
  redis.call('PEXPIRE', wk, 86400000)
  for _, item in ipairs(cjson.decode(f[2])) do
    local pk, att = item[1], item[2]
    local pf = pass_fields(pk)
    if pf[1] == 'w' and pf[4] == lid and tonumber(pf[2]) == att then
      requeue(pk, pf, cause, lid, counts)
      retire_open('g:' .. attempt_group(pk, att), reason)
    end
  end
  return 1
end

-- A work lease whose time ran out: a try for each of its unfinished passes.
local function expire_work(lid) return end_work(lid, 'e', 'expired', true, 'incomplete_group') end

-- Retire buffered units below the version floor (everything, in a closed run), at most
-- `budget` units; returns the budget left.
local function retire_below(budget)
  flush_units()  -- units made ready in this call are in the indexes, to be seen
  local floor_v
  if R.st == 'closed' then floor_v = '+inf' else floor_v = '(' .. I(min_version()) end
  local function reason_for(v)
    if R.st == 'closed' then return 'run_closed' end
    return version_reason(v)
  end
  if budget > 0 then
    local open_old = redis.call('ZRANGEBYSCORE', OV, '-inf', floor_v, 'WITHSCORES', 'LIMIT', 0, budget)
    for i = 1, #open_old, 2 do retire_open(open_old[i], reason_for(tonumber(open_old[i + 1]))) end
    budget = budget - #open_old / 2
  end
  budget = retire_awaiting('-inf', floor_v, reason_for, budget)
  while budget > 0 do
    local vs = redis.call('ZRANGEBYSCORE', VS, '-inf', floor_v, 'LIMIT', 0, 1)
    if #vs == 0 then break end
    local v = tonumber(vs[1])
    local units = redis.call('ZRANGE', qv(v), 0, math.min(budget, 1000) - 1)
    if #units == 0 then
      redis.call('ZREM', VS, vs[1])
    else
      local recs = redis.call('HMGET', US, unpack(units))
      for i, u in ipairs(units) do
        if recs[i] then
          retire_unit(u, reason_for(v), parse_unit(recs[i]), true)
        else
          unready(u, v)  -- no record: nothing to hand out
        end
      end
    end
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
  if expire_reward_leases(limit) == limit then more = 1 end

  local budget = limit
  local cutoff = NOW - CFG.group_timeout_s * 1000
  local late = redis.call('ZRANGEBYSCORE', OPEN, '-inf', I(cutoff), 'LIMIT', 0, budget)
  for _, u in ipairs(late) do retire_open(u, R.st == 'closed' and 'run_closed' or 'incomplete_group') end
  budget = budget - #late

  budget = retire_below(budget)
  if budget <= 0 then more = 1 end
  -- A closed run hands out no more work: its queued passes are cancelled.
  if R.st == 'closed' and budget > 0 and cancel_queued(budget) == budget then more = 1 end
  return more
end
