-- Move the run's policy version forward and retire what is now too stale (bounded; the rest
-- is retired by later sweeps, and never handed out meanwhile: the lease check is the same rule).
-- ARGV: wake, version, limit. Returns {'ok'|'missing'|'backwards'|'same', version, more}.
if not load_run() then return { 'missing' } end
local v = tonumber(ARGV[2])
if v < R.ver then return { 'backwards', I(R.ver) } end
if v == R.ver then return { 'same', I(R.ver), 0 } end
redis.call('HSET', RUN, 'ver', I(v))
R.ver = v
run_snapshot('policy')
local more = sweep(tonumber(ARGV[3]))
finish()
return { 'ok', I(v), more, RETIRED_N }
