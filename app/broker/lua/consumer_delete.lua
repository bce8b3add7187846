-- requires: consumers, audit
-- Delete a consumer and everything it holds (CON.free): the blobs of retired rollouts it was
-- the last to hold go with it. Its pending and leased items are counted dropped in its
-- 'consumers' event.
-- ARGV: wake, name, audit entry (written only when this call deletes it). Returns ok('deleted', pending items dropped) | ok('missing', 0)
--       | err('run_missing').
if redis.call('HEXISTS', RUN, 'cfg') == 0 then return err('run_missing') end
local c = CON.get(ARGV[2])
if not c then return ok('missing', 0) end
local pending = CON.free(c)
redis.call('HDEL', CON.CONS, c.name)
audit(ARGV[3])
CON.emit()
return ok('deleted', pending)
