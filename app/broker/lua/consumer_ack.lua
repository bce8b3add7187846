-- requires: consumers
-- Acknowledge a consumer's live batch: its items are done (counted acked), their holds go. A
-- repeat answers the same.
-- ARGV: wake, name, batch_id.
-- Returns ok('acked', items) | ok('repeat', items) | err('run_missing')
--       | err('consumer_missing', name) | err('batch_missing') | err('batch_nacked')
--       | err('lease_expired').
local c, items, answer = CON.live_batch(ARGV[2], ARGV[3], 'a')
if not c then return answer end
local members = CON.members(items)
CON.count(c.name, 'acked', #members)
redis.call('HINCRBY', CON.ckey(c.name), 'leased', -#members)
CON.release(members)
CON.settle_batch(c, ARGV[3], 'a')
CON.emit()
return ok('acked', #members)
