-- requires: replies
-- Take a parked run back into service. The caller has already put it in the active index at
-- `token` (RedisStore.activate: index first, so an unparked run is always in the index; a
-- crash in between leaves a parked run in the index, which the maintenance takes out again).
-- A token no larger than the run's own is stale: the run was parked again at a later token
-- since (its index entry may be gone), so it stays parked and the caller tries again.
-- ARGV: wake, token. Returns ok('woken') | ok('stale') | err('run_missing') (no run, or one
-- being deleted).
local f = redis.call('HMGET', RUN, 'cfg', 'parked', 'tok', 'deleting')
if not f[1] or f[4] then return err('run_missing') end
if tonumber(ARGV[2]) <= tonumber(f[3] or '0') then return ok('stale') end
redis.call('HSET', RUN, 'tok', ARGV[2])
if f[2] then redis.call('HDEL', RUN, 'parked') end
return ok('woken')
