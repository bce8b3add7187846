-- Read a batch as the ack needs it before the ack script runs; changes nothing. One call
-- instead of a command per unit and per rollout.
-- ARGV: wake (unused), batch_id, rollouts: 'none' (the state only) or 'meta' (also each
--       rollout's id, version and tokens; the caller reads the packed rollouts with MGET).
-- Returns ok('leased', config, V, n, { {rollout_id, version, tokens}, ... } or {} for 'none')
--       | ok('acked', config, V, n, answer) (answer: as ack.lua stored it)
--       | err('run_missing') | err('batch_missing') | err('batch_nacked') | err('lease_expired').
-- The run's config comes along because the ack measures with its KL estimator and clip epsilon.
local cfg = redis.call('HGET', RUN, 'cfg')
if not cfg then return err('run_missing') end
local f = redis.call('HMGET', bkey(ARGV[2]), 'st', 'v', 'n', 'ans', 'units')
if not f[1] then return err('batch_missing') end
if f[1] == 'a' then return ok('acked', cfg, f[2], f[3], f[4]) end
if f[1] == 'n' then return err('batch_nacked') end
if f[1] == 'e' then return err('lease_expired') end
local rows = {}
if ARGV[3] ~= 'none' then
  for _, u in ipairs(cjson.decode(f[5])) do
    for _, rid in ipairs(members(u)) do
      local rf = redis.call('HMGET', rkey(rid), 'v', 'n')
      table.insert(rows, { rid, rf[1], rf[2] })
    end
  end
end
return ok('leased', cfg, f[2], f[3], rows)
