-- Create a run, or confirm it: the same config again is a no-op, another config a conflict.
-- The caller has already put the run in the run index (index first: see RedisStore.create_run).
-- ARGV: wake, run_id, config_json (canonical), created (ms: the run's score in the run index).
-- Returns ok('created') | ok('exists') | err('run_conflict').
local existing = redis.call('HGET', RUN, 'cfg')
if existing then
  if existing == ARGV[3] then return ok('exists') end
  return err('run_conflict')
end
redis.call('HSET', RUN, 'id', ARGV[2], 'cfg', ARGV[3], 'ver', 0, 'st', 'open', 'created', ARGV[4],
  'floor', 0, 'seq', 0, 'live', 0, 'leased', 0, 'batches', 0)
run_snapshot('created')
return ok('created')
