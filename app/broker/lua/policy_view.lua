-- requires: replies
-- Read the run's policy version, the location of its weights and the time it was set (the run's
-- creation for the version it was created with). A follower about to wait for a version other
-- than ARGV[2] (it has that one) asks for wake-ups in the same call, so the version cannot move
-- unannounced between this read and the wait (set_policy.lua publishes while PWAITING lives).
-- ARGV: wake (unused), after ('' for none), wait_ms (0: not waiting).
-- Returns ok(version, weights or '', set_at ms) | err('run_missing').
local f = redis.call('HMGET', RUN, 'cfg', 'ver', 'wts', 'vat', 'created')
if not f[1] then return err('run_missing') end
local wait_ms = tonumber(ARGV[3])
if ARGV[2] == f[2] and wait_ms > 0 and redis.call('PTTL', PWAITING) < wait_ms then
  redis.call('SET', PWAITING, '1', 'PX', wait_ms)
end
return ok(f[2], f[3] or '', f[4] or f[5])
