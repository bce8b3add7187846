-- requires: cleanup, finish
-- Hand awaiting units to a reward worker as one reward lease (lib/rewards.lua), oldest first,
-- up to `max_rollouts` unscored rollouts (a unit is leased whole, so the first one is taken
-- even when it has more). Expired leases are swept first.
-- ARGV: wake, lease_id, max_rollouts, worker_id ('' = none), sweep_limit, wait_ms (how long the
--       caller will wait for a wake-up if this call hands out nothing; 0: it will not).
-- A lease_id that names a live lease returns it again (a retried request), with the rollouts
-- it still holds unscored.
-- Returns ok('leased', lease_id, expires_at, { {rollout_id, pass key ('' = none)}, ... })
--       | ok('short'): nothing to score | err('run_missing') | err('run_closed')
--       | err('reward_lease_over', state): the lease_id names a lease that is over.
if not load_run() then return err('run_missing') end
local lid = ARGV[2]
local rk = rlkey(lid)

-- The unscored rollouts of the units the lease `lid` holds, with their pass keys.
local function held(units)
  local rows = {}
  for _, u in ipairs(units) do
    local s = reward_state(u)
    if s and s.l == lid then
      local r = parse_unit(redis.call('HGET', US, u))
      for _, row in ipairs(unscored_rows(u, r)) do table.insert(rows, { row[1], r.pk or '' }) end
    end
  end
  return rows
end

local REWARD_STATE = { d = 'scored', e = 'expired', r = 'returned' }
local known = redis.call('HMGET', rk, 'st', 'exp', 'units')
if known[1] == 'l' and tonumber(known[2]) <= NOW then  -- ran out, not yet swept
  end_reward_lease(lid, 'e')
  finish()
  return err('reward_lease_over', 'expired')
end
if known[1] == 'l' then return ok('leased', lid, known[2], held(cjson.decode(known[3]))) end
if known[1] then return err('reward_lease_over', REWARD_STATE[known[1]]) end
if R.st == 'closed' then return err('run_closed') end
sweep(tonumber(ARGV[5]))

local k = tonumber(ARGV[3])
local units, rows, items = {}, {}, {}
local n, done = 0, false
while not done do
  local next_units = redis.call('ZRANGE', AQ, 0, 63)
  if #next_units == 0 then break end
  for _, u in ipairs(next_units) do
    local r = parse_unit(redis.call('HGET', US, u))
    local s = reward_state(u)
    if n > 0 and n + s.n > k then
      done = true
      break
    end
    redis.call('ZREM', AQ, u)
    s.l = lid
    set_reward_state(u, s)
    table.insert(units, u)
    for _, row in ipairs(unscored_rows(u, r)) do
      table.insert(rows, { row[1], r.pk or '' })
      table.insert(items, row)
    end
    n = n + s.n
    if n >= k then
      done = true
      break
    end
  end
end

if n == 0 then
  -- The caller is about to wait: from now on, units coming to await a reward lease publish a
  -- wake-up.
  local wait_ms = tonumber(ARGV[6])
  if wait_ms > 0 and redis.call('PTTL', RWAITING) < wait_ms then
    redis.call('SET', RWAITING, '1', 'PX', wait_ms)
  end
  finish()
  return ok('short')
end

local exp = NOW + math.floor((CFG.reward_timeout_s or 600) * 1000)
local ids = {}
for i, row in ipairs(items) do ids[i] = row[1] end
redis.call('HSET', rk, 'st', 'l', 'exp', I(exp), 'units', cjson.encode(units),
  'rids', cjson.encode(ids), 'left', #items, 'worker', ARGV[4], 't', I(NOW))
redis.call('ZADD', RLEASES, I(exp), lid)
redis.call('HINCRBY', RUN, 'rwl', #items)
local ev = { lease_id = lid, expires_at = exp, items = items }
if ARGV[4] ~= '' then ev['worker_id'] = ARGV[4] end
emit('reward_leased', ev)
finish()
return ok('leased', lid, I(exp), rows)
