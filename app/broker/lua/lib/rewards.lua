-- requires: units
-- Reward leases (SPEC "Rewards"): each one a hash rlkey(lease_id): st ('l'ive, 'd'one: all it
-- held was scored or retired, 'e'xpired, 'r'eturned), exp, worker, units (JSON list of the units
-- it took), rids (JSON list of their rollouts unscored then), left (unscored rollouts it still
-- holds), t; the live ones in RLEASES by expiry. A unit is leased whole: its reward state's `l`
-- names the lease while it holds it, and the run hash's `rwl` counts the rollouts so held.

-- The unscored rollouts of the awaiting unit `u` (record `r`): { {rid, version, tokens}, ... }.
local function unscored_rows(u, r)
  local rows = rollouts_of(u, r)
  local ids = {}
  for i, row in ipairs(rows) do ids[i] = row[1] end
  local out = {}
  for i, x in ipairs(redis.call('HMGET', AW, unpack(ids))) do
    if x then table.insert(out, rows[i]) end
  end
  return out
end

-- End the live reward lease `lid` for the units it holds (all, or those of the set `only`):
-- 'e'xpired (each such unit has one more expired lease, and one at max_reward_attempts retires
-- 'reward_timeout', its prompt going back as for any unused group) or 'r'eturned (no attempt
-- counted). The rest go back to AQ. The lease ends once it holds nothing. Returns the unscored
-- rollouts it gave up.
local function end_reward_lease(lid, st, only)
  local rk = rlkey(lid)
  local f = redis.call('HMGET', rk, 'st', 'units')
  if f[1] ~= 'l' then
    redis.call('ZREM', RLEASES, lid)
    return 0
  end
  local expired = st == 'e'
  local max_x = CFG.max_reward_attempts or 3
  local items, back, kept = {}, 0, 0
  for _, u in ipairs(cjson.decode(f[2])) do
    local s = reward_state(u)
    if s and s.l == lid then
      if only and not only[u] then
        kept = kept + 1
      else
        local r = parse_unit(redis.call('HGET', US, u))
        local rows = unscored_rows(u, r)
        s.l = nil
        if expired then s.x = s.x + 1 end
        set_reward_state(u, s)
        for _, row in ipairs(rows) do
          table.insert(items, { row[1], row[2], expired and s.x or row[3] })
        end
        back = back + #rows
        if expired and s.x >= max_x then
          retire_unit(u, 'reward_timeout', r, false)
        else
          redis.call('ZADD', AQ, I(r.seq), u)
          REWARD_WOKE = true
        end
      end
    end
  end
  if back > 0 then
    redis.call('HINCRBY', RUN, 'rwl', -back)
    redis.call('HINCRBY', rk, 'left', -back)
    emit(expired and 'reward_expired' or 'reward_returned', { lease_id = lid, items = items })
  end
  if kept == 0 then
    redis.call('HSET', rk, 'st', st)
    redis.call('PEXPIRE', rk, 86400000)
    redis.call('ZREM', RLEASES, lid)
  end
  return back
end

-- Reward leases whose time ran out, at most `limit`; returns how many.
local function expire_reward_leases(limit)
  local lids = redis.call('ZRANGEBYSCORE', RLEASES, '-inf', I(NOW), 'LIMIT', 0, limit)
  for _, lid in ipairs(lids) do end_reward_lease(lid, 'e') end
  return #lids
end

-- Retire awaiting units whose version is between `lo` and `hi` (ZRANGEBYSCORE bounds), by
-- `reason_for(v)`, at most `budget`; returns the budget left.
local function retire_awaiting(lo, hi, reason_for, budget)
  if budget <= 0 or not awaiting_on() then return budget end
  local old = redis.call('ZRANGEBYSCORE', AV, lo, hi, 'WITHSCORES', 'LIMIT', 0, budget)
  for i = 1, #old, 2 do
    local u = old[i]
    local rec = redis.call('HGET', US, u)
    if rec then
      retire_unit(u, reason_for(tonumber(old[i + 1])), parse_unit(rec), false)
    else
      redis.call('ZREM', AV, u)  -- no record: nothing to retire
    end
  end
  return budget - #old / 2
end
