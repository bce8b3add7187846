-- Read a batch as the ack needs it before the ack script runs; changes nothing. One call
-- instead of a command per unit and per rollout.
-- ARGV: wake (unused), batch_id, rollouts: 'none' (the state only) or 'meta' (also each
--       rollout's id, version and tokens; the caller reads the packed rollouts with MGET).
-- Returns {} for no such run, {config} for no such batch, else {config, st, V, n, answer|nil,
-- [rid, version, tokens]...}; the rollouts only while the batch is leased. The run's config
-- comes along because the ack measures with its KL estimator and clip epsilon.
local cfg = redis.call('HGET', RUN, 'cfg')
if not cfg then return {} end
local f = redis.call('HMGET', bkey(ARGV[2]), 'st', 'v', 'n', 'ans', 'units')
if not f[1] then return { cfg } end
local res = { cfg, f[1], f[2], f[3], f[4] or false }
if f[1] == 'l' and ARGV[3] ~= 'none' then
  for _, u in ipairs(cjson.decode(f[5])) do
    for _, rid in ipairs(members(u)) do
      local rf = redis.call('HMGET', rkey(rid), 'v', 'n')
      table.insert(res, rid)
      table.insert(res, rf[1])
      table.insert(res, rf[2])
    end
  end
end
return res
