-- requires: cleanup, finish, quarantine, preferences
-- Acknowledge a live batch: every rollout gains one use, units at max_reuse or above kl_max
-- retire, and kl_flush_window batches in a row with a mean KL above kl_flush raise the run's
-- version floor to the last one's version, flushing every buffered unit below it. The first use of a prompt attempt's group
-- makes its prompt pass done. A repeat returns the stored answer.
-- ARGV: wake, batch_id, kl_mean ('' = not measured), acked event payload (msgpack, without t
--       and kl_coef: added here), stats text (stored for repeats), flush_limit, the audit entry
--       of a quarantine ('' = none; lib/quarantine.lua fills in its detail). The event's items
--       [rollout_id, version, tokens, kl?] are also where each rollout's measured KL comes from,
--       so the KL gate and the accounting read one record; its gens are what each generator's
--       KL window (lib/quarantine.lua) adds, judged before the units are: a generator this ack
--       quarantines has its units of this batch retire ('quarantined') rather than go back.
-- Returns ok('acked', answer) | ok('repeat', answer) (acked before: the stored answer)
--       | err('run_missing') | err('batch_missing') | err('batch_nacked') | err('lease_expired')
--       | err('lease_rewound', version): a rewind below the batch's version ended its lease.
-- The answer is a msgpack map {retired, flushed, stats (the stats text), kl_coef (β after this
-- ack, as beta_text: '' when off)}.
if not load_run() then return err('run_missing') end
local bid = ARGV[2]
local bk = bkey(bid)
local f = redis.call('HMGET', bk, 'st', 'units', 'rows', 'n', 'v', 'exp', 'ans')
if not f[1] then return err('batch_missing') end
if f[1] == 'a' then return ok('repeat', f[7]) end
if f[1] == 'n' then return err('batch_nacked') end
if f[1] == 'e' then return err('lease_expired') end
if f[1] == 'r' then return err('lease_rewound', f[5]) end
if tonumber(f[6]) <= NOW then
  expire_batch(bid)
  finish()
  return err('lease_expired')
end

-- The adaptive KL penalty (SPEC): a measured batch of n samples moves β toward kl_target.
local beta = kl_beta()
if beta and ARGV[3] ~= '' then
  local e = math.min(math.max(tonumber(ARGV[3]) / CFG.kl_target - 1, -0.2), 0.2)
  beta = beta * (1 + e * tonumber(f[4]) / CFG.kl_horizon)
end

-- Before the first write: either may fail.
local acked = cmsgpack.unpack(ARGV[4])
local event = timed(ARGV[4], beta and { 'kl_coef', beta } or nil)
redis.call('ZREM', LEASES, bid)
emit_timed('acked', event)
if beta and ARGV[3] ~= '' then redis.call('HSET', RUN, 'beta', beta_text(beta)) end
local gens = acked.gens or {}
GEN.judge(gens, ARGV[7])
if #gens > 0 then  -- the uses of each generator a rewind below V would undo
  local counts = {}
  for _, g in ipairs(gens) do table.insert(counts, { g[1], g[2] }) end
  redis.call('HSET', bk, 'gs', cmsgpack.pack(counts))
end

CON.acked_rewards(acked.items or {})
local kl = {}
for _, item in ipairs(acked.items or {}) do
  if item[4] then kl[item[1]] = item[4] end
end

each_unit(cmsgpack.unpack(f[2]), cmsgpack.unpack(f[3]), function(u, r, part)
  r.uses = r.uses + 1
  if r.uses == 1 and CON.first_use(u) then  -- its first gradient: what 'trained' consumers see
    for _, row in ipairs(part) do CON.deliver('trained', row[1], row[2]) end
    CON.group('trained', part, r.pk)
  end
  if r.uses == 1 and r.pk then  -- the first use of a prompt attempt's group: its pass is done
    local pf = pass_fields(r.pk)
    if pf[1] == 'b' and tonumber(pf[2]) == r.att then
      redis.call('HSET', ppkey(r.pk), 'st', 'd')
      note_pass('acked', nil, r.pk, r.att, 'd', tonumber(pf[3]))
    end
  end
  -- A group is handed out whole, so its gate is its worst member's KL; a unit not measured
  -- this time has no KL gate.
  local worst = nil
  for _, row in ipairs(part) do
    local x = kl[row[1]]
    if x and (not worst or x > worst) then worst = x end
  end
  r.kl = worst
  -- As settle() does for a nack or an expiry, with this use and this KL counted.
  local reason = permanent_reason(r.uses, r.v, worst) or GEN.reason(u)
  if reason then
    retire_unit(u, reason, r, false, part)
  else
    set_unit(u, r)
    make_ready(u, r.v, r.seq, r.uses)
  end
end)
local retired = RETIRED_N

-- kl_flush_window: the run hash's 'klrun' counts the acked batches in a row whose mean KL is
-- above kl_flush; one at or below ends the streak, an unmeasured one leaves it as it is, and a
-- flush starts it afresh (a run created before the window reads it as 1: one batch flushes).
local over = false
if ARGV[3] ~= '' then
  if tonumber(ARGV[3]) > CFG.kl_flush then
    local streak = redis.call('HINCRBY', RUN, 'klrun', 1)
    over = streak >= (CFG.kl_flush_window or 1)
    if over then redis.call('HDEL', RUN, 'klrun') end
  else
    redis.call('HDEL', RUN, 'klrun')
  end
end

local flushed = 0
if over then
  local V = tonumber(f[5])
  if V > R.floor then
    redis.call('HSET', RUN, 'floor', I(V))
    redis.call('ZADD', FLOORS, I(V), I(V))  -- what a rewind below V restores from
    R.floor = V
  end
  retire_below(tonumber(ARGV[6]))
  flushed = RETIRED_N - retired
end

redis.call('HINCRBY', RUN, 'leased', -tonumber(f[4]))
local ans = cmsgpack.pack({
  retired = retired, flushed = flushed, stats = ARGV[5], kl_coef = beta_text(beta),
})
redis.call('HSET', bk, 'st', 'a', 'ans', ans, 'end', I(NOW))
redis.call('HDEL', bk, 'ml')  -- logprobs a measure kept for this ack
redis.call('ZADD', ACKED, I(NOW), f[5] .. ':' .. bid)  -- a rewind below its version undoes it
redis.call('PEXPIRE', bk, 86400000)
finish()
return ok('acked', ans)
