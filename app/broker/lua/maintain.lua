-- requires: settled, cleanup, finish
-- The maintenance worker's call on one run of the active index: the bounded sweep and, once a
-- closed run has settled (settled.lua) and the sweep left nothing to do, parking it. A parked
-- run stays as it is until a script would change it: the store then puts it back in the active
-- index and wakes it (wake_run.lua) first. The worker takes a parked run out of the index only
-- at the token it read (RedisStore.deactivate), so a wake-up since then keeps it in.
-- ARGV: wake, limit, token (the run's score in the active index, as the worker read it),
--       accounting consumer group.
-- Returns ok(state, more, retired, now): state 'active' | 'parked' | 'missing' (no run: a
-- creation under way, or one that never finished) | 'deleted'; `retired` as retired_counts().
local f = redis.call('HMGET', RUN, 'cfg', 'parked', 'tok', 'st')
if not f[1] then
  return ok(f[4] == 'deleted' and 'deleted' or 'missing', 0, {}, I(NOW))
end
local token = tonumber(ARGV[3])
local held = tonumber(f[3] or '0')
if f[2] then
  -- Parked before (a worker stopped before taking it out, or a wake-up that did not finish):
  -- it holds the larger token, so a wake-up still under way cannot take it back in.
  if token > held then redis.call('HSET', RUN, 'tok', I(token)) end
  return ok('parked', 0, {}, I(NOW))
end
load_run()
-- Acked batches leave the rewind index with their records (kept 24 h after they settle).
redis.call('ZREMRANGEBYSCORE', ACKED, '-inf', '(' .. I(NOW - 86400000))
local more = sweep(tonumber(ARGV[2]))
finish()
if more == 0 and RETIRED_N == 0 and not unsettled(ARGV[4]) then
  redis.call('HSET', RUN, 'parked', 1, 'tok', I(math.max(token, held)))
  return ok('parked', 0, {}, I(NOW))
end
return ok('active', more, retired_counts(), I(NOW))
