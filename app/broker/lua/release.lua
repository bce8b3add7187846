-- requires: run, audit
-- Lift a generator's quarantine (POST .../generators/{generator_id}/release, an operator's
-- action): it may post rollouts and take work again. Its KL window starts afresh: the
-- quarantine cleared it, and none is kept while it lasts (GEN.judge).
-- ARGV: wake (unused), generator_id, audit entry ('' = none; written only when it was
--       quarantined).
-- Returns ok('released') | ok('not_quarantined') | err('run_missing')
if not load_run() then return err('run_missing') end
local gen = ARGV[2]
if redis.call('HDEL', GQ, gen) == 0 then return ok('not_quarantined') end
emit('generator', { generator_id = gen, quarantined = 0 })
audit(ARGV[3])
return ok('released')
