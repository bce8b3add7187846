-- requires: cleanup, finish
-- A reward worker gives back, unscored, what its reward lease holds: the units of the rollouts
-- named, or all of them. They await the next reward lease at once; no attempt is counted.
-- ARGV: wake, lease_id, n (-1: all), then n rollout ids.
-- Returns ok(rollouts given back) | err('run_missing') | err('reward_lease_missing').
if not load_run() then return err('run_missing') end
local lid = ARGV[2]
local f = redis.call('HMGET', rlkey(lid), 'st', 'exp')
if not f[1] then return err('reward_lease_missing') end
if f[1] ~= 'l' then return ok(0) end
if tonumber(f[2]) <= NOW then  -- ran out, not yet swept
  end_reward_lease(lid, 'e')
  finish()
  return ok(0)
end
local only = nil
local n = tonumber(ARGV[3])
if n >= 0 then
  only = {}
  for i = 1, n, 1000 do
    local part = redis.call('HMGET', AW, unpack(ARGV, 4 + i - 1, 3 + math.min(i + 999, n)))
    for _, x in ipairs(part) do
      if x then
        local _, _, u = parse_awaiting(x)
        only[u] = true
      end
    end
  end
end
local back = end_reward_lease(lid, 'r', only)
finish()
return ok(back)
