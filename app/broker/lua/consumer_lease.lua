-- requires: run, consumers
-- Lease up to n of a consumer's pending items (rollouts, or pairs for kind preferences), oldest
-- delivery first, as batch `batch_id` (a retry with the same id while it is live returns the
-- same batch). First its leases whose time is up return their items. Under max_lag, an item
-- whose version (a pair's: its older rollout's) is below the run's version less max_lag is
-- dropped (counted), not handed out.
-- ARGV: wake, name, batch_id, n, lease ms (-1: the run's lease_timeout_s), expiry limit, wait_ms
--       (how long the caller waits for a wake-up when it finds nothing; 0: it does not).
-- Returns ok('leased', expires ms, {rollout_id, ...}[, pairs]) | ok('repeat', ...)
--       | ok('empty') | err('run_missing') | err('consumer_missing', name)
--       | err('batch_id_taken', state). Kind preferences adds the pairs
--       { {pair_id, prompt_id ('' = none), chosen, rejected, margin}, ... } and names each of
--       their rollouts once (CON.answer).
if not load_run() then return err('run_missing') end
local c = CON.get(ARGV[2])
if not c then return err('consumer_missing', ARGV[2]) end
local bid, n = ARGV[3], tonumber(ARGV[4])
CON.expire(c, tonumber(ARGV[6]))
local bk = CON.batch_key(c, bid)
local f = redis.call('HMGET', bk, 'st', 'items', 'exp')
local STATES = { a = 'acked', n = 'nacked', e = 'expired' }
if f[1] == 'l' then return ok('repeat', f[3], CON.answer(c, CON.members(cjson.decode(f[2])))) end
if f[1] then return err('batch_id_taken', STATES[f[1]]) end

local floor = c.max_lag and R.ver - c.max_lag or nil
local k = CON.qkey(c.name)
local items, members, dropped = {}, {}, {}
while #members < n do
  local got = redis.call('ZPOPMIN', k, n - #members)
  if #got == 0 then break end
  for i = 1, #got, 2 do
    local m = got[i]
    if floor and tonumber(string.match(m, '^(%d+) ')) < floor then
      table.insert(dropped, m)
    else
      table.insert(items, m)
      table.insert(items, got[i + 1])
      table.insert(members, m)
    end
  end
end
CON.drop(c, dropped)
CON.emit()
if #members == 0 then
  local wait_ms = tonumber(ARGV[7])
  if wait_ms > 0 and redis.call('PTTL', CON.WAITING) < wait_ms then
    redis.call('SET', CON.WAITING, '1', 'PX', wait_ms)
  end
  return ok('empty')
end
local lease_ms = tonumber(ARGV[5])
if lease_ms < 0 then lease_ms = CFG.lease_timeout_s * 1000 end
local exp = NOW + lease_ms
redis.call('HSET', bk, 'st', 'l', 'items', cjson.encode(items), 'exp', I(exp), 'n', #members)
redis.call('ZADD', CON.lkey(c.name), I(exp), bid)
redis.call('HINCRBY', CON.ckey(c.name), 'leased', #members)
return ok('leased', I(exp), CON.answer(c, members))
