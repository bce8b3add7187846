-- requires: cleanup, finish, audit
-- Move the run's policy version forward and retire what is now too stale (bounded; the rest
-- is retired by later sweeps, and never handed out meanwhile: the lease check is the same rule).
-- ARGV: wake, version, limit, audit entry (written only when the version moves: lib/audit.lua),
--       the version's weights ('' for none).
-- Returns ok('advanced', version, more, retired) | ok('same', version, 0, {})
--       | err('run_missing') | err('version_backwards', current); `retired` as retired_counts().
if not load_run() then return err('run_missing') end
local v = tonumber(ARGV[2])
if v < R.ver then return err('version_backwards', I(R.ver)) end
if v == R.ver then return ok('same', I(R.ver), 0, {}) end
move_version(v, ARGV[5])
run_snapshot('policy')
audit(ARGV[4])
WORK_WOKE = true  -- a later version widens the staleness budget
local more = sweep(tonumber(ARGV[3]))
finish()
return ok('advanced', I(v), more, retired_counts())
