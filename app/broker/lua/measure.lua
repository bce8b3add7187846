-- requires: batches, finish
-- Keep a live batch's measured logprobs with its lease (the batch hash's 'ml'), for an ack that
-- carries none; a later measure replaces them. Nothing else changes, unless the lease has run
-- out: then the batch expires here, as ack.lua would expire it.
-- ARGV: wake, batch_id, ml (one dtype byte, 'f' float32 or 'd' float64, then every rollout's
--       logprobs in the batch's row order, little-endian: app/broker/measures.py).
-- Returns ok('measured', kl_coef: β to use now as beta_text, '' when off)
--       | err('run_missing') | err('batch_missing') | err('batch_settled', 'acked' | 'nacked')
--       | err('lease_expired') | err('lease_rewound', version).
if not load_run() then return err('run_missing') end
local bid = ARGV[2]
local bk = bkey(bid)
local f = redis.call('HMGET', bk, 'st', 'v', 'exp')
if not f[1] then return err('batch_missing') end
if f[1] == 'a' then return err('batch_settled', 'acked') end
if f[1] == 'n' then return err('batch_settled', 'nacked') end
if f[1] == 'e' then return err('lease_expired') end
if f[1] == 'r' then return err('lease_rewound', f[2]) end
if tonumber(f[3]) <= NOW then
  expire_batch(bid)
  finish()
  return err('lease_expired')
end
redis.call('HSET', bk, 'ml', ARGV[3])
return ok('measured', beta_text(kl_beta()))
