-- requires: units, finish, preferences
-- Store a request's rollouts: all-or-nothing validation first (Redis does not roll a script
-- back), then the writes, the accounting events and one wake-up for long-polling trainers.
-- ARGV: wake, n, then n records of 9: rollout_id, group_id ('' = none), policy_version (v_old),
--       v_new, tokens, masked tokens, reward (exact decimal text; '' = it awaits one), blob,
--       generator_id ('' = none). A request with a rollout of a quarantined generator is
--       refused whole (lib/generators.lua).
-- A unit that completes with a rollout awaiting its reward awaits (lib/units.lua) instead of
-- being ready: no trainer gets it before its last member is scored (score.lua). A rollout is judged
--       'stale' by its governing version (lib/run.lua), 'future_version' by its v_new, and is
--       buffered, counted and retired under its governing version.
-- A group id that names a prompt attempt ('<prompt_id>#<pass>.<attempt>' of a registered
-- prompt) makes its rollouts that attempt's group; an attempt that is over (expired, returned,
-- retried) rejects them as 'stale_attempt'. A rollout of an attempt still in its work lease that
-- is rejected 'stale' ends the attempt, whose group can no longer complete: the pass goes back
-- to the queue at its next attempt (a try, as when its group retires unused), what its group
-- already holds retires ('incomplete_group'), and its other rollouts in the request are
-- 'stale_attempt'. A rollout of an attempt whose pass keeps a partial under its rollout_id
-- completes that partial (the caller checked the prefix, app/broker/partials.py).
-- Returns ok(accepted, duplicates, { {rollout_id, reason}, ... }) | err('run_missing')
--       | err('generator_quarantined', generator_id)
--       | err('group_missing', rollout_id) | err('group_done', group_id)
--       | err('group_overflow', group_id, would_have, group_size)
--       | err('over_capacity', live, capacity_rollouts).
if not load_run() then return err('run_missing') end
local n = tonumber(ARGV[2])
if GEN.quarantine_on() then
  local gens, named = {}, {}
  for i = 1, n do
    local g = ARGV[2 + (i - 1) * 9 + 9]
    if g ~= '' and not named[g] then
      named[g] = true
      table.insert(gens, g)
    end
  end
  local q = GEN.quarantined_of(gens)
  if q then return err('generator_quarantined', q) end
end

-- Phase 1: decide every rollout's fate and check the whole request, writing nothing.
local fate = {}      -- i -> 'ok' | 'dup' | reason
local unit = {}      -- i -> unit id
local in_req = {}
local pending = {}   -- unit -> members this request adds
local attempts = {}  -- group id -> {pk, att, live}: the prompt attempt it names, or false
local accepted = 0

-- The prompt attempt a group id names: {pk, att, live, seq, open} (live: handed out and not
-- yet over; seq: its place in arrival order, taken when it was handed out; open: live and its
-- group not yet complete), or false for a group of a generator that works on its own.
local function attempt_of(gid)
  local a = attempts[gid]
  if a == nil then
    a = false
    local pk, att = group_pass(gid)
    if pk then
      local f = redis.call('HMGET', ppkey(pk), 'st', 'att', 'useq')
      local live = (f[1] == 'w' or f[1] == 'b') and tonumber(f[2]) == att
      a = { pk, att, live, tonumber(f[3]), live and f[1] == 'w' }
    end
    attempts[gid] = a
  end
  return a
end

-- Which ids were received before: one SMISMEMBER for the request.
local ids = {}
for i = 1, n do ids[i] = ARGV[2 + (i - 1) * 9 + 1] end
local known = {}
for i = 1, n, 1000 do
  local part = redis.call('SMISMEMBER', SEEN, unpack(ids, i, math.min(i + 999, n)))
  for j, x in ipairs(part) do known[i + j - 1] = x == 1 end
end

-- The open attempts a new rollout of this request loses to staleness, by their canonical group
-- id, in request order: they end after the writes.
local lost, lost_order = {}, {}
if R.st ~= 'closed' then
  local first = {}
  for i = 1, n do
    local o = 2 + (i - 1) * 9
    local rid, gid = ARGV[o + 1], ARGV[o + 2]
    local work = not known[i] and not first[rid] and gid ~= '' and attempt_of(gid)
    first[rid] = true
    if work and work[5]
      and version_reason(governing_version(tonumber(ARGV[o + 3]), tonumber(ARGV[o + 4]))) then
      local g = attempt_group(work[1], work[2])
      if not lost[g] then
        lost[g] = work
        table.insert(lost_order, g)
      end
    end
  end
end

for i = 1, n do
  local o = 2 + (i - 1) * 9
  local rid, gid = ARGV[o + 1], ARGV[o + 2]
  local v_new = tonumber(ARGV[o + 4])
  local v = governing_version(tonumber(ARGV[o + 3]), v_new)
  if in_req[rid] or known[i] then
    fate[i] = 'dup'
  else
    in_req[rid] = true
    local work = gid ~= '' and attempt_of(gid)
    if R.st == 'closed' then
      fate[i] = 'run_closed'
    elseif work and not work[3] then
      fate[i] = 'stale_attempt'
    elseif v_new > R.ver then
      fate[i] = 'future_version'
    elseif version_reason(v) then
      -- Below the kl_flush floor too: as far off-policy as what the flush retired.
      fate[i] = 'stale'
    elseif work and lost[attempt_group(work[1], work[2])] then
      fate[i] = 'stale_attempt'  -- a fellow member of its group was rejected 'stale'
    else
      fate[i] = 'ok'
      accepted = accepted + 1
      local u
      if CFG.group_size > 1 or work then  -- a prompt attempt's rollouts are a group even of one
        if gid == '' then return err('group_missing', rid) end
        u = 'g:' .. gid
        local f = redis.call('HMGET', ukey(u), 'have', 'need')
        local have, need = 0, CFG.group_size
        if f[1] then
          have, need = tonumber(f[1]), tonumber(f[2])
        elseif redis.call('HEXISTS', US, u) == 1 then  -- complete: buffered or leased
          local k = redis.call('LLEN', mkey(u))
          return err('group_overflow', gid, I(k + 1), I(k))
        elseif redis.call('SISMEMBER', GDONE, u) == 1 then
          return err('group_done', gid)
        end
        pending[u] = (pending[u] or 0) + 1
        if have + pending[u] > need then
          return err('group_overflow', gid, I(have + pending[u]), I(need))
        end
      else
        u = 'r:' .. rid
      end
      unit[i] = u
    end
  end
end
local live = tonumber(redis.call('HGET', RUN, 'live'))
if accepted > 0 and live + accepted > CFG.capacity_rollouts then
  return err('over_capacity', I(live), I(CFG.capacity_rollouts))
end

-- Phase 2: write. Ids, blobs and new single units are written a few commands for the request.
redis.call('HINCRBY', RUN, 'live', accepted)
local acc_items, rej_items, dup_ids, out = {}, {}, {}, {}
local rewarded, reward_sum = 0, 0  -- of the accepted: those posted with a reward, and Σ
local seen, blobs = {}, {}
local seq = nil  -- the run's arrival counter, read once and written back once
local function next_seq()
  seq = (seq or tonumber(redis.call('HGET', RUN, 'seq') or '0')) + 1
  return seq
end
for i = 1, n do
  local o = 2 + (i - 1) * 9
  local rid, gid, ntok, masked, rw, blob, gen =
    ARGV[o + 1], ARGV[o + 2], ARGV[o + 5], tonumber(ARGV[o + 6]), ARGV[o + 7], ARGV[o + 8],
    ARGV[o + 9]
  local v_new = tonumber(ARGV[o + 4])
  local v, tokens = governing_version(tonumber(ARGV[o + 3]), v_new), tonumber(ntok)
  local vs = I(v)
  if fate[i] == 'dup' then
    table.insert(dup_ids, rid)
  elseif fate[i] ~= 'ok' then
    table.insert(seen, rid)
    table.insert(rej_items, { rid, fate[i], v, tokens })
    table.insert(out, { rid, fate[i] })
  else
    table.insert(seen, rid)
    table.insert(blobs, dkey(rid))
    table.insert(blobs, blob)
    local u = unit[i]
    local awaits = rw == ''
    if not awaits then
      rewarded, reward_sum = rewarded + 1, reward_sum + tonumber(rw)
      CON.deliver('received', rid, v)
      CON.known(rid, rw)
    end
    if gen ~= '' then GEN.note(u, gen) end
    if awaits then note_awaiting(rid, v, u) end
    if string.sub(u, 1, 2) == 'r:' then  -- a single rollout: a new complete unit
      admit(1)
      local us = next_seq()
      set_unit(u, { v = v, seq = us, uses = 0, k = 1, n = tokens })
      note_cross(u, v, v_new)
      if awaits then await_unit(u, v, us, 1, '', '') else make_ready(u, v, us) end
      table.insert(acc_items, accepted_item(rid, rid, v, tokens, 1, masked, awaits, gen))
    else
      local uk = ukey(u)
      local work = attempt_of(gid)
      -- A rollout that completes a partial takes its place (its prefix was checked before).
      if work then forget_partial(work[1], rid) end
      redis.call('RPUSH', mkey(u), member_entry(v, tokens, rid))
      local f = redis.call('HMGET', uk, 'have', 'need', 'v', 'rmin', 'rmax', 'seq', 'vn', 'aw')
      local new_unit = 0
      local have, need, uv, useq
      local uvn = v_new  -- the group's newest trained token so far
      if not f[1] then
        new_unit = 1
        useq = work and work[4] or next_seq()
        have, need, uv = 1, CFG.group_size, v
        redis.call('HSET', uk, 'need', CFG.group_size, 'have', 1, 'v', vs, 'seq', useq,
          'vn', I(v_new))
        if awaits then
          redis.call('HSET', uk, 'aw', 1)
        else
          redis.call('HSET', uk, 'rmin', rw, 'rmax', rw)
        end
        if work then
          redis.call('HSET', uk, 'pk', work[1], 'att', work[2])  -- admitted when handed out
        else
          admit(1)
        end
        if CFG.group_size > 1 then  -- a group of one (a prompt attempt's) is complete at once
          redis.call('ZADD', OPEN, NOW, u)
          redis.call('ZADD', OV, vs, u)
        end
      else
        have = redis.call('HINCRBY', uk, 'have', 1)
        need, uv, useq = tonumber(f[2]), tonumber(f[3]), tonumber(f[6])
        uvn = math.max(uvn, tonumber(f[7] or '0'))
        if uvn > tonumber(f[7] or '0') then redis.call('HSET', uk, 'vn', I(uvn)) end
        if v < uv then
          uv = v
          redis.call('HSET', uk, 'v', vs)
          redis.call('ZADD', OV, vs, u)
        end
        if awaits then
          redis.call('HINCRBY', uk, 'aw', 1)
        else
          note_reward(uk, rw, f[4], f[5])
        end
      end
      -- A prompt attempt's group sums its rewards: its mean sorts the prompt into a pool.
      if work and not awaits then redis.call('HINCRBYFLOAT', uk, 'rs', rw) end
      table.insert(acc_items, accepted_item(rid, gid, v, tokens, new_unit, masked, awaits, gen))
      if have == need then  -- complete: from its own hash to a record in US
        if need > 1 then
          redis.call('ZREM', OPEN, u)
          redis.call('ZREM', OV, u)
        end
        if work then  -- the attempt's group is in: it counts no more toward its work lease
          local lid = redis.call('HGET', ppkey(work[1]), 'lease')
          redis.call('HSET', ppkey(work[1]), 'st', 'b')
          if lid then work_settled(lid) end
          drop_partials(work[1], 'unused', lid)  -- partials its generator did not continue
        end
        local rr = redis.call('HMGET', uk, 'rmin', 'rmax', 'aw', 'rs')
        local unscored = tonumber(rr[3] or '0')
        if work and unscored == 0 then POOL.scored(work[1], rr[4], need) end
        -- Every reward in: its pairs, before a zero-variance group retires (it gives none).
        if unscored == 0 and CON.wants('received') then
          CON.group('received', rollouts_of(u), work and work[1])
        end
        if unscored == 0 and zero_variance(need, rr[1], rr[2]) then
          retire_open(u, 'zero_variance')
        else
          table.insert(DELS, uk)
          set_unit(u, {
            v = uv, seq = useq, uses = 0, k = need, n = 0,
            att = work and work[2] or nil, pk = work and work[1] or nil,
          })
          note_cross(u, uv, uvn)
          if unscored > 0 then
            await_unit(u, uv, useq, unscored, rr[1] or '', rr[2] or '', work and (rr[4] or '0'))
          else
            make_ready(u, uv, useq)
          end
        end
      end
    end
  end
end
if seq then redis.call('HSET', RUN, 'seq', I(seq)) end
for _, g in ipairs(lost_order) do
  local pk = lost[g][1]
  local pf = pass_fields(pk)
  requeue(pk, pf, 'rejected', pf[4], true)
  retire_open('g:' .. g, 'incomplete_group')
end
each_chunk(seen, 1000, function(...) redis.call('SADD', SEEN, ...) end)
-- Written before finish() deletes the blobs of any group this request completed and retired.
each_chunk(blobs, 200, function(...) redis.call('MSET', ...) end)

GEN.write()
if #acc_items > 0 then
  local ev = { items = acc_items }
  if rewarded > 0 then ev.rewarded, ev.reward_sum = rewarded, reward_sum end
  emit('accepted', ev)
end
if #dup_ids > 0 then emit('duplicate', { n = #dup_ids, ids = dup_ids }) end
if #rej_items > 0 then emit('rejected', { items = rej_items }) end
finish()
return ok(accepted, #dup_ids, out)
