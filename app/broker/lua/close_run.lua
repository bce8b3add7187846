-- Close a run: no more ingest; every buffered rollout retires with reason run_closed (bounded;
-- later sweeps finish), leased ones when they come back.
-- ARGV: wake, limit. Returns {'ok'|'missing', more}.
if not load_run() then return { 'missing' } end
if R.st ~= 'closed' then
  redis.call('HSET', RUN, 'st', 'closed')
  R.st = 'closed'
  run_snapshot('closed')
end
local more = sweep(tonumber(ARGV[2]))
finish()
return { 'ok', more, RETIRED_N }
