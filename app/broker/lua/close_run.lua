-- requires: cleanup, finish, audit
-- Close a run: no more ingest; every buffered rollout retires with reason run_closed (bounded;
-- later sweeps finish), leased ones when they come back.
-- ARGV: wake, limit, audit entry (written only when this call closes the run: lib/audit.lua).
-- Returns ok(more) | err('run_missing').
-- Runs on a parked run too (one that was closed and settled): closing it again changes nothing
-- and emits nothing, so it stays parked.
if not load_run() then return err('run_missing') end
if R.st == 'closed' and redis.call('HEXISTS', RUN, 'parked') == 1 then return ok(0) end
if R.st ~= 'closed' then
  redis.call('HSET', RUN, 'st', 'closed')
  R.st = 'closed'
  run_snapshot('closed')
  audit(ARGV[3])
  WORK_WOKE = true  -- waiting generators learn that the run is closed
end
local more = sweep(tonumber(ARGV[2]))
finish()
return ok(more)
