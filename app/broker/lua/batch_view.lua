-- requires: batches
-- Read a batch as the ack needs it before the ack script runs; changes nothing. One call
-- (the batch's record keeps its rollouts as the lease found them).
-- ARGV: wake (unused), batch_id, rollouts: 'none' (the state only) or 'meta' (also each
--       rollout's id, version and tokens; the caller reads the packed rollouts with MGET),
--       measured: '1' to have the logprobs measure.lua kept, else '' (or absent).
-- Returns ok('leased', config, V, n, { {rollout_id, version, tokens}, ... } or {} for 'none',
--            token_floor: as lease.lua returned it, ml: the kept logprobs, '' for none or not
--            asked for)
--       | ok('acked', config, V, n, answer) (answer: as ack.lua stored it)
--       | err('run_missing') | err('batch_missing') | err('batch_nacked') | err('lease_expired').
-- The run's config comes along because the ack measures with its KL estimator and clip epsilon.
if not load_run() then return err('run_missing') end
local cfg = R.cfg
local f = redis.call('HMGET', bkey(ARGV[2]), 'st', 'v', 'n', 'ans', 'rows', 'mf')
if not f[1] then return err('batch_missing') end
if f[1] == 'a' then return ok('acked', cfg, f[2], f[3], f[4]) end
if f[1] == 'n' then return err('batch_nacked') end
if f[1] == 'e' then return err('lease_expired') end
local rows = {}
local ml = ''
if ARGV[4] == '1' then ml = redis.call('HGET', bkey(ARGV[2]), 'ml') or '' end
if ARGV[3] ~= 'none' then rows = batch_items(cmsgpack.unpack(f[5])) end
return ok('leased', cfg, f[2], f[3], rows, f[6] or '', ml)
