-- requires: cleanup, finish
-- Hand queued prompt passes to a generator as one work lease, within the staleness budget:
-- with step_groups = B, no more than (V + max_staleness + 1) * B groups are admitted at once
-- (admission_left() in lib/admission.lua). Expired work leases are swept first.
-- ARGV: wake, lease_id, max_prompts, generator_id ('' = none), sweep_limit, wait_ms (how long
--       the caller will wait for a wake-up if this call hands out nothing; 0: it will not),
--       waited_ms (how long the request has waited so far; recorded with the lease, or in a
--       'waited' event when this is its last try and it hands out nothing), seed (of the draws
--       from difficulty pools: lib/pools.lua).
-- Under `difficulty`, up to sweep_limit queued passes of pools of weight 0 are skipped first
-- (their pass is over, state 'skipped'), then the passes are drawn from the other pools.
-- A lease_id that names a live or complete lease returns that lease again (a retried request),
-- with the prompts it still holds.
-- The packed prompts (keys pb:<prompt_id>) are read by the caller with one MGET. Each pass
-- comes with its partial rollouts (lib/partials.lua), packed.
-- Returns ok('leased', lease_id, V, expires_at, { {pass_key, attempt, {partial, ...}}, ... })
--       | ok('short', left): nothing handed out; `left` is the budget left ('' = no budget)
--       | err('run_missing') | err('run_closed') | err('generator_quarantined', generator_id)
--       | err('work_lease_over', state): the lease_id names a lease that was returned or expired.
if not load_run() then return err('run_missing') end
if ARGV[4] ~= '' and GEN.quarantined_of({ ARGV[4] }) then
  return err('generator_quarantined', ARGV[4])
end
local lid = ARGV[2]
local wk = wkey(lid)

-- The lease again, with the passes that are still its own: not those given back or expired
-- since (they went back to the queue, or on to another lease, at a later attempt).
local function reply(f)
  local mine = {}
  for _, item in ipairs(cjson.decode(f[4])) do
    local pf = redis.call('HMGET', ppkey(item[1]), 'lease', 'att')
    if pf[1] == lid and tonumber(pf[2]) == item[2] then
      local partials = {}
      for _, p in ipairs(partials_of(item[1])) do table.insert(partials, p[2]) end
      table.insert(mine, { item[1], item[2], partials })
    end
  end
  if #mine == 0 then return err('work_lease_over', 'returned') end
  return ok('leased', lid, f[2], f[3], mine)
end

local known = redis.call('HMGET', wk, 'st', 'v', 'exp', 'items')
if known[1] == 'l' and tonumber(known[3]) <= NOW then  -- ran out, not yet swept
  expire_work(lid)
  finish()
  return err('work_lease_over', 'expired')
end
if known[1] then
  if known[1] == 'l' or known[1] == 'c' then return reply(known) end
  return err('work_lease_over', WORK_STATE[known[1]])
end
if R.st == 'closed' then return err('run_closed') end
sweep(tonumber(ARGV[5]))

local k = tonumber(ARGV[3])
local left = admission_left()
if left then k = math.min(k, left) end
local picked = {}
if POOL.on() then
  for _, pk in ipairs(POOL.zero_weight(tonumber(ARGV[5]))) do skip_pass(pk) end
  math.randomseed(tonumber(ARGV[8]))
  if k > 0 then picked = POOL.draw(k) end
elseif k > 0 then
  picked = redis.call('ZRANGE', PQ, 0, k - 1)
end

local waited = tonumber(ARGV[7])
if #picked == 0 then
  -- The caller is about to wait: from now on, prompts or budget coming free publish a wake-up.
  local wait_ms = tonumber(ARGV[6])
  if wait_ms > 0 and redis.call('PTTL', WWAITING) < wait_ms then
    redis.call('SET', WWAITING, '1', 'PX', wait_ms)
  elseif wait_ms == 0 and waited > 0 then
    emit('waited', { role = 'generator', wait_ms = waited })
  end
  finish()
  return ok('short', left and I(left) or '')
end

local exp = NOW + CFG.work_timeout_s * 1000
local items, ev_items, rows = {}, {}, {}
for _, pk in ipairs(picked) do
  local att = tonumber(redis.call('HGET', ppkey(pk), 'att'))
  redis.call('ZREM', PQ, pk)
  -- The attempt's group takes its place in the buffer's arrival order now, when it is admitted:
  -- a trainer in 'fifo' order reaches groups in the order they were handed out.
  local useq = redis.call('HINCRBY', RUN, 'seq', 1)
  redis.call('HSET', ppkey(pk), 'st', 'w', 'lease', lid, 'useq', useq)
  table.insert(items, { pk, att })
  table.insert(rows, { pk, att, hand_out_partials(pk, lid) })
  table.insert(ev_items, { pass_prompt(pk), pass_number(pk), att })
end
admit(#picked)
local items_json = cjson.encode(items)
redis.call('HSET', wk, 'st', 'l', 'v', I(R.ver), 'exp', I(exp), 'items', items_json,
  'open', #picked, 'gen', ARGV[4], 't', I(NOW))
redis.call('ZADD', WLEASES, I(exp), lid)
local ev = {
  lease_id = lid, policy_version = R.ver, expires_at = exp, items = ev_items, wait_ms = waited,
}
if ARGV[4] ~= '' then ev['generator_id'] = ARGV[4] end
emit('work_leased', ev)
finish()
return ok('leased', lid, I(R.ver), I(exp), rows)
