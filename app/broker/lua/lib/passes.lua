-- requires: admission, pass_keys, partials, pools
-- Prompt passes and work leases. A pass '<prompt_id>#<pass>' is queued ('q'), handed out in a
-- work lease ('w'), its group complete and buffered or leased ('b'), done ('d'), failed ('f'),
-- skipped ('s': queued in a pool of weight 0) or cancelled ('c': its run closed first).
-- Its attempt 'att' names the group a generator posts: '<prompt_id>#<pass>.<att>'. What passes
-- went through is written as 'passes' events by finish() (emit_passes).
local PASS_STATE = {
  q = 'queued', w = 'in_flight', b = 'in_flight', d = 'done', f = 'failed', s = 'skipped',
  c = 'cancelled',
}
local WORK_STATE = { l = 'live', c = 'complete', r = 'returned', e = 'expired' }
local PASS_EVENTS  -- { {cause, lease_id or false, items}, ... } in order, for finish()
per_call(function() PASS_EVENTS = {} end)

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

-- A pass of a closed run that is not in the queue (taken out of it, or never put back) ends
-- without generation: cancelled, its partials dropped.
local function cancel_pass(pk, att, tries, cause, lease_id)
  redis.call('HSET', ppkey(pk), 'st', 'c', 'tries', tries)
  redis.call('HDEL', ppkey(pk), 'lease')
  note_pass(cause, lease_id, pk, att, 'c', tries)
  drop_partials(pk, 'cancelled', lease_id)
end

-- Up to `limit` queued passes of a closed run are cancelled; returns how many.
local function cancel_queued(limit)
  local pks = redis.call('ZRANGE', PQ, 0, limit - 1)
  for _, pk in ipairs(pks) do
    POOL.dequeue(pk)
    local f = pass_fields(pk)
    cancel_pass(pk, tonumber(f[2]), tonumber(f[3]), 'closed', nil)
  end
  return #pks
end

-- An attempt ended without its group reaching a gradient: the pass goes back to the queue at
-- the next attempt, ahead of fresh passes, or is failed once `counts` (a try that retired unused
-- or expired, not a return) brings its tries to max_attempts. In a closed run it is cancelled
-- instead of queued. `f` = pass_fields(pk). The partials the attempt was handed out with go back
-- with the pass, or are dropped with it.
local function requeue(pk, f, cause, lease_id, counts)
  if f[1] == 'w' then work_settled(f[4]) end
  release()
  local att, tries = tonumber(f[2]), tonumber(f[3])
  if counts then tries = tries + 1 end
  if tries >= CFG.max_attempts then
    redis.call('HSET', ppkey(pk), 'st', 'f', 'tries', tries)
    redis.call('HDEL', ppkey(pk), 'lease')
    note_pass(cause, lease_id, pk, att, 'f', tries)
    drop_partials(pk, 'failed', lease_id)
  elseif R.st == 'closed' then
    cancel_pass(pk, att, tries, cause, lease_id)
  else
    partials_back(pk, lease_id)
    att = att + 1
    redis.call('HSET', ppkey(pk), 'st', 'q', 'att', att, 'tries', tries)
    redis.call('HDEL', ppkey(pk), 'lease')
    POOL.enqueue(pk, pass_score(pk, tonumber(f[5])))
    WORK_WOKE = true  -- a prompt came free
    note_pass(cause, lease_id, pk, att, 'q', tries)
  end
end

-- A queued pass (taken out of the queue) is over without generation: its pool has weight 0.
local function skip_pass(pk)
  local f = pass_fields(pk)
  redis.call('HSET', ppkey(pk), 'st', 's')
  note_pass('skipped', nil, pk, tonumber(f[2]), 's', tonumber(f[3]))
  drop_partials(pk, 'skipped', nil)
end

-- The group of a prompt attempt retired (see retire_rollouts() in units.lua). Unused, it sends
-- its pass back, except `zero_variance`, which makes it done (its data says nothing); used, it
-- was done at its first use. A group of an attempt that has already ended (expired, returned)
-- changes nothing.
local function attempt_retired(pk, att, uses, reason)
  local f = pass_fields(pk)
  if (f[1] ~= 'w' and f[1] ~= 'b') or tonumber(f[2]) ~= att or uses > 0 then return end
  if reason == 'zero_variance' then
    if f[1] == 'w' then work_settled(f[4]) end
    release()
    redis.call('HSET', ppkey(pk), 'st', 'd')
    note_pass('retired', nil, pk, att, 'd', tonumber(f[3]))
    drop_partials(pk, 'unused')
  else
    -- A rewind took away the weights it was sampled by: not the prompt's fault, not a try.
    requeue(pk, f, 'retired', nil, reason ~= 'rewound')
  end
end

local function emit_passes()
  for _, p in ipairs(PASS_EVENTS) do
    local ev = { cause = p[1], items = p[3] }
    if p[2] then ev['lease_id'] = p[2] end
    emit('passes', ev)
  end
end
