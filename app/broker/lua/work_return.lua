-- requires: units, finish
-- Give prompts of a work lease back: each pass still in flight under this lease goes back to
-- the queue at its next attempt (ahead of fresh passes; a return is not a try), and a partial
-- group of it retires ('incomplete_group'). Returning every prompt ends the lease. The partial
-- rollouts given with a returned prompt stay with its pass (lib/partials.lua), in place of any
-- kept under the same rollout_id; the lease that next hands the pass out carries them.
-- ARGV: wake, lease_id, n, then n prompt ids (n = 0: all of the lease's prompts), m, then m
--       records of 6: rollout_id, group_id, policy_version, response tokens, packed partial,
--       the newest version of its trained tokens.
-- Every partial is checked before anything is written: its group must be a prompt attempt of
-- this lease that the call returns, its rollout_id not one received already, its version not
-- above the run's, and a prompt may keep no more partials than group_size. A partial of a
-- prompt that already left the lease (returned or expired before: a retried call) is ignored.
-- Returns ok(returned) | err('run_missing') | err('work_missing')
--       | err('work_not_in_lease', prompt_id): a prompt this lease was not given
--       | err('partial_not_in_lease', rollout_id, group_id)
--       | err('partial_not_returned', rollout_id, prompt_id)
--       | err('partial_posted', rollout_id) | err('partial_future_version', rollout_id, version)
--       | err('too_many_partials', prompt_id, partials, group_size).
if not load_run() then return err('run_missing') end
local lid = ARGV[2]
local wk = wkey(lid)
local f = redis.call('HMGET', wk, 'st', 'items')
if not f[1] then return err('work_missing') end
local items = cjson.decode(f[2])
local n = tonumber(ARGV[3])
local wanted = nil
local given = {}
for _, item in ipairs(items) do given[pass_prompt(item[1])] = true end
if n > 0 then
  wanted = {}
  for i = 1, n do
    local pid = ARGV[3 + i]
    if not given[pid] then return err('work_not_in_lease', pid) end
    wanted[pid] = true
  end
end

-- The partials, by pass: { pk = { {rollout_id, blob}, ... } }, checked whole first.
local lease_groups = {}
for _, item in ipairs(items) do lease_groups[attempt_group(item[1], item[2])] = item[1] end
local m = tonumber(ARGV[4 + n])
local given_partials = {}
for i = 1, m do
  local o = 4 + n + (i - 1) * 6
  local rid, gid, v, tokens = ARGV[o + 1], ARGV[o + 2], tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4])
  local pk = lease_groups[gid]
  if not pk then return err('partial_not_in_lease', rid, gid) end
  if wanted and not wanted[pass_prompt(pk)] then
    return err('partial_not_returned', rid, pass_prompt(pk))
  end
  if redis.call('SISMEMBER', SEEN, rid) == 1 then return err('partial_posted', rid) end
  local vn = tonumber(ARGV[o + 6])
  if vn > R.ver then return err('partial_future_version', rid, I(vn)) end
  local l = given_partials[pk]
  if not l then l = {} given_partials[pk] = l end
  table.insert(l, { rid, ARGV[o + 5], v, tokens, vn })
end
for pk, l in pairs(given_partials) do
  local ids = {}
  for _, p in ipairs(partials_of(pk)) do ids[p[1]] = true end
  for _, p in ipairs(l) do ids[p[1]] = true end
  local k = 0
  for _ in pairs(ids) do k = k + 1 end
  if k > CFG.group_size then
    return err('too_many_partials', pass_prompt(pk), I(k), I(CFG.group_size))
  end
end

local returned = 0
for _, item in ipairs(items) do
  local pk, att = item[1], item[2]
  if not wanted or wanted[pass_prompt(pk)] then
    local pf = pass_fields(pk)
    if pf[1] == 'w' and pf[4] == lid and tonumber(pf[2]) == att then
      local mine = given_partials[pk] or {}
      for _, p in ipairs(mine) do forget_partial(pk, p[1]) end  -- superseded
      requeue(pk, pf, 'returned', lid, false)
      retire_open('g:' .. attempt_group(pk, att), 'incomplete_group')
      if redis.call('HGET', ppkey(pk), 'st') == 'q' then
        for _, p in ipairs(mine) do
          keep_partial(pk, p[1], p[3], p[4], p[2], p[5])
          note_partial('returned', nil, lid, pk, p[1], p[3], p[4])
        end
      end
      returned = returned + 1
    end
  end
end
if not wanted and f[1] == 'l' then
  redis.call('HSET', wk, 'st', 'r')
  redis.call('ZREM', WLEASES, lid)
  redis.call('PEXPIRE', wk, 86400000)
end
finish()
return ok(returned)
