-- requires: rewards, finish, preferences
-- Rewards for rollouts that await them (SPEC "Rewards"), all-or-nothing: every rollout is
-- checked before anything is written. A rollout scored is its packed form again with the reward
-- in, packed by the caller from the stored one, which only this script changes, and only while
-- the rollout is in AW; the caller judged a rollout it found scored already (a duplicate, or a
-- conflict it refused). What changed since the caller's read is 'reward_raced': the caller reads
-- again and calls again. A unit whose last unscored member is scored becomes ready, or retires
-- 'zero_variance' (a group under drop_zero_variance_groups whose rewards are all equal).
-- ARGV: wake, lease_id ('' = none), n, then n records of 3: rollout_id, reward (exact decimal
--       text), and what the caller read: the packed rollout with the reward set (it was
--       unscored), 'd' (it was scored with this reward: a duplicate) or '' (not there).
-- Returns ok(scored, duplicates, {rollout_id, ...}: those that retired before their reward)
--       | err('run_missing') | err('reward_lease_unknown') | err('reward_raced')
--       | err('reward_unknown', rollout_id): never received
--       | err('reward_not_in_lease', rollout_id).
if not load_run() then return err('run_missing') end
local lid = ARGV[2]
local in_lease = nil
if lid ~= '' then
  local f = redis.call('HMGET', rlkey(lid), 'st', 'rids')
  if not f[1] then return err('reward_lease_unknown') end
  in_lease = {}
  for _, rid in ipairs(cjson.decode(f[2])) do in_lease[rid] = true end
end
local n = tonumber(ARGV[3])
local function at(i) return 3 + (i - 1) * 3 end

-- Phase 1: every rollout's fate, writing nothing.
local ids = {}
for i = 1, n do ids[i] = ARGV[at(i) + 1] end
local aw = {}
for i = 1, n, 1000 do
  local part = redis.call('HMGET', AW, unpack(ids, i, math.min(i + 999, n)))
  for j = 1, math.min(1000, n - i + 1) do aw[i + j - 1] = part[j] or false end
end
local fate, dups, retired = {}, 0, {}
for i = 1, n do
  local rid, text, blob = ids[i], ARGV[at(i) + 2], ARGV[at(i) + 3]
  if in_lease and not in_lease[rid] then return err('reward_not_in_lease', rid) end
  if aw[i] then
    if blob == '' or blob == 'd' then return err('reward_raced') end
    fate[i] = 'ok'
  elseif blob == 'd' then
    fate[i] = 'dup'
    dups = dups + 1
  elseif blob ~= '' then
    return err('reward_raced')  -- scored or retired since the caller's read
  elseif redis.call('SISMEMBER', SEEN, rid) == 1 then
    fate[i] = 'retired'
    table.insert(retired, rid)
  else
    return err('reward_unknown', rid)
  end
end

-- Phase 2: the scores, their units' reward states, and the units they complete.
local items, units, order, done = {}, {}, {}, {}
for i = 1, n do
  if fate[i] == 'ok' then
    local rid, text = ids[i], ARGV[at(i) + 2]
    local t, v, u = parse_awaiting(aw[i])
    redis.call('SET', dkey(rid), ARGV[at(i) + 3])
    CON.deliver('received', rid, v)
    CON.known(rid, text)
    table.insert(done, rid)
    local x = units[u]
    if not x then
      x = { s = reward_state(u) }  -- none: a group still filling
      units[u] = x
      table.insert(order, u)
    end
    local s = x.s
    table.insert(items, { rid, v, tonumber(text), math.max(0, NOW - t), (s and s.l) and 1 or 0 })
    if s then
      s.n = s.n - 1
      s.lo, s.hi = widen(s.lo, s.hi, text)
      if s.rs then s.rs = string.format('%.17g', tonumber(s.rs) + tonumber(text)) end
      if s.l then reward_lease_less(s.l, -1) end
    else
      local uk = ukey(u)
      local f = redis.call('HMGET', uk, 'rmin', 'rmax', 'pk')
      note_reward(uk, text, f[1], f[2])
      if f[3] then redis.call('HINCRBYFLOAT', uk, 'rs', text) end
      redis.call('HINCRBY', uk, 'aw', -1)
    end
  end
end
each_chunk(done, 1000, function(...) redis.call('HDEL', AW, ...) end)
for _, u in ipairs(order) do
  local s = units[u].s
  if s and s.n > 0 then
    set_reward_state(u, s)
  elseif s then
    local r = parse_unit(redis.call('HGET', US, u))
    if r.pk and s.rs then POOL.scored(r.pk, s.rs, r.k) end
    if CON.wants('received') then CON.group('received', rollouts_of(u, r), r.pk) end
    redis.call('HDEL', AUN, u)
    redis.call('ZREM', AQ, u)
    redis.call('ZREM', AV, u)
    if zero_variance(r.k, s.lo, s.hi) then
      retire_unit(u, 'zero_variance', r, false)
    else
      make_ready(u, r.v, r.seq, r.uses)
    end
  end
end
if #items > 0 then emit('scored', { items = items }) end
finish()
return ok(#items, dups, retired)
