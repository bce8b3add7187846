-- requires: run, audit
-- Lift a generator's quarantine (POST .../generators/{generator_id}/release, an operator's
-- action): it may post rollouts and take work again, and its KL window starts afresh.
-- ARGV: wake (unused), generator_id, audit entry ('' = none; written only when it was
--       quarantined).
-- Returns ok('released') | ok('not_quarantined') | err('run_missing')
if not load_run() then return err('run_missing') end
local gen = ARGV[2]
if redis.call('HDEL', GQ, gen) == 0 then return ok('not_quarantined') end
redis.call('HDEL', GW, gen)
emit('generator', { generator_id = gen, quarantined = 0 })
audit(ARGV[3])
return ok('released')
