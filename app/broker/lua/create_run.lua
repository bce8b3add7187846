-- requires: run, audit
-- Create a run, or confirm it: the same config again is a no-op, another config a conflict.
-- The caller has already put the run in the run index and the active index (index first, so
-- a run never exists unindexed: see RedisStore.create_run).
-- ARGV: wake, run_id, config_json (canonical), created (ms: the run's score in the run index),
-- audit entry (written only when the run is created: lib/audit.lua).
-- Returns ok('created') | ok('exists') | err('run_conflict') | err('run_deleted').
local f = redis.call('HMGET', RUN, 'cfg', 'st', 'deleting')
if f[2] == 'deleted' or f[3] then return err('run_deleted') end
if f[1] then
  if f[1] == ARGV[3] then return ok('exists') end
  return err('run_conflict')
end
-- 'lay' names the layout of the run's units (docs/design.md), for a later one to recognise.
redis.call('HSET', RUN, 'id', ARGV[2], 'cfg', ARGV[3], 'ver', 0, 'st', 'open', 'created', ARGV[4],
  'floor', 0, 'seq', 0, 'live', 0, 'leased', 0, 'batches', 0, 'tok', 0, 'lay', '4')
run_snapshot('created')
audit(ARGV[5])
return ok('created')
