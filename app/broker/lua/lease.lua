-- requires: cleanup, finish
-- Select eligible units in the run's order and lease them as one batch, atomically: no unit
-- can be in two live leases. Units found permanently ineligible on the way are retired.
-- ARGV: wake, batch_id, size, policy_version ('' = current), partial (0/1), trainer_id,
--       sweep_limit, scan_limit, seed (of the shuffle in 'random' order), wait_ms (how long
--       the caller will wait for a wake-up if this call finds too little; 0: it will not),
--       waited_ms (how long the request has waited so far: recorded with the lease, or in a
--       'waited' event when this is its last try and it finds too little).
-- A batch_id that already names a live batch returns that batch again (a retried request).
-- The packed rollouts (keys d:<rollout_id>) are read by the caller with one MGET: copying
-- them through Lua strings would cost the script more than all its other work.
-- Returns ok('leased', batch_id, V, expires_at, { {uses, lag, rollout_id, prompt_id}, ... },
--         token_floor, kl_coef)
--         (prompt_id: '' for a rollout not posted under a work lease; the caller reads that
--         prompt's packed prompt, pb:<prompt_id>, right after the rollouts. token_floor: '' or,
--         under stale_tokens 'mask', the oldest version a token may have and stay trained;
--         fixed with the lease, and kept with it for the ack. kl_coef: the adaptive KL
--         penalty's β now, as beta_text: '' when off)
--       | ok('short', found): too few eligible rollouts, nothing leased
--       | err('run_missing') | err('batch_size', group_size) | err('version_future', current)
--       | err('batch_id_taken', state): the batch_id names a batch that is no longer live.
if not load_run() then return err('run_missing') end
local bid, N = ARGV[2], tonumber(ARGV[3])
if N % CFG.group_size ~= 0 then return err('batch_size', I(CFG.group_size)) end  -- whole groups

-- The reply of a live batch: also what a retried lease with the same batch_id gets back.
local function reply(f)
  local V = tonumber(f[2])
  local rows = {}
  each_unit(cmsgpack.unpack(f[3]), cmsgpack.unpack(f[6]), function(_, r, part)
    for _, row in ipairs(part) do
      table.insert(rows, { r.uses, V - row[2], row[1], r.pk and pass_prompt(r.pk) or '' })
    end
  end)
  return ok('leased', bid, f[2], f[4], rows, f[7] or '', beta_text(kl_beta()))
end

local known = redis.call('HMGET', bkey(bid), 'st', 'v', 'units', 'exp', 'n', 'rows', 'mf')
if known[1] then
  if known[1] == 'l' and tonumber(known[4]) > NOW then return reply(known) end
  return err('batch_id_taken', BATCH_STATE[known[1]])
end

local V = R.ver
if ARGV[4] ~= '' then
  V = tonumber(ARGV[4])
  if V > R.ver then return err('version_future', I(R.ver)) end
end
local partial = ARGV[5] == '1'
sweep(tonumber(ARGV[7]))
local scan_limit = tonumber(ARGV[8])

local picked, picked_n, scanned = {}, 0, 0
local function full() return picked_n >= N or scanned >= scan_limit end

-- A ready unit and its record (nil: none, which no ready unit lacks).
local function consider(u, text)
  scanned = scanned + 1
  if not text then return end
  local r = parse_unit(text)
  local reason = permanent_reason(r.uses, r.v, r.kl)
  if reason then
    retire_unit(u, reason, r, true)
  elseif r.v <= V and r.k <= N - picked_n then  -- a trainer at V gets no rollouts of later policies
    table.insert(picked, { u, r, text })
    picked_n = picked_n + r.k
  end
end

-- Consider units in the order given, their records read 256 to a command.
local function consider_all(units)
  for i = 1, #units, 256 do
    local recs = redis.call('HMGET', US, unpack(units, i, math.min(i + 255, #units)))
    for j, rec in ipairs(recs) do
      consider(units[i + j - 1], rec)
      if full() then return end
    end
  end
end

-- Walk one zset in seq order, a page at a time (retiring changes ranks, not scores).
local function walk(key)
  local after = '-inf'
  while not full() do
    local page = redis.call('ZRANGEBYSCORE', key, after, '+inf', 'WITHSCORES', 'LIMIT', 0, 64)
    if #page == 0 then return end
    local units = {}
    for i = 1, #page, 2 do table.insert(units, page[i]) end
    after = '(' .. page[#page]
    consider_all(units)
  end
end

-- 'auto' (SPEC): oldest first under a staleness budget, which keeps its promise only so.
local order = CFG.order
if order == 'auto' then
  local budget = CFG.step_groups ~= nil and CFG.step_groups ~= cjson.null
  order = budget and 'fifo' or 'freshest'
end
if order == 'fifo' then -- lowest version first, fewer uses then arrival within a version
  for _, v in ipairs(redis.call('ZRANGEBYSCORE', VS, '-inf', I(V))) do
    walk(qvkey(v))
    if full() then break end
  end
elseif order == 'random' then
  -- A draw from the ready units of every version up to V, from each in proportion to the units
  -- it holds (rounded up: one at least from each).
  local want = math.min(scan_limit, 2 * N + 32)
  local versions = redis.call('ZRANGEBYSCORE', VS, '-inf', I(V))
  local sizes, total = {}, 0
  for i, v in ipairs(versions) do
    sizes[i] = redis.call('ZCARD', qvkey(v))
    total = total + sizes[i]
  end
  local sample = {}
  for i, v in ipairs(versions) do
    if sizes[i] > 0 then
      local k = math.ceil(want * sizes[i] / total)
      for _, u in ipairs(redis.call('ZRANDMEMBER', qvkey(v), k)) do table.insert(sample, u) end
    end
  end
  -- ZRANDMEMBER picks a random subset but returns a small set whole, and often a subset, in
  -- index order: shuffle the draw. The caller seeds the PRNG (script PRNGs restart from a fixed
  -- seed on some Redis versions, which would make every lease draw the same sequence).
  math.randomseed(tonumber(ARGV[9]))
  for i = #sample, 2, -1 do
    local j = math.random(i)
    sample[i], sample[j] = sample[j], sample[i]
  end
  consider_all(sample)
else -- freshest: highest version first, fewer uses then arrival within a version
  local versions = redis.call('ZREVRANGEBYSCORE', VS, I(V), '-inf')
  for _, v in ipairs(versions) do
    walk(qvkey(v))
    if full() then break end
  end
end

if picked_n == 0 or (picked_n < N and not partial) then
  -- The caller is about to wait: from now on, units becoming ready publish a wake-up. Set in
  -- the same call that found too little, so nothing can become ready unannounced in between.
  local wait_ms = tonumber(ARGV[10])
  if wait_ms > 0 and redis.call('PTTL', WAITING) < wait_ms then
    redis.call('SET', WAITING, '1', 'PX', wait_ms)
  elseif wait_ms == 0 and tonumber(ARGV[11]) > 0 then
    emit('waited', { role = 'trainer', wait_ms = tonumber(ARGV[11]) })
  end
  finish()
  return ok('short', picked_n)
end

local exp = NOW + CFG.lease_timeout_s * 1000
local units, brows, items, rows, taken = {}, {}, {}, {}, {}
local tokens = 0
for _, p in ipairs(picked) do
  local u, r = p[1], p[2]
  local part = rollouts_of(u, r)
  table.insert(units, u) table.insert(units, p[3]) table.insert(units, #part)
  table.insert(taken, { u, r.v })
  local pid = r.pk and pass_prompt(r.pk) or ''
  for _, row in ipairs(part) do
    local rid, rv, rn = row[1], row[2], row[3]
    tokens = tokens + rn
    table.insert(brows, rid) table.insert(brows, rv) table.insert(brows, rn)
    table.insert(items, { rid, rv, rn, V - rv, r.uses })
    table.insert(rows, { r.uses, V - rv, rid, pid })
  end
end
unready_many(taken)
local mf = token_floor(V)
mf = mf and I(mf) or ''
redis.call('HSET', bkey(bid), 'st', 'l', 'v', I(V), 'exp', I(exp), 'units', cmsgpack.pack(units),
  'rows', cmsgpack.pack(brows), 'n', picked_n, 'tok', I(tokens), 'tr', ARGV[6], 't', I(NOW),
  'mf', mf)
redis.call('ZADD', LEASES, I(exp), bid)
redis.call('HINCRBY', RUN, 'leased', picked_n)
local ev = {
  batch_id = bid, policy_version = V, expires_at = exp, items = items, wait_ms = tonumber(ARGV[11]),
}
if ARGV[6] ~= '' then ev['trainer_id'] = ARGV[6] end
emit('leased', ev)
finish()
return ok('leased', bid, I(V), I(exp), rows, mf, beta_text(kl_beta()))
