-- Acknowledge a live batch: every rollout gains one use, units at max_reuse or above kl_max
-- retire, and a batch mean KL above kl_flush raises the run's version floor to the batch's
-- version, flushing every buffered unit below it. The first use of a prompt attempt's group
-- makes its prompt pass done. A repeat returns the stored answer.
-- ARGV: wake, batch_id, kl_mean ('' = not measured), acked event payload (msgpack, without t),
--       stats text (stored for repeats), flush_limit. The event's items [rollout_id, version,
--       tokens, kl?] are also where each rollout's measured KL comes from, so the KL gate and the
--       accounting read one record.
-- Returns ok('acked', answer) | ok('repeat', answer) (acked before: the stored answer)
--       | err('run_missing') | err('batch_missing') | err('batch_nacked') | err('lease_expired').
-- The answer is a msgpack map {retired, flushed, stats (the stats text)}.
if not load_run() then return err('run_missing') end
local bid = ARGV[2]
local bk = bkey(bid)
local f = redis.call('HMGET', bk, 'st', 'units', 'n', 'v', 'exp', 'ans')
if not f[1] then return err('batch_missing') end
if f[1] == 'a' then return ok('repeat', f[6]) end
if f[1] == 'n' then return err('batch_nacked') end
if f[1] == 'e' then return err('lease_expired') end
if tonumber(f[5]) <= NOW then
  expire_batch(bid)
  finish()
  return err('lease_expired')
end

local acked = cmsgpack.unpack(ARGV[4])  -- before the first write: it may fail
redis.call('ZREM', LEASES, bid)
emit('acked', acked)

local kl = {}
for _, item in ipairs(acked.items or {}) do
  if item[4] then kl[item[1]] = item[4] end
end

local units = cjson.decode(f[2])
for _, u in ipairs(units) do
  local uk = ukey(u)
  local uf = redis.call('HMGET', uk, 'v', 'seq', 'uses', 'pk', 'att')
  local uses = tonumber(uf[3]) + 1
  if uses == 1 and uf[4] then  -- the first use of a prompt attempt's group: its pass is done
    local pf = pass_fields(uf[4])
    if pf[1] == 'b' and tonumber(pf[2]) == tonumber(uf[5]) then
      redis.call('HSET', ppkey(uf[4]), 'st', 'd')
      note_pass('acked', nil, uf[4], tonumber(uf[5]), 'd', tonumber(pf[3]))
    end
  end
  -- A group is handed out whole, so its gate is its worst member's KL.
  local worst = nil
  for _, rid in ipairs(members(u)) do
    local x = kl[rid]
    if x and (not worst or x > worst) then worst = x end
  end
  -- As settle() does for a nack or an expiry, with this use and this KL counted: a unit that
  -- retires is deleted, so only one that stays has them written.
  local v = tonumber(uf[1])
  local reason = permanent_reason(uses, v, worst)
  if reason then
    retire(u, reason, { 'l', uf[1], uses })
  else
    if worst then
      redis.call('HSET', uk, 'uses', uses, 'kl', worst)  -- Redis writes a double exactly
      redis.call('HDEL', uk, 'b')
    else
      redis.call('HSET', uk, 'uses', uses)
      redis.call('HDEL', uk, 'b', 'kl')  -- not measured this time: no KL gate
    end
    make_ready(u, v, tonumber(uf[2]))
  end
end
local retired = RETIRED_N

local flushed = 0
if ARGV[3] ~= '' and tonumber(ARGV[3]) > CFG.kl_flush then
  local V = tonumber(f[4])
  if V > R.floor then
    redis.call('HSET', RUN, 'floor', I(V))
    R.floor = V
  end
  retire_below(tonumber(ARGV[6]))
  flushed = RETIRED_N - retired
end

redis.call('HINCRBY', RUN, 'leased', -tonumber(f[3]))
local ans = cmsgpack.pack({ retired = retired, flushed = flushed, stats = ARGV[5] })
redis.call('HSET', bk, 'st', 'a', 'ans', ans, 'end', I(NOW))
redis.call('PEXPIRE', bk, 86400000)
finish()
return ok('acked', ans)
