-- requires: batches, finish
-- Give a live batch back: its rollouts return to the buffer with no use. A repeat is a no-op.
-- ARGV: wake, batch_id.
-- Returns ok('nacked', n) | ok('repeat', n) (nacked before) | err('run_missing')
--       | err('batch_missing') | err('batch_acked') | err('lease_expired')
--       | err('lease_rewound', version).
if not load_run() then return err('run_missing') end
local bid = ARGV[2]
local bk = bkey(bid)
local f = redis.call('HMGET', bk, 'st', 'units', 'rows', 'n', 'exp')
if not f[1] then return err('batch_missing') end
if f[1] == 'n' then return ok('repeat', tonumber(f[4])) end
if f[1] == 'a' then return err('batch_acked') end
if f[1] == 'e' then return err('lease_expired') end
if f[1] == 'r' then return err('lease_rewound', redis.call('HGET', bk, 'v')) end
if tonumber(f[5]) <= NOW then
  expire_batch(bid)
  finish()
  return err('lease_expired')
end
redis.call('ZREM', LEASES, bid)
return_batch(bid, f, 'n', 'nacked')
finish()
return ok('nacked', tonumber(f[4]))
