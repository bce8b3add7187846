-- requires: consumers
-- Give a consumer's live batch back: its items are pending again at their delivery seqs, so
-- they come first again. A repeat answers the same.
-- ARGV: wake, name, batch_id.
-- Returns ok('nacked', items) | ok('repeat', items) | err('run_missing')
--       | err('consumer_missing', name) | err('batch_missing') | err('batch_acked')
--       | err('lease_expired').
local c, items, answer = CON.live_batch(ARGV[2], ARGV[3], 'n')
if not c then return answer end
CON.back(c, ARGV[3], 'n', items)
return ok('nacked', #items / 2)
