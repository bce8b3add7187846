-- requires: consumers
-- Acknowledge a consumer's live batch: its items are done (counted acked), their holds go. A
-- repeat answers the same.
-- ARGV: wake, name, batch_id.
-- Returns ok('acked', items) | ok('repeat', items) | err('run_missing')
--       | err('consumer_missing', name) | err('batch_missing') | err('batch_nacked')
--       | err('lease_expired').
if redis.call('HEXISTS', RUN, 'cfg') == 0 then return err('run_missing') end
local c = CON.get(ARGV[2])
if not c then return err('consumer_missing', ARGV[2]) end
local bid = ARGV[3]
local f = redis.call('HMGET', CON.batch_key(c, bid), 'st', 'items', 'exp', 'n')
if not f[1] then return err('batch_missing') end
if f[1] == 'a' then return ok('repeat', tonumber(f[4])) end
if f[1] == 'n' then return err('batch_nacked') end
if f[1] == 'e' then return err('lease_expired') end
local items = cjson.decode(f[2])
if tonumber(f[3]) <= NOW then
  CON.back(c, bid, 'e', items)
  return err('lease_expired')
end
local members = CON.members(items)
redis.call('HINCRBY', CON.ckey(c.name), 'acked', #members)
redis.call('HINCRBY', CON.ckey(c.name), 'leased', -#members)
CON.release(members)
CON.settle_batch(c, bid, 'a')
return ok('acked', #members)
