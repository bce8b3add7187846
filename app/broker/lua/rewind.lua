-- requires: cleanup, finish, audit
-- Move the run back to version W, below its current one, because its trainer lost the
-- gradients of the later versions and resumes from a checkpoint of W. One atomic step:
-- 1. Live leases taken above W, or holding a unit with a token above W, end: their units come
--    back unused ('expired' events); the batch's state is 'r', so its ack or nack answers
--    'lease_rewound'.
-- 2. Every batch acknowledged at a version above W (the ACKED index) is undone: each of its
--    units gets that use back (one 'rewound' item per rollout per batch; the batch stays
--    acknowledged, marked 'rw'). A prompt pass an undone use completed is done no more: its
--    group, still buffered or leased, is in flight again at a new attempt and is trained again;
--    a group that retired after its uses sends the pass back to the queue at a new attempt.
--    Neither is a try, and the records of leases kept below are patched to match.
-- 3. Units and open groups with a trained token above W retire ('rewound'); their prompt passes
--    go back to the queue without a try (lib/passes.lua).
-- 4. Work leases taken above W end ('returned' state): their passes go back to the queue, not
--    as a try. Partials with a token above W are dropped when next handed out (lib/partials.lua).
-- 5. The run is at W, with the weights given; the kl_flush floor is what it was before any flush
--    above W, and the kl_flush_window streak is 0; the staleness budget counts from W ('adm'
--    follows every step above).
-- ARGV: wake, version W, weights ('' = none), audit entry.
-- Returns ok('rewound', W, retired) (`retired` as retired_counts())
--       | ok('not_behind', current): W is not below the run's version (the caller moves forward)
--       | err('run_missing') | err('run_closed').
if not load_run() then return err('run_missing') end
local W = tonumber(ARGV[2])
if W >= R.ver then return ok('not_behind', I(R.ver)) end
if R.st ~= 'open' then return err('run_closed') end
local from = R.ver
R.ver = W
local kept_floor = redis.call('ZREVRANGEBYSCORE', FLOORS, I(W), '-inf', 'LIMIT', 0, 1)
redis.call('ZREMRANGEBYSCORE', FLOORS, '(' .. I(W), '+inf')
if R.floor > W then R.floor = tonumber(kept_floor[1] or '0') end
redis.call('HSET', RUN, 'ver', I(W), 'floor', I(R.floor))
redis.call('HDEL', RUN, 'klrun')  -- the kl_flush_window streak starts afresh from W

-- 1. Leases.
local function holds_token_above(units)
  if redis.call('EXISTS', XV) == 0 then return false end
  local ids = {}
  for i = 1, #units, 3 do table.insert(ids, units[i]) end
  for _, s in ipairs(redis.call('ZMSCORE', XV, unpack(ids))) do
    if s and tonumber(s) > W then return true end
  end
  return false
end
local kept, kept_units = {}, {}  -- live leases at or below W, in order, and their units
for _, bid in ipairs(redis.call('ZRANGE', LEASES, 0, -1)) do
  local f = redis.call('HMGET', bkey(bid), 'st', 'units', 'rows', 'n', 'v')
  if f[1] == 'l' then
    local units = cmsgpack.unpack(f[2])
    if tonumber(f[5]) > W or holds_token_above(units) then
      redis.call('ZREM', LEASES, bid)
      return_batch(bid, f, 'r', 'expired')
    else
      table.insert(kept, bid)
      kept_units[bid] = units
    end
  end
end

-- 2. Acknowledged batches above W.
local undo, order, items, undone = {}, {}, {}, {}
local gen_uses, gen_order = {}, {}  -- the uses undone per generator (the batches' 'gs')
for _, m in ipairs(redis.call('ZRANGE', ACKED, 0, -1)) do
  local bv, bid = string.match(m, '^(%d+):(.*)$')
  bv = tonumber(bv)
  if bv > W then
    redis.call('ZREM', ACKED, m)
    local f = redis.call('HMGET', bkey(bid), 'st', 'units', 'rows', 'gs')
    if f[1] == 'a' then
      table.insert(undone, bid)
      for _, g in ipairs(f[4] and cmsgpack.unpack(f[4]) or {}) do
        if not gen_uses[g[1]] then table.insert(gen_order, g[1]) end
        gen_uses[g[1]] = (gen_uses[g[1]] or 0) + g[2]
      end
      redis.call('HSET', bkey(bid), 'rw', I(NOW))
      each_unit(cmsgpack.unpack(f[2]), cmsgpack.unpack(f[3]), function(u, r, part)
        local x = undo[u]
        if not x then
          x = { n = 0, top = -1 }
          undo[u] = x
          table.insert(order, u)
        end
        x.n = x.n + 1
        if r.uses + 1 > x.top then x.top, x.r = r.uses + 1, r end
        for _, row in ipairs(part) do table.insert(items, { row[1], row[2], row[3], bv }) end
      end)
    end
  end
end
local patched = {}  -- unit -> its record with the uses given back, for the leases kept
for i = 1, #order, 1000 do
  local part = { unpack(order, i, math.min(i + 999, #order)) }
  local recs = redis.call('HMGET', US, unpack(part))
  for j, u in ipairs(part) do
    local x = undo[u]
    if recs[j] then  -- still buffered or leased
      local r = parse_unit(recs[j])
      if r.uses > 0 and r.uses <= x.n then CON.rewound(u) end  -- its first use is undone
      r.uses = math.max(0, r.uses - x.n)
      local pf = r.uses == 0 and r.pk and pass_fields(r.pk)
      if pf and pf[1] == 'd' and tonumber(pf[2]) == r.att then
        r.att = r.att + 1
        redis.call('HSET', ppkey(r.pk), 'st', 'b', 'att', I(r.att))
        note_pass('rewound', nil, r.pk, r.att, 'b', tonumber(pf[3]))
      end
      set_unit(u, r)
      patched[u] = unit_record(r)
    elseif x.top - x.n <= 0 then  -- retired, and none of its uses stands
      local pf = x.r.pk and pass_fields(x.r.pk)
      if pf then
        if pf[1] == 'd' and tonumber(pf[2]) == x.r.att then
          requeue(x.r.pk, pf, 'rewound', nil, false)
        end
      else
        release()  -- it counted toward the budget as a group that reached a gradient
      end
    end
  end
end
for _, bid in ipairs(kept) do
  local units, changed = kept_units[bid], false
  for i = 1, #units, 3 do
    if patched[units[i]] then
      units[i + 1] = patched[units[i]]
      changed = true
    end
  end
  if changed then redis.call('HSET', bkey(bid), 'units', cmsgpack.pack(units)) end
end

-- 3. What holds a token above W.
flush_units()
while true do
  local vs = redis.call('ZRANGEBYSCORE', VS, '(' .. I(W), '+inf', 'LIMIT', 0, 1)
  if #vs == 0 then break end
  local v = tonumber(vs[1])
  local units = redis.call('ZRANGE', qvkey(vs[1]), 0, 999)
  if #units == 0 then
    redis.call('ZREM', VS, vs[1])
  else
    local recs = redis.call('HMGET', US, unpack(units))
    for i, u in ipairs(units) do
      if recs[i] then
        retire_unit(u, 'rewound', parse_unit(recs[i]), true)
      else
        unready(u, v)
      end
    end
  end
end
local function rewound() return 'rewound' end
while retire_awaiting('(' .. I(W), '+inf', rewound, 1000) == 0 do end
for _, u in ipairs(redis.call('ZRANGEBYSCORE', XV, '(' .. I(W), '+inf')) do
  -- Ready or awaiting ones only: the leases that held one ended above, and what they retired
  -- is gone.
  local rec = redis.call('HGET', US, u)
  local r = rec and parse_unit(rec)
  local ready = r and is_ready(u, r.v)
  if ready or (r and awaiting_on() and redis.call('HEXISTS', AUN, u) == 1) then
    retire_unit(u, 'rewound', r, ready)
  end
end
for _, u in ipairs(redis.call('ZRANGE', OPEN, 0, -1)) do
  local f = redis.call('HMGET', ukey(u), 'v', 'vn')
  if f[1] and math.max(tonumber(f[1]), tonumber(f[2] or f[1])) > W then
    retire_open(u, 'rewound')
  end
end

-- 4. Work leases above W.
for _, lid in ipairs(redis.call('ZRANGE', WLEASES, 0, -1)) do
  if tonumber(redis.call('HGET', wkey(lid), 'v')) > W then
    end_work(lid, 'r', 'rewound', false, 'rewound')
  end
end

-- 5. The run.
move_version(W, ARGV[3])  -- its followers learn of it at once
run_snapshot('policy')
audit(ARGV[4])
local gens = {}
for _, g in ipairs(gen_order) do table.insert(gens, { g, gen_uses[g] }) end
emit('rewound', {
  from_version = from, to_version = W, batches = undone, items = items,
  gens = #gens > 0 and gens or nil,
})
WORK_WOKE = true  -- the budget and the queue changed
finish()
return ok('rewound', I(W), retired_counts())
